"""The :class:`Pipeline`: the stages in order for one request (see ``gateway.pipeline``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from opentelemetry import trace
from qwenvl.cache.v1 import cache_service_pb2, cache_service_pb2_grpc
from qwenvl.common.v1 import generation_pb2
from qwenvl.decoder.v1 import decoder_service_pb2, decoder_service_pb2_grpc
from qwenvl.encoder.v1 import encoder_service_pb2_grpc
from qwenvl.gateway.v1 import gateway_service_pb2 as pb

from gateway import metrics
from gateway.fetch import UrlFetcher
from gateway.pipeline.cache import CacheStage
from gateway.pipeline.decode import DecodeStage, RefsLost
from gateway.pipeline.encode import EncodeStage
from gateway.pipeline.events import GenerateEvent
from gateway.pipeline.images import ImageFiles, ImageIntake, fetch_urls
from gateway.pipeline.preprocess import Preprocessor
from gateway.pipeline.route import DecoderRouter
from gateway.pipeline.same_file import Claims
from gateway.pipeline.types import (
    HeldRefs,
    PreparedImage,
    PreparedVideo,
    grid_message,
    inline_bytes,
    ref_attributes,
    thw_message,
)
from gateway.pipeline.videos import VideoIntake
from gateway.request import GenerateInput, RequestParser
from gateway.settings import GatewaySettings
from gateway.video_config import load_video_config
from vlcommon import handoff
from vlcommon.deadline import NO_DEADLINE, Deadline
from vlcommon.model_info import VisionSpec, resolve_model_dir

log = logging.getLogger(__name__)
tracer = trace.get_tracer("splitvl.gateway")
CLAIM_ELSEWHERE = cache_service_pb2.CLAIM_STATE_ELSEWHERE
OFF = generation_pb2.CACHE_POLICY_OFF


@dataclass(frozen=True)
class Downstream:
    """Stubs of the three services the gateway calls (cache may be None; the decoder's a
    :class:`DecoderRouter` over its replicas, or one stub), and the client that releases
    held embeddings the gateway received but no reader will read (None: a plaintext one of
    its own)."""

    encoder: encoder_service_pb2_grpc.EncoderServiceStub
    decoder: decoder_service_pb2_grpc.DecoderServiceStub | DecoderRouter
    cache: cache_service_pb2_grpc.CacheServiceStub | None
    releaser: handoff.Reader | None = None


@dataclass
class _Flight:
    """One request on its way through the stages."""

    request: GenerateInput
    held: HeldRefs
    claims: Claims  # on files this request encodes (ImageIntake.same_file), landed once
    timings: pb.StageTimings = field(default_factory=pb.StageTimings)
    intake: ImageFiles | None = None  # the images between their read, lookup and decode
    datas: list[bytes] = field(default_factory=list)
    images: list[PreparedImage] = field(default_factory=list)
    videos: list[PreparedVideo] = field(default_factory=list)
    misses: list[PreparedImage] = field(default_factory=list)
    ask_cache: bool = False

    @property
    def items(self) -> list[PreparedImage]:
        return [*self.images, *self.videos]


class Pipeline:
    """The gateway's request path over the encoder, the cache and the decoder.

    Owns the stages, the preprocess threads, the URL fetchers and the background puts;
    created once at start (:meth:`warm_up` before SERVING, :meth:`close` at shutdown).

    Args:
        settings: Limits, timeouts, cache policy, thread counts.
        spec: Vision geometry of the served checkpoint.
        revision: Model revision folded into every exact key.
        forbidden_tokens: Control tokens that may not appear in user text (case C05).
        downstream: Stubs of encoder, decoder and cache.
    """

    def __init__(
        self,
        settings: GatewaySettings,
        spec: VisionSpec,
        revision: str,
        forbidden_tokens: tuple[str, ...],
        downstream: Downstream,
    ) -> None:
        self.settings = settings
        self.spec = spec
        self.down = downstream
        transport = handoff.TRANSPORTS[settings.embedding_transport]
        self.releaser = downstream.releaser or handoff.Reader()
        self.cache = CacheStage(
            downstream.cache,
            spec=spec,
            revision=revision,
            transport=transport,
            timeout_s=settings.cache_timeout_s,
            put_timeout_s=settings.cache_put_timeout_s,
            releaser=self.releaser,
        )
        self.encode = EncodeStage(
            downstream.encoder,
            transport=transport,
            timeout_s=settings.encode_timeout_s,
            releaser=self.releaser,
        )
        self.decode = DecodeStage(
            downstream.decoder,
            releaser=self.releaser,
            migration_limit=settings.migration_limit,
            migration_max_seq_len=settings.migration_max_seq_len,
        )
        self.preprocessor = Preprocessor(
            settings, spec, revision, for_cache=downstream.cache is not None
        )
        self.fetcher = UrlFetcher(settings)
        video_fetcher = UrlFetcher(settings, noun="videos", max_bytes=settings.max_video_bytes)
        video_config = (
            load_video_config(resolve_model_dir(settings.model), spec) if settings.model else None
        )
        self.parser = RequestParser(
            settings, spec, forbidden_tokens, video_config, self.fetcher, video_fetcher
        )
        self.images = ImageIntake(self.preprocessor, self.cache)
        self.videos = (
            VideoIntake(
                settings, spec, revision, video_config, self.parser.video_limits, video_fetcher
            )
            if video_config is not None
            else None
        )
        self._background: set[asyncio.Task[None]] = set()

    def parse(
        self,
        request: pb.GenerateRequest,
        deadline: Deadline,
        arrived: float | None = None,
        caller: str | None = None,
    ) -> GenerateInput:
        """The validated request (:meth:`gateway.request.RequestParser.parse`)."""
        return self.parser.parse(request, deadline, arrived, caller)

    async def warm_up(self) -> None:
        """The preprocess path once on every thread (:meth:`Preprocessor.warm_up`)."""
        await self.preprocessor.warm_up()

    def close(self) -> None:
        self.preprocessor.close()

    async def generate(self, request: GenerateInput) -> AsyncGenerator[GenerateEvent, None]:
        """Run ``request`` through the stages; yield the decoder's steps as they come.

        Raises:
            ServiceError: before the first event for bad input (INVALID_ARGUMENT,
                RESOURCE_EXHAUSTED, ... naming the field), a dependency down (UNAVAILABLE
                naming it), the deadline (DEADLINE_EXCEEDED); after it, the decoder's
                status. Never a partial answer presented as whole.
        """
        flight = _Flight(request, HeldRefs(), self.images.claims())
        try:
            async with contextlib.aclosing(self._run(flight)) as events:
                async for event in events:
                    yield event
        finally:
            # Claims not handed to a put (failed, cancelled, or hits after all): their
            # followers look up again and, missing, decode as before.
            flight.claims.land()
            # Failed (or cancelled) before the decoder took its refs over: release them,
            # so no hit stays leased and no segment stays held until its TTL.
            if flight.held.refs:
                self.releaser.release_unread(flight.held.refs)

    async def _run(self, f: _Flight) -> AsyncGenerator[GenerateEvent, None]:
        request_span = trace.get_current_span()  # the front's server span
        # Stages 1-3 under the one gateway.preprocess span (the trace's contract,
        # docs/observability.md); each stage's time lands in its own timing.
        with tracer.start_as_current_span("gateway.preprocess") as span:
            await self._read(f)
            await self._lookup_files(f)
            await self._decode_images(f)
            self._describe(f, span, request_span)
        await self._lookup(f)
        await self._encode_misses(f)
        for attempt in (0, 1):
            try:
                async with contextlib.aclosing(self._decode(f, request_span)) as events:
                    async for event in events:
                        yield event
                break
            except RefsLost as lost:
                if attempt == 1:
                    raise lost.error from lost
                # A held entry was gone when the decoder came to read it (its holder
                # restarted, or it expired): encode every image again and decode once
                # more, within the same deadline. Nothing was streamed yet.
                log.warning(
                    "decoder could not read held embeddings (%s); re-encoding",
                    lost.error.reason,
                )
                metrics.REENCODED.inc()
                await self._encode_again(f)
        self._observe_stages(f)

    # -- 1-3. preprocess: fetch and read; lookup by the files' bytes; decode the rest -------
    def _describe(self, f: _Flight, span: trace.Span, request_span: trace.Span) -> None:
        """What stages 1-3 prepared, on their span, the request span and the counters."""
        span.set_attribute("splitvl.videos", len(f.videos))
        span.set_attribute("splitvl.images", len(f.images))
        span.set_attribute("splitvl.grids", [str(im.plan.grid) for im in f.images])
        span.set_attribute("splitvl.decoded", [im.decoded for im in f.images])
        metrics.IMAGES.inc(len(f.images))
        metrics.VIDEOS.inc(len(f.videos))
        request_span.set_attribute("splitvl.request.model", self.settings.model)
        request_span.set_attribute("splitvl.request.images", len(f.images))
        request_span.set_attribute("splitvl.request.videos", len(f.videos))
        request_span.set_attribute(
            "splitvl.request.video_tokens", sum(v.plan.tokens for v in f.videos)
        )

    async def _read(self, f: _Flight) -> None:
        """1. URLs fetched, image headers and digests read (or, without a lookup by
        digest, the images decoded), videos decoded; timed from the request's arrival."""
        req = f.request
        f.datas = await fetch_urls(self.fetcher, req.images, req.deadline)
        f.intake = await self.images.read(
            f.datas, req.min_pixels, req.max_pixels, req.cache_policy, req.deadline
        )
        if req.videos:
            assert self.videos is not None  # the parser refuses videos without one
            sources = await self.videos.fetch_urls(req.videos, req.deadline)
            f.videos = await self.preprocessor.run(
                self.videos.prepare, sources, deadline=req.deadline
            )
        f.timings.preprocess_ms = (time.perf_counter() - req.arrived) * 1000

    async def _lookup_files(self, f: _Flight) -> None:
        """2. The cache asked by the files' digests: an image it answers is never decoded."""
        assert f.intake is not None
        t = time.perf_counter()
        # Only a request of one image and no video takes part in the same-file flights: a
        # waiter waits for its holder's whole encode and put, which is one image's then.
        single = len(f.datas) == 1 and not f.request.videos
        claims = f.claims if single else None
        await self.images.lookup_files(f.intake, f.request.deadline, f.held, claims)
        f.timings.lookup_ms += (time.perf_counter() - t) * 1000

    async def _decode_images(self, f: _Flight) -> None:
        """3. The images their digests did not answer, decoded and resized."""
        assert f.intake is not None
        t = time.perf_counter()
        f.images = await self.images.decode(f.intake, f.request.deadline)
        f.timings.preprocess_ms += (time.perf_counter() - t) * 1000

    # -- 4. cache lookup by pixel key -------------------------------------------------------
    async def _lookup(self, f: _Flight) -> None:
        assert f.intake is not None
        policy, deadline = f.request.cache_policy, f.request.deadline
        t = time.perf_counter()
        lookups = []
        if f.intake.ask_cache:
            decoded = [im for im in f.images if im.decoded]
            claim = self.settings.cache_claims
            lookups.append(self.cache.lookup(decoded, policy, deadline, f.held, claim=claim))
        if f.videos and self.down.cache is not None and policy != OFF:
            # Videos have no similarity tier: exact keys only, whatever the policy.
            exact = generation_pb2.CACHE_POLICY_EXACT_ONLY
            lookups.append(self.cache.lookup(list(f.videos), exact, deadline, f.held))
        await asyncio.gather(*lookups)
        f.timings.lookup_ms += (time.perf_counter() - t) * 1000

    # -- 5. encode ---------------------------------------------------------------------------
    async def _encode_misses(self, f: _Flight) -> None:
        f.misses = [im for im in f.items if im.embedding is None]
        # Claims on files that were hits by pixel key after all, or that the put will not
        # store under their digest (a plan that differs from the header's): land them now.
        f.claims.keep({im.bytes_key for im in f.misses if im.bytes_key})
        if not f.misses:
            return
        policy, deadline = f.request.cache_policy, f.request.deadline
        stores = self.down.cache is not None and policy != OFF
        readers = 2 if stores else 1
        t = time.perf_counter()
        # Images another gateway claimed (it is encoding them): wait for its Put beside
        # this request's own encode, then encode what is still missing.
        elsewhere = [im for im in f.misses if im.claim == CLAIM_ELSEWHERE]
        own = [im for im in f.misses if im.claim != CLAIM_ELSEWHERE]
        if elsewhere:
            left = deadline.left()
            wait_s = self.settings.cache_claim_wait_s
            wait_s = wait_s if left is None else min(wait_s, left / 2)
            await asyncio.gather(
                self.encode.encode(own, deadline, readers=readers, held=f.held),
                self.cache.lookup(elsewhere, policy, deadline, f.held, claim=True, wait_s=wait_s),
            )
            late = [im for im in elsewhere if im.embedding is None]
            metrics.CLAIM_WAITS.labels(outcome="miss" if late else "hit").inc(len(elsewhere))
            await self.encode.encode(late, deadline, readers=readers, held=f.held)
            f.misses = own + late
        else:
            await self.encode.encode(f.misses, deadline, readers=readers, held=f.held)
        f.timings.encode_ms = (time.perf_counter() - t) * 1000
        # The put runs beside the decode: the decoder already has the embeddings, so
        # TTFT does not wait for the cache (its duration lands in timings.put_ms).
        put = asyncio.create_task(self.cache.put(f.misses, policy, NO_DEADLINE, f.timings))
        self._background.add(put)
        put.add_done_callback(self._background.discard)
        # The put lands the claims once the entries are stored (or it failed). A done
        # callback, not the coroutine's finally: a task cancelled before its first step
        # never runs its body, and a claim never landed would hold every later request for
        # that file in its wait.
        claims = f.claims.hand_over()
        put.add_done_callback(lambda _: claims.land())

    async def _encode_again(self, f: _Flight, positions: list[int] | None = None) -> None:
        """After lost refs: every image and video encoded again, or those at ``positions``
        in ``f.items`` (an image answered by its file's digest was never decoded: it is
        decoded first, in its place)."""
        req = f.request
        chosen = list(range(len(f.items))) if positions is None else positions
        undecoded = [p for p in chosen if p < len(f.images) and f.images[p].pixels is None]
        if undecoded:
            again = await self.images.prepare(
                [f.datas[p] for p in undecoded], req.min_pixels, req.max_pixels, OFF, req.deadline
            )
            for p, im in zip(undecoded, again.images, strict=True):
                im.index = p
                f.images[p] = im
        items = f.items
        retry = [items[p] for p in chosen]
        for im in retry:
            im.embedding, im.tier = None, generation_pb2.CACHE_TIER_MISS
        t = time.perf_counter()
        await self.encode.encode(retry, req.deadline, readers=1, held=f.held)
        f.timings.encode_ms += (time.perf_counter() - t) * 1000
        if positions is None:
            f.misses = retry

    async def _refs_again(
        self, f: _Flight, old: decoder_service_pb2.GenerateRequest
    ) -> decoder_service_pb2.GenerateRequest:
        """``old`` with fresh refs to the embeddings it served, for an answer moving to
        another decoder (the first one read and released its refs): each read again from
        the cache by the served entry's key (exact tier), the rest encoded again. An image
        a similarity hit served with another grid is encoded at its own (the continuation
        then sees the image's own embeddings; still a valid answer).

        Raises:
            ServiceError: the encoder's status when what the cache no longer has cannot be
                encoded again; DEADLINE_EXCEEDED.
        """
        req, items, found = f.request, f.items, set()
        if self.down.cache is not None and req.cache_policy != OFF:
            asks = {
                p: dataclasses.replace(
                    im,
                    key=im.embedding.key or im.key,
                    bytes_key="",
                    embedding=None,
                    tier=generation_pb2.CACHE_TIER_MISS,
                    claim=0,
                )
                for p, im in enumerate(items)
                if im.embedding is not None and im.served_grid == im.plan.grid
            }
            if asks:
                exact = generation_pb2.CACHE_POLICY_EXACT_ONLY
                await self.cache.lookup(list(asks.values()), exact, req.deadline, f.held)
                for p, again in asks.items():
                    if again.embedding is not None:
                        items[p].embedding = again.embedding
                        found.add(p)
        missing = [p for p in range(len(items)) if p not in found]
        if missing:
            await self._encode_again(f, missing)
        fresh = decoder_service_pb2.GenerateRequest()
        fresh.CopyFrom(old)
        del fresh.images[:]
        for im in f.images:
            fresh.images.append(im.embedding)
        for v, sent in zip(f.videos, fresh.videos, strict=True):
            sent.embedding.CopyFrom(v.embedding)
        f.held.hand_over()  # the next decoder reads or releases each ref
        return fresh

    # -- 6. decode ---------------------------------------------------------------------------
    def _decoder_request(self, f: _Flight) -> decoder_service_pb2.GenerateRequest:
        """The decoder's request: the messages and one ref per image and video. The copy
        of the refs is the ``embedding.transfer`` span; the bytes travel from their
        holders to the decoder, never through the gateway."""
        decode_request = decoder_service_pb2.GenerateRequest(
            request_id=uuid.uuid4().hex[:16],
            messages=f.request.messages,
            sampling=f.request.sampling,
            priority=self._priority(f),
        )
        with tracer.start_as_current_span("embedding.transfer") as span:
            for im in f.images:
                decode_request.images.append(im.embedding)
            for v in f.videos:
                assert v.video is not None
                decode_request.videos.add(
                    embedding=v.embedding, timestamps=v.video.patch_timestamps
                )
            embeddings = [im.embedding for im in f.items if im.embedding]
            sent = sum(inline_bytes(e) for e in embeddings)
            span.set_attribute("splitvl.embedding.bytes", sent)
            span.set_attribute("splitvl.embedding.destination", "decoder")
            ref_attributes(span, embeddings)
            span.set_attribute("splitvl.request.images", len(f.images))
            metrics.EMBEDDING_SENT_BYTES.labels(destination="decoder").inc(sent)
        return decode_request

    def _priority(self, f: _Flight) -> int:
        """The aged priority the decoder gets (:mod:`gateway.priority`): the client's class,
        else the policy's (short-first: from max_tokens and the prompt's media tokens and
        text, about 4 characters a token)."""
        req, rules = f.request, self.parser.priority
        if req.priority is not None:
            klass, how = req.priority, "raised" if req.priority_raised else "asked"
        else:
            media = sum(self.spec.tokens(*im.served_grid) for im in f.images)
            media += sum(v.plan.tokens for v in f.videos)
            chars = sum(len(p.text) for m in req.messages for p in m.parts)
            chars += sum(len(m.reasoning_content) for m in req.messages)
            text = chars // 4
            klass, how = rules.default_class(req.sampling.max_tokens, media + text), rules.policy
        metrics.PRIORITY_REQUESTS.labels(source=how).inc()
        return rules.aged(klass, req.arrived_wall)

    async def _decode(
        self, f: _Flight, request_span: trace.Span
    ) -> AsyncGenerator[GenerateEvent, None]:
        """One decode attempt's events.

        Raises:
            RefsLost: the decoder could not read a held ref (before any event).
        """
        decode_request = self._decoder_request(f)
        infos = [self._image_info(i, im) for i, im in enumerate(f.images)]
        video_infos = [_video_info(v) for v in f.videos]
        request_span.set_attribute("splitvl.served_grids", [str(im.served_grid) for im in f.images])
        t_decode = time.perf_counter()
        t_start = f.request.arrived
        with tracer.start_as_current_span("gateway.decode") as span:
            span.set_attribute("splitvl.transfer_bytes", decode_request.ByteSize())
            first = True
            f.held.hand_over()  # the decoder reads or releases each ref
            try:
                # aclosing: a cancelled client (GeneratorExit at the yield below) closes
                # the stream, which cancels the decoder call, which aborts the vLLM request.
                stream = self.decode.stream(
                    decode_request,
                    f.request.deadline,
                    affinity_key(decode_request),
                    renew=lambda old: self._refs_again(f, old),
                )
                async with contextlib.aclosing(stream) as chunks:
                    async for chunk in chunks:
                        now = time.perf_counter()
                        event = GenerateEvent(
                            list(chunk.token_ids), chunk.text, chunk.finish_reason
                        )
                        if first:
                            f.timings.ttft_ms = (now - t_decode) * 1000
                            metrics.TTFT.observe(now - t_start)
                            span.add_event("first_token", {"splitvl.ttft_ms": f.timings.ttft_ms})
                            event.images, event.videos = infos, video_infos
                            first = False
                        if event.finished:
                            _finish(event, chunk.usage, f.timings, t_decode, t_start)
                            request_span.set_attribute(
                                "splitvl.usage.prompt_tokens", chunk.usage.prompt_tokens
                            )
                            request_span.set_attribute(
                                "splitvl.usage.completion_tokens", chunk.usage.completion_tokens
                            )
                        yield event
            except RefsLost:
                span.set_attribute("splitvl.reencoded", True)
                raise

    def _image_info(self, index: int, im: PreparedImage) -> pb.ImageInfo:
        """The response's per-image information: what the language model got (the served
        grid and its token count) and what the request asked for."""
        return pb.ImageInfo(
            index=index,
            tier=im.tier,
            similarity=im.similarity,
            grid=thw_message(im.served_grid),
            tokens=self.spec.tokens(*im.served_grid),
            key=im.key,
            decoded=im.decoded,
            served_grid=thw_message(im.served_grid),
            requested_grid=grid_message(im.plan),
        )

    def _observe_stages(self, f: _Flight) -> None:
        """Each stage that ran into ``splitvl_gateway_stage_seconds``: a 0 for an encode
        that every hit skipped (or a lookup with the cache off) would dilute the
        histogram; the put observes itself when it ends."""
        ran = ["preprocess"]
        if f.images and self.down.cache is not None and f.request.cache_policy != OFF:
            ran.append("lookup")
        if f.misses:
            ran.append("encode")
        for name in (*ran, "decode"):
            seconds = getattr(f.timings, f"{name}_ms") / 1000
            metrics.STAGE_SECONDS.labels(stage=name).observe(seconds)


