"""One Lookup's work, after its request is checked (:mod:`cache_service.validation`).

Each query is answered from the exact tier, then (policy permitting) the similar one. With
``bytes_keys`` the queries' keys are digests of encoded files: they are answered from the
exact tier only (an entry's alias keys included), and a miss is not counted (the caller
looks the image up again by its pixel key), so the counters and the hit ratio count each
image once. A query's ``alias_key`` becomes an alias of the entry that its own key hit
exactly. A similarity hit may come from an entry whose grid is one of the query's
``reusable_grids`` (then the result's embedding carries that grid); the exact tier always
needs the query's own grid.

Entries returned with their embeddings are leased until the RPC is done (the response
sent, or the call failed or was cancelled), so eviction cannot pick them. The queries are
matched on a worker thread: a similarity candidate's verification costs up to ~90 ms (2 MP
images), and 256 queries with 8 candidates each must not stall health checks and other
calls. A cancelled call stops matching at the next query.

- :class:`Leases`: the entries one call leased, released together when it is done.
- :class:`Matcher`: matches the queries against the store on a worker thread, taking
  the claims of missed keys beside the matching and settling them (waiting, with
  ``wait_claimed_ms``, for the keys others claimed).
- :func:`hold_hits` / :func:`check_response_size`: the hits answered by reference, or
  inline within the message limit.
- :func:`count`, :func:`render`, :func:`trace_outcome`: the counters, the response and
  the RPC span's attributes.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Iterator

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span
from qwenvl.cache.v1 import cache_service_pb2 as pb
from qwenvl.common.v1 import generation_pb2, tensor_pb2

from cache_service import metrics
from cache_service.claims import POLL_S, Claims
from cache_service.entries import Entry, Match, Store
from cache_service.validation import LookupInput, Query
from vlcommon.by_reference import Payload, hold_answer
from vlcommon.handoff import Holder
from vlcommon.refusals import Refusal
from vlcommon.request_rules import CACHE_TIERS

tracer = trace.get_tracer("splitvl.cache")
TIERS = CACHE_TIERS
# A Lookup that waits on others' claims answers this long before its caller's deadline,
# and waits at most MAX_CLAIM_WAIT_MS (a caller without a deadline never hangs on it).
CLAIM_WAIT_MARGIN_S = 0.05
MAX_CLAIM_WAIT_MS = 60_000
# A result's bytes besides its embeddings (key, grid, shape, tier, score), an upper bound.
RESULT_OVERHEAD_BYTES = 1024


class Leases:
    """The entries one Lookup leased, released together when its RPC is done.

    The matching runs on a worker thread, so a lease can be taken after the RPC was
    cancelled; :meth:`add` then releases it at once instead of leaking it (a leaked lease
    would keep the entry from eviction for ever).
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._entries: list[Entry] = []
        self.done = threading.Event()

    def add(self, entry: Entry) -> None:
        with self._lock:
            if not self.done.is_set():
                self._entries.append(entry)
                return
        self._store.release(entry)

    def release_all(self) -> None:
        with self._lock:
            self.done.set()
            entries, self._entries = self._entries, []
        for entry in entries:
            self._store.release(entry)


