"""Encoder service settings (environment prefix ``ENCODER_``)."""

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from vlcommon.settings import ServerSettings


class EncoderSettings(ServerSettings):
    """Settings of the encoder service; e.g. ``ENCODER_MODEL``, ``ENCODER_PORT``."""

    model_config = SettingsConfigDict(env_prefix="ENCODER_", extra="ignore")

    model: str = Field("", description="Checkpoint directory or hub id.")
    device: str = Field("auto", description="cpu, cuda, cuda:N or auto.")
    dtype: str = Field("float32", pattern="^(float32|bfloat16|float16)$")
    cpus: str = Field(
        "", description="CPU list to pin to (e.g. '1' or '12-15'); empty = no pinning."
    )
    threads: int = Field(0, ge=0, description="torch threads; 0 = one per pinned CPU.")
    fast_cpu_kernels: bool = Field(
        True, description="On CPU, run Linear layers through vLLM's oneDNN GEMM when present."
    )
    max_batch_images: int = Field(8, ge=1, description="Images per ViT call.")
    # 16,384 patches = 16 images of 448x448 (784 patches each) plus room; bounds activation memory.
    max_batch_patches: int = Field(16384, ge=1, description="Patches per ViT call.")
    max_wait_ms: float = Field(2.0, ge=0, description="Wait for more images after the first, ms.")
    max_queue: int = Field(256, ge=1, description="Images waiting; more get RESOURCE_EXHAUSTED.")
    max_images_per_request: int = Field(64, ge=1)
    max_patches_per_image: int = Field(
        0,
        ge=0,
        description="Larger images are refused; 0 = the checkpoint's max_pixels / patch_size**2.",
    )
