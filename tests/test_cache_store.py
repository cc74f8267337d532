"""The embedding store (exact + FAISS similarity tier, byte budget) and its gRPC servicer."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from qwenvl.cache.v1 import cache_service_pb2 as pb
from qwenvl.cache.v1 import cache_service_pb2_grpc as pb_grpc
from qwenvl.common.v1 import generation_pb2, tensor_pb2

from cache_service.servicer import CacheServicer
from cache_service.store import EmbeddingStore
from tests.conftest import in_process_server
from vlcommon import tensors

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


def put(store: EmbeddingStore, key: str, desc: np.ndarray, grid=(1, 4, 4), nbytes=100) -> int:
    return store.put(key, desc, grid, tensor_pb2.DATA_TYPE_FP32, (nbytes // 4, 1), b"\1" * nbytes)


def test_exact_then_similar_then_miss() -> None:
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=10_000, threshold=0.85)
    a = unit(1)
    put(store, "a", a)
    assert store.lookup("a", None, (1, 4, 4), similar=True).tier == "exact"
    hit = store.lookup("b", near(a, 0.9), (1, 4, 4), similar=True)
    assert hit.tier == "similar" and hit.entry is not None and hit.entry.key == "a"
    assert hit.similarity == pytest.approx(0.9, abs=1e-4)
    assert store.lookup("b", near(a, 0.8), (1, 4, 4), similar=True).tier == "miss"
    assert store.lookup("b", near(a, 0.9), (1, 4, 4), similar=False).tier == "miss"


def test_similar_needs_an_equal_grid() -> None:
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=10_000)
    a = unit(2)
    put(store, "a", a, grid=(1, 4, 6))
    miss = store.lookup("q", a, (1, 6, 4), similar=True)
    assert miss.tier == "miss" and miss.similarity == pytest.approx(1.0, abs=1e-5)
    assert store.lookup("q", a, (1, 4, 6), similar=True).tier == "similar"


def test_threshold_edge_is_a_hit_within_tolerance() -> None:
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=10_000, threshold=0.85)
    a = unit(3)
    put(store, "a", a)
    assert store.lookup("q", near(a, 0.85), (1, 4, 4), similar=True).tier == "similar"
    assert store.lookup("q", near(a, 0.849), (1, 4, 4), similar=True).tier == "miss"


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
    assert store.lookup("x", unit(11), (1, 4, 4), similar=True).tier == "miss"
    with pytest.raises(ValueError, match="exceeds the budget"):
        put(store, "huge", unit(20), nbytes=400)


def test_zero_descriptor_only_hits_exactly() -> None:
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=1000)
    put(store, "flat", np.zeros(DIM, dtype=np.float32))
    assert store.index_size == 0
    assert store.lookup("other", np.zeros(DIM, np.float32), (1, 4, 4), similar=True).tier == "miss"


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
                pb.LookupQuery(key="a", descriptor=tensors.from_numpy(a), grid=grid),
                pb.LookupQuery(key="b", descriptor=tensors.from_numpy(near(a, 0.95)), grid=grid),
                pb.LookupQuery(key="c", descriptor=tensors.from_numpy(unit(6)), grid=grid),
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
                pb.LookupQuery(key="b", descriptor=tensors.from_numpy(near(a, 0.95)), grid=grid)
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
