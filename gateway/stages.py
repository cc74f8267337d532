"""The gateway's cache, encode and decode stages, each a unit over one downstream service.

:class:`CacheStage` asks ``CacheService`` (``Lookup`` by file digest before any decode,
``Lookup`` by pixel key after it, ``Put`` of new embeddings beside the decode) and trusts
only hits that fit the image and the model; :class:`EncodeStage` asks ``EncoderService``
to encode the misses and hold their embeddings for their readers; :class:`DecodeStage`
streams the decoder's tokens. The cache and encode stages fill in the
:class:`PreparedImage` they are given (``tier``, ``similarity``, ``embedding``), record
their spans and metrics, and never move an embedding's bytes (refs, ``vlcommon.handoff``).
The intake (parsing, headers, decoding, plans) stays in ``gateway.servicer``, which
runs the stages in order for each request and builds its responses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np
from opentelemetry import trace
from qwenvl.cache.v1 import cache_service_pb2, cache_service_pb2_grpc
from qwenvl.common.v1 import generation_pb2, tensor_pb2
from qwenvl.decoder.v1 import decoder_service_pb2, decoder_service_pb2_grpc
from qwenvl.encoder.v1 import encoder_service_pb2, encoder_service_pb2_grpc
from qwenvl.gateway.v1 import gateway_service_pb2 as pb

from gateway import metrics
from gateway.video import DecodedVideo
from vlcommon import handoff, tensors
from vlcommon.errors import ServiceError, error_info, from_rpc_error
from vlcommon.imaging import ImageHeader, ResizePlan
from vlcommon.model_info import VisionSpec
from vlcommon.verification import VerificationImage

log = logging.getLogger(__name__)
tracer = trace.get_tracer("splitvl.gateway")

CACHE_FAILURES = metrics.CACHE_FAILURES


@dataclass(frozen=True)
class EncodedFile:
    """One encoded image as its header describes it, before any pixel is decoded.

    Attributes:
        header: Size, mode and EXIF orientation (:func:`vlcommon.imaging.read_header`).
        plan: The resize plan of the header's upright size.
        bytes_key: The file's digest with the plan (:func:`vlcommon.imaging.bytes_key`);
            empty when no cache lookup will use it (then it is not computed).
    """

    header: ImageHeader
    plan: ResizePlan
    bytes_key: str


@dataclass
class PreparedImage:
    """One image with everything computed before any ViT work.

    A decoded image has ``pixels``, ``descriptor`` and (with a cache) ``verification``;
    one whose file digest answered from the exact tier has none of them (``decoded`` is
    False) and already has its ``embedding``.
    """

    index: int  # position among the request's images
    plan: ResizePlan
    key: str  # the pixel key (exact_key); after a file-digest hit, the entry's pixel key
    decoded: bool
    pixels: np.ndarray | None = None  # uint8 [resized_height, resized_width, 3], upright RGB
    descriptor: np.ndarray | None = None  # float32 [DESCRIPTOR_DIM]
    # The decoded image's luma (at most VERIFY_MAX_PIXELS) and chroma: the cache verifies
    # similarity candidates on it (vlcommon.verification); built when there is a cache
    # and the image is verifiable (else it only ever hits exactly).
    verification: VerificationImage | None = None
    # The encoded file's digest when its header's plan is the decoded image's plan: stored
    # as an alias of ``key`` so that the same file is found again without decoding.
    bytes_key: str = ""
    tier: int = generation_pb2.CACHE_TIER_MISS
    similarity: float = 0.0
    embedding: tensor_pb2.ImageEmbedding | None = None
    # Other grids a similarity hit may serve (the plan's aspect class, vlcommon.grid_reuse).
    reusable: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)

    @property
    def served_grid(self) -> tuple[int, int, int]:
        """The grid of the embeddings the decoder gets: the plan's, unless a similarity hit
        answered with an entry of another grid of the aspect class."""
        if self.embedding is None or not self.embedding.HasField("grid"):
            return self.plan.grid
        g = self.embedding.grid
        return (g.t, g.h, g.w)


@dataclass
class PreparedVideo(PreparedImage):
    """One video, sampled and resized (gateway.video), on the image path's stages.

    ``pixels`` holds every kept frame, uint8 ``[frames, resized_height, resized_width, 3]``;
    ``plan.grid_t`` is frames / temporal_patch_size. It has no descriptor and no
    verification image: a video is only ever an exact hit.
    """

    video: DecodedVideo | None = None


def descriptor_tensor(im: PreparedImage) -> tensor_pb2.Tensor:
    """The image's similarity descriptor as an FP32 tensor; empty for an image never
    decoded (only decoded images are looked up by pixel key or stored)."""
    if im.descriptor is None:
        return tensor_pb2.Tensor()
    return tensors.from_numpy(im.descriptor)


def verification_fields(v: VerificationImage | None) -> dict[str, Any]:
    """A verification image as a Lookup query's or Put entry's fields:
    ``verification`` and ``verification_chroma`` (UINT8 tensors) and, for an image decoded
    from a JPEG of its own size, ``verification_jpeg_quantization`` (64 values) and the
    pixels where the JPEG's Y channel differs from the luma (where the conversion to RGB
    clipped): ``verification_jpeg_clipped_index`` and ``verification_jpeg_clipped_luma``.

    ``GatewayServicer._prepare_images`` builds an image's whenever the gateway has a cache
    and the image is verifiable, and only then are there lookups and puts; no fields
    (never a similarity hit) when it is missing.
    """
    if v is None:
        return {}
    fields: dict[str, Any] = {
        "verification": tensors.from_numpy(v.luma),
        "verification_chroma": tensors.from_numpy(v.chroma),
    }
    if v.jpeg is not None:
        fields["verification_jpeg_quantization"] = v.jpeg.quantization.tolist()
        if v.jpeg.clipped_index.size:
            fields["verification_jpeg_clipped_index"] = v.jpeg.clipped_index.tolist()
            fields["verification_jpeg_clipped_luma"] = v.jpeg.clipped_luma.tobytes()
    return fields


def tier_name(tier: int) -> str:
    """``exact`` / ``similar`` / ``miss``: the metric label and span attribute value."""
    return generation_pb2.CacheTier.Name(tier).removeprefix("CACHE_TIER_").lower()


def inline_bytes(emb: tensor_pb2.ImageEmbedding) -> int:
    """Embedding bytes that travel inside ``emb`` (0 for one sent by reference)."""
    return 0 if emb.HasField("ref") else tensors.payload_nbytes(emb.embeddings)


def ref_attributes(span: trace.Span, embeddings: Sequence[tensor_pb2.ImageEmbedding]) -> None:
    """Which transport carries each image's embeddings, from which holder, how many bytes
    (the bytes themselves never pass through the gateway)."""
    refs = [e.ref for e in embeddings if e.HasField("ref")]
    span.set_attribute(
        "splitvl.embedding.transports", [handoff.transport_name(r.transport) for r in refs]
    )
    span.set_attribute("splitvl.embedding.holders", [r.service for r in refs])
    span.set_attribute("splitvl.embedding.ref_bytes", [r.nbytes for r in refs])


def grid_message(plan: ResizePlan) -> tensor_pb2.GridTHW:
    return tensor_pb2.GridTHW(t=plan.grid_t, h=plan.grid_h, w=plan.grid_w)


def thw_message(grid: tuple[int, int, int]) -> tensor_pb2.GridTHW:
    return tensor_pb2.GridTHW(t=grid[0], h=grid[1], w=grid[2])


def remaining(context: grpc.aio.ServicerContext | None, cap: float | None = None) -> float | None:
    """Seconds left of the request's deadline (capped); None when neither bounds it.

    Raises:
        ServiceError: DEADLINE_EXCEEDED when no time is left.
    """
    left = context.time_remaining() if context is not None else None
    if left is not None and left <= 0:
        raise ServiceError(
            grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED", "the request's deadline expired"
        )
    if cap is None:
        return left
    return cap if left is None else min(left, cap)


class SameFileFlights:
    """The files (by bytes key) that a request of this gateway is encoding now.

    Without it, requests that send the same bytes while the first of them is still in the
    encoder each decode, preprocess, look up and put the image again (they share only its
    ViT call, in the encoder): at repeat50 with 32 requests in flight, 19 of a run's 84
    misses were such repeats, ~15 ms each of the gateway's core (docs/benchmarks.md). With
    it, such a request waits for the first one's put and is then answered by the file's
    digest, an exact hit, never decoded.

    A request claims every key no other request holds and follows the others; it waits
    only when it claimed none, so no two requests ever wait on each other. (The servicer
    lets only requests of one image and no video take part, and caps a wait at half the
    time left to the deadline: docs/cache.md.) A claimant
    lands its keys when its put has ended, or when it ends without one (failed,
    cancelled, or its images were hits after all); a follower then looks its files up
    again, and decodes as before if they are still missing (the put failed, or stored the
    entry under its pixel key only).
    """

    def __init__(self) -> None:
        self._flights: dict[str, asyncio.Future[None]] = {}

    def claim_or_follow(
        self, keys: Sequence[str], owned: list[str]
    ) -> dict[int, asyncio.Future[None]]:
        """Claims each of ``keys`` that no request holds (appending it to ``owned``, the
        caller's claims); returns the positions of the others, with the flight each
        follows. A key the caller already holds is neither claimed again nor followed."""
        loop = asyncio.get_running_loop()
        follow: dict[int, asyncio.Future[None]] = {}
        for pos, key in enumerate(keys):
            flight = self._flights.get(key)
            if flight is None:
                self._flights[key] = loop.create_future()
                owned.append(key)
            elif key not in owned:
                follow[pos] = flight
        return follow

    def land(self, keys: Sequence[str]) -> None:
        """Ends the caller's claims on ``keys``: their followers look up again."""
        for key in keys:
            flight = self._flights.pop(key, None)
            if flight is not None and not flight.done():
                flight.set_result(None)

    def __len__(self) -> int:
        return len(self._flights)


@dataclass
class HeldRefs:
    """The refs one request's stages received and no reader has taken over yet.

    A holder keeps an entry until its readers have read or released it (or its TTL,
    120 s, ends). The gateway reads none, so every ref it receives is owed to a reader:
    the decoder takes them over with its request (and then reads or releases each one);
    until then, a request that fails must release them, or a cache hit stays leased and a
    segment stays in ``/dev/shm`` for two minutes.
    """

    refs: list[tensor_pb2.EmbeddingRef] = dataclasses.field(default_factory=list)

    def add(self, emb: tensor_pb2.ImageEmbedding) -> None:
        if emb.HasField("ref"):
            self.refs.append(emb.ref)

    def hand_over(self) -> None:
        """The decoder took every ref over (it reads or releases each)."""
        self.refs.clear()


def release(
    releaser: handoff.Reader | None, embeddings: Sequence[tensor_pb2.ImageEmbedding]
) -> None:
    """Release, in the background, the refs among ``embeddings`` that no reader will read."""
    refs = [e.ref for e in embeddings if e.HasField("ref")]
    if releaser is not None and refs:
        releaser.release_unread(refs)


R = TypeVar("R")


async def answer_or_release(
    releaser: handoff.Reader | None,
    call: Awaitable[R],
    embeddings: Callable[[R], Sequence[tensor_pb2.ImageEmbedding]],
    readers: int = 1,
) -> R:
    """The answer of a unary call that holds embeddings for this request (Encode, a
    Lookup by reference).

    If the request is cancelled meanwhile (its client went away), the call is not
    cancelled: an answer already on its way would be lost with the holds it names, which
    no reader would then release before their TTL. It finishes within its own deadline,
    and the refs in its answer are released once for each of their ``readers``.

    Raises:
        grpc.aio.AioRpcError: the call failed.
        asyncio.CancelledError: the request was cancelled.
    """
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:

        def late(done: asyncio.Future[R]) -> None:
            if not done.cancelled() and done.exception() is None:
                release(releaser, list(embeddings(done.result())) * readers)

        task.add_done_callback(late)
        _LATE.add(task)  # asyncio keeps only weak references to tasks
        task.add_done_callback(_LATE.discard)
        raise


_LATE: set[asyncio.Future[Any]] = set()


class CacheStage:
    """The cache stage: lookups and puts against ``CacheService``.

    The cache is an optimisation: when it fails or answers malformed, the images are
    misses and the failure is counted (``splitvl_gateway_cache_failures_total``); no
    cache error fails a request.

    Args:
        cache: The cache's stub; None for a gateway without a cache (every method then
            does nothing).
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
        cache: cache_service_pb2_grpc.CacheServiceStub | None,
        *,
        spec: VisionSpec,
        revision: str,
        transport: int,
        timeout_s: float,
        put_timeout_s: float,
        releaser: handoff.Reader | None = None,
    ) -> None:
        self.cache = cache
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
        context: grpc.aio.ServicerContext,
        held: HeldRefs | None = None,
    ) -> dict[int, PreparedImage] | None:
        """``CacheService/Lookup`` by bytes key, exact tier only, before any decode.

        Returns:
            The images the cache answered, by request index (exact hits, never decoded);
            None when the cache failed or answered malformed (counted in
            ``splitvl_gateway_cache_failures_total{op="lookup"}``; the request then asks
            the cache no more and encodes).
        """
        cache = self.cache
        asked = [(i, f) for i, f in enumerate(files) if f is not None and f.bytes_key]
        if cache is None or not asked:
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
            try:
                response = await answer_or_release(
                    self.releaser,
                    cache.Lookup(request, timeout=remaining(context, self.timeout_s)),
                    lambda r: [x.embedding for x in r.results],
                )
            except grpc.aio.AioRpcError as err:
                CACHE_FAILURES.labels(op="lookup").inc()
                span.set_attribute("splitvl.cache.error", err.code().name)
                log.warning("cache lookup failed (%s); encoding instead", err.code().name)
                return None
            if len(response.results) != len(asked):
                CACHE_FAILURES.labels(op="lookup").inc()
                log.warning(
                    "cache answered %d results for %d queries; encoding instead",
                    len(response.results),
                    len(asked),
                )
                release(self.releaser, [r.embedding for r in response.results])
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
                if not self.usable_hit(result.embedding, im):
                    CACHE_FAILURES.labels(op="bad_entry").inc()
                    log.warning("cache returned an unusable entry for %s", f.bytes_key[:16])
                    release(self.releaser, [result.embedding])
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
        context: grpc.aio.ServicerContext,
        held: HeldRefs | None = None,
    ) -> None:
        """``CacheService/Lookup`` by pixel key (exact, then similarity) for decoded images.

        An image whose file digest was computed sends it as the query's ``alias_key``: on
        an exact hit the cache makes it an alias of the entry, so that file is found again
        without decoding (the same pixels sent as another file, say a PNG copy of a JPEG).
        """
        if self.cache is None or policy == generation_pb2.CACHE_POLICY_OFF or not images:
            return
        request = cache_service_pb2.LookupRequest(
            policy=policy, include_embeddings=True, transport=self.transport
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
            try:
                response = await answer_or_release(
                    self.releaser,
                    self.cache.Lookup(request, timeout=remaining(context, self.timeout_s)),
                    lambda r: [x.embedding for x in r.results],
                )
            except grpc.aio.AioRpcError as err:
                # The cache is an optimisation: serve by encoding, count the failure.
                CACHE_FAILURES.labels(op="lookup").inc()
                span.set_attribute("splitvl.cache.error", err.code().name)
                log.warning("cache lookup failed (%s); encoding instead", err.code().name)
                return
            if len(response.results) != len(images):
                CACHE_FAILURES.labels(op="lookup").inc()
                log.warning(
                    "cache answered %d results for %d queries; encoding instead",
                    len(response.results),
                    len(images),
                )
                release(self.releaser, [r.embedding for r in response.results])
                return
            for im, result in zip(images, response.results, strict=True):
                im.similarity = result.similarity
                if result.tier in (
                    generation_pb2.CACHE_TIER_EXACT,
                    generation_pb2.CACHE_TIER_SIMILAR,
                ):
                    similar = result.tier == generation_pb2.CACHE_TIER_SIMILAR
                    if not self.usable_hit(result.embedding, im, similar=similar):
                        CACHE_FAILURES.labels(op="bad_entry").inc()
                        log.warning("cache returned an unusable entry for %s", im.key[:16])
                        release(self.releaser, [result.embedding])
                        continue  # never bind embeddings that do not fit
                    im.tier = result.tier
                    im.embedding = result.embedding
                    if held is not None:
                        held.add(result.embedding)
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

    async def put(
        self,
        fresh: list[PreparedImage],
        policy: int,
        context: grpc.aio.ServicerContext | None,
        timings: pb.StageTimings | None = None,
    ) -> None:
        """``CacheService/Put`` of newly encoded images (their refs: the cache reads the
        bytes from the encoder), under the pixel key with the file digest as its alias.

        Runs beside the decode; observes the put stage's duration when it ends (and sets
        ``timings.put_ms``). A failed put is counted, never raised.
        """
        if self.cache is None or policy == generation_pb2.CACHE_POLICY_OFF or not fresh:
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
            try:
                await self.cache.Put(request, timeout=remaining(context, self.put_timeout_s))
            except grpc.aio.AioRpcError as err:
                CACHE_FAILURES.labels(op="put").inc()
                log.warning("cache put failed (%s)", err.code().name)
                if error_info(err) is None:  # the cache never answered: its share is ours
                    release(self.releaser, [im.embedding for im in fresh if im.embedding])
        seconds = time.perf_counter() - t0
        # Observed here, once the put has run: it ends after the stream, which used to
        # record the put stage as 0 whenever the decode finished first.
        metrics.STAGE_SECONDS.labels(stage="put").observe(seconds)
        if timings is not None:
            timings.put_ms = seconds * 1000


class EncodeStage:
    """The encode stage: ``EncoderService/Encode`` for the misses.

    Args:
        encoder: The encoder's stub (grpc's retry policy retries Encode on UNAVAILABLE).
        transport: ``tensor_pb2.Transport`` the encoder holds the embeddings for.
        timeout_s: Cap on an Encode's deadline (within the request's), seconds.
        releaser: Releases the refs of an answer the gateway cannot use.
    """

    def __init__(
        self,
        encoder: encoder_service_pb2_grpc.EncoderServiceStub,
        *,
        transport: int,
        timeout_s: float,
        releaser: handoff.Reader | None = None,
    ) -> None:
        self.encoder = encoder
        self.releaser = releaser
        self.transport = transport
        self.timeout_s = timeout_s

    async def encode(
        self,
        misses: list[PreparedImage],
        context: grpc.aio.ServicerContext,
        *,
        readers: int = 1,
        held: HeldRefs | None = None,
    ) -> None:
        """``EncoderService/Encode`` for the misses: the encoder holds their embeddings for
        ``readers`` readers (the decoder, and the cache when it stores them) and answers
        refs (an encoder that answers the bytes inline is relayed as it is)."""
        request = encoder_service_pb2.EncodeRequest(transport=self.transport, readers=readers)
        for im in misses:
            if im.pixels is None:  # a file-digest hit has its embedding: never a miss
                raise ServiceError(
                    grpc.StatusCode.INTERNAL, "INTERNAL", f"images[{im.index}] has no pixels"
                )
            request.images.add(
                key=im.key,
                pixels=tensors.from_numpy(im.pixels),
                plan=tensor_pb2.ResizePlan(
                    resized_height=im.plan.resized_height,
                    resized_width=im.plan.resized_width,
                    grid=grid_message(im.plan),
                ),
            )
        with tracer.start_as_current_span("gateway.encode") as span:
            span.set_attribute("splitvl.images", len(misses))
            span.set_attribute("splitvl.transfer_bytes", request.ByteSize())
            try:
                response = await answer_or_release(
                    self.releaser,
                    self.encoder.Encode(request, timeout=remaining(context, self.timeout_s)),
                    lambda r: r.embeddings,
                    readers,
                )
            except grpc.aio.AioRpcError as err:
                raise from_rpc_error(err, dependency="encoder") from err
            if len(response.embeddings) != len(misses):
                release(self.releaser, response.embeddings)
                raise ServiceError(
                    grpc.StatusCode.UNAVAILABLE,
                    "ENCODER_BAD_RESPONSE",
                    f"encoder answered {len(response.embeddings)} embeddings for "
                    f"{len(misses)} images",
                    {"dependency": "encoder"},
                )
            received = sum(inline_bytes(e) for e in response.embeddings)
            metrics.EMBEDDING_RECEIVED_BYTES.labels(source="encoder").inc(received)
            span.set_attribute("splitvl.embedding.bytes", received)
            ref_attributes(span, response.embeddings)
        for im, emb in zip(misses, response.embeddings, strict=True):
            im.embedding = emb
            if held is not None:
                held.add(emb)


# The decoder could not read an image's held embeddings: their holder lost them (restart,
# expiry) or could not be reached. Encoding again (a new holder) can still answer.
REF_LOST_REASONS = frozenset({"EMBEDDING_REF_GONE", "EMBEDDING_HOLDER_UNAVAILABLE"})


class RefsLost(Exception):
    """The decoder could not read a held ref before its first token (``REF_LOST_REASONS``).

    Attributes:
        error: The decoder's status as the gateway would answer it (UNAVAILABLE naming
            the image and its holder), for when encoding again is not tried.
    """

    def __init__(self, error: ServiceError) -> None:
        super().__init__(error.message)
        self.error = error


class DecodeStage:
    """The decode stage: ``DecoderService/Generate``, its chunks streamed as they come.

    The decoder takes over the refs of its request: it reads each or releases those it
    will not read, and answers with a status of its own. A call that fails without one (the
    decoder was never reached) leaves them to this stage, which releases them.

    Args:
        decoder: The decoder's stub (Generate streams tokens: never retried).
        releaser: Releases the refs of a request the decoder never received.
    """

    def __init__(
        self,
        decoder: decoder_service_pb2_grpc.DecoderServiceStub,
        releaser: handoff.Reader | None = None,
    ) -> None:
        self.decoder = decoder
        self.releaser = releaser

    async def stream(
        self,
        request: decoder_service_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext | None,
    ) -> AsyncGenerator[decoder_service_pb2.GenerateResponse, None]:
        """The decoder's chunks for ``request``, within the request's deadline; observes
        the inter-token latency (``splitvl_gateway_inter_token_latency_seconds``).

        Closing the iterator (the client went away) cancels the decoder call, which
        aborts the vLLM request.

        Raises:
            RefsLost: the decoder could not read a held ref, before any chunk.
            ServiceError: the decoder's status otherwise, naming it as the dependency.
        """
        call = self.decoder.Generate(request, timeout=remaining(context))
        first = True
        t_last = time.perf_counter()
        try:
            async for chunk in call:
                now = time.perf_counter()
                if chunk.token_ids and not first:
                    metrics.ITL.observe((now - t_last) / len(chunk.token_ids))
                t_last, first = now, False
                yield chunk
        except grpc.aio.AioRpcError as err:
            error = from_rpc_error(err, dependency="decoder")
            info = error_info(err)
            if info is None and first:  # never reached the decoder's servicer
                embeddings = [*request.images, *(v.embedding for v in request.videos)]
                release(self.releaser, embeddings)
            if first and info is not None and info.reason in REF_LOST_REASONS:
                raise RefsLost(error) from err
            raise error from err
        finally:
            if not call.done():
                call.cancel()
