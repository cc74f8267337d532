"""The cache service under concurrency (case C13), leases over gRPC, refusals, metrics, spans.

Real FAISS, real in-process ``grpc.aio`` servers on loopback; no fakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY
from qwenvl.cache.v1 import cache_service_pb2 as pb
from qwenvl.cache.v1 import cache_service_pb2_grpc as pb_grpc
from qwenvl.common.v1 import generation_pb2, tensor_pb2

from cache_service.index import IndexParams, gpu_count
from cache_service.servicer import CacheServicer
from cache_service.store import EmbeddingStore
from tests.conftest import in_process_server
from vlcommon import tensors
from vlcommon.verification import VerificationImage

DIM = 64
GRID = (1, 4, 4)  # 4 rows after the 2x2 merge
WIDTH = 6
N_KEYS = 240
# Every entry and query carries this verification image: equal images pass the cache's
# verification (vlcommon.verification); tests/unit/cache_service/test_cache_verification.py covers
# it.
VERIFY = VerificationImage(np.full((2, 2), 128, np.uint8), np.full((1, 1, 2), 128, np.uint8))
ENTRY_BYTES = 4 * WIDTH * 4 + VERIFY.nbytes  # embeddings + verification image: 102


def vectors(n: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


VECS = vectors(N_KEYS, 11)


def payload(i: int) -> np.ndarray:
    """Entry i's embeddings: every value encodes i, so a torn or mixed-up read shows."""
    return np.full((4, WIDTH), float(i), dtype=np.float32) + np.arange(WIDTH, dtype=np.float32)


def query_of(i: int, seed: int) -> np.ndarray:
    """A near-duplicate (cosine ~0.99) of entry i's descriptor."""
    noise = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32) * 0.015
    q = VECS[i] + noise
    return q / np.linalg.norm(q)


def new_store(**kw: object) -> EmbeddingStore:
    args: dict[str, object] = {
        "descriptor_dim": DIM,
        "capacity_bytes": 10**8,
        "index_threshold": 64,
        "index_params": IndexParams(projected_dim=16, hnsw_m=16, ef_search=64),
    }
    args.update(kw)
    return EmbeddingStore(**args)  # type: ignore[arg-type]


def store_put(store: EmbeddingStore, i: int) -> int:
    data = payload(i).tobytes()
    return store.put(
        f"k{i}", VECS[i], GRID, tensor_pb2.DATA_TYPE_FP32, (4, WIDTH), data, verification=VERIFY
    )


def answer(store: EmbeddingStore, i: int, seed: int) -> tuple[str, str | None, float]:
    m = store.lookup(f"q{i}-{seed}", query_of(i, seed), GRID, similar=True, verification=VERIFY)
    if m.entry is not None:
        got = np.frombuffer(m.entry.data, dtype=np.float32).reshape(4, WIDTH)
        j = int(m.entry.key[1:])
        assert np.array_equal(got, payload(j)), "torn read: payload does not match its key"
    return m.tier, m.entry.key if m.entry else None, round(m.similarity, 5)


def test_c13_threads_putting_and_searching_match_a_serial_run() -> None:
    """Case C13: 8 threads put disjoint keys and search near-duplicates concurrently, with
    the index migrating to HNSW (in a background thread) on the way; then the answers for
    every key equal those of a store filled serially."""
    preload = range(40)
    store = new_store(background_rebuild=True)
    for i in preload:
        store_put(store, i)
    before = {i: answer(store, i, 0) for i in preload}
    errors: list[BaseException] = []
    during: dict[int, list[tuple[str, str | None, float]]] = {i: [] for i in preload}

    def worker(t: int) -> None:
        try:
            for n, i in enumerate(range(40 + t, N_KEYS, 8)):
                store_put(store, i)
                j = (t * 7 + n) % 40
                during[j].append(answer(store, j, 0))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors
    assert store.wait_for_rebuild(timeout=60)
    assert store.index_kind == "hnsw" and len(store) == N_KEYS
    store.check_invariants()
    # Searches made during the adds saw the preloaded entries exactly as before them.
    for j, seen in during.items():
        assert all(s == before[j] for s in seen), (j, seen, before[j])

    serial = new_store()
    for i in range(N_KEYS):
        store_put(serial, i)
    for i in range(N_KEYS):
        expected = answer(serial, i, 1)
        assert expected[:2] == ("similar", f"k{i}")
        assert answer(store, i, 1) == expected


