"""Several cache replicas on one Redis store: they share entries and follow each other.

Real ``redis-server`` processes (the helper of
tests/unit/cache_service/test_cache_store_redis.py): two replicas' stores in one process
find each other's puts by exact key at once and by similarity within 2 s (the log); two
in-process CacheServices hand out a hit put through the other one as a reference its
reader reads (tests/e2e/test_cache_store_redis_replicas.py: a cache service process
restarted on a store whose log is gone rebuilds its index from the store before it
reports SERVING); a store down behind the
servicer is a miss and a dropped Put, never an error status; Redis Cluster
(``redis+cluster://``) and TLS (``rediss://``) work the same way.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis
from qwenvl.cache.v1 import cache_service_pb2 as pb
from qwenvl.cache.v1 import cache_service_pb2_grpc as pb_grpc
from qwenvl.common.v1 import generation_pb2, tensor_pb2

from cache_service.servicer import CacheServicer
from cache_service.store_redis import RedisStore
from tests.conftest import in_process_server
from tests.unit.cache_service.test_cache_store_redis import (
    FP32,
    GRID,
    PASSWORD,
    STORES,
    RedisServer,
    V,
    exact,
    free_port,
    integrity,
    near,
    payload,
    put,
    redis_server,
    replica,
    similar,
    unit,
)
from vlcommon import handoff, tensors
from vlcommon.errors import ConfigError
from vlcommon.settings import HoldingSettings

CACHE = pb.DESCRIPTOR.services_by_name["CacheService"].full_name
FOLLOW_WITHIN_S = 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as s:
        yield s


@pytest.fixture(autouse=True)
def _close_stores() -> Iterator[None]:
    yield
    while STORES:
        STORES.pop().close()


def wait_similar(store: RedisStore, i: int, within_s: float = FOLLOW_WITHIN_S) -> float:
    """Seconds until ``store`` finds entry i by similarity (fails past ``within_s``)."""
    t0 = time.monotonic()
    while similar(store, i) != f"k{i}":
        assert time.monotonic() - t0 < within_s, f"k{i} not found by similarity in {within_s}s"
        time.sleep(0.01)
    return time.monotonic() - t0


def test_two_replicas_find_each_others_puts(server: RedisServer) -> None:
    a, b = replica(server, "two:"), replica(server, "two:")
    put(a, 1)
    assert exact(b, "k1") == payload(1)  # at once: the exact tier reads the store
    assert wait_similar(b, 1) < FOLLOW_WITHIN_S  # the log
    put(b, 2)
    assert exact(a, "k2") == payload(2)
    wait_similar(a, 2)
    assert b.follower.last_id != "0-0" and len(a.catalog) == len(b.catalog) == 2


def test_racing_puts_of_one_key_keep_the_first_write_for_every_reader(
    server: RedisServer,
) -> None:
    """Two encoders miss one new image at once; their payloads differ in the last bits
    (GEMM results depend on the batch). The store keeps one of them for the key's life:
    readers on two replicas, racing the Puts, only ever get that one, and none counts an
    integrity failure (the old store rewrote the hash and a reader between its two reads
    refused the entry)."""
    import threading

    rows = 4096  # 64 KiB: a Put takes long enough for readers to land inside it
    first, second = payload(1, rows), bytearray(payload(1, rows))
    second[-1] ^= 1  # the last bit of the last value
    before = {r: integrity(r) for r in ("mac", "field", "key", "format")}
    for round_ in range(6):
        key = f"race-{round_}"
        writers = [replica(server, "race:", follow=False) for _ in range(2)]
        readers = [replica(server, "race:", follow=False) for _ in range(2)]
        seen: list[bytes] = []
        go = threading.Event()

        def write(store: RedisStore, data: bytes, key: str = key, go: threading.Event = go) -> None:
            go.wait()
            store.put(key, unit(1), GRID, FP32, (rows, 4), data, verification=V)

        def read(
            store: RedisStore,
            key: str = key,
            go: threading.Event = go,
            seen: list[bytes] = seen,
        ) -> None:
            go.wait()
            for _ in range(60):
                m = store.lookup(key, None, GRID, similar=False)
                if m.entry is not None:
                    seen.append(bytes(m.entry.data))

        threads = [
            threading.Thread(target=write, args=(writers[0], first)),
            threading.Thread(target=write, args=(writers[1], bytes(second))),
            *(threading.Thread(target=read, args=(r,)) for r in readers),
        ]
        for t in threads:
            t.start()
        go.set()
        for t in threads:
            t.join(30)
        stored = exact(replica(server, "race:", follow=False), key)
        assert stored in (first, bytes(second))
        for store in (*writers, *readers):  # every replica answers the first write
            assert exact(store, key) == stored, round_
        assert all(data == stored for data in seen), round_
    assert {r: integrity(r) for r in before} == before


def servicer(store: RedisStore, tmp_path: Path) -> CacheServicer:
    holder = handoff.Holder("cache", shm_dir=tmp_path)
    return CacheServicer(
        store,
        default_policy=generation_pb2.CACHE_POLICY_SIMILAR,
        max_queries=16,
        holder=holder,
    )


def add_cache_and_handoff(s: CacheServicer, server: grpc.aio.Server) -> None:
    pb_grpc.add_CacheServiceServicer_to_server(s, server)
    assert s.holder is not None
    handoff.register_holder(s.holder, server)


def put_request(i: int) -> pb.PutRequest:
    emb = np.frombuffer(payload(i), np.float32).reshape(4, 4)
    return pb.PutRequest(
        entries=[
            pb.PutEntry(
                key=f"k{i}",
                embedding=tensor_pb2.ImageEmbedding(
                    embeddings=tensors.from_numpy(emb),
                    grid=tensor_pb2.GridTHW(t=1, h=4, w=4),
                    key=f"k{i}",
                ),
                descriptor=tensors.from_numpy(unit(i)),
                verification=tensors.from_numpy(V.luma),
                verification_chroma=tensors.from_numpy(V.chroma),
            )
        ]
    )


def lookup_request(i: int, transport: int = 0) -> pb.LookupRequest:
    return pb.LookupRequest(
        queries=[
            pb.LookupQuery(
                key=f"query-{i}",
                grid=tensor_pb2.GridTHW(t=1, h=4, w=4),
                descriptor=tensors.from_numpy(near(unit(i))),
                verification=tensors.from_numpy(V.luma),
                verification_chroma=tensors.from_numpy(V.chroma),
            )
        ],
        include_embeddings=True,
        transport=transport,
    )


async def test_a_hit_put_through_one_replica_is_handed_out_by_the_other(
    server: RedisServer, tmp_path: Path
) -> None:
    a = servicer(replica(server, "svc:"), tmp_path / "a")
    b = servicer(replica(server, "svc:"), tmp_path / "b")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    holding = HoldingSettings(port=0)
    async with (
        in_process_server(add_cache_and_handoff, a, CACHE) as ca,
        in_process_server(
            add_cache_and_handoff, b, CACHE, on_port=handoff.on_listening(b.holder, holding)
        ) as cb,
    ):
        assert (await pb_grpc.CacheServiceStub(ca).Put(put_request(7))).stored == 1
        stub_b = pb_grpc.CacheServiceStub(cb)
        deadline = time.monotonic() + FOLLOW_WITHIN_S
        while True:  # by similarity: once B has followed A's put through the log
            got = await stub_b.Lookup(lookup_request(7, tensor_pb2.TRANSPORT_GRPC))
            if (
                got.results[0].tier == generation_pb2.CACHE_TIER_SIMILAR
                or time.monotonic() > deadline
            ):
                break
            await asyncio.sleep(0.02)
        result = got.results[0]
        assert result.tier == generation_pb2.CACHE_TIER_SIMILAR and result.matched_key == "k7"
        # Held by B, read from B: store -> B -> reader (A never takes part).
        assert b.holder is not None and result.embedding.ref.holder == b.holder.address
        assert result.embedding.ref.service == "cache"
        reader = handoff.Reader()
        fetched = await reader.fetch(result.embedding, field="images[0]", timeout=10)
        await reader.close()
        assert bytes(fetched.data) == payload(7)


async def test_a_store_down_behind_the_servicer_is_a_miss_and_a_dropped_put(
    tmp_path: Path,
) -> None:
    nowhere = RedisServer(tmp_path)  # a port where nothing listens
    store = replica(nowhere, "down:", timeout_s=0.3)
    s = servicer(store, tmp_path)
    async with in_process_server(add_cache_and_handoff, s, CACHE) as channel:
        stub = pb_grpc.CacheServiceStub(channel)
        assert (await stub.Put(put_request(1))).stored == 0  # dropped, no error status
        got = await stub.Lookup(lookup_request(1))
        assert got.results[0].tier == generation_pb2.CACHE_TIER_MISS
        nowhere.start()  # the store comes up: caching starts without a restart
        try:
            deadline = time.monotonic() + 10
            while (await stub.Put(put_request(1))).stored != 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            got = await stub.Lookup(lookup_request(1))
            assert got.results[0].tier == generation_pb2.CACHE_TIER_SIMILAR
        finally:
            nowhere.stop()


def test_redis_cluster_store(tmp_path: Path) -> None:
    ports: list[int] = []
    while len(ports) < 3:  # a cluster bus listens on port + 10000
        if (port := free_port()) <= 55535:
            ports.append(port)
    servers = [
        RedisServer(tmp_path / str(p), "--cluster-enabled", "yes", "--cluster-node-timeout", "2000")
        for p in ports
    ]
    try:
        for s, p in zip(servers, ports, strict=True):
            s.port = p
            s.start()
        cli = shutil.which("redis-cli") or "/usr/bin/redis-cli"
        subprocess.run(
            [cli, "-a", PASSWORD, "--no-auth-warning", "--cluster", "create",
             *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while any(s.client().cluster("info")["cluster_state"] != "ok" for s in servers):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        url = f"redis+cluster://:{PASSWORD}@127.0.0.1:{ports[0]}"
        a, b = replica(servers[0], "c:", url=url), replica(servers[0], "c:", url=url)
        for i in range(12):  # spread over the three primaries' slots
            put(a, i, alias=f"file-{i}")
        assert all(exact(b, f"k{i}") == payload(i) for i in range(12))
        assert exact(b, "file-5") == payload(5)
        wait_similar(b, 11)
        holding = {s.port: s.client().dbsize() for s in servers}
        assert sum(1 for n in holding.values() if n) >= 2, holding  # sharded across nodes
        c = replica(servers[0], "c:", url=url, follow=False)  # a scan of every primary
        assert sorted(c.catalog.keys()) == sorted(f"k{i}" for i in range(12))
        assert similar(c, 3) == "k3"
    finally:
        for s in servers:
            s.stop()


class TlsRedisServer(RedisServer):
    """A redis-server that speaks TLS only, with client certificates required."""

    def __init__(self, root: Path, pki: object) -> None:
        super().__init__(root)
        self.pki = pki

    @property
    def url(self) -> str:
        return f"rediss://:{self.password}@localhost:{self.port}/0"

    def args(self) -> list[str]:
        p = self.pki
        return [
            *super().args(),
            "--port", "0", "--tls-port", str(self.port),
            "--tls-cert-file", str(p.server_cert), "--tls-key-file", str(p.server_key),  # type: ignore[attr-defined]
            "--tls-ca-cert-file", str(p.ca), "--tls-auth-clients", "yes",  # type: ignore[attr-defined]
        ]  # fmt: skip

    def client(self) -> redis.Redis:
        p = self.pki
        return redis.Redis(
            host="localhost", port=self.port, password=self.password, socket_timeout=5,
            ssl=True, ssl_ca_certs=str(p.ca), ssl_certfile=str(p.client_cert),  # type: ignore[attr-defined]
            ssl_keyfile=str(p.client_key),  # type: ignore[attr-defined]
        )  # fmt: skip


def test_rediss_store_with_a_ca_and_a_client_certificate(tmp_path: Path) -> None:
    from tests.unit.vlcommon.test_security import make_pki

    pki = make_pki(tmp_path / "pki")
    s = TlsRedisServer(tmp_path / "redis", pki).start()
    try:
        tls = {
            "url": s.url,
            "tls_ca_file": str(pki.ca),
            "tls_cert_file": str(pki.client_cert),
            "tls_key_file": str(pki.client_key),
        }
        a, b = replica(s, "tls:", **tls), replica(s, "tls:", **tls)
        put(a, 1)
        assert exact(b, "k1") == payload(1)
        wait_similar(b, 1)
        with pytest.raises(ConfigError, match="certificate"):  # the system's roots
            replica(s, "tls:", url=s.url)
    finally:
        s.stop()
