"""The end-to-end tests of tests/unit/cache_service/test_cache_store_redis_replicas.py
(the services started); the rest of that file runs without them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from qwenvl.cache.v1 import cache_service_pb2 as pb
from qwenvl.cache.v1 import cache_service_pb2_grpc as pb_grpc
from qwenvl.common.v1 import generation_pb2

from cache_service.store_codec import StoreCodec
from tests.unit.cache_service import test_cache_store_redis_replicas as unit_part
from tests.unit.cache_service.test_cache_store_redis import (
    FP32,
    GRID,
    PASSWORD,
    SECRET,
    RedisServer,
    V,
    free_port,
    payload,
    unit,
)
from tests.unit.cache_service.test_cache_store_redis_replicas import CACHE, lookup_request

ROOT = Path(__file__).resolve().parents[2]

# The unit part's fixtures, under their names (pytest finds fixtures by name here).
server = unit_part.server


def write_entries(server: RedisServer, prefix: str, n: int) -> None:
    """``n`` entries (keys k0..), sealed and written in one pipeline, as replicas would."""
    codec = StoreCodec(SECRET, prefix)
    pipe = server.client().pipeline(transaction=False)
    for i in range(n):
        _, fields = codec.seal(
            key=f"k{i}", revision="", grid=GRID, dtype=FP32, shape=(4, 4),
            payload=payload(i), descriptor=unit(i), verification=V, written_ms=0,
        )  # fmt: skip
        body = fields.pop("p")
        pipe.hset(codec.entry(f"k{i}"), mapping=fields)  # type: ignore[arg-type]
        pipe.set(codec.payload(f"k{i}"), body)
    pipe.execute()


def health_status(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            return stub.Check(health_pb2.HealthCheckRequest(service=CACHE), timeout=1).status
        except grpc.RpcError:
            return -1


@pytest.mark.e2e  # it starts the cache service as a process (no model: about 3 s)
def test_a_restarted_cache_rebuilds_its_index_from_the_store_before_serving(
    server: RedisServer, tmp_path: Path
) -> None:
    """The log is deleted first, so only a scan of the store can find the entries."""
    n, prefix = 3000, "restart:"
    write_entries(server, prefix, n)
    server.client().delete(StoreCodec(SECRET, prefix).log)
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "CACHE_INTERNAL_TOKEN": SECRET,
        "CACHE_DESCRIPTOR_DIM": "16",
        "CACHE_STORE_PREFIX": prefix,
        "CACHE_STORE_PASSWORD": PASSWORD,
    }
    url = server.url.replace(f":{PASSWORD}@", "")  # the password from the environment
    log = open(tmp_path / "cache.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "cache_service", "--port", str(port), "--store", url],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        seen = []
        deadline = time.monotonic() + 60
        while (status := health_status(port)) != health_pb2.HealthCheckResponse.SERVING:
            assert proc.poll() is None and time.monotonic() < deadline, (
                tmp_path / "cache.log"
            ).read_text()
            seen.append(status)
            time.sleep(0.005)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.CacheServiceStub(channel)
            meta = (("x-splitvl-internal-token", SECRET),)
            stats = stub.GetStats(pb.GetStatsRequest(), metadata=meta, timeout=10)
            got = stub.Lookup(lookup_request(n - 1), metadata=meta, timeout=10)
        assert stats.entries == n  # indexed before SERVING
        assert got.results[0].tier == generation_pb2.CACHE_TIER_SIMILAR
        assert got.results[0].matched_key == f"k{n - 1}"
        assert health_pb2.HealthCheckResponse.NOT_SERVING in seen  # it listened before
        assert f"{n} entries indexed from a scan" in (tmp_path / "cache.log").read_text()
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
