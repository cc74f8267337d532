"""Each new image encoded once: claims on missed keys (cache_service/claims.py).

Real gRPC cache servers on loopback: the in-process store (claims in the cache process) and
two replicas on a real ``redis-server`` (claims in the store, fleet-wide). The first caller
to miss a key owns it; a second one is told it is claimed elsewhere and, asking again with
``wait_claimed_ms``, is answered the first caller's Put as an exact hit; a claimant that
never puts costs its waiter at most the claim TTL, after which the waiter owns the key; a
store that is down grants every claim (everyone encodes, as without claims).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from qwenvl.cache.v1 import cache_service_pb2 as pb
from qwenvl.cache.v1 import cache_service_pb2_grpc as pb_grpc
from qwenvl.common.v1 import generation_pb2, tensor_pb2

from cache_service.claims import MemoryClaims
from cache_service.servicer import CacheServicer
from cache_service.store import EmbeddingStore
from tests.conftest import in_process_server
from tests.unit.cache_service.test_cache_store_redis import (
    DIM,
    RedisServer,
    payload,
    redis_server,
    replica,
    unit,
)
from vlcommon import tensors
from vlcommon.errors import error_info

CACHE = pb.DESCRIPTOR.services_by_name["CacheService"].full_name
OWNED, ELSEWHERE = pb.CLAIM_STATE_OWNED, pb.CLAIM_STATE_ELSEWHERE
EXACT, MISS = generation_pb2.CACHE_TIER_EXACT, generation_pb2.CACHE_TIER_MISS


def lookup(key: str, *, wait_ms: int = 0, claim: bool = True) -> pb.LookupRequest:
    return pb.LookupRequest(
        queries=[pb.LookupQuery(key=key, grid=tensor_pb2.GridTHW(t=1, h=4, w=4))],
        include_embeddings=True,
        claim=claim,
        wait_claimed_ms=wait_ms,
    )


def put(key: str, i: int = 1) -> pb.PutRequest:
    emb = np.frombuffer(payload(i), np.float32).reshape(4, 4)
    return pb.PutRequest(
        entries=[
            pb.PutEntry(
                key=key,
                embedding=tensor_pb2.ImageEmbedding(
                    embeddings=tensors.from_numpy(emb), grid=tensor_pb2.GridTHW(t=1, h=4, w=4)
                ),
                descriptor=tensors.from_numpy(unit(i)),
            )
        ]
    )


def servicer(store: object, ttl_s: float = 5.0, claims: object = None) -> CacheServicer:
    return CacheServicer(
        store,  # type: ignore[arg-type]
        default_policy=generation_pb2.CACHE_POLICY_SIMILAR,
        max_queries=16,
        claims=claims or MemoryClaims(ttl_s),  # type: ignore[arg-type]
    )


def add(s: CacheServicer, server: grpc.aio.Server) -> None:
    pb_grpc.add_CacheServiceServicer_to_server(s, server)


def memory_store() -> EmbeddingStore:
    return EmbeddingStore(descriptor_dim=DIM, capacity_bytes=10**7)


async def test_the_first_miss_owns_the_key_and_a_waiter_gets_its_put() -> None:
    async with in_process_server(add, servicer(memory_store()), CACHE) as channel:
        stub = pb_grpc.CacheServiceStub(channel)
        first = (await stub.Lookup(lookup("k1"))).results[0]
        assert (first.tier, first.claim) == (MISS, OWNED)
        second = (await stub.Lookup(lookup("k1"))).results[0]
        assert (second.tier, second.claim) == (MISS, ELSEWHERE)
        unclaimed = (await stub.Lookup(lookup("k1", claim=False))).results[0]
        assert unclaimed.claim == pb.CLAIM_STATE_UNSPECIFIED
        t0 = time.monotonic()
        waiter = asyncio.ensure_future(stub.Lookup(lookup("k1", wait_ms=3000)))
        await asyncio.sleep(0.3)
        assert not waiter.done()  # waiting for the claimant's Put
        assert (await stub.Put(put("k1"))).stored == 1
        got = (await waiter).results[0]
        waited = time.monotonic() - t0
        assert got.tier == EXACT and got.claim == pb.CLAIM_STATE_UNSPECIFIED
        assert got.embedding.embeddings.data == payload(1)
        assert 0.3 <= waited < 1.5, waited
        # The Put ended the claim: a new image's key is owned again by its first miss.
        assert (await stub.Lookup(lookup("k2"))).results[0].claim == OWNED
        hit = (await stub.Lookup(lookup("k1"))).results[0]
        assert (hit.tier, hit.claim) == (EXACT, pb.CLAIM_STATE_UNSPECIFIED)


async def test_a_claimant_that_never_puts_costs_its_waiter_the_claim_ttl() -> None:
    async with in_process_server(add, servicer(memory_store(), ttl_s=0.4), CACHE) as channel:
        stub = pb_grpc.CacheServiceStub(channel)
        assert (await stub.Lookup(lookup("k1"))).results[0].claim == OWNED  # then it dies
        t0 = time.monotonic()
        got = (await stub.Lookup(lookup("k1", wait_ms=5000))).results[0]
        waited = time.monotonic() - t0
        assert (got.tier, got.claim) == (MISS, OWNED)  # the waiter's turn
        assert 0.3 <= waited < 1.5, waited
        # A wait shorter than the claim answers at its end, still claimed elsewhere.
        t0 = time.monotonic()
        got = (await stub.Lookup(lookup("k1", wait_ms=150))).results[0]
        assert (got.tier, got.claim) == (MISS, ELSEWHERE)
        assert time.monotonic() - t0 < 1.0
        # And never past the caller's deadline (shorter than the claim): answered before it.
        assert (await stub.Lookup(lookup("k3"))).results[0].claim == OWNED
        t0 = time.monotonic()
        got = (await stub.Lookup(lookup("k3", wait_ms=60_000), timeout=0.3)).results[0]
        assert (got.tier, got.claim) == (MISS, ELSEWHERE)
        assert 0.15 < time.monotonic() - t0 < 0.3


def ref_put(key: str, **ref: object) -> pb.PutRequest:
    """A Put of one entry by reference to a holder that is not there."""
    request = put(key)
    emb = request.entries[0].embedding
    emb.embeddings.data = b""
    emb.ref.CopyFrom(
        tensor_pb2.EmbeddingRef(holder="127.0.0.1:9", ticket="ab" * 16, nbytes=64, **ref)
    )
    return request


async def test_a_refused_put_ends_its_claim_at_once() -> None:
    """A Put the cache refuses (its ref unreadable: the encoder restarted; or its payload
    bad) ends the claim, so a waiter looks again now instead of at the claim's TTL."""
    async with in_process_server(add, servicer(memory_store(), ttl_s=30.0), CACHE) as channel:
        stub = pb_grpc.CacheServiceStub(channel)
        for key, bad in (
            ("k1", ref_put("k1", transport=tensor_pb2.TRANSPORT_GRPC)),
            ("k2", put("k2")),
        ):
            assert (await stub.Lookup(lookup(key))).results[0].claim == OWNED
            if key == "k2":  # a NaN in the payload
                data = bytearray(bad.entries[0].embedding.embeddings.data)
                data[:4] = np.float32(np.nan).tobytes()
                bad.entries[0].embedding.embeddings.data = bytes(data)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Put(bad)
            assert refused.value.code() in (
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.INVALID_ARGUMENT,
            )
            t0 = time.monotonic()
            got = (await stub.Lookup(lookup(key, wait_ms=10_000))).results[0]
            assert got.claim == OWNED and time.monotonic() - t0 < 1.0  # the waiter's turn