@contextlib.asynccontextmanager
async def serving(
    store: EmbeddingStore, max_queries: int = 16, **kw: object
) -> AsyncIterator[tuple[pb_grpc.CacheServiceStub, grpc.aio.Channel]]:
    """``store`` behind a CacheServicer (similar policy by default) on the real bootstrap."""
    servicer = CacheServicer(
        store,
        default_policy=generation_pb2.CACHE_POLICY_SIMILAR,
        max_queries=max_queries,
        **kw,  # type: ignore[arg-type]
    )
    async with in_process_server(
        pb_grpc.add_CacheServiceServicer_to_server, servicer, "qwenvl.cache.v1.CacheService"
    ) as channel:
        yield pb_grpc.CacheServiceStub(channel), channel


async def leases_released(store: EmbeddingStore, timeout_s: float = 2.5) -> bool:
    """Whether the store holds no lease within ``timeout_s`` (a Lookup's leases go back
    in its done callback, which runs just after the client has the response)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while store.leased:
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


@pytest.fixture
async def served():
    store = new_store(capacity_bytes=60 * ENTRY_BYTES)  # room for 60 entries
    async with serving(store) as (stub, _):
        yield stub, store


def put_entry(i: int) -> pb.PutEntry:
    t, h, w = GRID
    return pb.PutEntry(
        key=f"k{i}",
        descriptor=tensors.from_numpy(VECS[i]),
        embedding=tensor_pb2.ImageEmbedding(
            embeddings=tensors.from_numpy(payload(i)),
            grid=tensor_pb2.GridTHW(t=t, h=h, w=w),
            key=f"k{i}",
        ),
        verification=tensors.from_numpy(VERIFY.luma),
        verification_chroma=tensors.from_numpy(VERIFY.chroma),
    )


def lookup_request(ids: list[int], seed: int, include: bool = True) -> pb.LookupRequest:
    t, h, w = GRID
    return pb.LookupRequest(
        include_embeddings=include,
        queries=[
            pb.LookupQuery(
                key=f"q{i}",
                descriptor=tensors.from_numpy(query_of(i, seed)),
                grid=tensor_pb2.GridTHW(t=t, h=h, w=w),
                verification=tensors.from_numpy(VERIFY.luma),
                verification_chroma=tensors.from_numpy(VERIFY.chroma),
            )
            for i in ids
        ],
    )


def check_results(resp: pb.LookupResponse) -> list[str | None]:
    """Matched keys; every returned embedding must be its key's own payload."""
    keys: list[str | None] = []
    for r in resp.results:
        if r.tier == generation_pb2.CACHE_TIER_MISS:
            keys.append(None)
            continue
        j = int(r.matched_key[1:])
        assert r.embedding.key == r.matched_key
        assert np.array_equal(tensors.to_numpy(r.embedding.embeddings), payload(j))
        keys.append(r.matched_key)
    return keys


async def test_c13_concurrent_rpcs_with_eviction_release_every_lease(served) -> None:
    """Case C13 over gRPC: 24 tasks interleave Puts and similarity Lookups while the byte
    budget (60 entries) evicts; every answer is its key's own payload, leases taken for the
    responses are all released when the calls end, and the bookkeeping holds."""
    stub, store = served

    async def client(t: int) -> int:
        hits = 0
        for n in range(10):
            i = (t * 10 + n) % N_KEYS
            await stub.Put(pb.PutRequest(entries=[put_entry(i)]))
            resp = await stub.Lookup(lookup_request([i, (i + 1) % N_KEYS], seed=n))
            keys = check_results(resp)
            assert keys[0] in (f"k{i}", None)  # evicted by others meanwhile, or itself
            hits += keys[0] is not None
        return hits

    hits = await asyncio.gather(*(client(t) for t in range(24)))
    assert sum(hits) > 0
    assert await leases_released(store)
    assert len(store) == 60 and store.bytes <= store.capacity_bytes
    store.check_invariants()
    # Serial check afterwards: what is held is found, what was evicted is not.
    resp = await stub.Lookup(lookup_request(list(range(N_KEYS)[:16]), seed=99))
    for i, key in zip(range(16), check_results(resp), strict=True):
        assert key == (f"k{i}" if f"k{i}" in store else None)


