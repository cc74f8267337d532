"""``qwenvl.gateway.v1.GatewayService``: the orchestration of one request.

1. Validate messages and parts; decode each image once (EXIF-upright RGB), plan its
   resize (``image_grid_thw``), compute its exact key and similarity descriptor.
2. ``CacheService/Lookup`` for all images in one call (skipped when the policy is off;
   when the cache is down or slow, every image is a miss and the failure is counted).
3. ``EncoderService/Encode`` for the misses; ``CacheService/Put`` of the new embeddings.
4. ``DecoderService/Generate`` with the messages and one embedding per image; its tokens
   stream back. Nothing is streamed before the decoder's first token, so every bad input
   fails with a status before the stream starts. A cancelled client cancels the decoder
   call, which aborts the vLLM request. Each hop gets the deadline that remains.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
from opentelemetry import trace
from prometheus_client import Counter, Histogram
from qwenvl.cache.v1 import cache_service_pb2, cache_service_pb2_grpc
from qwenvl.common.v1 import generation_pb2, tensor_pb2
from qwenvl.decoder.v1 import decoder_service_pb2, decoder_service_pb2_grpc
from qwenvl.encoder.v1 import encoder_service_pb2, encoder_service_pb2_grpc
from qwenvl.gateway.v1 import gateway_service_pb2 as pb
from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

from gateway.media import image_bytes
from gateway.settings import GatewaySettings
from vlcommon import tensors
from vlcommon.errors import (
    ServiceError,
    abort,
    check_count,
    check_no_control_tokens,
    check_role,
    from_rpc_error,
    invalid_argument,
)
from vlcommon.imaging import (
    ResizePlan,
    decode_image,
    exact_key,
    plan_resize,
    resize_to_plan,
    similarity_descriptor,
)
from vlcommon.model_info import VisionSpec

log = logging.getLogger(__name__)
tracer = trace.get_tracer("splitvl.gateway")

REQUESTS = Counter("splitvl_gateway_requests_total", "Generate RPCs by gRPC status.", ["code"])
IMAGES = Counter("splitvl_gateway_images_total", "Images served, by cache tier.", ["tier"])
CACHE_FAILURES = Counter(
    "splitvl_gateway_cache_failures_total",
    "Cache calls that failed or timed out (served by encoding).",
    ["op"],
)
STAGE_SECONDS = Histogram("splitvl_gateway_stage_seconds", "Wall time per stage.", ["stage"])
EMBEDDING_DTYPES = (
    tensor_pb2.DATA_TYPE_FP32,
    tensor_pb2.DATA_TYPE_BF16,
    tensor_pb2.DATA_TYPE_FP16,
)
POLICY_NAMES = {
    "exact_only": generation_pb2.CACHE_POLICY_EXACT_ONLY,
    "similar": generation_pb2.CACHE_POLICY_SIMILAR,
    "off": generation_pb2.CACHE_POLICY_OFF,
}


@dataclass
class PreparedImage:
    """One decoded image with everything computed before any ViT work."""

    pixels: np.ndarray  # uint8 [resized_height, resized_width, 3], upright RGB
    plan: ResizePlan
    key: str
    descriptor: np.ndarray  # float32 [DESCRIPTOR_DIM]
    tier: int = generation_pb2.CACHE_TIER_MISS
    similarity: float = 0.0
    embedding: tensor_pb2.ImageEmbedding | None = None


@dataclass(frozen=True)
class Downstream:
    """Stubs of the three services the gateway calls (cache may be None)."""

    encoder: encoder_service_pb2_grpc.EncoderServiceStub
    decoder: decoder_service_pb2_grpc.DecoderServiceStub
    cache: cache_service_pb2_grpc.CacheServiceStub | None


def _grid(plan: ResizePlan) -> tensor_pb2.GridTHW:
    return tensor_pb2.GridTHW(t=plan.grid_t, h=plan.grid_h, w=plan.grid_w)


def _remaining(context: grpc.aio.ServicerContext | None, cap: float | None = None) -> float | None:
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


class GatewayServicer(pb_grpc.GatewayServiceServicer):
    """Serves the public Generate RPC.

    Args:
        settings: Limits, addresses and cache policy.
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
        self.revision = revision
        self.forbidden_tokens = forbidden_tokens
        self.down = downstream
        self.default_policy = POLICY_NAMES[settings.default_cache_policy]
        self._background: set[asyncio.Task[None]] = set()
        self._preprocess = ThreadPoolExecutor(
            max_workers=settings.preprocess_threads, thread_name_prefix="preprocess"
        )

    # -- validation ---------------------------------------------------------------------
    def _parse(
        self, request: pb.GenerateRequest
    ) -> tuple[list[decoder_service_pb2.Message], list[bytes]]:
        """Validate the messages and collect the images' encoded bytes, in order.

        Counts (messages, parts, images, characters) are checked before any content is
        scanned, so an oversized request is refused without work proportional to its size.
        """
        s = self.settings
        check_count(len(request.messages), field="messages", limit=s.max_messages)
        parts = sum(len(m.parts) for m in request.messages)
        if parts > s.max_parts:
            raise invalid_argument(
                "TOO_MANY_PARTS",
                f"messages hold {parts} parts; the limit is {s.max_parts}",
                field="messages",
                limit=s.max_parts,
            )
        n_images = sum(1 for m in request.messages for q in m.parts if q.HasField("image"))
        if n_images > s.max_images:
            raise invalid_argument(
                "TOO_MANY_IMAGES",
                f"the request has {n_images} images; the limit is {s.max_images}",
                field="images",
                limit=s.max_images,
            )
        chars = sum(len(q.text) for m in request.messages for q in m.parts)
        if chars > s.max_text_chars:
            raise invalid_argument(
                "TEXT_TOO_LONG",
                f"messages hold {chars} characters of text; the limit is {s.max_text_chars}",
                field="messages",
                limit=s.max_text_chars,
            )
        messages: list[decoder_service_pb2.Message] = []
        images: list[bytes] = []
        for i, message in enumerate(request.messages):
            check_role(message.role, f"messages[{i}].role")
            if not message.parts:
                raise invalid_argument(
                    "PARTS_EMPTY", f"messages[{i}].parts is empty", field=f"messages[{i}].parts"
                )
            out = decoder_service_pb2.Message(role=message.role)
            run: list[str] = []  # adjacent text parts: the chat template joins them
            for j, part in enumerate(message.parts):
                field = f"messages[{i}].parts[{j}]"
                kind = part.WhichOneof("part")
                if kind == "text":
                    self._check_text(part.text, f"{field}.text")
                    run.append(part.text)
                    out.parts.add(text=part.text)
                    continue
                if len(run) > 1:
                    self._check_text("".join(run), f"messages[{i}].parts (joined text)")
                run = []
                if kind == "image":
                    images.append(
                        image_bytes(part.image, index=len(images), max_bytes=s.max_image_bytes)
                    )
                    out.parts.add(image_index=len(images) - 1)
                else:
                    raise invalid_argument(
                        "PART_EMPTY", f"{field} has neither text nor image", field=field
                    )
            if len(run) > 1:
                self._check_text("".join(run), f"messages[{i}].parts (joined text)")
            messages.append(out)
        return messages, images

    def _check_text(self, text: str, field: str) -> None:
        """Refuse a control token (``<|image_pad|>``, ``<|im_start|>``, ...) in user text."""
        check_no_control_tokens(text, self.forbidden_tokens, field)

    def _budget(self, request: pb.GenerateRequest) -> tuple[int, int]:
        lo = request.pixel_budget.min_pixels or self.spec.min_pixels
        hi = request.pixel_budget.max_pixels or self.spec.max_pixels
        floor = self.spec.factor**2
        if lo < floor or hi < lo or hi > self.spec.max_pixels:
            raise invalid_argument(
                "PIXEL_BUDGET_INVALID",
                f"pixel_budget [{lo}, {hi}] is out of range: min_pixels >= {floor}, "
                f"min_pixels <= max_pixels <= {self.spec.max_pixels}",
                field="pixel_budget",
                limit=self.spec.max_pixels,
            )
        return lo, hi

    def _prepare_images(self, datas: list[bytes], lo: int, hi: int) -> list[PreparedImage]:
        """Decode, plan, key, describe and resize each image, one at a time.

        The pixels kept (and sent to the encoder) are the resized ones, produced by the one
        shared resize function: a 6000x6000 upload shrinks to the pixel budget here instead
        of travelling as 108 MB, and only one full-size decode is alive per thread.
        """
        prepared = []
        for index, data in enumerate(datas):
            image = decode_image(
                data, index=index, max_decoded_pixels=self.settings.max_decoded_pixels
            )
            plan = plan_resize(
                image.height, image.width, self.spec, index=index, min_pixels=lo, max_pixels=hi
            )
            key = exact_key(image, plan, self.revision)
            descriptor = similarity_descriptor(image)
            if (image.height, image.width) == (plan.resized_height, plan.resized_width):
                resized = np.asarray(image, dtype=np.uint8)  # already the planned size
            else:
                resized = resize_to_plan(image, plan).permute(1, 2, 0).contiguous().numpy()
            del image
            prepared.append(
                PreparedImage(pixels=resized, plan=plan, key=key, descriptor=descriptor)
            )
        return prepared

    def _usable_hit(self, emb: tensor_pb2.ImageEmbedding, im: PreparedImage) -> bool:
        """Trust a cache hit only if its tensor fits this image and this model.

        A bad entry (wrong rows for the grid, wrong width, bad byte count, NaN) would make
        the decoder refuse the request; treated as a miss, the image is encoded instead.
        """
        grid = (emb.grid.t, emb.grid.h, emb.grid.w)
        shape = list(emb.embeddings.shape)
        if grid != im.plan.grid or shape != [im.plan.tokens, self.spec.embedding_width]:
            return False
        try:
            tensors.validate(emb.embeddings, field="cache", dtypes=EMBEDDING_DTYPES)
        except ServiceError:
            return False
        return bool(np.isfinite(tensors.to_numpy(emb.embeddings)).all())

    # -- stages -------------------------------------------------------------------------
    async def _lookup(
        self, images: list[PreparedImage], policy: int, context: grpc.aio.ServicerContext
    ) -> None:
        if self.down.cache is None or policy == generation_pb2.CACHE_POLICY_OFF or not images:
            return
        request = cache_service_pb2.LookupRequest(policy=policy, include_embeddings=True)
        for im in images:
            request.queries.add(
                key=im.key, descriptor=tensors.from_numpy(im.descriptor), grid=_grid(im.plan)
            )
        with tracer.start_as_current_span("gateway.cache_lookup") as span:
            try:
                response = await self.down.cache.Lookup(
                    request, timeout=_remaining(context, self.settings.cache_timeout_s)
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
                return
            for im, result in zip(images, response.results, strict=True):
                im.similarity = result.similarity
                if result.tier in (
                    generation_pb2.CACHE_TIER_EXACT,
                    generation_pb2.CACHE_TIER_SIMILAR,
                ):
                    if not self._usable_hit(result.embedding, im):
                        CACHE_FAILURES.labels(op="bad_entry").inc()
                        log.warning("cache returned an unusable entry for %s", im.key[:16])
                        continue  # never bind embeddings that do not fit
                    im.tier = result.tier
                    im.embedding = result.embedding
            span.set_attribute(
                "splitvl.cache.tiers", [generation_pb2.CacheTier.Name(im.tier) for im in images]
            )
            span.set_attribute("splitvl.cache.similarities", [im.similarity for im in images])

    async def _encode(self, misses: list[PreparedImage], context: grpc.aio.ServicerContext) -> None:
        request = encoder_service_pb2.EncodeRequest()
        for im in misses:
            request.images.add(
                key=im.key,
                pixels=tensors.from_numpy(im.pixels),
                plan=tensor_pb2.ResizePlan(
                    resized_height=im.plan.resized_height,
                    resized_width=im.plan.resized_width,
                    grid=_grid(im.plan),
                ),
            )
        with tracer.start_as_current_span("gateway.encode") as span:
            span.set_attribute("splitvl.images", len(misses))
            span.set_attribute("splitvl.transfer_bytes", request.ByteSize())
            try:
                response = await self.down.encoder.Encode(request, timeout=_remaining(context))
            except grpc.aio.AioRpcError as err:
                raise from_rpc_error(err, dependency="encoder") from err
        for im, emb in zip(misses, response.embeddings, strict=True):
            im.embedding = emb

    async def _put(
        self,
        fresh: list[PreparedImage],
        policy: int,
        context: grpc.aio.ServicerContext | None,
        timings: pb.StageTimings | None = None,
    ) -> None:
        if self.down.cache is None or policy == generation_pb2.CACHE_POLICY_OFF or not fresh:
            return
        request = cache_service_pb2.PutRequest()
        for im in fresh:
            request.entries.add(
                key=im.key, descriptor=tensors.from_numpy(im.descriptor), embedding=im.embedding
            )
        t0 = time.perf_counter()
        with tracer.start_as_current_span("gateway.cache_put") as span:
            span.set_attribute("splitvl.transfer_bytes", request.ByteSize())
            try:
                await self.down.cache.Put(
                    request, timeout=_remaining(context, self.settings.cache_timeout_s)
                )
            except grpc.aio.AioRpcError as err:
                CACHE_FAILURES.labels(op="put").inc()
                log.warning("cache put failed (%s)", err.code().name)
        if timings is not None:
            timings.put_ms = (time.perf_counter() - t0) * 1000

    # -- the RPC ------------------------------------------------------------------------
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        code = grpc.StatusCode.OK
        call = None
        t_start = time.perf_counter()
        timings = pb.StageTimings()
        try:
            sampling = request.sampling
            if sampling.HasField("max_tokens") and not (
                1 <= sampling.max_tokens <= self.settings.max_tokens_limit
            ):
                raise invalid_argument(
                    "MAX_TOKENS_OUT_OF_RANGE",
                    f"sampling.max_tokens is {sampling.max_tokens}; "
                    f"allowed 1..{self.settings.max_tokens_limit}",
                    field="sampling.max_tokens",
                    limit=self.settings.max_tokens_limit,
                )
            if request.cache_policy not in generation_pb2.CachePolicy.values():
                raise invalid_argument(
                    "CACHE_POLICY_INVALID",
                    f"cache_policy {request.cache_policy} is not a CachePolicy value",
                    field="cache_policy",
                )
            policy = request.cache_policy or self.default_policy
            with tracer.start_as_current_span("gateway.preprocess") as span:
                messages, datas = self._parse(request)
                lo, hi = self._budget(request)
                images = await asyncio.get_running_loop().run_in_executor(
                    self._preprocess, self._prepare_images, datas, lo, hi
                )
                span.set_attribute("splitvl.images", len(images))
                span.set_attribute("splitvl.grids", [str(im.plan.grid) for im in images])
            timings.preprocess_ms = (time.perf_counter() - t_start) * 1000

            t = time.perf_counter()
            await self._lookup(images, policy, context)
            timings.lookup_ms = (time.perf_counter() - t) * 1000

            misses = [im for im in images if im.embedding is None]
            if misses:
                t = time.perf_counter()
                await self._encode(misses, context)
                timings.encode_ms = (time.perf_counter() - t) * 1000
                # The put runs beside the decode: the decoder already has the embeddings, so
                # TTFT does not wait for the cache (its duration lands in timings.put_ms).
                put = asyncio.create_task(self._put(misses, policy, None, timings))
                self._background.add(put)
                put.add_done_callback(self._background.discard)

            decode_request = decoder_service_pb2.GenerateRequest(
                request_id=uuid.uuid4().hex[:16], messages=messages, sampling=sampling
            )
            for im in images:
                decode_request.images.append(im.embedding)
            infos = [
                pb.ImageInfo(
                    index=i,
                    tier=im.tier,
                    similarity=im.similarity,
                    grid=_grid(im.plan),
                    tokens=im.plan.tokens,
                    key=im.key,
                )
                for i, im in enumerate(images)
            ]
            for im in images:
                IMAGES.labels(tier=generation_pb2.CacheTier.Name(im.tier)).inc()

            t_decode = time.perf_counter()
            with tracer.start_as_current_span("gateway.decode") as span:
                span.set_attribute("splitvl.transfer_bytes", decode_request.ByteSize())
                call = self.down.decoder.Generate(decode_request, timeout=_remaining(context))
                first = True
                try:
                    async for chunk in call:
                        response = pb.GenerateResponse(
                            token_ids=chunk.token_ids,
                            text=chunk.text,
                            finish_reason=chunk.finish_reason,
                        )
                        if first:
                            timings.ttft_ms = (time.perf_counter() - t_decode) * 1000
                            span.add_event("first_token", {"ttft_ms": timings.ttft_ms})
                            response.images.extend(infos)
                            first = False
                        if chunk.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
                            response.usage.CopyFrom(chunk.usage)
                            timings.decode_ms = (time.perf_counter() - t_decode) * 1000
                            timings.total_ms = (time.perf_counter() - t_start) * 1000
                            response.timings.CopyFrom(timings)
                        yield response
                except grpc.aio.AioRpcError as err:
                    raise from_rpc_error(err, dependency="decoder") from err
            for name in ("preprocess", "lookup", "encode", "put", "decode"):
                STAGE_SECONDS.labels(stage=name).observe(getattr(timings, f"{name}_ms") / 1000)
        except ServiceError as err:
            code = err.code
            await abort(context, err)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            if call is not None and not call.done():
                call.cancel()  # the decoder aborts the vLLM request
            REQUESTS.labels(code=code.name).inc()
