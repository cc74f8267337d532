"""Run the cache service: ``python -m cache_service --port 50053``.

Settings come from ``CACHE_*`` environment variables; flags override them.
"""

from __future__ import annotations

import argparse

from qwenvl.cache.v1 import cache_service_pb2, cache_service_pb2_grpc

from cache_service.servicer import POLICIES, CacheServicer
from cache_service.settings import CacheSettings
from cache_service.store import EmbeddingStore
from vlcommon.server import configure_logging, run, serve

SERVICE = cache_service_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name


def build_servicer(settings: CacheSettings) -> CacheServicer:
    store = EmbeddingStore(
        descriptor_dim=settings.descriptor_dim,
        capacity_bytes=settings.capacity_bytes,
        threshold=settings.threshold,
    )
    return CacheServicer(
        store,
        default_policy=POLICIES[settings.default_policy],
        max_queries=settings.max_queries,
        spatial_merge_size=settings.spatial_merge_size,
    )


async def main_async(settings: CacheSettings) -> None:
    servicer = build_servicer(settings)
    await serve(
        service_name="cache",
        service_full_names=[SERVICE],
        settings=settings,
        register=lambda server: cache_service_pb2_grpc.add_CacheServiceServicer_to_server(
            servicer, server
        ),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cache_service", description=__doc__)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--metrics-port", type=int)
    parser.add_argument("--capacity-bytes", type=int)
    parser.add_argument("--threshold", type=float)
    args = parser.parse_args(argv)
    settings = CacheSettings(**{k: v for k, v in vars(args).items() if v is not None})
    configure_logging("cache")
    run(main_async(settings))


if __name__ == "__main__":
    main()