class Matcher:
    """Matches checked queries against one store, and settles their claims.

    Args:
        store: The entries (in-process or shared).
        claims: The claims on missed keys (``LookupRequest.claim``;
            :mod:`cache_service.claims`).
    """

    def __init__(self, store: Store, claims: Claims) -> None:
        self.store = store
        self.claims = claims

    async def run(
        self, lookup: LookupInput, leases: Leases, context: grpc.aio.ServicerContext
    ) -> tuple[list[Match], list[int]]:
        """Match every query (a hit leased in ``leases`` when it carries embeddings).

        Returns:
            (matches, claim states): one ``Match`` and one ``ClaimState`` per query.
        """
        # Claims are taken beside the matching, not after it (one store round trip
        # less on a miss); a hit gives its claim back (cache_service/claims.py).
        claiming = None
        if lookup.claim:
            keys = lookup.claim_keys()
            claiming = asyncio.ensure_future(asyncio.to_thread(self._claim_all, keys))
        try:
            # to_thread copies the context: the per-query spans stay under this RPC's span.
            matches = await asyncio.to_thread(
                self._match_all,
                list(lookup.queries),
                lookup.policy,
                lookup.include_embeddings,
                leases,
                lookup.bytes_keys,
            )
        finally:
            taken = await claiming if claiming is not None else {}
        if claiming is None:
            return matches, [0] * len(matches)
        return matches, await self._settle_claims(lookup, matches, taken, leases, context)

    def _claim_all(self, keys: list[str]) -> dict[str, bool]:
        """Take each key's claim (on a worker thread); True where this caller holds it."""
        return {key: self.claims.claim(key) for key in keys}

    async def _settle_claims(
        self,
        lookup: LookupInput,
        matches: list[Match],
        taken: dict[str, bool],
        leases: Leases,
        context: grpc.aio.ServicerContext,
    ) -> list[int]:
        """Each missed image's claim state from the claims ``taken`` beside the matching
        (a hit gives back a claim it took); with ``wait_claimed_ms``, wait for the keys
        others claimed: ``matches`` take the hits that land meanwhile. Returns each
        query's ``ClaimState``."""
        queries = lookup.queries
        states = [pb.CLAIM_STATE_UNSPECIFIED] * len(matches)
        lease = lookup.include_embeddings
        missed = [i for i, m in enumerate(matches) if m.entry is None and not queries[i].video]
        for i in missed:
            owned = taken.get(queries[i].key, False)
            states[i] = pb.CLAIM_STATE_OWNED if owned else pb.CLAIM_STATE_ELSEWHERE
        needed = {queries[i].key for i in missed}
        returned = [k for k, owned in taken.items() if owned and k not in needed]
        if returned:
            await asyncio.to_thread(self.claims.end, returned)

        def claim(i: int) -> None:
            owned = self.claims.claim(queries[i].key)
            states[i] = pb.CLAIM_STATE_OWNED if owned else pb.CLAIM_STATE_ELSEWHERE

        def poll(waiting: list[int]) -> list[int]:
            still = []
            for i in waiting:
                exact = generation_pb2.CACHE_POLICY_EXACT_ONLY
                match = self._match_all([queries[i]], exact, lease, leases)[0]
                if match.entry is None and not self.claims.held(queries[i].key):
                    match = self._match_all([queries[i]], lookup.policy, lease, leases)[0]
                    if match.entry is None:
                        claim(i)  # the claimant is gone: this caller's turn
                if match.entry is not None:
                    matches[i], states[i] = match, pb.CLAIM_STATE_UNSPECIFIED
                elif states[i] == pb.CLAIM_STATE_ELSEWHERE:
                    still.append(i)
            return still

        waiting = [i for i in missed if states[i] == pb.CLAIM_STATE_ELSEWHERE]
        end = time.monotonic() + min(lookup.wait_claimed_ms, MAX_CLAIM_WAIT_MS) / 1000
        remaining = context.time_remaining()
        if remaining is not None:  # answer before the caller's deadline
            end = min(end, time.monotonic() + remaining - CLAIM_WAIT_MARGIN_S)
        while waiting and time.monotonic() + POLL_S < end and not leases.done.is_set():
            await asyncio.sleep(POLL_S)
            waiting = await asyncio.to_thread(poll, waiting)
        return states

    def _match_all(
        self,
        queries: list[Query],
        policy: int,
        lease: bool,
        leases: Leases,
        bytes_keys: bool = False,
    ) -> list[Match]:
        """Match every query against the store (on a worker thread)."""
        matches = []
        span_name = "cache.lookup_bytes" if bytes_keys else "cache.lookup"
        for query in queries:
            if leases.done.is_set():  # the call is over: nobody reads the rest
                break
            with tracer.start_as_current_span(span_name) as span:
                if policy == generation_pb2.CACHE_POLICY_OFF:
                    match = Match("miss", 0.0, None)
                else:
                    match = self.store.lookup(
                        query.key,
                        query.descriptor,
                        query.grid,
                        similar=policy == generation_pb2.CACHE_POLICY_SIMILAR,
                        lease=lease,
                        revision=query.revision,
                        verification=query.verification,
                        alias=query.alias_key,
                        reusable=query.reusable,
                    )
                if match.entry is not None and lease:
                    leases.add(match.entry)
                span.set_attribute("splitvl.cache.tier", match.tier)
                span.set_attribute("splitvl.cache.similarity", match.similarity)
                span.set_attribute("splitvl.cache.rejected_candidates", match.rejected)
                if match.entry is not None and match.entry.grid != query.grid:
                    # A similarity hit served with the stored entry's grid (docs/cache.md).
                    span.set_attribute("splitvl.cache.served_grid", list(match.entry.grid))
                    span.set_attribute("splitvl.cache.requested_grid", list(query.grid))
            matches.append(match)
        return matches


