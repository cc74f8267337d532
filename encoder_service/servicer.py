"""``qwenvl.encoder.v1.EncoderService``: converts protos to engine calls and maps errors.

:class:`EncoderServicer` checks a request whole (:mod:`encoder_service.validation`),
preprocesses its images on a worker thread, submits them to the :class:`Batcher` and
answers inline or by reference (:mod:`vlcommon.by_reference`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

import grpc
import torch
from opentelemetry import trace
from qwenvl.common.v1 import tensor_pb2
from qwenvl.encoder.v1 import encoder_service_pb2 as pb
from qwenvl.encoder.v1 import encoder_service_pb2_grpc as pb_grpc

from encoder_service import metrics
from encoder_service.batcher import Batcher
from encoder_service.engine import Preprocessed, VisionEngine
from encoder_service.validation import EncodeInput, ImageInput, Limits, parse_encode
from vlcommon import tensors
from vlcommon.by_reference import Payload, hold_answer
from vlcommon.handoff import Holder
from vlcommon.refusals import Refusal

log = logging.getLogger(__name__)
# ViT outputs above this many bytes are cast and held on a worker thread (Encode).
ANSWER_ON_LOOP_BYTES = 1 << 20
tracer = trace.get_tracer("splitvl.encoder")


class EncoderServicer(pb_grpc.EncoderServiceServicer):
    """Serves Encode: validates, preprocesses (shared resize plan), batches, encodes.

    Args:
        engine: The ViT; None until the model has loaded (health says NOT_SERVING).
        batcher: Batches the ViT calls; None until then too.
        max_images_per_request: Images (and videos) per call.
        max_patches_per_image: ViT patches per image (``__main__`` sets it from the model
            when the setting is 0).
        max_patches_per_video: ViT patches per video.
        holder: Holds the embeddings handed out by reference; None answers inline.
    """

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

    async def Encode(
        self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.EncodeResponse:
        """Encode each image (or video) with the ViT: its embeddings, ``[tokens, out_hidden *
        (1 + n_deepstack)]`` in ``output_dtype``, inline or held for ``readers`` readers.

        Raises (as status): UNAVAILABLE ``ENCODER_LOADING`` before the model has loaded;
        INVALID_ARGUMENT or RESOURCE_EXHAUSTED for a request that fails
        :func:`encoder_service.validation.parse_encode` (nothing is prepared then);
        RESOURCE_EXHAUSTED ``ENCODER_QUEUE_FULL`` or ``IMAGE_OUT_OF_MEMORY`` from the
        batcher, ``HANDOFF_FULL`` from the holder (what this answer had held is freed).
        """
        t0 = time.perf_counter()
        engine, batcher = self._ready()
        limits = Limits(self.max_images, self.max_patches, self.max_video_patches)
        encode = parse_encode(request, engine.spec, limits, self.holder)
        metrics.IMAGES.inc(len(encode.images))
        with tracer.start_as_current_span("encoder.preprocess") as span:
            span.set_attribute("splitvl.images", len(encode.images))
            images = await asyncio.to_thread(self._preprocess_all, engine, encode.images)
        t_queue = time.perf_counter()
        outs = await self._encode(batcher, encode.images, images)
        response = pb.EncodeResponse(encode_ms=(time.perf_counter() - t_queue) * 1000)
        # Casting one 1,024-token image at Qwen3-VL-2B's width to bf16 and copying its 16 MiB
        # into a segment took 14-49 ms here (median 21 of 9): off the event loop, which
        # serves the other calls (health, new Encodes, ReadEmbedding) meanwhile.
        big = sum(o.numel() * o.element_size() for o in outs) > ANSWER_ON_LOOP_BYTES
        if encode.by_ref:
            await self._answer_by_reference(response, encode, outs, on_thread=big)
        else:
            await self._answer_inline(response, encode, outs, on_thread=big)
        log.debug("encoded %d images in %.1f ms", len(outs), (time.perf_counter() - t0) * 1000)
        return response

    @staticmethod
    def _preprocess_all(engine: VisionEngine, images: tuple[ImageInput, ...]) -> list[Preprocessed]:
        return [engine.preprocess(im.pixels, im.plan) for im in images]

    @staticmethod
    async def _encode(
        batcher: Batcher, inputs: tuple[ImageInput, ...], images: list[Preprocessed]
    ) -> list[torch.Tensor]:
        """The ViT outputs of ``images``, in order, under this request's ``encoder.encode``
        span (the ``vit.batch`` spans that served it link there)."""
        with tracer.start_as_current_span("encoder.encode") as span:
            span.set_attribute("splitvl.request.images", len(inputs))
            span.set_attribute("splitvl.request.patches", sum(im.patches for im in inputs))
            timed = await asyncio.gather(
                *(
                    batcher.submit_timed(im.dedup_key, pre)
                    for im, pre in zip(inputs, images, strict=True)
                )
            )
            outs = [out for out, _ in timed]
            span.set_attribute(
                "splitvl.encoder.queue_wait_ms", max(i.queue_wait_s for _, i in timed) * 1000
            )
            span.set_attribute("splitvl.batch.ids", [i.batch_id for _, i in timed])
            span.set_attribute("splitvl.batch.sizes", [i.batch_size for _, i in timed])
            span.set_attribute("splitvl.tokens", sum(o.shape[0] for o in outs))
        return outs

    @staticmethod
    def _cast(out: torch.Tensor, output_dtype: int) -> torch.Tensor:
        if output_dtype == tensor_pb2.DATA_TYPE_BF16:
            return out.to(torch.bfloat16)
        if output_dtype == tensor_pb2.DATA_TYPE_FP32:
            return out.to(torch.float32)
        return out

    @staticmethod
    def _add(response: pb.EncodeResponse, image: ImageInput) -> tensor_pb2.ImageEmbedding:
        plan = image.plan
        return response.embeddings.add(
            grid=tensor_pb2.GridTHW(t=plan.grid_t, h=plan.grid_h, w=plan.grid_w), key=image.key
        )

    async def _answer_inline(
        self,
        response: pb.EncodeResponse,
        encode: EncodeInput,
        outs: list[torch.Tensor],
        *,
        on_thread: bool,
    ) -> None:
        """Fill ``response.embeddings`` with the ViT outputs cast to ``output_dtype`` (cast
        and copied on a worker thread ``on_thread``)."""

        def fill() -> None:
            for image, out in zip(encode.images, outs, strict=True):
                emb = self._add(response, image)
                emb.embeddings.CopyFrom(tensors.from_torch(self._cast(out, encode.output_dtype)))

        if on_thread:
            await asyncio.to_thread(fill)
        else:
            fill()
        sent = sum(tensors.payload_nbytes(e.embeddings) for e in response.embeddings)
        metrics.EMBEDDING_SENT_BYTES.inc(sent)
        trace.get_current_span().set_attribute("splitvl.embedding.bytes", sent)

    async def _answer_by_reference(
        self,
        response: pb.EncodeResponse,
        encode: EncodeInput,
        outs: list[torch.Tensor],
        *,
        on_thread: bool,
    ) -> None:
        """Fill ``response.embeddings`` with refs to the ViT outputs cast to ``output_dtype``,
        each held for ``readers`` readers (cast and held on a worker thread ``on_thread``).

        Raises:
            ServiceError: RESOURCE_EXHAUSTED ``HANDOFF_FULL`` from the holder (what this
                answer had held is freed).
        """
        assert self.holder is not None

        def payloads() -> Iterator[Payload]:
            for out in outs:
                cast = self._cast(out, encode.output_dtype)
                dtype, data = tensors.torch_payload(cast)
                yield Payload(data, dtype, tuple(cast.shape))

        held = await hold_answer(
            self.holder,
            payloads(),
            transport=encode.transport,
            readers=encode.readers,
            on_thread=on_thread,
        )
        for image, h in zip(encode.images, held, strict=True):
            assert h is not None
            emb = self._add(response, image)
            emb.embeddings.dtype, emb.embeddings.shape[:] = h.payload.dtype, list(h.payload.shape)
            emb.ref.CopyFrom(h.ref)
