"""The encode stage: ``EncoderService/Encode`` for the misses, answered with refs."""

from __future__ import annotations

import grpc
from opentelemetry import trace
from qwenvl.common.v1 import tensor_pb2
from qwenvl.encoder.v1 import encoder_service_pb2, encoder_service_pb2_grpc

from gateway import metrics
from gateway.pipeline.types import (
    HeldRefs,
    PreparedImage,
    answer_or_release,
    grid_message,
    inline_bytes,
    ref_attributes,
    release,
)
from vlcommon import handoff, tensors
from vlcommon.deadline import Deadline
from vlcommon.refusals import Refusal
from vlcommon.relay import from_rpc_error

tracer = trace.get_tracer("splitvl.gateway")


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
        deadline: Deadline,
        *,
        readers: int = 1,
        held: HeldRefs | None = None,
    ) -> None:
        """``EncoderService/Encode`` for the misses: the encoder holds their embeddings for
        ``readers`` readers (the decoder, and the cache when it stores them) and answers
        refs (an encoder that answers the bytes inline is relayed as it is). No misses:
        no call."""
        if not misses:
            return
        request = encoder_service_pb2.EncodeRequest(transport=self.transport, readers=readers)
        for im in misses:
            if im.pixels is None:  # a file-digest hit has its embedding: never a miss
                raise Refusal.INTERNAL.error(f"images[{im.index}] has no pixels")
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
                    self.encoder.Encode(request, timeout=deadline.remaining(self.timeout_s)),
                    lambda r: r.embeddings,
                    readers,
                )
            except grpc.aio.AioRpcError as err:
                raise from_rpc_error(err, dependency="encoder") from err
            if len(response.embeddings) != len(misses):
                release(self.releaser, response.embeddings)
                raise Refusal.ENCODER_BAD_RESPONSE.error(
                    f"encoder answered {len(response.embeddings)} embeddings for "
                    f"{len(misses)} images",
                    dependency="encoder",
                )
            received = sum(inline_bytes(e) for e in response.embeddings)
            metrics.EMBEDDING_RECEIVED_BYTES.labels(source="encoder").inc(received)
            span.set_attribute("splitvl.embedding.bytes", received)
            ref_attributes(span, response.embeddings)
        for im, emb in zip(misses, response.embeddings, strict=True):
            im.embedding = emb
            if held is not None:
                held.add(emb)
