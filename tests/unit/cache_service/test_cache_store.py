"""The embedding store (exact + FAISS similarity tier, byte budget) and its gRPC servicer."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from qwenvl.cache.v1 import cache_service_pb2 as pb
from qwenvl.cache.v1 import cache_service_pb2_grpc as pb_grpc
from qwenvl.common.v1 import generation_pb2, tensor_pb2

from cache_service.index import IndexParams
from cache_service.servicer import CacheServicer
from cache_service.store import CacheFullError, EmbeddingStore, EntryTooLargeError
from tests.conftest import in_process_server
from vlcommon import tensors
from vlcommon.verification import VerificationImage

DIM = 16


def unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def near(v: np.ndarray, cos: float, seed: int = 99) -> np.ndarray:
    """A unit vector with cosine similarity ``cos`` to ``v``."""
    r = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    r -= r.dot(v) * v
    r /= np.linalg.norm(r)
    return (cos * v + np.sqrt(1 - cos**2) * r).astype(np.float32)


# Every entry and query carries this verification image: equal images pass the cache's
# verification (vlcommon.verification), so these tests exercise the descriptor, grid, index
# and budget rules; tests/unit/cache_service/test_cache_verification.py covers the verification
# itself.
# A verification image (vlcommon.verification) that passes against itself: a flat grey
# 1x4 luma with its 1x2 neutral chroma; VT and VTC as a Lookup query or Put entry sends them.
V = VerificationImage(np.full((1, 4), 128, np.uint8), np.full((1, 2, 2), 128, np.uint8))
VT = tensors.from_numpy(V.luma)
VTC = tensors.from_numpy(V.chroma)


def put(store: EmbeddingStore, key: str, desc: np.ndarray, grid=(1, 4, 4), nbytes=100) -> int:
    """Store an entry of ``nbytes`` budget bytes (embeddings plus the verification image)."""
    data = b"\1" * (nbytes - V.nbytes)
    return store.put(
        key, desc, grid, tensor_pb2.DATA_TYPE_FP32, (nbytes // 4, 1), data, verification=V
    )


def test_exact_then_similar_then_miss() -> None:
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=10_000, threshold=0.85)
    a = unit(1)
    put(store, "a", a)
    assert store.lookup("a", None, (1, 4, 4), similar=True, verification=V).tier == "exact"
    hit = store.lookup("b", near(a, 0.9), (1, 4, 4), similar=True, verification=V)
    assert hit.tier == "similar" and hit.entry is not None and hit.entry.key == "a"
    assert hit.similarity == pytest.approx(0.9, abs=1e-4)
    assert store.lookup("b", near(a, 0.8), (1, 4, 4), similar=True, verification=V).tier == "miss"
    assert store.lookup("b", near(a, 0.9), (1, 4, 4), similar=False).tier == "miss"


def test_similar_needs_an_equal_grid() -> None:
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=10_000)
    a = unit(2)
    put(store, "a", a, grid=(1, 4, 6))
    miss = store.lookup("q", a, (1, 6, 4), similar=True, verification=V)
    assert miss.tier == "miss" and miss.similarity == pytest.approx(1.0, abs=1e-5)
    assert store.lookup("q", a, (1, 4, 6), similar=True, verification=V).tier == "similar"


def test_threshold_edge_is_a_hit_within_tolerance() -> None:
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=10_000, threshold=0.85)
    a = unit(3)
    put(store, "a", a)
    assert (
        store.lookup("q", near(a, 0.85), (1, 4, 4), similar=True, verification=V).tier == "similar"
    )
    assert store.lookup("q", near(a, 0.849), (1, 4, 4), similar=True, verification=V).tier == "miss"


def test_byte_budget_evicts_lru_and_removes_index_entries() -> None:
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=350)
    for i in range(3):
        put(store, f"k{i}", unit(10 + i))
    assert store.bytes == 300
    store.lookup("k0", None, (1, 4, 4), similar=False)  # k0 becomes most recent
    assert put(store, "k3", unit(13)) == 1
    assert "k1" not in store and {"k0", "k2", "k3"} <= {k for k in ("k0", "k2", "k3") if k in store}
    assert store.bytes == 300 <= store.capacity_bytes
    assert store.index_size == len(store) == 3
    # The evicted entry's vector is gone: its own descriptor finds nothing similar now.
    assert store.lookup("x", unit(11), (1, 4, 4), similar=True, verification=V).tier == "miss"
    with pytest.raises(ValueError, match="exceeds the budget"):
        put(store, "huge", unit(20), nbytes=400)


def test_zero_descriptor_only_hits_exactly() -> None:
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=1000)
    put(store, "flat", np.zeros(DIM, dtype=np.float32))
    assert store.index_size == 0
    assert (
        store.lookup(
            "other", np.zeros(DIM, np.float32), (1, 4, 4), similar=True, verification=V
        ).tier
        == "miss"
    )


@pytest.fixture
async def cache_stub():

    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=10_000)
    servicer = CacheServicer(
        store, default_policy=generation_pb2.CACHE_POLICY_SIMILAR, max_queries=4
    )
    async with in_process_server(
        pb_grpc.add_CacheServiceServicer_to_server, servicer, "qwenvl.cache.v1.CacheService"
    ) as channel:
        stub = pb_grpc.CacheServiceStub(channel)
        stub.raw_channel = channel  # type: ignore[attr-defined]
        yield stub


def _entry(key: str, desc: np.ndarray, rows: int = 4) -> pb.PutEntry:
    emb = np.ones((rows, 6), dtype=np.float32)
    return pb.PutEntry(
        key=key,
        descriptor=tensors.from_numpy(desc),
        embedding=tensor_pb2.ImageEmbedding(
            embeddings=tensors.from_numpy(emb), grid=tensor_pb2.GridTHW(t=1, h=4, w=4), key=key
        ),
        verification=VT,
        verification_chroma=VTC,
    )


async def test_servicer_put_lookup_and_errors(cache_stub) -> None:
    a = unit(5)
    put_resp = await cache_stub.Put(pb.PutRequest(entries=[_entry("a", a)]))
    assert put_resp.stored == 1
    grid = tensor_pb2.GridTHW(t=1, h=4, w=4)
    resp = await cache_stub.Lookup(
        pb.LookupRequest(
            include_embeddings=True,
            queries=[
                pb.LookupQuery(
                    key="a",
                    descriptor=tensors.from_numpy(a),
                    grid=grid,
                    verification=VT,
                    verification_chroma=VTC,
                ),
                pb.LookupQuery(
                    key="b",
                    descriptor=tensors.from_numpy(near(a, 0.95)),
                    grid=grid,
                    verification=VT,
                    verification_chroma=VTC,
                ),
                pb.LookupQuery(
                    key="c",
                    descriptor=tensors.from_numpy(unit(6)),
                    grid=grid,
                    verification=VT,
                    verification_chroma=VTC,
                ),
            ],
        )
    )
    tiers = [r.tier for r in resp.results]
    assert tiers == [
        generation_pb2.CACHE_TIER_EXACT,
        generation_pb2.CACHE_TIER_SIMILAR,
        generation_pb2.CACHE_TIER_MISS,
    ]
    assert resp.results[1].matched_key == "a"
    assert list(resp.results[1].embedding.embeddings.shape) == [4, 6]
    exact_only = await cache_stub.Lookup(
        pb.LookupRequest(
            policy=generation_pb2.CACHE_POLICY_EXACT_ONLY,
            queries=[
                pb.LookupQuery(
                    key="b",
                    descriptor=tensors.from_numpy(near(a, 0.95)),
                    grid=grid,
                    verification=VT,
                    verification_chroma=VTC,
                )
            ],
        )
    )
    assert exact_only.results[0].tier == generation_pb2.CACHE_TIER_MISS
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await cache_stub.Lookup(
            pb.LookupRequest(
                queries=[
                    pb.LookupQuery(
                        key="x",
                        descriptor=tensors.from_numpy(np.ones(DIM + 1, np.float32)),
                        grid=grid,
                    )
                ]
            )
        )
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "queries[0].descriptor.shape is [17]; expected [16]" in exc.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await cache_stub.Lookup(pb.LookupRequest(queries=[pb.LookupQuery(key="x", grid=grid)] * 5))
    assert (
        exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit is 4" in exc.value.details()
    )
    stats = await cache_stub.GetStats(pb.GetStatsRequest())
    assert (stats.entries, stats.exact_hits, stats.similar_hits) == (1, 1, 1)


async def test_servicer_refuses_entries_that_do_not_fit_their_grid(cache_stub) -> None:
    bad_rows = _entry("rows", unit(7), rows=5)  # grid 1x4x4 needs 4 rows
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await cache_stub.Put(pb.PutRequest(entries=[bad_rows]))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "entries[0].embedding.embeddings has shape [5, 6]; grid [1, 4, 4] needs 4 rows" in (
        exc.value.details()
    )
    nan = _entry("nan", unit(8))
    values = np.ones((4, 6), dtype=np.float32)
    values[1, 2] = np.nan
    nan.embedding.embeddings.CopyFrom(tensors.from_numpy(values))
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await cache_stub.Put(pb.PutRequest(entries=[nan]))
    assert "NaN or inf" in exc.value.details()
    stats = await cache_stub.GetStats(pb.GetStatsRequest())
    assert stats.entries == 0


async def test_unknown_policy_and_unparsable_bytes_are_invalid_argument(cache_stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await cache_stub.Lookup(pb.LookupRequest(policy=99))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "policy 99 is not a CachePolicy value" in exc.value.details()
    raw = cache_stub.raw_channel.unary_unary(
        "/qwenvl.cache.v1.CacheService/Lookup",
        request_serializer=lambda b: b,
        response_deserializer=pb.LookupResponse.FromString,
    )
    # queries[0].key holding invalid UTF-8: protobuf refuses to parse it.
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await raw(b"\x0a\x04\x0a\x02\xff\xfe")
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not be parsed" in exc.value.details()


# -- capacity: TTL, leases, byte budget, index kinds (issue 4) ----------------------------
class Clock:
    """A manual monotonic clock: tests move time instead of sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_ttl_expired_entries_are_never_served_and_are_reclaimed() -> None:
    clock = Clock()
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=10_000, ttl_s=10.0, clock=clock)
    a, b = unit(30), unit(31)
    put(store, "a", a)
    clock.now += 5
    put(store, "b", b)
    clock.now += 4.9  # a is 9.9 s old
    assert store.lookup("a", None, (1, 4, 4), similar=False).tier == "exact"
    clock.now += 0.1  # a is exactly 10 s old: expired
    assert store.lookup("a", a, (1, 4, 4), similar=True, verification=V).tier == "miss"
    # Its vector is gone too: a near-duplicate finds nothing similar.
    assert store.lookup("q", near(a, 0.95), (1, 4, 4), similar=True, verification=V).tier == "miss"
    assert "a" not in store and store.evictions["ttl"] == 1
    store.check_invariants()
    # A Put of a held key refreshes its TTL; lookups do not.
    clock.now += 4  # b is 9 s old
    put(store, "b", b)
    clock.now += 9
    assert store.lookup("b", None, (1, 4, 4), similar=False).tier == "exact"
    clock.now += 1
    assert store.expire() == 1 and len(store) == 0 and store.bytes == 0
    store.check_invariants()


