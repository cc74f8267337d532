"""Run the cache service: ``python -m cache_service --port 50053``.

Settings come from ``CACHE_*`` environment variables; flags override them. With
``--store redis://host:port/0`` (``CACHE_STORE``) replicas share their entries through
Redis (docs/scaling.md, "Store"); the default, ``memory``, keeps them in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import faiss
from qwenvl.cache.v1 import cache_service_pb2, cache_service_pb2_grpc

from cache_service.claims import MemoryClaims
from cache_service.entries import Store
from cache_service.index import gpu_count
from cache_service.servicer import POLICIES, CacheServicer
from cache_service.settings import CacheSettings
from cache_service.store import EmbeddingStore
from cache_service.store_redis import RedisStore
from vlcommon import handoff, malloc
from vlcommon.server import serve
from vlcommon.service_main import service_main
from vlcommon.tls import ClientSecurity

SERVICE = cache_service_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name
log = logging.getLogger("cache_service")


def build_store(settings: CacheSettings) -> Store:
    """The store the settings describe (in process, or a shared Redis store: then its
    :meth:`RedisStore.start` must run before SERVING); checks the GPU capability once.

    Raises:
        RuntimeError: ``gpu=on`` but FAISS sees no GPU (faiss-cpu, or no device).
    """
    gpus = gpu_count()
    if settings.gpu == "on" and gpus == 0:
        raise RuntimeError("CACHE_GPU=on but FAISS sees no GPU (install faiss-gpu-cu12)")
    use_gpu = gpus > 0 and settings.gpu != "off"
    store: Store
    if settings.store != "memory":
        store = RedisStore.from_settings(settings, use_gpu=use_gpu)
        log.info(
            "entries live in the shared store %s; this replica keeps copies within "
            "CACHE_CAPACITY_BYTES=%d",
            store.access.url.shown,
            settings.capacity_bytes,
        )
    else:
        store = EmbeddingStore(
            descriptor_dim=settings.descriptor_dim,
            capacity_bytes=settings.capacity_bytes,
            threshold=settings.threshold,
            search_k=settings.search_k,
            ttl_s=settings.ttl_s,
            index_threshold=settings.index_threshold,
            index_params=settings.index_params(),
            use_gpu=use_gpu,
            rebuild_fraction=settings.rebuild_fraction,
            background_rebuild=True,
        )
    log.info(
        "FAISS %s, GPUs seen: %d; similarity index: %s",
        faiss.__version__,
        gpus,
        "exact on GPU 0 (GpuIndexFlatIP; removals by tombstones + rebuild)"
        if use_gpu
        else f"exact (IndexFlatIP) below {settings.index_threshold} entries, HNSW on a "
        f"{settings.projected_dim}-dim projection with exact re-scoring above",
    )
    return store


def build_servicer(settings: CacheSettings) -> CacheServicer:
    store = build_store(settings)
    return CacheServicer(
        store,
        default_policy=POLICIES[settings.default_policy],
        max_queries=settings.max_queries,
        spatial_merge_size=settings.spatial_merge_size,
        max_response_bytes=settings.max_message_bytes,
        holder=handoff.holder_for("cache", settings),
        reader=handoff.Reader(
            ClientSecurity.from_settings(settings), max_message_bytes=settings.max_message_bytes
        ),
        # A shared store's claims are fleet-wide (cache_service/claims.py).
        claims=store.claims
        if isinstance(store, RedisStore)
        else MemoryClaims(settings.claim_ttl_s),
    )


async def _reclaim_expired(store: Store, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        n = store.expire()
        if n:
            log.info("reclaimed %d expired entries", n)


async def main_async(settings: CacheSettings) -> None:
    # Lookups search one vector at a time on this (event-loop) thread: an OpenMP parallel
    # region per search only adds spin-waits (cache-bench's p99 rose from sub-ms to over
    # 100 ms with 2 threads on a shared CPU). Index rebuilds run in their own thread and
    # keep the default thread count (OpenMP's setting is per calling thread).
    faiss.omp_set_num_threads(1)
    malloc.keep_large_blocks(settings.malloc_heap_max_bytes)
    servicer = build_servicer(settings)
    reclaim: asyncio.Task[None] | None = None

    holder = servicer.holder
    assert holder is not None
    expiry: asyncio.Future[None] | None = None

    async def startup() -> None:
        nonlocal reclaim, expiry
        expiry = asyncio.ensure_future(handoff.expire_periodically(holder))
        if isinstance(servicer.store, RedisStore):
            # Before SERVING: the similarity index is rebuilt from the store itself.
            await asyncio.to_thread(servicer.store.start)
        elif settings.ttl_s > 0:
            reclaim = asyncio.create_task(
                _reclaim_expired(servicer.store, settings.expire_interval_s)
            )

    async def shutdown() -> None:
        if expiry is not None:
            expiry.cancel()
        holder.close()  # no segment outlives the service
        await servicer.reader.close()
        if reclaim is not None:
            reclaim.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reclaim
        if isinstance(servicer.store, RedisStore):
            await asyncio.to_thread(servicer.store.close)

    def register(server: object) -> None:
        cache_service_pb2_grpc.add_CacheServiceServicer_to_server(servicer, server)
        handoff.register_holder(holder, server)  # type: ignore[arg-type]

    await serve(
        service_name="cache",
        service_full_names=[SERVICE, handoff.HANDOFF_SERVICE],
        settings=settings,
        register=register,
        startup=startup,
        shutdown=shutdown,
        on_started=handoff.on_listening(holder, settings),
    )


def main(argv: list[str] | None = None) -> None:
    service_main(
        "cache",
        CacheSettings,
        flags=(
            "host",
            "port",
            "metrics_port",
            "capacity_bytes",
            "ttl_s",
            "threshold",
            "index_threshold",
            "gpu",
            "store",
        ),
        serve=lambda settings, _: main_async(settings),
        argv=argv,
        doc=__doc__,
    )


if __name__ == "__main__":
    main()