async def test_put_refused_while_leases_hold_the_budget(served) -> None:
    stub, store = served
    await stub.Put(pb.PutRequest(entries=[put_entry(i) for i in range(16)]))
    await stub.Put(pb.PutRequest(entries=[put_entry(i) for i in range(16, 32)]))
    await stub.Put(pb.PutRequest(entries=[put_entry(i) for i in range(32, 48)]))
    await stub.Put(pb.PutRequest(entries=[put_entry(i) for i in range(48, 60)]))
    held = [store.lookup(f"k{i}", None, GRID, similar=False, lease=True).entry for i in range(60)]
    refused = (
        REGISTRY.get_sample_value("splitvl_cache_puts_refused_total", {"reason": "leased"}) or 0.0
    )
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Put(pb.PutRequest(entries=[put_entry(60)]))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "entries[0] needs 102 bytes but 6120 of the 6120-byte budget" in exc.value.details()
    assert (
        REGISTRY.get_sample_value("splitvl_cache_puts_refused_total", {"reason": "leased"})
        == refused + 1
    )
    assert len(store) == 60 and "k60" not in store
    for entry in held[:1]:
        assert entry is not None
        store.release(entry)
    resp = await stub.Put(pb.PutRequest(entries=[put_entry(60)]))
    assert (resp.stored, resp.evicted) == (1, 1) and "k0" not in store
    for entry in held[1:]:
        assert entry is not None
        store.release(entry)
    store.check_invariants()


