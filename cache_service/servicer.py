"""``qwenvl.cache.v1.CacheService``: converts protos to store calls and maps errors."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
from opentelemetry import trace
from qwenvl.cache.v1 import cache_service_pb2 as pb
from qwenvl.cache.v1 import cache_service_pb2_grpc as pb_grpc
from qwenvl.common.v1 import generation_pb2, tensor_pb2

from cache_service import metrics
from cache_service.claims import POLL_S, Claims, MemoryClaims
from cache_service.entries import (
    CacheFullError,
    Entry,
    KeyGridConflictError,
    Match,
    Store,
    StoreUnavailableError,
)
from vlcommon import handoff, tensors
from vlcommon.deadline import Deadline
from vlcommon.errors import ServiceError
from vlcommon.handoff import Holder, Reader, check_transport, transport_name
from vlcommon.refusals import Refusal
from vlcommon.request_rules import CACHE_POLICIES, CACHE_TIERS, check_cache_policy, check_grid
from vlcommon.verification import (
    CHROMA_SCALE,
    JPEG_MAX_CLIPPED_SHARE,
    JPEG_MAX_SIDE,
    MAX_VERIFICATION_BYTES,
    JpegLuma,
    VerificationImage,
    chroma_shape,
)

tracer = trace.get_tracer("splitvl.cache")
TIERS = CACHE_TIERS
OFF = generation_pb2.CACHE_POLICY_OFF
# A Lookup that waits on others' claims answers this long before its caller's deadline,
# and waits at most MAX_CLAIM_WAIT_MS (a caller without a deadline never hangs on it).
CLAIM_WAIT_MARGIN_S = 0.05
MAX_CLAIM_WAIT_MS = 60_000
POLICIES = CACHE_POLICIES


def _grid(
    msg: tensor_pb2.GridTHW, field: str, merge: int, *, video: bool = False
) -> tuple[int, int, int]:
    """A grid by the rule the encoder and the decoder apply: t = 1 for an image, t >= 1
    for a video (``video``)."""
    return check_grid(msg, field, merge, video=video)


def _check_video(msg: pb.LookupQuery | pb.PutEntry, field: str) -> None:
    """Refuse a video query or entry that brings a similarity descriptor, a verification
    image or reusable grids: a video is found only by its exact key.

    Raises:
        ServiceError: INVALID_ARGUMENT ``VIDEO_NOT_EXACT`` naming the field.
    """
    names = ["descriptor", "verification", "verification_chroma"]
    lists = [
        "verification_jpeg_quantization",
        "verification_jpeg_clipped_index",
        "verification_jpeg_clipped_luma",
    ]
    if isinstance(msg, pb.LookupQuery):
        lists.append("reusable_grids")
    for name in names + lists:
        value = getattr(msg, name)
        if len(value) if name in lists else (value.shape or value.data):
            raise Refusal.VIDEO_NOT_EXACT.error(
                f"{field}.{name} is set on a video ({field}.video); a video is found only "
                "by its exact key",
                field=f"{field}.{name}",
            )


@dataclass(frozen=True)
class _Query:
    key: str
    grid: tuple[int, int, int]
    descriptor: np.ndarray | None
    verification: VerificationImage | None
    revision: str
    alias_key: str
    reusable: frozenset[tuple[int, int, int]] = frozenset()


# Most grids one query may list as reusable (LookupQuery.reusable_grids): the gateway sends
# a 10% size class, under 60 grids even for a 12 MP image at Qwen3-VL's budget.
MAX_REUSABLE_GRIDS = 256


def _reusable(
    msgs: Sequence[tensor_pb2.GridTHW], field: str, merge: int
) -> frozenset[tuple[int, int, int]]:
    """The grids of ``LookupQuery.reusable_grids``, each checked like ``grid``."""
    if len(msgs) > MAX_REUSABLE_GRIDS:
        raise Refusal.TOO_MANY_REUSABLE_GRIDS.error(
            f"{field} has {len(msgs)} grids; at most {MAX_REUSABLE_GRIDS}",
            field=field,
            limit=MAX_REUSABLE_GRIDS,
        )
    return frozenset(_grid(g, f"{field}[{j}]", merge) for j, g in enumerate(msgs))


class _Leases:
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


# A result's bytes besides its embeddings (key, grid, shape, tier, score), an upper bound.
RESULT_OVERHEAD_BYTES = 1024

# A key is a content digest (64 hex characters from the gateway); the store holds it beside
# the entry outside the byte budget, so its length is bounded here (4 MiB keys were accepted).
MAX_KEY_CHARS = 256


def _key(key: str, field: str, *, name: str = "key", optional: bool = False) -> str:
    """A key (or, with ``name="alias_key"`` and ``optional``, an alias key; empty allowed)."""
    if not key and not optional:
        raise Refusal.KEY_MISSING.error(f"{field}.{name} is empty", field=f"{field}.{name}")
    if len(key) > MAX_KEY_CHARS:
        raise Refusal.KEY_TOO_LONG.error(
            f"{field}.{name} has {len(key)} characters; at most {MAX_KEY_CHARS} are allowed",
            field=f"{field}.{name}",
            limit=MAX_KEY_CHARS,
        )
    return key


# Unset (None) when both shape and data are empty; shape is tested first, since reading
# ``data`` copies it.
def _descriptor(msg: tensor_pb2.Tensor, dim: int, field: str) -> np.ndarray | None:
    if not msg.shape and not msg.data:
        return None
    data = tensors.validate(msg, field=field, dtypes=(tensor_pb2.DATA_TYPE_FP32,), ndim=1)
    if msg.shape[0] != dim:
        raise Refusal.DESCRIPTOR_SHAPE_INVALID.error(
            f"{field}.shape is {list(msg.shape)}; expected [{dim}]",
            field=f"{field}.shape",
            expected=dim,
        )
    return tensors.to_numpy(msg, data)


def _verification(msg: pb.LookupQuery | pb.PutEntry, prefix: str) -> VerificationImage | None:
    """The verification image (vlcommon.verification) of a query or an entry from its
    ``verification`` (luma, UINT8 [h, w]) and ``verification_chroma`` (UINT8 [ceil(h / 2),
    ceil(w / 2), 2]), with its JPEG fields (:func:`_jpeg`); None when the luma is unset,
    or sent without chroma (older gateways): then no similarity hit.

    Raises:
        ServiceError: INVALID_ARGUMENT naming the field when a shape or dtype is wrong or
            the luma holds more than MAX_VERIFICATION_BYTES; as :func:`_jpeg`.
    """
    luma, chroma = msg.verification, msg.verification_chroma
    field, chroma_field = f"{prefix}.verification", f"{prefix}.verification_chroma"
    jpeg_set = [
        name
        for name in (
            "verification_jpeg_quantization",
            "verification_jpeg_clipped_index",
            "verification_jpeg_clipped_luma",
        )
        if len(getattr(msg, name))
    ]
    if jpeg_set and not (luma.shape or luma.data):
        raise Refusal.VERIFICATION_JPEG_INVALID.error(
            f"{prefix}.{jpeg_set[0]} is set without {field}: it describes the verification "
            "image's JPEG",
            field=f"{prefix}.{jpeg_set[0]}",
        )
    if not luma.shape and not luma.data:
        return None
    data = tensors.validate(luma, field=field, dtypes=(tensor_pb2.DATA_TYPE_UINT8,), ndim=2)
    if min(luma.shape) <= 0 or len(data) > MAX_VERIFICATION_BYTES:
        raise Refusal.VERIFICATION_SHAPE_INVALID.error(
            f"{field}.shape is {list(luma.shape)}; both sides must be > 0 and the image at "
            f"most {MAX_VERIFICATION_BYTES} bytes",
            field=f"{field}.shape",
            limit=MAX_VERIFICATION_BYTES,
        )
    jpeg = _jpeg(msg, prefix, (int(luma.shape[0]), int(luma.shape[1])))
    if not chroma.shape and not chroma.data:
        return None
    expected = list(chroma_shape(*luma.shape))
    chroma_data = tensors.validate(
        chroma, field=chroma_field, dtypes=(tensor_pb2.DATA_TYPE_UINT8,), ndim=3
    )
    if list(chroma.shape) != expected:
        raise Refusal.VERIFICATION_SHAPE_INVALID.error(
            f"{chroma_field}.shape is {list(chroma.shape)}; for {field}.shape "
            f"{list(luma.shape)} it must be {expected} (ceil(h / {CHROMA_SCALE}), "
            f"ceil(w / {CHROMA_SCALE}), 2)",
            field=f"{chroma_field}.shape",
        )
    return VerificationImage(
        tensors.to_numpy(luma, data), tensors.to_numpy(chroma, chroma_data), jpeg
    )


def _jpeg(
    msg: pb.LookupQuery | pb.PutEntry, prefix: str, shape: tuple[int, int]
) -> JpegLuma | None:
    """The verification image's JPEG fields (vlcommon.verification.JpegLuma):
    ``verification_jpeg_quantization``, 64 values in 1..255 (on an image of at most
    JPEG_MAX_SIDE pixels per side), and where the JPEG's Y channel
    differs from the luma of ``shape`` [h, w], ``verification_jpeg_clipped_index`` (strictly
    increasing flat indices below h * w, at most h * w * JPEG_MAX_CLIPPED_SHARE of them)
    and ``verification_jpeg_clipped_luma`` (one byte each). None when none is set.

    Raises:
        ServiceError: INVALID_ARGUMENT ``VERIFICATION_JPEG_INVALID`` naming the field and
            the rule it breaks.
    """
    table = msg.verification_jpeg_quantization
    index, values = msg.verification_jpeg_clipped_index, msg.verification_jpeg_clipped_luma
    table_field = f"{prefix}.verification_jpeg_quantization"
    index_field = f"{prefix}.verification_jpeg_clipped_index"
    values_field = f"{prefix}.verification_jpeg_clipped_luma"
    if not table:
        if index or values:
            name = index_field if index else values_field
            raise Refusal.VERIFICATION_JPEG_INVALID.error(
                f"{name} is set without {table_field} (64 values)", field=name
            )
        return None
    if len(table) != 64 or min(table) < 1 or max(table) > 255:
        raise Refusal.VERIFICATION_JPEG_INVALID.error(
            f"{table_field} has {len(table)} values from {min(table)} to {max(table)}; it "
            "must be a baseline JPEG luma table: 64 values in 1..255",
            field=table_field,
            limit=64,
        )
    if max(shape) > JPEG_MAX_SIDE:
        raise Refusal.VERIFICATION_JPEG_INVALID.error(
            f"{table_field} is set on {prefix}.verification of shape {list(shape)}; a JPEG "
            f"is at most {JPEG_MAX_SIDE} pixels per side",
            field=table_field,
            limit=JPEG_MAX_SIDE,
        )
    pixels = shape[0] * shape[1]
    limit = int(JPEG_MAX_CLIPPED_SHARE * pixels)
    if len(index) > limit:
        raise Refusal.VERIFICATION_JPEG_INVALID.error(
            f"{index_field} has {len(index)} indices; at most {limit} "
            f"({JPEG_MAX_CLIPPED_SHARE:g} of the {pixels} pixels of {prefix}.verification)",
            field=index_field,
            limit=limit,
        )
    if len(values) != len(index):
        raise Refusal.VERIFICATION_JPEG_INVALID.error(
            f"{values_field} has {len(values)} bytes; it must have one per index of "
            f"{index_field} ({len(index)})",
            field=values_field,
        )
    flat = np.asarray(index, dtype=np.int64)
    if flat.size and (flat[-1] >= pixels or (flat.size > 1 and np.any(np.diff(flat) <= 0))):
        raise Refusal.VERIFICATION_JPEG_INVALID.error(
            f"{index_field} must be strictly increasing flat indices below {pixels} "
            f"(h * w of {prefix}.verification)",
            field=index_field,
        )
    return JpegLuma(
        np.asarray(table, dtype=np.uint16),
        flat.astype(np.uint32),
        np.frombuffer(values, dtype=np.uint8).copy(),
    )


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


class CacheServicer(pb_grpc.CacheServiceServicer):
    """Serves Lookup, Put and GetStats over one store: the in-process
    :class:`cache_service.store.EmbeddingStore` or a shared
    :class:`cache_service.store_redis.RedisStore`."""

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
        # Hits handed out by reference (LookupRequest.transport) are held here; entries
        # put by reference (PutEntry.embedding.ref) are read with the reader.
        self.holder = holder
        self.reader = reader or Reader(max_message_bytes=max_response_bytes)
        self.merge = spatial_merge_size
        self.max_response_bytes = max_response_bytes
        self.default_policy = default_policy
        self.max_queries = max_queries
        self.hits = {"exact": 0, "similar": 0, "miss": 0}

    def _check_count(self, n: int, field: str) -> None:
        if n > self.max_queries:
            raise Refusal.TOO_MANY_ITEMS.error(
                f"{field} has {n} entries; the limit is {self.max_queries}",
                field=field,
                limit=self.max_queries,
            )

    async def Lookup(
        self, request: pb.LookupRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupResponse:
        """Answer each query from the exact tier, then (policy permitting) the similar one.

        With ``bytes_keys`` the queries' keys are digests of encoded files: they are
        answered from the exact tier only (an entry's alias keys included), and a miss is
        not counted (the caller looks the image up again by its pixel key), so the counters
        and the hit ratio count each image once. A query's ``alias_key`` becomes an alias of
        the entry that its own key hit exactly.

        Entries returned with their embeddings are leased until the RPC is done (the
        response sent, or the call failed or was cancelled), so eviction cannot pick them.
        The queries are checked on the event loop and matched on a worker thread: a
        similarity candidate's verification costs up to ~90 ms (2 MP images), and 256
        queries with 8 candidates each must not stall health checks and other calls. A
        cancelled call stops matching at the next query.

        A similarity hit may come from an entry whose grid is one of the query's
        ``reusable_grids`` (then the result's embedding carries that grid); the exact tier
        always needs the query's own grid.

        Raises (as status): INVALID_ARGUMENT for a bad key or alias key, grid or reusable
        grid (or more than 256 of them), descriptor, verification image (luma not UINT8
        [h, w] or over 4 MiB, chroma not UINT8 [ceil(h / 2), ceil(w / 2), 2]), policy or
        too many queries.
        """
        t0 = time.perf_counter()
        rpc_span = trace.get_current_span()
        leases = _Leases(self.store)
        # Runs when the call completes, whatever the outcome.
        context.add_done_callback(lambda _ctx: leases.release_all())
        try:
            self._check_count(len(request.queries), "queries")
            check_cache_policy(request.policy, "policy")
            check_transport(request.transport)
            # A cache built without a holder (embedded in a tool or a test) answers inline.
            by_ref = request.include_embeddings and request.transport != 0
            by_ref = by_ref and self.holder is not None
            policy = request.policy or self.default_policy
            if request.bytes_keys and policy == generation_pb2.CACHE_POLICY_SIMILAR:
                policy = generation_pb2.CACHE_POLICY_EXACT_ONLY  # a file digest has no descriptor
            queries = []
            for i, query in enumerate(request.queries):
                field = f"queries[{i}]"
                if query.video:
                    _check_video(query, field)
                queries.append(
                    _Query(
                        _key(query.key, field),
                        _grid(query.grid, f"{field}.grid", self.merge, video=query.video),
                        _descriptor(query.descriptor, self.store.dim, f"{field}.descriptor"),
                        _verification(query, field),
                        query.revision,
                        _key(query.alias_key, field, name="alias_key", optional=True),
                        _reusable(query.reusable_grids, f"{field}.reusable_grids", self.merge),
                    )
                )
            # Claims are taken beside the matching, not after it (one store round trip
            # less on a miss); a hit gives its claim back (cache_service/claims.py).
            claiming = None
            if request.claim and not request.bytes_keys and policy != OFF:
                images = zip(queries, request.queries, strict=True)
                keys = list(dict.fromkeys(q.key for q, r in images if not r.video))
                claiming = asyncio.ensure_future(asyncio.to_thread(self._claim_all, keys))
            try:
                # to_thread copies the context: the per-query spans stay under this RPC's span.
                matches = await asyncio.to_thread(
                    self._match_all,
                    queries,
                    policy,
                    request.include_embeddings,
                    leases,
                    request.bytes_keys,
                )
            finally:
                taken = await claiming if claiming is not None else {}
            claimed = [0] * len(matches)
            if claiming is not None:
                videos = [q.video for q in request.queries]
                claimed = await self._settle_claims(
                    queries, matches, videos, taken, request, policy, leases, context
                )
            refs: list[tensor_pb2.EmbeddingRef | None] = []
            if by_ref:
                # No hold outlives a call cancelled while it is made (by its client, or
                # past its deadline): it would keep its entry leased until the TTL.
                assert self.holder is not None
                refs = await handoff.hold_on_thread(
                    self.holder, functools.partial(self._hold_all, matches, request.transport)
                )
            elif request.include_embeddings:
                self._check_response_size(matches)
            response = pb.LookupResponse()
            for i, match in enumerate(matches):
                self._count(match, counted_miss=not request.bytes_keys)
                result = response.results.add(
                    tier=TIERS[match.tier], similarity=match.similarity, claim=claimed[i]
                )
                if match.entry is not None:
                    result.matched_key = match.entry.key
                    if by_ref:
                        result.embedding.CopyFrom(_embedding_proto(match.entry, refs[i]))
                    elif request.include_embeddings:
                        result.embedding.CopyFrom(_embedding_proto(match.entry))
            tiers = [m.tier for m in matches]
            scores = [m.similarity for m in matches]
            rpc_span.set_attribute("splitvl.cache.tiers", tiers)
            rpc_span.set_attribute("splitvl.cache.similarities", scores)
            if len(tiers) == 1:
                rpc_span.set_attribute("splitvl.cache.tier", tiers[0])
                rpc_span.set_attribute("splitvl.cache.similarity", scores[0])
            return response
        finally:
            metrics.LOOKUP_SECONDS.observe(time.perf_counter() - t0)

    def _claim_all(self, keys: list[str]) -> dict[str, bool]:
        """Take each key's claim (on a worker thread); True where this caller holds it."""
        return {key: self.claims.claim(key) for key in keys}

    async def _settle_claims(
        self,
        queries: list[_Query],
        matches: list[Match],
        videos: list[bool],
        taken: dict[str, bool],
        request: pb.LookupRequest,
        policy: int,
        leases: _Leases,
        context: grpc.aio.ServicerContext,
    ) -> list[int]:
        """Each missed image's claim state from the claims ``taken`` beside the matching
        (a hit gives back a claim it took); with ``wait_claimed_ms``, wait for the keys
        others claimed: ``matches`` take the hits that land meanwhile. Returns each
        query's ``ClaimState``."""
        states = [pb.CLAIM_STATE_UNSPECIFIED] * len(matches)
        lease = request.include_embeddings
        missed = [i for i, m in enumerate(matches) if m.entry is None and not videos[i]]
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
                    match = self._match_all([queries[i]], policy, lease, leases)[0]
                    if match.entry is None:
                        claim(i)  # the claimant is gone: this caller's turn
                if match.entry is not None:
                    matches[i], states[i] = match, pb.CLAIM_STATE_UNSPECIFIED
                elif states[i] == pb.CLAIM_STATE_ELSEWHERE:
                    still.append(i)
            return still

        waiting = [i for i in missed if states[i] == pb.CLAIM_STATE_ELSEWHERE]
        end = time.monotonic() + min(request.wait_claimed_ms, MAX_CLAIM_WAIT_MS) / 1000
        remaining = context.time_remaining()
        if remaining is not None:  # answer before the caller's deadline
            end = min(end, time.monotonic() + remaining - CLAIM_WAIT_MARGIN_S)
        while waiting and time.monotonic() + POLL_S < end and not leases.done.is_set():
            await asyncio.sleep(POLL_S)
            waiting = await asyncio.to_thread(poll, waiting)
        return states

    def _hold_all(
        self, matches: list[Match], transport: int
    ) -> list[tensor_pb2.EmbeddingRef | None]:
        """Hold each hit's bytes for its reader (on a worker thread: a shared-memory copy
        of 16 MiB takes a few ms). Each held hit takes a lease of its own, ended when its
        reader releases it or the hold expires, so eviction cannot pick it meanwhile (the
        bytes would stay readable anyway: entries are immutable and the holder keeps them)."""
        assert self.holder is not None
        refs: list[tensor_pb2.EmbeddingRef | None] = []
        span = trace.get_current_span()
        held = 0
        try:
            for match in matches:
                entry = match.entry
                if entry is None:
                    refs.append(None)
                    continue
                leased = self.store.lease(entry)
                try:
                    ref = self.holder.hold(
                        entry.data,
                        entry.dtype,
                        entry.shape,
                        transport=transport,
                        on_release=functools.partial(self.store.release, entry) if leased else None,
                    )
                except BaseException:
                    if leased:
                        self.store.release(entry)
                    raise
                refs.append(ref)
                held += len(entry.data)
        except BaseException:  # HANDOFF_FULL part-way: free what this answer held
            for ref in refs:
                if ref is not None:
                    self.holder.drop(ref.ticket)
            raise
        span.set_attribute("splitvl.embedding.held_bytes", held)
        span.set_attribute(
            "splitvl.embedding.transports", [transport_name(r.transport) for r in refs if r]
        )
        return refs

    def _check_response_size(self, matches: list[Match]) -> None:
        """Refuse a response that would exceed the message limit before building it.

        Two queries answered by one 200 MiB entry used to build a 400 MiB response that
        gRPC then refused to send ("Sent message larger than max", no field named, an
        ERROR traceback in the log). The leases taken are released when the call ends.
        """
        hits = [m.entry for m in matches if m.entry is not None]
        total = sum(len(e.data) for e in hits) + RESULT_OVERHEAD_BYTES * len(matches)
        if total > self.max_response_bytes:
            raise Refusal.LOOKUP_RESPONSE_TOO_LARGE.error(
                f"the {len(hits)} hits of queries hold about {total} bytes of embeddings; "
                f"a response is limited to {self.max_response_bytes} bytes "
                "(max_message_bytes): look them up in smaller batches, or with "
                "include_embeddings false",
                field="queries",
                limit=self.max_response_bytes,
            )

    def _match_all(
        self,
        queries: list[_Query],
        policy: int,
        lease: bool,
        leases: _Leases,
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

    def _count(self, match: Match, *, counted_miss: bool = True) -> None:
        """Count one query's outcome; a miss only with ``counted_miss`` (see Lookup)."""
        if match.tier == "miss" and not counted_miss:
            return
        self.hits[match.tier] += 1
        metrics.LOOKUPS.labels(tier=match.tier).inc()
        if match.tier == "exact":
            metrics.HITS.labels(tier="exact").inc()
        else:
            metrics.MISSES.labels(tier="exact").inc()
            if match.tier == "similar":
                metrics.HITS.labels(tier="similar").inc()
            elif match.consulted_similar:
                metrics.MISSES.labels(tier="similar").inc()
        total = sum(self.hits.values())
        metrics.HIT_RATIO.set((self.hits["exact"] + self.hits["similar"]) / total)

    async def Put(
        self, request: pb.PutRequest, context: grpc.aio.ServicerContext
    ) -> pb.PutResponse:
        """Validate every entry, then store them in order (with its alias key, if any).

        Raises (as status): INVALID_ARGUMENT for a bad key or alias key, grid, descriptor or
        tensor (then nothing is stored); RESOURCE_EXHAUSTED for an entry larger than the byte budget
        (nothing stored) or one that cannot fit because leased entries hold the budget (the
        entries before it were stored; the message says how many). An entry a shared store
        could not take (down or slow) is dropped without an error: ``stored`` leaves it out.
        """
        # Entries sent by reference are read from their holder first (on this loop, the
        # reads of one request concurrently); a ref that cannot be read fails the Put.
        payloads: dict[int, bytes] = {}
        refs = [
            (i, e.embedding) for i, e in enumerate(request.entries) if e.embedding.HasField("ref")
        ]
        if refs:
            self._check_count(len(request.entries), "entries")
            for i, emb in refs:  # before any byte is read: a ref's size fits its grid
                self._check_ref_entry(request.entries[i], emb, f"entries[{i}]")
            timeout = Deadline.of(context).left()
            fetched = await asyncio.gather(
                *(
                    self.reader.fetch(emb, field=f"entries[{i}].embedding", timeout=timeout)
                    for i, emb in refs
                ),
                return_exceptions=True,
            )
            for (i, _), got in zip(refs, fetched, strict=True):
                if isinstance(got, BaseException):
                    if isinstance(got, ServiceError) and got.code == grpc.StatusCode.UNAVAILABLE:
                        raise ServiceError(
                            grpc.StatusCode.FAILED_PRECONDITION,
                            got.reason,
                            got.message,
                            got.metadata,
                        ) from got
                    raise got
                # Entries are immutable bytes; the copy runs once, off the critical path.
                payloads[i] = bytes(got.data)
            trace.get_current_span().set_attribute(
                "splitvl.embedding.fetched_bytes", sum(len(p) for p in payloads.values())
            )
        # On a worker thread: the payload's copy out of the request and the finiteness
        # check (~0.25 s together at the 256 MiB message limit) and the index add (slow at
        # a million entries) should not hold health checks and lookups. The store takes
        # its own lock.
        return await asyncio.to_thread(self._put, request, payloads)

    def _check_ref_entry(
        self, entry: pb.PutEntry, emb: tensor_pb2.ImageEmbedding, field: str
    ) -> None:
        """An entry sent by reference, checked before its bytes are read: its grid, its
        rows against the grid, and its size against the byte budget (a forged 1 GiB ref
        for a 4-token grid was allocated in full, then refused).

        Raises:
            ServiceError: INVALID_ARGUMENT naming the field; RESOURCE_EXHAUSTED
                ``ENTRY_TOO_LARGE`` over ``capacity_bytes``.
        """
        grid = _grid(emb.grid, f"{field}.embedding.grid", self.merge, video=entry.video)
        rows = grid[0] * grid[1] * grid[2] // (self.merge * self.merge)
        self._check_rows(emb.embeddings, grid, rows, f"{field}.embedding.embeddings")
        if emb.ref.nbytes > self.store.capacity_bytes:
            metrics.PUTS_REFUSED.labels(reason="too_large").inc()
            raise Refusal.ENTRY_TOO_LARGE.error(
                f"{field}.embedding.ref holds {emb.ref.nbytes} bytes; the cache's byte "
                f"budget (capacity_bytes) is {self.store.capacity_bytes}",
                field=f"{field}.embedding.ref",
                limit=self.store.capacity_bytes,
            )

    def _check_rows(
        self, emb: tensor_pb2.Tensor, grid: tuple[int, int, int], rows: int, field: str
    ) -> None:
        """Refuse embeddings whose rows are not the grid's tokens, or whose width is 0.

        Raises:
            ServiceError: INVALID_ARGUMENT ``EMBEDDING_SHAPE_MISMATCH`` naming ``field``.
        """
        shape = list(emb.shape)
        if len(shape) != 2 or shape[0] != rows:
            raise Refusal.EMBEDDING_SHAPE_MISMATCH.error(
                f"{field} has shape {shape}; grid {list(grid)} needs {rows} rows "
                f"(t*h*w/{self.merge}**2)",
                field=field,
            )
        if shape[1] <= 0:
            raise Refusal.EMBEDDING_SHAPE_MISMATCH.error(
                f"{field} has shape {shape}; its width must be > 0", field=field
            )

    def _put(
        self, request: pb.PutRequest, payloads: dict[int, bytes] | None = None
    ) -> pb.PutResponse:
        """Put's body (raises ServiceError); ``payloads``: the bytes of entries sent by
        reference, by entry index, already read from their holder."""
        payloads = payloads or {}
        self._check_count(len(request.entries), "entries")
        checked = []
        for i, entry in enumerate(request.entries):
            field = f"entries[{i}]"
            key = _key(entry.key, field)
            alias_key = _key(entry.alias_key, field, name="alias_key", optional=True)
            if entry.video:
                _check_video(entry, field)
            grid = _grid(
                entry.embedding.grid, f"{field}.embedding.grid", self.merge, video=entry.video
            )
            descriptor = _descriptor(entry.descriptor, self.store.dim, f"{field}.descriptor")
            verification = _verification(entry, field)
            emb = entry.embedding.embeddings
            data = tensors.validate(
                emb,
                field=f"{field}.embedding.embeddings",
                ndim=2,
                dtypes=(
                    tensor_pb2.DATA_TYPE_FP32,
                    tensor_pb2.DATA_TYPE_BF16,
                    tensor_pb2.DATA_TYPE_FP16,
                ),
                data=payloads.get(i),
            )
            rows = grid[0] * grid[1] * grid[2] // (self.merge * self.merge)
            self._check_rows(emb, grid, rows, f"{field}.embedding.embeddings")
            tensors.check_finite(emb, data, f"{field}.embedding.embeddings")
            size = len(data) + (0 if verification is None else verification.nbytes)
            if size > self.store.capacity_bytes:
                metrics.PUTS_REFUSED.labels(reason="too_large").inc()
                raise Refusal.ENTRY_TOO_LARGE.error(
                    f"{field}.embedding.embeddings holds {len(data)} bytes; the "
                    f"cache's byte budget (capacity_bytes) is {self.store.capacity_bytes}; "
                    f"with its verification image the entry needs {size} bytes",
                    field=f"{field}.embedding.embeddings",
                    limit=self.store.capacity_bytes,
                )
            checked.append(
                (key, descriptor, grid, emb, data, verification, entry.revision, alias_key)
            )
        stored = evicted = dropped = 0
        try:
            stored, evicted, dropped = self._store_all(checked)
        finally:
            # Stored, dropped or refused, nobody is encoding these any more: waiters on
            # their claims look again (and encode, if still missing).
            self.claims.end([c[0] for c in checked])
        if dropped:
            trace.get_current_span().set_attribute("splitvl.cache.dropped_entries", dropped)
        return pb.PutResponse(stored=stored, evicted=evicted)

    def _store_all(self, checked: list[tuple]) -> tuple[int, int, int]:  # type: ignore[type-arg]
        """Store checked entries in order; (stored, evicted, dropped)."""
        stored = evicted = dropped = 0
        for i, checked_entry in enumerate(checked):
            key, descriptor, grid, emb, data, verification, revision, alias_key = checked_entry
            try:
                evicted += self.store.put(
                    key,
                    descriptor,
                    grid,
                    emb.dtype,
                    tuple(emb.shape),
                    data if isinstance(data, bytes) else bytes(data),
                    verification=verification,
                    revision=revision,
                    alias=alias_key,
                )
            except KeyGridConflictError as err:
                raise Refusal.KEY_GRID_CONFLICT.error(
                    f"entries[{i}].embedding.grid is {list(grid)} but entries[{i}].key is "
                    f"already stored with grid {list(err.stored_grid)} (a key is a digest "
                    f"over the pixels and the resize plan); the {i} entries before it "
                    "were stored",
                    field=f"entries[{i}].embedding.grid",
                ) from err
            except StoreUnavailableError:
                dropped += 1  # a shared store down: not stored, never an error (counted)
                continue
            except CacheFullError as err:
                metrics.PUTS_REFUSED.labels(reason="leased").inc()
                raise Refusal.CACHE_FULL_LEASED.error(
                    f"entries[{i}] needs {err.needed} bytes but {err.leased_bytes} of the "
                    f"{err.capacity_bytes}-byte budget (capacity_bytes) are leased by "
                    f"lookups in flight; the {i} entries before it were stored; retry later",
                    field=f"entries[{i}]",
                    limit=err.capacity_bytes,
                    retry_after_ms=100,
                ) from err
            stored += 1
            metrics.PUTS.inc()
        return stored, evicted, dropped

    async def GetStats(
        self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatsResponse:
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