def test_a_leased_entry_that_expires_is_not_served_and_is_reclaimed_on_release() -> None:
    clock = Clock()
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=10_000, ttl_s=1.0, clock=clock)
    put(store, "a", unit(32))
    match = store.lookup("a", None, (1, 4, 4), similar=False, lease=True)
    assert match.entry is not None and store.leased == 1
    clock.now += 2
    assert store.lookup("a", None, (1, 4, 4), similar=False).tier == "miss"
    assert store.expire() == 0 and "a" in store  # leased: kept until released
    store.release(match.entry)
    assert "a" not in store and store.leased == 0 and store.evictions["ttl"] == 1
    store.check_invariants()
    with pytest.raises(RuntimeError, match="released more often than leased"):
        store.release(match.entry)


def test_eviction_skips_leased_entries_and_refuses_when_all_are_leased() -> None:
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=300)
    for i in range(3):
        put(store, f"k{i}", unit(40 + i))
    held = store.lookup("k0", None, (1, 4, 4), similar=False, lease=True).entry
    store.lookup("k1", None, (1, 4, 4), similar=False)  # LRU order now k2, k0, k1
    assert held is not None
    assert put(store, "k3", unit(43)) == 1
    assert "k2" not in store and "k0" in store  # k0 was the LRU candidate after k2
    assert put(store, "k4", unit(44)) == 1
    assert "k0" in store and "k1" not in store  # k0 is older than k1 but leased
    assert store.lookup("k3", None, (1, 4, 4), similar=False, lease=True).entry is not None
    assert store.lookup("k4", None, (1, 4, 4), similar=False, lease=True).entry is not None
    # Everything is leased: a Put is refused, nothing is evicted, the budget holds.
    with pytest.raises(CacheFullError, match="300 of the 300-byte budget are leased"):
        put(store, "k5", unit(45))
    assert len(store) == 3 and store.bytes == 300
    store.release(held)
    assert put(store, "k5", unit(45)) == 1 and "k0" not in store
    store.check_invariants()
    with pytest.raises(EntryTooLargeError, match="exceeds the budget of 300 bytes"):
        put(store, "huge", unit(46), nbytes=304)