class GatedStore(EmbeddingStore):
    """A store whose lookups (or, with ``gate_puts``, puts) wait at a gate: a slow
    verification or a slow index add, in effect."""

    def __init__(self, gate_puts: bool = False, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.gate_puts = gate_puts
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.returned = threading.Event()

    def lookup(self, *args: object, **kw: object):  # type: ignore[no-untyped-def]
        if self.gate_puts:
            return super().lookup(*args, **kw)  # type: ignore[arg-type]
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        match = super().lookup(*args, **kw)  # type: ignore[arg-type]
        self.returned.set()
        return match

    def put(self, *args: object, **kw: object) -> int:
        if not self.gate_puts:
            return super().put(*args, **kw)  # type: ignore[arg-type]
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        evicted = super().put(*args, **kw)  # type: ignore[arg-type]
        self.returned.set()
        return evicted


async def test_slow_lookup_leaves_the_service_answering_and_a_cancelled_one_keeps_no_lease() -> (
    None
):
    """Matching runs off the event loop: while one Lookup is held inside the store (as a
    long verification would be: 60 queries of 2048x2048 images held the loop for 62 s), a
    GetStats is answered. That Lookup's caller then cancels it; the lease the store takes
    afterwards, with nobody left to read the answer, is released, not leaked."""
    args: dict[str, object] = {"descriptor_dim": DIM, "capacity_bytes": 10**6}
    store = GatedStore(**args)
    store_put(store, 1)
    async with serving(store) as (stub, channel):
        exact = lookup_request([1], seed=0)
        exact.queries[0].key = "k1"  # an exact hit: leased for the response
        call = stub.Lookup(exact)
        assert await asyncio.to_thread(store.entered.wait, 10)
        stats = await stub.GetStats(pb.GetStatsRequest(), timeout=5)
        assert stats.entries == 1
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(0.2)  # the server sees the cancellation
        store.gate.set()
        assert await asyncio.to_thread(store.returned.wait, 10)
        # The worker thread hands the lease back just after.
        assert await leases_released(store)
        store.check_invariants()
        # The service goes on answering, with a lease released once the call is done (just
        # after the client has the response: asserting at once raced with it).
        resp = await stub.Lookup(exact)
        assert check_results(resp) == ["k1"]
        assert await leases_released(store)


async def test_a_slow_put_leaves_the_service_answering() -> None:
    """Put runs off the event loop too: while one Put is held inside the store (a large
    entry's finiteness check, or an index add at a million entries), a Lookup and a
    GetStats are answered, and the Put then completes with its entry stored."""
    store = GatedStore(gate_puts=True, descriptor_dim=DIM, capacity_bytes=10**6)
    async with serving(store) as (stub, channel):
        put = asyncio.ensure_future(stub.Put(pb.PutRequest(entries=[put_entry(2)]), timeout=30))
        assert await asyncio.to_thread(store.entered.wait, 10)
        stats = await stub.GetStats(pb.GetStatsRequest(), timeout=5)
        assert stats.entries == 0  # the held Put has not stored yet
        query = lookup_request([2], seed=0)
        query.queries[0].key = "k2"
        miss = await stub.Lookup(query, timeout=5)
        assert miss.results[0].tier == generation_pb2.CACHE_TIER_MISS
        store.gate.set()
        resp = await put
        assert (resp.stored, resp.evicted) == (1, 0)
        assert check_results(await stub.Lookup(query, timeout=5)) == ["k2"]


async def test_stats_are_never_torn_by_an_eviction_in_progress() -> None:
    """GetStats reads entries, bytes and evictions together under the store's lock. Caught
    inside an eviction (the entry dropped, its bytes not yet subtracted: the index removal
    releases the GIL there), it used to answer 0 entries holding a full entry's bytes; it
    now waits for the Put, on a worker thread, so the service still answers meanwhile."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    store = new_store(capacity_bytes=ENTRY_BYTES)  # room for one entry
    store_put(store, 1)
    entered, gate = threading.Event(), threading.Event()
    remove = store._index.remove

    def gated_remove(index_id: int) -> None:
        entered.set()
        assert gate.wait(30), "the test never opened the gate"
        remove(index_id)

    store._index.remove = gated_remove  # type: ignore[method-assign]
    async with serving(store) as (stub, channel):
        put = asyncio.ensure_future(stub.Put(pb.PutRequest(entries=[put_entry(2)]), timeout=30))
        assert await asyncio.to_thread(entered.wait, 10)  # k1 is being evicted
        stats = asyncio.ensure_future(stub.GetStats(pb.GetStatsRequest(), timeout=30))
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # the loop answers
        assert not stats.done()  # waiting for the lock, not answering half an eviction
        gate.set()
        assert (await put).evicted == 1
        answered = await stats
    assert (answered.entries, answered.bytes, answered.evictions) == (1, ENTRY_BYTES, 1)


async def test_a_lookup_whose_embeddings_exceed_the_message_limit_is_refused_up_front() -> None:
    """Hits whose embeddings would not fit one response are refused before the response is
    built (it used to be built and then dropped by gRPC with "Sent message larger than
    max", no field named), RESOURCE_EXHAUSTED naming queries and the limit; the leases go
    back; the same queries without embeddings, or fewer of them, are answered."""
    from cache_service.servicer import RESULT_OVERHEAD_BYTES

    store = new_store()
    payload_bytes = payload(0).nbytes
    limit = 2 * (payload_bytes + RESULT_OVERHEAD_BYTES)  # two hits fit, three do not
    for i in (1, 2, 3):
        store_put(store, i)
    async with serving(store, max_response_bytes=limit) as (stub, channel):
        query = lookup_request([1, 2, 3], seed=0)
        for q, key in zip(query.queries, ("k1", "k2", "k3"), strict=True):
            q.key = key
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Lookup(query)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert exc.value.details().startswith("the 3 hits of queries hold about ")
        assert f"a response is limited to {limit} bytes (max_message_bytes)" in (
            exc.value.details()
        )
        assert await leases_released(store)  # when the call is done
        query.include_embeddings = False
        resp = await stub.Lookup(query)
        assert [r.matched_key for r in resp.results] == ["k1", "k2", "k3"]
        del query.queries[2]
        query.include_embeddings = True
        assert check_results(await stub.Lookup(query)) == ["k1", "k2"]


async def test_keys_longer_than_the_limit_are_refused(served) -> None:
    """Keys sit beside the entries outside the byte budget; 4 MiB keys used to be stored.
    A key over MAX_KEY_CHARS is INVALID_ARGUMENT naming the field and the limit, in a Put
    and in a Lookup; one at the limit is accepted."""
    from cache_service.servicer import MAX_KEY_CHARS

    stub, store = served
    entry = put_entry(1)
    entry.key = "k" * (MAX_KEY_CHARS + 1)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Put(pb.PutRequest(entries=[put_entry(2), entry]))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details() == (
        f"entries[1].key has {MAX_KEY_CHARS + 1} characters; at most {MAX_KEY_CHARS} are allowed"
    )
    assert len(store) == 0  # nothing stored when an entry is refused
    query = lookup_request([1], seed=0)
    query.queries[0].key = "q" * (MAX_KEY_CHARS + 1)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Lookup(query)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details().startswith("queries[0].key has ")
    entry.key = "k" * MAX_KEY_CHARS
    assert (await stub.Put(pb.PutRequest(entries=[entry]))).stored == 1


async def test_a_key_answers_and_stores_only_with_its_own_grid(served) -> None:
    """One exact key has one grid (the key digests the resize plan). A Lookup of the key
    with another grid is a miss, not the stored [4, w] embeddings for an [8, 8] grid; a Put
    of the key with another grid is INVALID_ARGUMENT naming the grid (it used to answer
    ``stored: 1`` and drop it); a grid whose h or w is not a multiple of the merge size
    (its rows would be truncated) is refused."""
    stub, store = served
    await stub.Put(pb.PutRequest(entries=[put_entry(1)]))
    query = lookup_request([1], seed=0)
    query.queries[0].key = "k1"
    assert check_results(await stub.Lookup(query)) == ["k1"]
    query.queries[0].grid.CopyFrom(tensor_pb2.GridTHW(t=1, h=8, w=8))
    query.queries[0].ClearField("descriptor")
    resp = await stub.Lookup(query)
    assert resp.results[0].tier == generation_pb2.CACHE_TIER_MISS
    assert not resp.results[0].HasField("embedding")

    other = put_entry(1)
    other.embedding.grid.CopyFrom(tensor_pb2.GridTHW(t=1, h=2, w=8))
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Put(pb.PutRequest(entries=[put_entry(2), other]))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details().startswith("entries[1].embedding.grid is [1, 2, 8] but ")
    assert "already stored with grid [1, 4, 4]" in exc.value.details()
    assert "k2" in store and store.lookup("k1", None, GRID, similar=False).tier == "exact"

    odd = put_entry(3)
    odd.embedding.grid.CopyFrom(tensor_pb2.GridTHW(t=1, h=3, w=4))  # 12 / 4 = 3 rows
    odd.embedding.embeddings.CopyFrom(tensors.from_numpy(payload(3)[:3]))
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Put(pb.PutRequest(entries=[odd]))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "entries[0].embedding.grid is [1, 3, 4]" in exc.value.details()
    assert "multiples of spatial_merge_size 2" in exc.value.details()
    assert "k3" not in store
    store.check_invariants()


async def test_an_image_grid_has_t_1_and_a_video_is_found_only_by_its_key(served) -> None:
    """The cache applies the grid rule of the encoder and the decoder
    (vlcommon.request_rules.check_grid): an image's grid with t = 2 is refused on Put and
    on Lookup (it used to be stored, and the decoder then refused it); a video's (``video``)
    is stored and found by its exact key; a video that brings a descriptor is refused."""
    stub, store = served
    clip = np.concatenate([payload(5), payload(6)])  # [8, WIDTH]: t*h*w / 4 = 2*4*4 / 4
    entry = put_entry(5)
    entry.embedding.grid.t = 2
    entry.embedding.embeddings.CopyFrom(tensors.from_numpy(clip))
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Put(pb.PutRequest(entries=[entry]))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details().startswith(
        "entries[0].embedding.grid is [2, 4, 4]; an image has t = 1"
    )
    assert "k5" not in store

    query = lookup_request([5], seed=0)
    query.queries[0].grid.t = 2
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Lookup(query)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details().startswith("queries[0].grid is [2, 4, 4]; an image has t = 1")

    with_descriptor = pb.PutEntry()
    with_descriptor.CopyFrom(entry)
    with_descriptor.video = True
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Put(pb.PutRequest(entries=[with_descriptor]))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details().startswith("entries[0].descriptor is set on a video")

    video = pb.PutEntry(key="clip", embedding=entry.embedding, video=True)
    assert (await stub.Put(pb.PutRequest(entries=[video]))).stored == 1
    found = await stub.Lookup(
        pb.LookupRequest(
            include_embeddings=True,
            policy=generation_pb2.CACHE_POLICY_EXACT_ONLY,
            queries=[pb.LookupQuery(key="clip", grid=entry.embedding.grid, video=True)],
        )
    )
    assert found.results[0].tier == generation_pb2.CACHE_TIER_EXACT
    got = found.results[0].embedding
    assert (got.grid.t, got.grid.h, got.grid.w) == (2, 4, 4)
    np.testing.assert_array_equal(tensors.to_numpy(got.embeddings), clip)
    store.check_invariants()


async def test_entry_larger_than_the_budget_is_resource_exhausted() -> None:
    store = new_store(capacity_bytes=64)
    async with serving(store, max_queries=4) as (stub, channel):
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Put(pb.PutRequest(entries=[put_entry(1)]))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert exc.value.details() == (
        "entries[0].embedding.embeddings holds 96 bytes; the cache's byte budget "
        "(capacity_bytes) is 64; with its verification image the entry needs 102 bytes"
    )
    assert len(store) == 0


def _sample(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


async def test_metrics_per_tier_and_lookup_attributes_on_the_rpc_span(served) -> None:
    from vlcommon import telemetry

    exporter = InMemorySpanExporter()
    telemetry.setup_tracing("test").add_span_processor(SimpleSpanProcessor(exporter))
    stub, store = served
    names = [
        ("splitvl_cache_hits_total", {"tier": "exact"}),
        ("splitvl_cache_hits_total", {"tier": "similar"}),
        ("splitvl_cache_misses_total", {"tier": "exact"}),
        ("splitvl_cache_misses_total", {"tier": "similar"}),
        ("splitvl_cache_lookup_duration_seconds_count", None),
    ]
    before = [_sample(n, lab) for n, lab in names]
    await stub.Put(pb.PutRequest(entries=[put_entry(1), put_entry(2)]))
    request = lookup_request([1, 2, 3], seed=5)
    request.queries[0].key = "k1"  # an exact hit; 2 is similar; 3 misses both tiers
    resp = await stub.Lookup(request)
    assert [r.tier for r in resp.results] == [
        generation_pb2.CACHE_TIER_EXACT,
        generation_pb2.CACHE_TIER_SIMILAR,
        generation_pb2.CACHE_TIER_MISS,
    ]
    after = [_sample(n, lab) for n, lab in names]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 2, 1, 1]
    assert _sample("splitvl_cache_entries") == len(store) == 2
    assert _sample("splitvl_cache_stored_bytes") == store.bytes == 2 * (96 + VERIFY.nbytes)
    exporter.force_flush()
    spans = [s for s in exporter.get_finished_spans() if "Lookup" in s.name]
    assert spans, [s.name for s in exporter.get_finished_spans()]
    attrs = spans[-1].attributes or {}
    assert list(attrs["splitvl.cache.tiers"]) == ["exact", "similar", "miss"]
    sims = list(attrs["splitvl.cache.similarities"])
    assert sims[0] == 1.0 and sims[1] == pytest.approx(float(VECS[2] @ query_of(2, 5)), abs=1e-5)
    per_query = [s for s in exporter.get_finished_spans() if s.name == "cache.lookup"]
    assert [dict(s.attributes or {})["splitvl.cache.tier"] for s in per_query[-3:]] == [
        "exact",
        "similar",
        "miss",
    ]
    exporter.shutdown()


def test_startup_checks_the_gpu_capability() -> None:
    from cache_service.__main__ import build_store
    from cache_service.settings import CacheSettings

    settings = CacheSettings(descriptor_dim=DIM, gpu="auto")
    store = build_store(settings)
    assert store.gpu == (gpu_count() > 0)
    assert store.index_kind == ("gpu_flat" if store.gpu else "flat")
    if gpu_count() == 0:
        with pytest.raises(RuntimeError, match="CACHE_GPU=on but FAISS sees no GPU"):
            build_store(CacheSettings(descriptor_dim=DIM, gpu="on"))
    assert build_store(CacheSettings(descriptor_dim=DIM, gpu="off")).index_kind == "flat"


@pytest.mark.skipif(gpu_count() == 0, reason="FAISS sees no GPU (faiss-cpu or no device)")
def test_gpu_index_tombstones_and_rebuilds() -> None:
    store = new_store(use_gpu=True, min_rebuild_tombstones=8, capacity_bytes=40 * ENTRY_BYTES)
    for i in range(80):  # 40 evicted: tombstones, purged by rebuilds on the way
        store_put(store, i)
    assert store.index_kind == "gpu_flat" and store.rebuilds > 0
    store.check_invariants()
    for i in range(80):
        assert answer(store, i, 3)[1] == (f"k{i}" if i >= 40 else None)
