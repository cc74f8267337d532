"""``qwenvl.cache.v1.CacheService``: converts protos to store calls and maps errors.

:class:`CacheServicer` checks each request whole (:mod:`cache_service.validation`), does
its work (a Lookup's matching, claims and holds in :mod:`cache_service.lookup`; a Put's
reads by reference and stores in :mod:`cache_service.put`) and answers.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from opentelemetry import trace
from qwenvl.cache.v1 import cache_service_pb2 as pb
from qwenvl.cache.v1 import cache_service_pb2_grpc as pb_grpc
from qwenvl.common.v1 import tensor_pb2

from cache_service import metrics
from cache_service.claims import Claims, MemoryClaims
from cache_service.entries import Store
from cache_service.lookup import (
    RESULT_OVERHEAD_BYTES,
    TIERS,
    Leases,
    Matcher,
    check_response_size,
    count,
    hold_hits,
    render,
    trace_outcome,
)
from cache_service.put import read_refs, store_all
from cache_service.validation import (
    MAX_KEY_CHARS,
    MAX_REUSABLE_GRIDS,
    POLICIES,
    EntryFields,
    _grid,
    _reusable,
    check_ref_entries,
    parse_lookup,
    parse_put,
)
from vlcommon.deadline import Deadline
from vlcommon.handoff import Holder, Reader

# Kept importable from here (the service's entry point and the tests import them).
__all__ = [
    "MAX_KEY_CHARS",
    "MAX_REUSABLE_GRIDS",
    "POLICIES",
    "RESULT_OVERHEAD_BYTES",
    "TIERS",
    "CacheServicer",
    "_grid",
    "_reusable",
]


def _claimed_keys(request: pb.PutRequest, limit: int) -> list[str]:
    """The keys a refused Put may hold claims on: well-formed ones, at most ``limit``."""
    return [e.key for e in request.entries[:limit] if 0 < len(e.key) <= MAX_KEY_CHARS]


class CacheServicer(pb_grpc.CacheServiceServicer):
    """Serves Lookup, Put and GetStats over one store: the in-process
    :class:`cache_service.store.EmbeddingStore` or a shared
    :class:`cache_service.store_redis.RedisStore`.

    Args:
        store: The entries.
        default_policy: The CachePolicy of a Lookup that leaves it unspecified.
        max_queries: Queries per Lookup, entries per Put.
        spatial_merge_size: The model's (grids' h and w are multiples of it).
        max_response_bytes: The message limit a Lookup's inline answer must fit.
        holder: Holds hits handed out by reference; None answers inline.
        reader: Reads entries put by reference.
        claims: Claims on missed keys; None: this process's own.
    """

    def __init__(
        self,
        store: Store,
        *,
        default_policy: int,
        max_queries: int,
        spatial_merge_size: int = 2,
        max_response_bytes: int = 256 * 1024 * 1024,
        holder: Holder | None = None,
        reader: Reader | None = None,
        claims: Claims | None = None,
    ) -> None:
        self.store = store
        # Claims on missed keys (LookupRequest.claim; cache_service/claims.py): the shared
        # store's, fleet-wide, or (the default) this process's.
        self.claims: Claims = claims or MemoryClaims(ttl_s=5.0)
        self.matcher = Matcher(store, self.claims)
        # Hits handed out by reference (LookupRequest.transport) are held here; entries
        # put by reference (PutEntry.embedding.ref) are read with the reader.
        self.holder = holder
        self.reader = reader or Reader(max_message_bytes=max_response_bytes)
        self.merge = spatial_merge_size
        self.max_response_bytes = max_response_bytes
        self.default_policy = default_policy
        self.max_queries = max_queries
        self.hits = {"exact": 0, "similar": 0, "miss": 0}

    async def Lookup(
        self, request: pb.LookupRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupResponse:
        """Answer each query from the exact tier, then (policy permitting) the similar one
        (:mod:`cache_service.lookup`: leases, ``bytes_keys``, alias keys, claims).

        Raises (as status): INVALID_ARGUMENT for a request that fails
        :func:`cache_service.validation.parse_lookup` (a bad key or alias key, grid or
        reusable grid (or more than 256 of them), descriptor, verification image, policy,
        transport, or too many queries); RESOURCE_EXHAUSTED ``LOOKUP_RESPONSE_TOO_LARGE``
        for inline hits over the message limit, ``HANDOFF_FULL`` for hits the holder
        cannot take.
        """
        t0 = time.perf_counter()
        rpc_span = trace.get_current_span()
        leases = Leases(self.store)
        # Runs when the call completes, whatever the outcome.
        context.add_done_callback(lambda _ctx: leases.release_all())
        try:
            lookup = parse_lookup(
                request,
                max_queries=self.max_queries,
                merge=self.merge,
                dim=self.store.dim,
                default_policy=self.default_policy,
                holder=self.holder,
            )
            matches, claimed = await self.matcher.run(lookup, leases, context)
            refs: list[tensor_pb2.EmbeddingRef | None] | None = None
            if lookup.by_ref:
                assert self.holder is not None
                refs = await hold_hits(self.store, self.holder, matches, lookup.transport)
            elif lookup.include_embeddings:
                check_response_size(matches, self.max_response_bytes)
            for match in matches:
                count(self.hits, match, counted_miss=not lookup.bytes_keys)
            trace_outcome(rpc_span, matches)
            return render(matches, claimed, refs, include_embeddings=lookup.include_embeddings)
        finally:
            metrics.LOOKUP_SECONDS.observe(time.perf_counter() - t0)

    async def Put(
        self, request: pb.PutRequest, context: grpc.aio.ServicerContext
    ) -> pb.PutResponse:
        """Validate every entry, then store them in order (with its alias key, if any).

        Entries sent by reference are read from their holder first (on this loop, the
        reads of one request concurrently), after their grid, rows and size are checked.

        Raises (as status): INVALID_ARGUMENT for a bad key or alias key, grid, descriptor or
        tensor (then nothing is stored); RESOURCE_EXHAUSTED for an entry larger than the byte budget
        (nothing stored) or one that cannot fit because leased entries hold the budget (the
        entries before it were stored; the message says how many); FAILED_PRECONDITION with
        the reader's reason for a ref whose holder is unreachable or no longer holds it
        (nothing stored). An entry a shared store could not take (down or slow) is dropped
        without an error: ``stored`` leaves it out.
        """
        try:
            # On a worker thread, as the rest of the checks: verification images are
            # copied out of the request (up to 4 MiB each).
            refs, fields = await asyncio.to_thread(
                check_ref_entries,
                request,
                max_entries=self.max_queries,
                merge=self.merge,
                dim=self.store.dim,
                capacity_bytes=self.store.capacity_bytes,
            )
            timeout = Deadline.of(context).left()
            payloads = await read_refs(self.reader, refs, timeout) if refs else {}
            # On a worker thread: the payload's copy out of the request and the finiteness
            # check (~0.25 s together at the 256 MiB message limit) and the index add (slow
            # at a million entries) should not hold health checks and lookups. The store
            # takes its own lock.
            return await asyncio.to_thread(self._put, request, payloads, fields)
        except BaseException:
            # Refused, unreadable or cancelled: nobody is encoding these any more either,
            # so waiters on their claims look again now, not at the claims' TTL.
            self.claims.end(_claimed_keys(request, self.max_queries))
            raise

    def _put(
        self,
        request: pb.PutRequest,
        payloads: dict[int, bytes],
        fields: list[EntryFields] | None,
    ) -> pb.PutResponse:
        """Put's body, on a worker thread: check every entry (``fields``: those
        :func:`check_ref_entries` checked already), then store them."""
        put = parse_put(
            request,
            payloads,
            max_entries=self.max_queries,
            merge=self.merge,
            dim=self.store.dim,
            capacity_bytes=self.store.capacity_bytes,
            fields=fields,
        )
        try:
            stored, evicted, dropped = store_all(self.store, put.entries)
        finally:
            # Stored, dropped or refused, nobody is encoding these any more: waiters on
            # their claims look again (and encode, if still missing).
            self.claims.end(put.keys)
        if dropped:
            trace.get_current_span().set_attribute("splitvl.cache.dropped_entries", dropped)
        return pb.PutResponse(stored=stored, evicted=evicted)

    async def GetStats(
        self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatsResponse:
        """The store's entries, bytes and evictions, and this servicer's hit counters."""
        # On a worker thread: the store's lock may be held by a Put or a rebuild's swap.
        entries, nbytes, evictions = await asyncio.to_thread(self.store.stats)
        return pb.GetStatsResponse(
            entries=entries,
            bytes=nbytes,
            capacity_bytes=self.store.capacity_bytes,
            exact_hits=self.hits["exact"],
            similar_hits=self.hits["similar"],
            misses=self.hits["miss"],
            evictions=evictions,
        )