def _finish(
    event: GenerateEvent,
    usage: generation_pb2.Usage,
    timings: pb.StageTimings,
    t_decode: float,
    t_start: float,
) -> None:
    """The last event's usage and stage timings."""
    now = time.perf_counter()
    timings.decode_ms = (now - t_decode) * 1000
    timings.total_ms = (now - t_start) * 1000
    event.usage = generation_pb2.Usage()
    event.usage.CopyFrom(usage)
    event.timings = pb.StageTimings()
    event.timings.CopyFrom(timings)


def _video_info(v: PreparedVideo) -> pb.VideoInfo:
    """The response's per-video information."""
    assert v.video is not None
    sampling = v.video.sampling
    return pb.VideoInfo(
        index=v.index,
        tier=v.tier,
        grid=grid_message(v.plan),
        tokens=v.plan.tokens,
        frames=len(sampling.indices),
        timestamps=sampling.timestamps,
        key=v.key,
        source_frames=sampling.source_frames,
        frame_indices=sampling.indices,
    )


def affinity_key(request: decoder_service_pb2.GenerateRequest) -> str | None:
    """The affinity key: the identity of the request's first image or video in prompt
    order, as served (after the cache lookup, so a similarity hit routes with the entry it
    serves): the cache entry's key, which names one embedding content, as the decoder's
    ``multi_modal_uuids`` (the BLAKE3 of those bytes, ``decoder_service.validation``) does
    for vLLM's prefix cache. None without images and videos (least loaded)."""
    for message in request.messages:
        for part in message.parts:
            kind = part.WhichOneof("part")
            if kind == "image_index":
                return request.images[part.image_index].key or None
            if kind == "video_index":
                return request.videos[part.video_index].embedding.key or None
    return None
