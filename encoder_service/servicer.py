"""``qwenvl.encoder.v1.EncoderService``: converts protos to engine calls and maps errors."""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import grpc
import numpy as np
import torch
from opentelemetry import trace
from qwenvl.common.v1 import tensor_pb2
from qwenvl.encoder.v1 import encoder_service_pb2 as pb
from qwenvl.encoder.v1 import encoder_service_pb2_grpc as pb_grpc

from encoder_service import metrics
from encoder_service.batcher import Batcher
from encoder_service.engine import Preprocessed, VisionEngine
from vlcommon import handoff, tensors
from vlcommon.handoff import MAX_READERS, Holder, check_transport, transport_name
from vlcommon.imaging import MAX_ASPECT_RATIO, ResizePlan
from vlcommon.refusals import Refusal
from vlcommon.request_rules import check_count

log = logging.getLogger(__name__)
# ViT outputs above this many bytes are cast and held on a worker thread (Encode).
ANSWER_ON_LOOP_BYTES = 1 << 20
tracer = trace.get_tracer("splitvl.encoder")


def plan_from_proto(
    msg: tensor_pb2.ResizePlan, engine: VisionEngine, field: str, frames: int = 0
) -> ResizePlan:
    """Check a ResizePlan against the model's geometry.

    Args:
        frames: 0 for an image (grid t = 1); a video's frame count, a positive multiple
            of temporal_patch_size (grid t = frames / temporal_patch_size).

    Raises:
        ServiceError: INVALID_ARGUMENT naming ``field`` when sizes are not positive
            multiples of patch_size * spatial_merge_size or the grid does not follow.
    """
    spec = engine.spec
    h, w = msg.resized_height, msg.resized_width
    if h <= 0 or w <= 0 or h % spec.factor or w % spec.factor:
        raise Refusal.RESIZE_PLAN_INVALID.error(
            f"{field}: resized size {h}x{w} must be positive multiples of {spec.factor}",
            field=field,
            limit=spec.factor,
        )
    if frames and frames % spec.temporal_patch_size:
        raise Refusal.VIDEO_FRAMES_INVALID.error(
            f"{field}: a video of {frames} frames; the count must be a multiple of the "
            f"temporal patch size {spec.temporal_patch_size} (the gateway pads)",
            field=field,
            limit=spec.temporal_patch_size,
        )
    grid = (msg.grid.t, msg.grid.h, msg.grid.w)
    grid_t = frames // spec.temporal_patch_size if frames else 1
    expected = (grid_t, h // spec.patch_size, w // spec.patch_size)
    if grid != expected:
        what = f"a video of {frames} frames of {h}x{w}" if frames else f"a {h}x{w} image"
        raise Refusal.RESIZE_PLAN_INVALID.error(
            f"{field}.grid is {grid}; {what} has {expected}", field=f"{field}.grid"
        )
    if max(h, w) / min(h, w) > MAX_ASPECT_RATIO:
        raise Refusal.RESIZE_PLAN_INVALID.error(
            f"{field}: resized size {h}x{w} has an aspect ratio over {MAX_ASPECT_RATIO:g}",
            field=field,
            limit=f"{MAX_ASPECT_RATIO:g}",
        )
    return ResizePlan(h, w, grid_t, expected[1], expected[2], spec.tokens(*expected))


class EncoderServicer(pb_grpc.EncoderServiceServicer):
    """Serves Encode: validates, preprocesses (shared resize plan), batches, encodes."""

    def __init__(
        self,
        engine: VisionEngine | None,
        batcher: Batcher | None,
        *,
        max_images_per_request: int,
        max_patches_per_image: int,
        max_patches_per_video: int = 65536,
        holder: Holder | None = None,
    ) -> None:
        # None until the model has loaded (health says NOT_SERVING meanwhile).
        self.engine = engine
        self.batcher = batcher
        self.max_images = max_images_per_request
        self.max_patches = max_patches_per_image
        self.max_video_patches = max_patches_per_video
        # Holds the embeddings handed out by reference (request.transport set).
        self.holder = holder

    def _ready(self) -> tuple[VisionEngine, Batcher]:
        if self.engine is None or self.batcher is None:
            raise Refusal.ENCODER_LOADING.error("encoder is loading the model")
        return self.engine, self.batcher

    def _prepare(
        self, request: pb.EncodeRequest, engine: VisionEngine
    ) -> list[tuple[str, np.ndarray, ResizePlan]]:
        check_count(len(request.images), field="images", limit=self.max_images, noun="images")
        prepared = []
        for i, image in enumerate(request.images):
            field = f"images[{i}]"
            # [height, width, 3] for an image, [frames, height, width, 3] for a video.
            video = len(image.pixels.shape) == 4
            pixels = tensors.validate(
                image.pixels,
                field=f"{field}.pixels",
                dtypes=(tensor_pb2.DATA_TYPE_UINT8,),
                ndim=4 if video else 3,
            )
            shape = list(image.pixels.shape)
            if shape[-1] != 3 or min(shape[:-1]) < 1:
                raise Refusal.PIXELS_SHAPE_INVALID.error(
                    f"{field}.pixels.shape is {shape}; expected [height, width, 3] (an image) "
                    "or [frames, height, width, 3] (a video)",
                    field=f"{field}.pixels.shape",
                )
            plan = plan_from_proto(image.plan, engine, f"{field}.plan", shape[0] if video else 0)
            if video and shape[1:3] != [plan.resized_height, plan.resized_width]:
                # Frames come resized by the gateway (one resize per frame, its plan).
                raise Refusal.PIXELS_SHAPE_INVALID.error(
                    f"{field}.pixels.shape is {shape}; a video's frames must already have the "
                    f"plan's size {plan.resized_height}x{plan.resized_width}",
                    field=f"{field}.pixels.shape",
                )
            patches = plan.grid_t * plan.grid_h * plan.grid_w
            limit = self.max_video_patches if video else self.max_patches
            if patches > limit:
                too_many = (
                    Refusal.VIDEO_TOO_MANY_PATCHES if video else Refusal.IMAGE_TOO_MANY_PATCHES
                )
                raise too_many.error(
                    f"{field} has {patches} patches; the limit is {limit}",
                    field=field,
                    limit=limit,
                )
            # In-flight de-duplication is by content AND plan: one key never stands for two
            # different resizes.
            dedup_key = (
                f"{image.key}|{plan.grid_t}x{plan.resized_height}x{plan.resized_width}"
                if image.key
                else ""
            )
            prepared.append((dedup_key, tensors.to_numpy(image.pixels, pixels), plan))
        return prepared

    @staticmethod
    def _preprocess_all(
        engine: VisionEngine, prepared: list[tuple[str, np.ndarray, ResizePlan]]
    ) -> list[Preprocessed]:
        return [engine.preprocess(pixels, plan) for _, pixels, plan in prepared]

    async def Encode(
        self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.EncodeResponse:
        t0 = time.perf_counter()
        engine, batcher = self._ready()
        prepared = self._prepare(request, engine)
        metrics.IMAGES.inc(len(prepared))
        out_dtype = request.output_dtype or tensor_pb2.DATA_TYPE_UNSPECIFIED
        if out_dtype not in (
            tensor_pb2.DATA_TYPE_UNSPECIFIED,
            tensor_pb2.DATA_TYPE_FP32,
            tensor_pb2.DATA_TYPE_BF16,
        ):
            raise Refusal.OUTPUT_DTYPE_UNSUPPORTED.error(
                "output_dtype must be FP32 or BF16", field="output_dtype"
            )
        check_transport(request.transport)
        # An encoder built without a holder (embedded in a tool or a test) answers inline.
        by_ref = request.transport != tensor_pb2.TRANSPORT_UNSPECIFIED and self.holder is not None
        if not 0 <= request.readers <= MAX_READERS:
            raise Refusal.READERS_OUT_OF_RANGE.error(
                f"readers is {request.readers}; allowed 0..{MAX_READERS}",
                field="readers",
                limit=MAX_READERS,
            )
        with tracer.start_as_current_span("encoder.preprocess") as span:
            span.set_attribute("splitvl.images", len(prepared))
            images = await asyncio.to_thread(self._preprocess_all, engine, prepared)
        t_queue = time.perf_counter()
        # The per-request span: the vit.batch spans that served it link here.
        with tracer.start_as_current_span("encoder.encode") as span:
            span.set_attribute("splitvl.request.images", len(prepared))
            span.set_attribute(
                "splitvl.request.patches",
                sum(p.grid_t * p.grid_h * p.grid_w for _, _, p in prepared),
            )
            timed = await asyncio.gather(
                *(
                    batcher.submit_timed(key, im)
                    for (key, _, _), im in zip(prepared, images, strict=True)
                )
            )
            outs = [out for out, _ in timed]
            span.set_attribute(
                "splitvl.encoder.queue_wait_ms", max(i.queue_wait_s for _, i in timed) * 1000
            )
            span.set_attribute("splitvl.batch.ids", [i.batch_id for _, i in timed])
            span.set_attribute("splitvl.batch.sizes", [i.batch_size for _, i in timed])
            span.set_attribute("splitvl.tokens", sum(o.shape[0] for o in outs))
        response = pb.EncodeResponse(encode_ms=(time.perf_counter() - t_queue) * 1000)
        answer = functools.partial(
            self._answer, response, request, prepared, outs, out_dtype, by_ref=by_ref
        )
        # Casting one 1,024-token image at Qwen3-VL-2B's width to bf16 and copying its 16 MiB
        # into a segment took 14-49 ms here (median 21 of 9): off the event loop, which
        # serves the other calls (health, new Encodes, ReadEmbedding) meanwhile.
        big = sum(o.numel() * o.element_size() for o in outs) > ANSWER_ON_LOOP_BYTES
        if by_ref:
            assert self.holder is not None

            def hold() -> list[tensor_pb2.EmbeddingRef | None]:
                answer()
                return [e.ref for e in response.embeddings]

            # No hold outlives a call cancelled while it is made (by its client, or past
            # its deadline): it would have no reader and stay held until the TTL.
            if big:
                await handoff.hold_on_thread(self.holder, hold)
            else:
                hold()  # no await between the holds and the answer
        elif big:
            await asyncio.to_thread(answer)
        else:
            answer()
        sent = sum(tensors.payload_nbytes(e.embeddings) for e in response.embeddings)
        if by_ref:
            held = [transport_name(e.ref.transport) for e in response.embeddings]
            trace.get_current_span().set_attribute("splitvl.embedding.held_bytes", sent)
            trace.get_current_span().set_attribute("splitvl.embedding.transports", held)
        else:
            metrics.EMBEDDING_SENT_BYTES.inc(sent)
            trace.get_current_span().set_attribute("splitvl.embedding.bytes", sent)
        log.debug("encoded %d images in %.1f ms", len(prepared), (time.perf_counter() - t0) * 1000)
        return response

    def _answer(
        self,
        response: pb.EncodeResponse,
        request: pb.EncodeRequest,
        prepared: list[tuple[str, np.ndarray, ResizePlan]],
        outs: list[torch.Tensor],
        out_dtype: int,
        *,
        by_ref: bool,
    ) -> None:
        """Fill ``response.embeddings`` from the ViT outputs: cast to ``out_dtype``, then
        held for readers (``by_ref``) or inline.

        Raises:
            ServiceError: RESOURCE_EXHAUSTED ``HANDOFF_FULL`` from the holder.
        """
        try:
            for request_image, (_, _, plan), out in zip(
                request.images, prepared, outs, strict=True
            ):
                if out_dtype == tensor_pb2.DATA_TYPE_BF16:
                    out = out.to(torch.bfloat16)
                elif out_dtype == tensor_pb2.DATA_TYPE_FP32:
                    out = out.to(torch.float32)
                emb = response.embeddings.add(
                    grid=tensor_pb2.GridTHW(t=plan.grid_t, h=plan.grid_h, w=plan.grid_w),
                    key=request_image.key,
                )
                if by_ref:
                    assert self.holder is not None
                    dtype, data = tensors.torch_payload(out)
                    emb.embeddings.dtype, emb.embeddings.shape[:] = dtype, list(out.shape)
                    emb.ref.CopyFrom(
                        self.holder.hold(
                            data,
                            dtype,
                            tuple(out.shape),
                            transport=request.transport,
                            readers=request.readers or 1,
                        )
                    )
                else:
                    emb.embeddings.CopyFrom(tensors.from_torch(out))
        except BaseException:  # HANDOFF_FULL part-way: free what this answer held
            if by_ref and self.holder is not None:
                for emb in response.embeddings:
                    if emb.ref.ticket:
                        self.holder.drop(emb.ref.ticket)
            raise
