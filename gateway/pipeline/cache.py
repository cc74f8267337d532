"""The cache stage: ``CacheService`` lookups (by file digest before any decode, by pixel
key after it) and the put of new embeddings beside the decode."""

from __future__ import annotations

import logging
import time

import grpc
from opentelemetry import trace
from qwenvl.cache.v1 import cache_service_pb2, cache_service_pb2_grpc
from qwenvl.common.v1 import generation_pb2, tensor_pb2
from qwenvl.gateway.v1 import gateway_service_pb2 as pb

from gateway import metrics
from gateway.pipeline.route import DecoderRouter, Endpoint
from gateway.pipeline.types import (
    EncodedFile,
    HeldRefs,
    PreparedImage,
    PreparedVideo,
    answer_or_release,
    descriptor_tensor,
    grid_message,
    inline_bytes,
    ref_attributes,
    release,
    thw_message,
    tier_name,
    verification_fields,
)
from vlcommon import handoff, tensors
from vlcommon.deadline import Deadline
from vlcommon.errors import ServiceError, error_info
from vlcommon.model_info import VisionSpec

log = logging.getLogger(__name__)
tracer = trace.get_tracer("splitvl.gateway")

CACHE_FAILURES = metrics.CACHE_FAILURES


class CacheStage:
    """The cache stage: lookups and puts against ``CacheService``.

    The cache is an optimisation: when it fails or answers malformed, the images are
    misses and the failure is counted (``splitvl_gateway_cache_failures_total``); no
    cache error fails a request.

    Each call goes to the cache replica its first image's key hashes to (a
    :class:`DecoderRouter` ring over the cache endpoints, bounded loads; :func:`route_key`),
    the one most likely to hold the entry as a local copy; a replica that failed is passed
    over for a while.

    Args:
        cache: The caches' router (one endpoint per replica), or one stub; None for a
            gateway without a cache (every method then does nothing).
        spec: Vision geometry of the served checkpoint (the shapes a hit must have).
        revision: Model revision sent with every query and entry.
        transport: ``tensor_pb2.Transport`` asked for hits (refs) and put entries.
        timeout_s: Cap on a Lookup's deadline (within the request's), seconds.
        put_timeout_s: Cap on a Put's deadline, seconds (it runs beside the decode).
        releaser: Releases the refs of hits the gateway does not use (unusable ones, or a
            malformed answer), and the cache's share of a Put that never reached it.
    """

    def __init__(
        self,
        cache: cache_service_pb2_grpc.CacheServiceStub | DecoderRouter | None,
        *,
        spec: VisionSpec,
        revision: str,
        transport: int,
        timeout_s: float,
        put_timeout_s: float,
        releaser: handoff.Reader | None = None,
    ) -> None:
        self.cache = cache
        self.router = (
            cache
            if isinstance(cache, DecoderRouter) or cache is None
            else DecoderRouter.single(cache, "cache")
        )
        self.releaser = releaser
        self.spec = spec
        self.revision = revision
        self.transport = transport
        self.timeout_s = timeout_s
        self.put_timeout_s = put_timeout_s

    def usable_hit(
        self, emb: tensor_pb2.ImageEmbedding, im: PreparedImage, *, similar: bool = False
    ) -> bool:
        """Trust a cache hit only if its tensor fits this image and this model.

        Its grid must be the plan's, or (``similar``: a similarity hit) one of the plan's
        aspect class (``im.reusable``); its rows must be that grid's token count. A bad
        entry (wrong rows for the grid, wrong width, bad byte count, NaN) would make the
        decoder refuse the request; treated as a miss, the image is encoded instead.
        """
        grid = (emb.grid.t, emb.grid.h, emb.grid.w)
        if grid != im.plan.grid and not (similar and grid in im.reusable):
            return False
        shape = list(emb.embeddings.shape)
        if shape != [self.spec.tokens(*grid), self.spec.embedding_width]:
            return False
        if emb.HasField("ref"):
            # By reference: the bytes are the decoder's to check (once, finiteness
            # included); the cache checked them when they were put.
            return emb.ref.nbytes == tensors.payload_nbytes(emb.embeddings) and bool(emb.ref.ticket)
        try:
            data = tensors.validate(emb.embeddings, field="cache", dtypes=tensors.EMBEDDING_DTYPES)
        except ServiceError:
            return False
        return tensors.all_finite(emb.embeddings, data)

    async def lookup_files(
        self,
        files: list[EncodedFile | None],
        deadline: Deadline,
        held: HeldRefs | None = None,
    ) -> dict[int, PreparedImage] | None:
        """``CacheService/Lookup`` by bytes key, exact tier only, before any decode.

        Returns:
            The images the cache answered, by request index (exact hits, never decoded);
            None when the cache failed or answered malformed (counted in
            ``splitvl_gateway_cache_failures_total{op="lookup"}``; the request then asks
            the cache no more and encodes).
        """
        asked = [(i, f) for i, f in enumerate(files) if f is not None and f.bytes_key]
        if self.router is None or not asked:
            return {}
        request = cache_service_pb2.LookupRequest(
            policy=generation_pb2.CACHE_POLICY_EXACT_ONLY,
            include_embeddings=True,
            bytes_keys=True,
            transport=self.transport,
        )
        for _, f in asked:
            request.queries.add(key=f.bytes_key, grid=grid_message(f.plan), revision=self.revision)
        hits: dict[int, PreparedImage] = {}
        with tracer.start_as_current_span("cache.lookup_bytes") as span:
            response = await self._ask(request, asked[0][1].bytes_key, deadline, span)
            if response is None:
                return None
            received = 0
            for (index, f), result in zip(asked, response.results, strict=True):
                if result.tier != generation_pb2.CACHE_TIER_EXACT:
                    continue
                im = PreparedImage(
                    index=index,
                    plan=f.plan,
                    key=result.matched_key or result.embedding.key,
                    decoded=False,
                    bytes_key=f.bytes_key,
                    tier=result.tier,
                    similarity=result.similarity,
                    embedding=result.embedding,
                )
                if not self._trust(result.embedding, im, f.bytes_key):
                    continue  # decoded and looked up by pixel key instead
                hits[index] = im
                if held is not None:
                    held.add(result.embedding)
                metrics.CACHE_LOOKUPS.labels(tier="exact").inc()
                received += inline_bytes(result.embedding)
                span.add_event("image", {"splitvl.image.index": index})
            metrics.EMBEDDING_RECEIVED_BYTES.labels(source="cache").inc(received)
            span.set_attribute(
                "splitvl.cache.tiers", ["exact" if i in hits else "miss" for i, _ in asked]
            )
            span.set_attribute("splitvl.embedding.bytes", received)
        return hits

    async def lookup(
        self,
        images: list[PreparedImage],
        policy: int,
        deadline: Deadline,
        held: HeldRefs | None = None,
        *,
        claim: bool = False,
        wait_s: float = 0.0,
    ) -> None:
        """``CacheService/Lookup`` by pixel key (exact, then similarity) for decoded images.

        An image whose file digest was computed sends it as the query's ``alias_key``: on
        an exact hit the cache makes it an alias of the entry, so that file is found again
        without decoding (the same pixels sent as another file, say a PNG copy of a JPEG).

        With ``claim`` each missed image's key is claimed fleet-wide
        (cache_service/claims.py) and ``im.claim`` says who encodes it; ``wait_s`` > 0
        waits that long for the Puts of images another gateway claimed.
        """
        if self.router is None or policy == generation_pb2.CACHE_POLICY_OFF or not images:
            return
        request = cache_service_pb2.LookupRequest(
            policy=policy,
            include_embeddings=True,
            transport=self.transport,
            claim=claim,
            wait_claimed_ms=round(wait_s * 1000),
        )
        for im in images:
            request.queries.add(
                key=im.key,
                descriptor=descriptor_tensor(im),
                grid=grid_message(im.plan),
                revision=self.revision,
                alias_key=im.bytes_key,
                reusable_grids=[thw_message(g) for g in im.reusable],
                video=isinstance(im, PreparedVideo),
                **verification_fields(im.verification),
            )
        with tracer.start_as_current_span("cache.lookup") as span:
            span.set_attribute("splitvl.cache.wait_claimed_ms", request.wait_claimed_ms)
            response = await self._ask(request, route_key(images[0]), deadline, span, wait_s)
            if response is None:
                return
            for im, result in zip(images, response.results, strict=True):
                im.similarity = result.similarity
                im.claim = result.claim
                if result.tier not in (
                    generation_pb2.CACHE_TIER_EXACT,
                    generation_pb2.CACHE_TIER_SIMILAR,
                ):
                    continue
                similar = result.tier == generation_pb2.CACHE_TIER_SIMILAR
                if not self._trust(result.embedding, im, im.key, similar=similar):
                    continue  # never bind embeddings that do not fit
                im.tier = result.tier
                im.embedding = result.embedding
                if held is not None:
                    held.add(result.embedding)
            _record_lookup(span, images)

    def _endpoint(self, key: str) -> Endpoint | None:
        """The cache replica for a call whose first image has ``key`` (None: no replica
        known yet, a ``dns:`` target that has not resolved)."""
        assert self.router is not None
        order, _ = self.router.candidates(key)
        return order[0] if order else None

    async def _ask(
        self,
        request: cache_service_pb2.LookupRequest,
        key: str,
        deadline: Deadline,
        span: trace.Span,
        wait_s: float = 0.0,
    ) -> cache_service_pb2.LookupResponse | None:
        """One ``Lookup`` on ``key``'s replica; None (the failure counted and logged, any
        refs released) when the call failed or answered other than one result a query."""
        expected = len(request.queries)
        endpoint = self._endpoint(key)
        if endpoint is None:
            CACHE_FAILURES.labels(op="lookup").inc()
            return None
        span.set_attribute("splitvl.cache.replica", endpoint.address)
        try:
            with self.router.track(endpoint):  # type: ignore[union-attr]
                response: cache_service_pb2.LookupResponse = await answer_or_release(
                    self.releaser,
                    endpoint.stub.Lookup(
                        request, timeout=deadline.remaining(self.timeout_s + wait_s)
                    ),
                    lambda r: [x.embedding for x in r.results],
                )
        except grpc.aio.AioRpcError as err:
            # The cache is an optimisation: serve by encoding, count the failure.
            CACHE_FAILURES.labels(op="lookup").inc()
            span.set_attribute("splitvl.cache.error", err.code().name)
            log.warning("cache lookup failed (%s); encoding instead", err.code().name)
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                DecoderRouter.mark_down(endpoint)  # the next calls try the next replica
            return None
        if len(response.results) != expected:
            CACHE_FAILURES.labels(op="lookup").inc()
            log.warning(
                "cache answered %d results for %d queries; encoding instead",
                len(response.results),
                expected,
            )
            release(self.releaser, [r.embedding for r in response.results])
            return None
        return response

    def _trust(
        self, emb: tensor_pb2.ImageEmbedding, im: PreparedImage, key: str, *, similar: bool = False
    ) -> bool:
        """:meth:`usable_hit`, counting, logging and releasing an unusable entry."""
        if self.usable_hit(emb, im, similar=similar):
            return True
        CACHE_FAILURES.labels(op="bad_entry").inc()
        log.warning("cache returned an unusable entry for %s", key[:16])
        release(self.releaser, [emb])
        return False

    async def put(
        self,
        fresh: list[PreparedImage],
        policy: int,
        deadline: Deadline,
        timings: pb.StageTimings | None = None,
    ) -> None:
        """``CacheService/Put`` of newly encoded images (their refs: the cache reads the
        bytes from the encoder), under the pixel key with the file digest as its alias.

        Runs beside the decode; observes the put stage's duration when it ends (and sets
        ``timings.put_ms``). A failed put is counted, never raised.
        """
        if self.router is None or policy == generation_pb2.CACHE_POLICY_OFF or not fresh:
            return
        request = cache_service_pb2.PutRequest()
        for im in fresh:
            request.entries.add(
                key=im.key,
                descriptor=descriptor_tensor(im),
                embedding=im.embedding,
                revision=self.revision,
                alias_key=im.bytes_key,
                video=isinstance(im, PreparedVideo),
                **verification_fields(im.verification),
            )
        t0 = time.perf_counter()
        with tracer.start_as_current_span("gateway.cache_put") as span:
            span.set_attribute("splitvl.transfer_bytes", request.ByteSize())
            sent = sum(inline_bytes(im.embedding) for im in fresh if im.embedding)
            span.set_attribute("splitvl.embedding.bytes", sent)
            ref_attributes(span, [im.embedding for im in fresh if im.embedding])
            metrics.EMBEDDING_SENT_BYTES.labels(destination="cache").inc(sent)
            endpoint = self._endpoint(route_key(fresh[0]))  # where its lookups go
            failed = "UNAVAILABLE (no cache replica resolved yet)" if endpoint is None else ""
            unanswered = True
            if endpoint is not None:
                span.set_attribute("splitvl.cache.replica", endpoint.address)
                try:
                    with self.router.track(endpoint):  # type: ignore[union-attr]
                        await endpoint.stub.Put(
                            request, timeout=deadline.remaining(self.put_timeout_s)
                        )
                except grpc.aio.AioRpcError as err:
                    failed = err.code().name
                    unanswered = error_info(err) is None
            if failed:
                CACHE_FAILURES.labels(op="put").inc()
                log.warning("cache put failed (%s)", failed)
                if unanswered:  # the cache never answered: its share is ours
                    release(self.releaser, [im.embedding for im in fresh if im.embedding])
        seconds = time.perf_counter() - t0
        # Observed here, once the put has run: it ends after the stream, which used to
        # record the put stage as 0 whenever the decode finished first.
        metrics.STAGE_SECONDS.labels(stage="put").observe(seconds)
        if timings is not None:
            timings.put_ms = seconds * 1000