async def test_a_put_of_refs_is_checked_whole_before_any_read() -> None:
    """Refs are refused before the reader allocates or reads a byte: a bad field beside
    them, an unknown dtype, a revision over its limit, refs over the budget together."""
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=100)
    async with in_process_server(add, servicer(store), CACHE) as channel:
        stub = pb_grpc.CacheServiceStub(channel)
        bad_key = ref_put("")
        bad_dtype = ref_put("k")
        bad_dtype.entries[0].embedding.embeddings.dtype = 99
        long_revision = ref_put("k")
        long_revision.entries[0].revision = "r" * 257
        two = ref_put("k")
        two.entries.append(ref_put("k2").entries[0])  # 2 x 64 bytes over a 100-byte budget
        cases = [
            (bad_key, grpc.StatusCode.INVALID_ARGUMENT, "KEY_MISSING", "entries[0].key"),
            (
                bad_dtype,
                grpc.StatusCode.INVALID_ARGUMENT,
                "TENSOR_DTYPE_UNSUPPORTED",
                "entries[0].embedding.embeddings.dtype",
            ),
            (
                long_revision,
                grpc.StatusCode.INVALID_ARGUMENT,
                "REVISION_TOO_LONG",
                "entries[0].revision",
            ),
            (two, grpc.StatusCode.RESOURCE_EXHAUSTED, "PUT_TOO_LARGE", "entries"),
        ]
        for request, code, reason, field in cases:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Put(request)
            info = error_info(refused.value)
            assert refused.value.code() == code, refused.value.details()
            assert info is not None and (info.reason, info.metadata["field"]) == (reason, field)


@contextlib.asynccontextmanager
async def two_replicas(
    server: RedisServer, prefix: str
) -> AsyncIterator[tuple[pb_grpc.CacheServiceStub, pb_grpc.CacheServiceStub]]:
    a, b = replica(server, prefix), replica(server, prefix)
    async with (
        in_process_server(add, servicer(a, claims=a.claims), CACHE) as ca,
        in_process_server(add, servicer(b, claims=b.claims), CACHE) as cb,
    ):
        yield pb_grpc.CacheServiceStub(ca), pb_grpc.CacheServiceStub(cb)


async def test_claims_in_the_store_are_fleet_wide(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        async with two_replicas(server, "claims:") as (a, b):
            assert (await a.Lookup(lookup("k1"))).results[0].claim == OWNED
            assert (await b.Lookup(lookup("k1"))).results[0].claim == ELSEWHERE
            waiter = asyncio.ensure_future(b.Lookup(lookup("k1", wait_ms=3000)))
            await asyncio.sleep(0.2)
            assert not waiter.done()
            assert (await a.Put(put("k1"))).stored == 1
            got = (await waiter).results[0]
            assert got.tier == EXACT and got.embedding.embeddings.data == payload(1)
            # The claim lives in Redis under a sealed name, with its TTL.
            names = [n for n in server.client().keys("claims:c:*")]  # type: ignore[union-attr]
            assert names == []  # the Put ended it
            assert (await b.Lookup(lookup("k2"))).results[0].claim == OWNED
            (name,) = server.client().keys("claims:c:*")  # type: ignore[misc]
            assert b"k2" not in name and 0 < server.client().pttl(name) <= 5000  # type: ignore[operator]


async def test_a_store_that_is_down_grants_every_claim(tmp_path: Path) -> None:
    server = RedisServer(tmp_path).start()
    try:
        store = replica(server, "down:", timeout_s=0.3)
        server.stop()
        async with in_process_server(add, servicer(store, claims=store.claims), CACHE) as ch:
            stub = pb_grpc.CacheServiceStub(ch)
            for _ in range(2):  # both callers encode: as without claims
                got = (await stub.Lookup(lookup("k1"))).results[0]
                assert (got.tier, got.claim) == (MISS, OWNED)
    finally:
        server.stop()
