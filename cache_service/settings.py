"""Cache service settings (environment prefix ``CACHE_``)."""

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from vlcommon.imaging import DESCRIPTOR_DIM
from vlcommon.settings import ServerSettings


class CacheSettings(ServerSettings):
    """Settings of the cache service; e.g. ``CACHE_CAPACITY_BYTES``, ``CACHE_THRESHOLD``."""

    model_config = SettingsConfigDict(env_prefix="CACHE_", extra="ignore")

    capacity_bytes: int = Field(2 * 1024**3, ge=1, description="Byte budget of stored embeddings.")
    threshold: float = Field(0.85, ge=-1.0, le=1.0, description="Cosine similarity for a hit.")
    descriptor_dim: int = Field(DESCRIPTOR_DIM, ge=1, description="Similarity descriptor length.")
    default_policy: str = Field("similar", pattern="^(exact_only|similar|off)$")
    max_queries: int = Field(256, ge=1, description="Queries or entries per call.")
    spatial_merge_size: int = Field(
        2, ge=1, description="Qwen-VL merge size: an entry's rows must be t*h*w / merge**2."
    )