def route_key(im: PreparedImage) -> str:
    """The key a call about ``im`` is routed by: its file digest when it has one (the
    lookup by file bytes, the one by pixels after it, and the put all reach one replica,
    which then holds the entry for the file's repeats), else its pixel key."""
    return im.bytes_key or im.key


def _record_lookup(span: trace.Span, images: list[PreparedImage]) -> None:
    """A pixel-key lookup's metrics and span: each image's tier, similarity and grids."""
    received = 0
    for im in images:
        metrics.CACHE_LOOKUPS.labels(tier=tier_name(im.tier)).inc()
        if im.embedding is not None:
            received += inline_bytes(im.embedding)
        span.add_event(
            "image",
            {
                "splitvl.image.index": im.index,
                "splitvl.cache.tier": tier_name(im.tier),
                "splitvl.cache.similarity": im.similarity,
                # A similarity hit may serve the stored entry's grid (docs/cache.md).
                "splitvl.cache.requested_grid": list(im.plan.grid),
                "splitvl.cache.served_grid": list(im.served_grid),
                "splitvl.cache.grid_changed": im.served_grid != im.plan.grid,
            },
        )
    metrics.EMBEDDING_RECEIVED_BYTES.labels(source="cache").inc(received)
    span.set_attribute("splitvl.cache.tiers", [tier_name(im.tier) for im in images])
    span.set_attribute("splitvl.cache.similarities", [im.similarity for im in images])
    span.set_attribute(
        "splitvl.cache.grid_changed", [im.served_grid != im.plan.grid for im in images]
    )
    span.set_attribute("splitvl.embedding.bytes", received)