def test_byte_budget_is_never_exceeded_under_a_random_workload() -> None:
    rng = np.random.default_rng(7)
    clock = Clock()
    store = EmbeddingStore(
        descriptor_dim=DIM,
        capacity_bytes=2_000,
        ttl_s=4.0,
        clock=clock,
        index_threshold=6,
        min_rebuild_tombstones=4,
    )
    leases: list = []
    refused = 0
    for step in range(600):
        op = rng.random()
        if op < 0.5:
            try:
                put(
                    store,
                    f"k{rng.integers(80)}",
                    unit(int(rng.integers(80))),
                    nbytes=4 * int(rng.integers(1, 150)),
                )
            except CacheFullError:
                refused += 1
        elif op < 0.9:
            m = store.lookup(
                f"k{rng.integers(80)}",
                unit(int(rng.integers(80))),
                (1, 4, 4),
                similar=True,
                lease=True,
                verification=V,
            )
            if m.entry is not None:
                leases.append(m.entry)
        elif leases:
            store.release(leases.pop(int(rng.integers(len(leases)))))
        clock.now += float(rng.random())
        assert store.bytes <= store.capacity_bytes, step
        store.check_invariants()
    assert store.evictions["lru"] > 0 and store.evictions["ttl"] > 0
    assert store.rebuilds > 0  # migrations and tombstone purges happened on the way
    for entry in leases:
        store.release(entry)
    assert store.leased == 0
    store.check_invariants()


