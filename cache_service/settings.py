"""Cache service settings (environment prefix ``CACHE_``)."""

import os
import stat
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from cache_service.index import IndexParams
from cache_service.store_conn import parse_store_url
from vlcommon.errors import ConfigError
from vlcommon.imaging import DESCRIPTOR_DIM
from vlcommon.settings import HoldingSettings


class CacheSettings(HoldingSettings):
    """Settings of the cache service; e.g. ``CACHE_CAPACITY_BYTES``, ``CACHE_TTL_S``."""

    model_config = SettingsConfigDict(env_prefix="CACHE_", extra="ignore")

    capacity_bytes: int = Field(2 * 1024**3, ge=1, description="Byte budget of stored embeddings.")
    ttl_s: float = Field(
        0.0, ge=0, description="Seconds an entry lives after its last Put; 0 = no expiry."
    )
    expire_interval_s: float = Field(
        5.0, gt=0, description="How often expired entries are reclaimed, seconds."
    )
    threshold: float = Field(0.85, ge=-1.0, le=1.0, description="Cosine similarity for a hit.")
    descriptor_dim: int = Field(DESCRIPTOR_DIM, ge=1, description="Similarity descriptor length.")
    default_policy: str = Field("similar", pattern="^(exact_only|similar|off)$")
    max_queries: int = Field(256, ge=1, description="Queries or entries per call.")
    spatial_merge_size: int = Field(
        2, ge=1, description="Qwen-VL merge size: an entry's rows must be t*h*w / merge**2."
    )
    # Exact search over 3,072-dim descriptors took 2.6 ms (p50) at 4k entries on a 2-core
    # CPU; HNSW on the projection about 0.3 ms at 20k (docs/cache.md, cache-bench).
    index_threshold: int = Field(
        2048, ge=1, description="Entries at which the exact index migrates to HNSW."
    )
    hnsw_m: int = Field(32, ge=4, description="HNSW graph neighbours per node (FAISS M).")
    hnsw_ef_construction: int = Field(40, ge=8, description="HNSW efConstruction.")
    hnsw_ef_search: int = Field(
        64, ge=8, description="HNSW efSearch (recall vs latency) up to the reference size."
    )
    hnsw_ef_reference_entries: int = Field(
        100_000,
        ge=0,
        description="Entries past which efSearch grows as (n / this) ** 0.6; 0 = fixed.",
    )
    projected_dim: int = Field(
        256, ge=8, description="Random-projection dimensions HNSW searches in."
    )
    refine_k_factor: int = Field(8, ge=1, description="Candidates re-scored exactly per k.")
    search_k: int = Field(8, ge=1, description="Neighbours examined for an equal grid.")
    rebuild_fraction: float = Field(
        0.25, gt=0, le=1, description="Tombstone share of the index that triggers a rebuild."
    )
    gpu: Literal["auto", "on", "off"] = Field(
        "auto", description="FAISS GPU index: auto = if one is seen."
    )
    # A shared store (docs/scaling.md, "Store"): replicas share entries and follow each
    # other's puts; capacity_bytes is then each replica's budget for its local copies.
    store: str = Field(
        "memory",
        description="Where entries live: memory (this process), redis://[user:password@]"
        "host:port/db, rediss://... (TLS), redis+cluster://host:port (Redis Cluster; "
        "rediss+cluster:// with TLS). A password here shows in ps: prefer "
        "CACHE_STORE_PASSWORD.",
    )
    store_password: SecretStr = Field(
        SecretStr(""), description="Password of the store's user when the URL has none."
    )
    store_tls_ca_file: str = Field(
        "", description="PEM CA that signs the store's certificate (rediss://); empty = system."
    )
    store_tls_cert_file: str = Field(
        "", description="PEM client certificate for a store that requires one (rediss://)."
    )
    store_tls_key_file: str = Field("", description="PEM private key of store_tls_cert_file.")
    store_prefix: str = Field(
        "splitvl:", min_length=1, description="Prefix of every key in the store."
    )
    # A lookup makes one to three round trips (header, payload or candidates); a slow store
    # must cost a lookup less than the gateway's 1 s cache deadline.
    store_timeout_s: float = Field(
        0.5, gt=0, description="Connect and command timeout of the store, seconds."
    )
    store_log_maxlen: int = Field(
        100_000, ge=100, description="Puts kept in the store's log (approximate, XADD MAXLEN ~)."
    )
    store_sync_interval_s: float = Field(
        30.0, gt=0, description="Seconds between two scans of the store by each replica."
    )
    # vlcommon/malloc.py: freed 16 MiB payloads are reused, not unmapped and page-faulted in
    # again (a store hit 1.8x -> 1.2x a raw GET). glibc caps the threshold at 32 MiB on
    # 64-bit unless set, as here.
    malloc_heap_max_bytes: int = Field(
        64 * 1024**2,
        ge=0,
        le=2**31 - 1,
        description="Allocations up to this size come from the heap (glibc mallopt); 0 = "
        "glibc's defaults.",
    )
    # Each new image encoded once (cache_service/claims.py): a claim lives this long unless
    # the claimant's Put ends it; a claimant that died costs its waiters at most this.
    claim_ttl_s: float = Field(
        5.0, gt=0, le=600, description="Seconds a claim on a missed key lives without a Put."
    )
    # Entries are sealed (AES-256-GCM) and named under keys derived from this secret, so the
    # store holds nothing in the clear and nobody without it can plant an entry
    # (docs/security.md, "The shared store"). A store without one does not start.
    store_secret: SecretStr = Field(
        SecretStr(""),
        description="Secret entries in the store are sealed under; empty = "
        "store_secret_file, else internal_token.",
    )
    store_secret_file: str = Field(
        "", description="File holding store_secret (splitvl up writes one, mode 0600)."
    )
    store_allow_no_secret: bool = Field(
        False,
        description="Development only: a store with no secret (entries sealed under a "
        "public key: readable and forgeable by whoever reaches the store).",
    )

    @field_validator("store")
    @classmethod
    def _store_url(cls, value: str) -> str:
        parse_store_url(value)  # raises ValueError with the reason
        return value.strip()

    def secret(self) -> str:
        """The store secret: ``store_secret``, else ``store_secret_file``'s content, else
        ``internal_token``, surrounding whitespace dropped; "" for none.

        Raises:
            ConfigError: ``store_secret_file`` cannot be read as UTF-8 text (a FIFO or a
                folder is refused, not waited on).
        """
        if self.store_secret.get_secret_value().strip():
            return self.store_secret.get_secret_value().strip()
        if self.store_secret_file:
            path = self.store_secret_file
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    os.close(fd)
                    raise ConfigError(f"CACHE_STORE_SECRET_FILE {path} is not a file")
                with os.fdopen(fd, "rb") as f:
                    return f.read().decode().strip()
            except (OSError, UnicodeDecodeError) as err:
                why = getattr(err, "strerror", None) or "not UTF-8 text"
                raise ConfigError(f"CACHE_STORE_SECRET_FILE {path}: {why}") from None
        return self.internal_token.get_secret_value().strip()

    def index_params(self) -> IndexParams:
        """The FAISS index parameters these settings name (service and cache-bench alike)."""
        return IndexParams(
            projected_dim=self.projected_dim,
            hnsw_m=self.hnsw_m,
            ef_construction=self.hnsw_ef_construction,
            ef_search=self.hnsw_ef_search,
            k_factor=self.refine_k_factor,
            ef_reference_entries=self.hnsw_ef_reference_entries,
        )
