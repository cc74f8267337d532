"""What the pipeline's stages pass along: one image or video as prepared for the cache,
the encoder and the decoder, the refs a request holds, and the small conversions the
stages share (grids as messages, a ref's bytes and holders as span attributes).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from opentelemetry import trace
from qwenvl.common.v1 import generation_pb2, tensor_pb2

from gateway.video import DecodedVideo
from vlcommon import handoff, tensors
from vlcommon.imaging import ImageHeader, ResizePlan
from vlcommon.verification import VerificationImage


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
    # After a lookup that claimed misses: cache_service_pb2.ClaimState (OWNED: this
    # gateway encodes it; ELSEWHERE: another one is encoding it, wait for its Put).
    claim: int = 0

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

    ``gateway.pipeline.preprocess`` builds an image's whenever the gateway has a cache
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
