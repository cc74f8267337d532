"""Encoder service settings (environment prefix ``ENCODER_``)."""

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from vlcommon.settings import HoldingSettings


class EncoderSettings(HoldingSettings):
    """Settings of the encoder service; e.g. ``ENCODER_MODEL``, ``ENCODER_PORT``."""

    model_config = SettingsConfigDict(env_prefix="ENCODER_", extra="ignore")

    model: str = Field("", description="Checkpoint directory or hub id.")
    device: str = Field("auto", description="cpu, cuda, cuda:N or auto.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Vision tower dtype."
    )
    cpus: str = Field(
        "", description="CPU list to pin to (e.g. '1' or '12-15'); empty = no pinning."
    )
    threads: int = Field(0, ge=0, description="torch threads; 0 = one per pinned CPU.")
    nice: int = Field(
        0,
        ge=0,
        le=19,
        description=(
            "Least scheduling niceness of the whole process (every thread, the ViT's "
            "included; one started nicer keeps its own); "
            "splitvl up sets 5 on CPU hosts, where the encoder's core also runs the "
            "gateway, the cache and vLLM's engine core."
        ),
    )
    fast_cpu_kernels: bool = Field(
        True, description="On CPU, run Linear layers through vLLM's oneDNN GEMM when present."
    )
    max_batch_images: int = Field(8, ge=1, description="Images per ViT call.")
    max_batch_patches: int = Field(
        0,
        ge=0,
        description="Patches per ViT call; 0 = by device (batch_patches_for).",
    )
    max_wait_ms: float = Field(2.0, ge=0, description="Wait for more images after the first, ms.")
    max_queue: int = Field(256, ge=1, description="Images waiting; more get RESOURCE_EXHAUSTED.")
    max_images_per_request: int = Field(64, ge=1)
    max_patches_per_image: int = Field(
        0,
        ge=0,
        description="Larger images are refused; 0 = the checkpoint's max_pixels / patch_size**2.",
    )
    # A video is one item of t * h * w patches: 16,384 video tokens (the gateway's default
    # per-request video budget) are 65,536 patches.
    max_patches_per_video: int = Field(
        65536, ge=1, description="Patches of one video (t*h*w); larger ones are refused."
    )


# Packing pays only while one ViT call is small enough to leave the matmuls short of their
# peak. On CPU (bench checkpoint, 1 thread, `docs/benchmarks.md`) ms per image packed k to a
# call: 224x224 (196 patches) 45.7 / 43.5 / 42.6 / 46.2 at k = 1/2/4/8; 320x320 (400)
# 96.8 / 97.1 / 96.4 at k = 1/2/4; 448x448 (784) 210.6 / 218.2 / 224.4 at k = 1/2/4. So on
# CPU calls stop at 1,024 patches: small images pack (5 of 224x224), 448x448 ones run alone,
# and the first image of a burst is not held back behind 7 others (8 x 213 ms on CPU).
# On a GPU the ViT is far from saturated by one image: 16,384 patches = 16 images of 448x448
# plus room, a bound on activation memory.
CPU_BATCH_PATCHES = 1024
GPU_BATCH_PATCHES = 16384


def batch_patches_for(setting: int, device_type: str) -> int:
    """``max_batch_patches`` in effect: the setting, or by device when it is 0."""
    if setting:
        return setting
    return CPU_BATCH_PATCHES if device_type == "cpu" else GPU_BATCH_PATCHES