async def hold_hits(
    store: Store, holder: Holder, matches: list[Match], transport: int
) -> list[tensor_pb2.EmbeddingRef | None]:
    """Hold each hit's bytes for its reader (on a worker thread: a shared-memory copy of
    16 MiB takes a few ms). Each held hit takes a lease of its own, ended when its reader
    releases it or the hold expires, so eviction cannot pick it meanwhile (the bytes
    would stay readable anyway: entries are immutable and the holder keeps them).

    Returns:
        One ref per match, None for a miss.

    Raises:
        asyncio.CancelledError: the call was cancelled meanwhile (the holds are freed).
        ServiceError: RESOURCE_EXHAUSTED ``HANDOFF_FULL`` (what was held is freed, its
            leases ended).
    """

    def payloads() -> Iterator[Payload | None]:
        for match in matches:
            entry = match.entry
            if entry is None:
                yield None
                continue
            leased = store.lease(entry)
            release = functools.partial(store.release, entry) if leased else None
            yield Payload(entry.data, entry.dtype, entry.shape, on_release=release)

    # No hold outlives a call cancelled while it is made (by its client, or past its
    # deadline): it would keep its entry leased until the TTL.
    held = await hold_answer(holder, payloads(), transport=transport, on_thread=True)
    return [None if h is None else h.ref for h in held]


def check_response_size(matches: list[Match], max_response_bytes: int) -> None:
    """Refuse a response that would exceed the message limit before building it.

    Two queries answered by one 200 MiB entry used to build a 400 MiB response that
    gRPC then refused to send ("Sent message larger than max", no field named, an
    ERROR traceback in the log). The leases taken are released when the call ends.

    Raises:
        ServiceError: RESOURCE_EXHAUSTED ``LOOKUP_RESPONSE_TOO_LARGE`` naming ``queries``
            with the limit ``max_response_bytes``.
    """
    hits = [m.entry for m in matches if m.entry is not None]
    total = sum(len(e.data) for e in hits) + RESULT_OVERHEAD_BYTES * len(matches)
    if total > max_response_bytes:
        raise Refusal.LOOKUP_RESPONSE_TOO_LARGE.error(
            f"the {len(hits)} hits of queries hold about {total} bytes of embeddings; "
            f"a response is limited to {max_response_bytes} bytes "
            "(max_message_bytes): look them up in smaller batches, or with "
            "include_embeddings false",
            field="queries",
            limit=max_response_bytes,
        )


def count(hits: dict[str, int], match: Match, *, counted_miss: bool = True) -> None:
    """Count one query's outcome in ``hits`` (by tier) and the metrics; a miss only with
    ``counted_miss`` (a ``bytes_keys`` miss is looked up again by its pixel key)."""
    if match.tier == "miss" and not counted_miss:
        return
    hits[match.tier] += 1
    metrics.LOOKUPS.labels(tier=match.tier).inc()
    if match.tier == "exact":
        metrics.HITS.labels(tier="exact").inc()
    else:
        metrics.MISSES.labels(tier="exact").inc()
        if match.tier == "similar":
            metrics.HITS.labels(tier="similar").inc()
        elif match.consulted_similar:
            metrics.MISSES.labels(tier="similar").inc()
    total = sum(hits.values())
    metrics.HIT_RATIO.set((hits["exact"] + hits["similar"]) / total)


def render(
    matches: list[Match],
    claimed: list[int],
    refs: list[tensor_pb2.EmbeddingRef | None] | None,
    *,
    include_embeddings: bool,
) -> pb.LookupResponse:
    """The response: each query's tier, similarity and claim state, and for a hit its
    key and embedding (by ``refs`` when given, else inline with ``include_embeddings``)."""
    response = pb.LookupResponse()
    for i, match in enumerate(matches):
        result = response.results.add(
            tier=TIERS[match.tier], similarity=match.similarity, claim=claimed[i]
        )
        if match.entry is not None:
            result.matched_key = match.entry.key
            if refs is not None:
                result.embedding.CopyFrom(_embedding_proto(match.entry, refs[i]))
            elif include_embeddings:
                result.embedding.CopyFrom(_embedding_proto(match.entry))
    return response


def trace_outcome(span: Span, matches: list[Match]) -> None:
    """Each query's tier and similarity on the RPC's span (and, for one query, alone)."""
    tiers = [m.tier for m in matches]
    scores = [m.similarity for m in matches]
    span.set_attribute("splitvl.cache.tiers", tiers)
    span.set_attribute("splitvl.cache.similarities", scores)
    if len(tiers) == 1:
        span.set_attribute("splitvl.cache.tier", tiers[0])
        span.set_attribute("splitvl.cache.similarity", scores[0])


def _embedding_proto(
    entry: Entry, ref: tensor_pb2.EmbeddingRef | None = None
) -> tensor_pb2.ImageEmbedding:
    """The entry's embeddings inline, or (with ``ref``) its dtype, shape and where to read it."""
    t, h, w = entry.grid
    msg = tensor_pb2.ImageEmbedding(
        embeddings=tensor_pb2.Tensor(
            dtype=entry.dtype, shape=list(entry.shape), data=b"" if ref else entry.data
        ),
        grid=tensor_pb2.GridTHW(t=t, h=h, w=w),
        key=entry.key,
    )
    if ref is not None:
        msg.ref.CopyFrom(ref)
    return msg