def _put_100b(store: EmbeddingStore, key: str, descriptor: np.ndarray) -> None:
    """Put a 100-byte entry (25 fp32 rows + the verification image) with grid (1, 4, 4)."""
    store.put(
        key,
        descriptor,
        (1, 4, 4),
        tensor_pb2.DATA_TYPE_FP32,
        (25, 1),
        b"\0" * (100 - V.nbytes),
        verification=V,
    )


def _reference_best(vectors: dict[str, np.ndarray], q: np.ndarray, threshold: float):
    """Brute-force answer: the best-scoring key at or above the threshold, or None."""
    best = max(vectors, key=lambda k: float(vectors[k] @ q))
    return best if float(vectors[best] @ q) >= threshold - 1e-5 else None


def test_migration_to_hnsw_and_back_and_tombstone_rebuilds() -> None:
    dim = 64
    rng = np.random.default_rng(3)
    vecs = rng.standard_normal((400, dim)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    store = EmbeddingStore(
        descriptor_dim=dim,
        capacity_bytes=400 * 100,
        index_threshold=100,
        index_params=IndexParams(projected_dim=16, hnsw_m=16, ef_search=64),
        min_rebuild_tombstones=20,
        rebuild_fraction=0.25,
    )
    for i in range(99):
        _put_100b(store, f"k{i}", vecs[i])
    assert store.index_kind == "flat"
    _put_100b(store, "k99", vecs[99])
    assert store.index_kind == "hnsw" and store.index_size == 100 and store.rebuilds == 1
    store.check_invariants()

    def query(i: int) -> np.ndarray:
        noise = rng.standard_normal(dim).astype(np.float32) * 0.02
        q = vecs[i] + noise
        return q / np.linalg.norm(q)

    live = {f"k{i}": vecs[i] for i in range(100)}
    for i in range(100):
        q = query(i)
        m = store.lookup(f"q{i}", q, (1, 4, 4), similar=True, verification=V)
        assert m.tier == "similar" and m.entry is not None
        assert m.entry.key == _reference_best(live, q, 0.85)
        assert m.similarity == pytest.approx(float(vecs[i] @ q), abs=1e-5)  # exact re-score
    # Removals from HNSW are tombstones; evicted vectors are never answered.
    store.capacity_bytes = 40 * 100
    _put_100b(store, "k100", vecs[100])
    assert len(store) == 40 and store.evictions["lru"] == 61
    # 40 live vectors are below half the threshold: the index was rebuilt from them as the
    # exact index, leaving the 61 tombstones behind.
    assert store.index_kind == "flat" and store.index_size == 40 and store.tombstones == 0
    store.check_invariants()
    store.capacity_bytes = 400 * 100
    for i in range(101, 260):
        _put_100b(store, f"k{i}", vecs[i])
    assert store.index_kind == "hnsw"
    assert store.index_kind == "hnsw" and store.index_size == 199 and store.tombstones == 0
    store.capacity_bytes = 180 * 100
    _put_100b(store, "k260", vecs[260])
    assert store.index_kind == "hnsw" and store.tombstones == 20  # 20 < 25% of 200: kept
    store.check_invariants()
    for i in range(60, 261):  # tombstoned vectors are in the graph but never answered
        m = store.lookup(f"q{i}", vecs[i], (1, 4, 4), similar=True, verification=V)
        assert (m.entry.key if m.entry else None) == (f"k{i}" if f"k{i}" in store else None)
    store.capacity_bytes = 150 * 100
    _put_100b(store, "k261", vecs[261])
    # 51 tombstones > 25% of 201 vectors: purged by a rebuild of the 150 live ones.
    assert store.index_kind == "hnsw" and store.tombstones == 0 and store.index_size == 150
    store.check_invariants()
    live = {k: vecs[int(k[1:])] for k in [f"k{i}" for i in range(262)] if k in store}
    assert len(live) == 150
    for i in range(262):
        q = query(i)
        m = store.lookup(f"q{i}", q, (1, 4, 4), similar=True, verification=V)
        expected = _reference_best(live, q, 0.85)
        assert (m.entry.key if m.entry else None) == expected, i


def test_background_rebuild_replays_concurrent_adds_and_removals() -> None:
    dim = 32
    rng = np.random.default_rng(4)
    vecs = rng.standard_normal((300, dim)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    store = EmbeddingStore(
        descriptor_dim=dim,
        capacity_bytes=250 * 100,
        index_threshold=100,
        index_params=IndexParams(projected_dim=8, hnsw_m=8),
        background_rebuild=True,
    )
    for i in range(300):  # crosses the threshold (a rebuild in a thread) and evicts 50
        _put_100b(store, f"k{i}", vecs[i])
    assert store.wait_for_rebuild(timeout=60)
    store.check_invariants()
    assert store.index_kind == "hnsw" and len(store) == 250
    for i in range(300):
        m = store.lookup(f"q{i}", vecs[i], (1, 4, 4), similar=True, verification=V)
        assert (m.entry.key if m.entry else None) == (f"k{i}" if i >= 50 else None), i


def test_background_rebuild_catches_up_outside_the_lock(monkeypatch) -> None:
    """Every add made during a rebuild is replayed in catch-up rounds (forced here by a
    zero allowance under the lock), and evictions meanwhile stay removed."""
    import threading

    from cache_service import store as store_module

    monkeypatch.setattr(store_module, "CATCH_UP_UNDER_LOCK", 0)
    dim = 32
    rng = np.random.default_rng(5)
    vecs = rng.standard_normal((2000, dim)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    store = EmbeddingStore(
        descriptor_dim=dim,
        capacity_bytes=600 * 100,
        index_threshold=100,
        index_params=IndexParams(projected_dim=8, hnsw_m=8),
        min_rebuild_tombstones=50,
        background_rebuild=True,
    )

    def writer(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            _put_100b(store, f"k{i}", vecs[i])

    threads = [threading.Thread(target=writer, args=(t * 500, t * 500 + 500)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert store.wait_for_rebuild(timeout=120)
    store.check_invariants()
    assert store.rebuilds >= 2 and len(store) == 600 and store.index_kind == "hnsw"
    # check_invariants above: every held entry's vector is indexed, no evicted one is. A
    # search is approximate (HNSW over 8-dim projections, built in the threads' interleaved
    # order), so a held vector may rarely be missed (1 of 600 in one CI run); an evicted
    # one must never answer, and nothing may answer for another key.
    missed = 0
    for i in range(2000):
        m = store.lookup(f"q{i}", vecs[i], (1, 4, 4), similar=True, verification=V)
        found = m.entry.key if m.entry else None
        if f"k{i}" in store:
            assert found in (f"k{i}", None), i
            missed += found is None
        else:
            assert found is None, i
    assert missed <= 6, missed  # recall >= 0.99 over the 600 held


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_reserve_keeps_the_flat_storage_in_place_while_filling(kind: str) -> None:
    """reserve(n): adds up to n vectors never reallocate FAISS's code buffers (the doubling
    that made a 1M-entry fill peak at 1.5x its vectors); searches are unchanged."""
    import faiss

    from cache_service.index import VectorIndex

    def storage(index: VectorIndex) -> list:
        inner = faiss.downcast_index(index._inner)
        if kind == "flat":
            return [inner]
        hnsw = faiss.downcast_index(faiss.downcast_index(inner.base_index).index)
        return [faiss.downcast_index(inner.refine_index), faiss.downcast_index(hnsw.storage)]

    rng = np.random.default_rng(5)
    vecs = rng.standard_normal((3000, 64)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    moved = {}
    for reserved in (False, True):
        index = VectorIndex(kind, 64, IndexParams(projected_dim=16))
        if reserved:
            index.reserve(len(vecs))
        pointers: set[tuple[int, ...]] = set()
        for start in range(0, len(vecs), 500):
            index.add(np.arange(start, start + 500), vecs[start : start + 500])
            pointers.add(tuple(int(f.codes.owned_data.data()) for f in storage(index)))
        moved[reserved] = len(pointers)
        assert index.ntotal == len(vecs)
        scores, ids = index.search(vecs[1234], 1)
        assert int(ids[0]) == 1234 and scores[0] == pytest.approx(1.0, abs=1e-5)
    assert moved == {False: moved[False], True: 1} and moved[False] > 1


def test_ef_search_grows_with_the_index_past_its_reference_size() -> None:
    """IndexParams.ef_search_for: the configured efSearch up to the reference size, then
    (n / reference) ** 0.6 times it (64 at 100k -> 255 at 1M, where 256 measured recall
    0.990 against 0.962); VectorIndex applies it as it grows, and a value set from outside
    holds until the size calls for another."""
    import faiss

    from cache_service.index import VectorIndex

    defaults = IndexParams()
    assert defaults.ef_search_for(100_000) == 64
    assert defaults.ef_search_for(1_000_000) == 255
    assert IndexParams(ef_reference_entries=0).ef_search_for(10**7) == 64

    params = IndexParams(projected_dim=16, ef_search=16, ef_reference_entries=100)
    index = VectorIndex("hnsw", 64, params)
    hnsw = faiss.downcast_index(faiss.downcast_index(index._inner).base_index)
    hnsw = faiss.downcast_index(hnsw.index)
    rng = np.random.default_rng(9)
    vecs = rng.standard_normal((1000, 64)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    index.add(np.arange(100), vecs[:100])
    index.search(vecs[0], 4)
    assert hnsw.hnsw.efSearch == 16  # at the reference size
    index.add(np.arange(100, 1000), vecs[100:])
    _, ids = index.search(vecs[500], 4)
    assert int(ids[0]) == 500 and hnsw.hnsw.efSearch == round(16 * 10**0.6) == 64
    hnsw.hnsw.efSearch = 200  # e.g. cache-bench's sweep
    index.search(vecs[1], 4)
    assert hnsw.hnsw.efSearch == 200
    more = rng.standard_normal((1000, 64)).astype(np.float32)
    index.add(np.arange(1000, 2000), more / np.linalg.norm(more, axis=1, keepdims=True))
    index.search(vecs[1], 4)
    assert hnsw.hnsw.efSearch == round(16 * 20**0.6) == 97
