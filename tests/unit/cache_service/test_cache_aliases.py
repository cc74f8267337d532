"""Alias keys in the cache (issue 19): the gateway's digest of an encoded file finds the
entry stored under the pixel key, with the byte budget, LRU, TTL and leases unchanged.

The store and the servicer are the real ones; the servicer runs on an in-process grpc.aio
server (tests/conftest.py ``in_process_server``).
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from qwenvl.cache.v1 import cache_service_pb2 as pb
from qwenvl.cache.v1 import cache_service_pb2_grpc as pb_grpc
from qwenvl.common.v1 import generation_pb2, tensor_pb2

from cache_service.servicer import MAX_KEY_CHARS, CacheServicer
from cache_service.store import MAX_ALIASES_PER_ENTRY, EmbeddingStore
from tests.conftest import in_process_server
from tests.unit.cache_service.test_cache_store import DIM, VT, VTC, Clock, V, near, put, unit
from vlcommon import tensors

GRID = (1, 4, 4)
EXACT, SIMILAR, MISS = (
    generation_pb2.CACHE_TIER_EXACT,
    generation_pb2.CACHE_TIER_SIMILAR,
    generation_pb2.CACHE_TIER_MISS,
)


def put_aliased(store: EmbeddingStore, key: str, alias: str, nbytes: int = 100) -> int:
    data = b"\1" * (nbytes - V.nbytes)
    return store.put(
        key,
        unit(len(key)),
        GRID,
        tensor_pb2.DATA_TYPE_FP32,
        (nbytes // 4, 1),
        data,
        verification=V,
        alias=alias,
    )


def exact(store: EmbeddingStore, key: str, grid: tuple[int, int, int] = GRID) -> str | None:
    """The key of the entry an exact-only lookup of ``key`` answers with, or None."""
    match = store.lookup(key, None, grid, similar=False)
    return None if match.entry is None else match.entry.key


def test_an_alias_finds_its_entry_and_counts_no_bytes() -> None:
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=1_000)
    put_aliased(store, "pixels", "file")
    assert exact(store, "file") == "pixels" and exact(store, "pixels") == "pixels"
    assert len(store) == 1 and store.bytes == 100  # one entry, its bytes counted once
    # The alias's grid check is the entry's: another plan under the file's digest misses.
    assert exact(store, "file", grid=(1, 4, 6)) is None
    # A second Put of the same pixel key with the alias refreshes; nothing doubles.
    assert put_aliased(store, "pixels", "file") == 0
    assert len(store) == 1 and store.bytes == 100
    store.check_invariants()


def test_an_alias_goes_with_its_entry_on_eviction_and_expiry() -> None:
    clock = Clock()
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=250, ttl_s=10.0, clock=clock)
    put_aliased(store, "p1", "f1")
    put_aliased(store, "p2", "f2")
    put_aliased(store, "p3", "f3")  # 300 bytes > 250: p1 is evicted, and f1 with it
    assert "p1" not in store and exact(store, "f1") is None
    assert exact(store, "f2") == "p2"
    store.check_invariants()
    clock.now += 11  # p2 and p3 expire: their aliases are never served either
    assert exact(store, "f2") is None  # and the lookup reclaimed p2
    assert store.expire() == 1  # p3, with f3
    assert exact(store, "f3") is None
    assert len(store) == 0 and store.bytes == 0
    store.check_invariants()


def test_a_leased_entry_found_by_alias_is_not_evicted() -> None:
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=200)
    put_aliased(store, "p1", "f1")
    match = store.lookup("f1", None, GRID, similar=False, lease=True)
    assert match.entry is not None and match.entry.key == "p1"
    put_aliased(store, "p2", "f2")
    put_aliased(store, "p3", "f3")  # evicts p2, the unleased one, not p1
    assert exact(store, "f1") == "p1" and "p2" not in store
    store.release(match.entry)
    store.check_invariants()


def test_the_newest_put_wins_an_alias_and_own_keys_win_over_aliases() -> None:
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=10_000)
    put_aliased(store, "old", "file")
    put_aliased(store, "new", "file")  # the same file decoded to other pixels: newest wins
    assert exact(store, "file") == "new"
    store.check_invariants()
    put_aliased(store, "a", "new")  # an alias that is an entry's own key is ignored
    assert exact(store, "new") == "new"
    put_aliased(store, "file", "x")  # a key stored that was an alias finds its own entry
    assert exact(store, "file") == "file" and exact(store, "x") == "file"
    store.check_invariants()


def test_an_entry_keeps_its_newest_aliases() -> None:
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=10_000)
    for i in range(MAX_ALIASES_PER_ENTRY + 2):
        put_aliased(store, "pixels", f"file{i}")
    found = [exact(store, f"file{i}") for i in range(MAX_ALIASES_PER_ENTRY + 2)]
    assert found == [None, None] + ["pixels"] * MAX_ALIASES_PER_ENTRY
    store.check_invariants()


def test_an_exact_hit_by_own_key_adds_the_alias_a_similar_hit_does_not() -> None:
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=10_000)
    a = unit(1)
    put(store, "a", a)
    similar = store.lookup("b", near(a, 0.95), GRID, similar=True, verification=V, alias="f-b")
    assert similar.tier == "similar" and exact(store, "f-b") is None
    # An exact hit through an alias adds nothing either (only the pixel key's hit does).
    assert store.lookup("a", a, GRID, similar=True, verification=V, alias="f-a").tier == "exact"
    assert exact(store, "f-a") == "a"
    store.lookup("f-a", None, GRID, similar=False, alias="f-c")
    assert exact(store, "f-c") is None
    store.check_invariants()


def test_budget_and_aliases_hold_under_a_random_workload() -> None:
    rng = np.random.default_rng(19)
    clock = Clock()
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=1_500, ttl_s=5.0, clock=clock)
    leases = []
    for step in range(800):
        op = rng.random()
        key, alias = f"p{rng.integers(30)}", f"f{rng.integers(40)}"
        if op < 0.45:
            put_aliased(store, key, alias, nbytes=4 * int(rng.integers(5, 100)))
        elif op < 0.9:
            m = store.lookup(
                alias if op < 0.7 else key, None, GRID, similar=False, lease=True, alias=alias
            )
            if m.entry is not None:
                leases.append(m.entry)
        elif leases:
            store.release(leases.pop(int(rng.integers(len(leases)))))
        clock.now += float(rng.random())
        assert store.bytes <= store.capacity_bytes, step
        store.check_invariants()
    for entry in leases:
        store.release(entry)
    store.check_invariants()


@pytest.fixture
async def cache_stub():
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=10_000)
    servicer = CacheServicer(
        store, default_policy=generation_pb2.CACHE_POLICY_SIMILAR, max_queries=4
    )
    async with in_process_server(
        pb_grpc.add_CacheServiceServicer_to_server, servicer, "qwenvl.cache.v1.CacheService"
    ) as channel:
        yield pb_grpc.CacheServiceStub(channel)


def _entry(key: str, alias: str) -> pb.PutEntry:
    return pb.PutEntry(
        key=key,
        alias_key=alias,
        descriptor=tensors.from_numpy(unit(5)),
        embedding=tensor_pb2.ImageEmbedding(
            embeddings=tensors.from_numpy(np.ones((4, 6), dtype=np.float32)),
            grid=tensor_pb2.GridTHW(t=1, h=4, w=4),
            key=key,
        ),
        verification=VT,
        verification_chroma=VTC,
    )


async def test_servicer_bytes_key_lookup_counts_each_image_once(cache_stub) -> None:
    grid = tensor_pb2.GridTHW(t=1, h=4, w=4)
    await cache_stub.Put(pb.PutRequest(entries=[_entry("pixels", "file")]))
    by_bytes = await cache_stub.Lookup(
        pb.LookupRequest(
            include_embeddings=True,
            bytes_keys=True,
            queries=[
                pb.LookupQuery(key="file", grid=grid),
                pb.LookupQuery(key="other-file", grid=grid),
            ],
        )
    )
    assert [r.tier for r in by_bytes.results] == [EXACT, MISS]
    hit = by_bytes.results[0]
    assert hit.matched_key == "pixels" and hit.embedding.key == "pixels"
    assert list(hit.embedding.embeddings.shape) == [4, 6]
    stats = await cache_stub.GetStats(pb.GetStatsRequest())
    # The bytes-key miss is not counted: the gateway asks again by pixel key.
    assert (stats.exact_hits, stats.similar_hits, stats.misses) == (1, 0, 0)
    # A bytes-key query never reaches the similarity tier, whatever the policy says.
    near_query = pb.LookupQuery(
        key="near",
        grid=grid,
        descriptor=tensors.from_numpy(unit(5)),
        verification=VT,
        verification_chroma=VTC,
    )
    similar = await cache_stub.Lookup(
        pb.LookupRequest(
            policy=generation_pb2.CACHE_POLICY_SIMILAR, bytes_keys=True, queries=[near_query]
        )
    )
    assert similar.results[0].tier == MISS
    by_pixels = await cache_stub.Lookup(pb.LookupRequest(queries=[near_query]))
    assert by_pixels.results[0].tier == SIMILAR  # the same query by pixel key: a hit
    stats = await cache_stub.GetStats(pb.GetStatsRequest())
    assert (stats.exact_hits, stats.similar_hits, stats.misses) == (1, 1, 0)


async def test_servicer_pixel_key_hit_registers_the_alias(cache_stub) -> None:
    grid = tensor_pb2.GridTHW(t=1, h=4, w=4)
    await cache_stub.Put(pb.PutRequest(entries=[_entry("pixels", "jpeg-file")]))
    # The same pixels as another file: found by pixel key, which adds the PNG's digest.
    await cache_stub.Lookup(
        pb.LookupRequest(queries=[pb.LookupQuery(key="pixels", grid=grid, alias_key="png-file")])
    )
    again = await cache_stub.Lookup(
        pb.LookupRequest(
            bytes_keys=True,
            queries=[
                pb.LookupQuery(key="png-file", grid=grid),
                pb.LookupQuery(key="jpeg-file", grid=grid),
            ],
        )
    )
    assert [r.tier for r in again.results] == [EXACT, EXACT]
    assert [r.matched_key for r in again.results] == ["pixels", "pixels"]


async def test_servicer_refuses_an_alias_key_that_is_too_long(cache_stub) -> None:
    long_alias = "f" * (MAX_KEY_CHARS + 1)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await cache_stub.Put(pb.PutRequest(entries=[_entry("pixels", long_alias)]))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"entries[0].alias_key has {MAX_KEY_CHARS + 1} characters" in exc.value.details()
    grid = tensor_pb2.GridTHW(t=1, h=4, w=4)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await cache_stub.Lookup(
            pb.LookupRequest(queries=[pb.LookupQuery(key="k", grid=grid, alias_key=long_alias)])
        )
    assert "queries[0].alias_key has" in exc.value.details()
    stats = await cache_stub.GetStats(pb.GetStatsRequest())
    assert stats.entries == 0
