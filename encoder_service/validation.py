"""The encoder's request checks: an ``EncodeRequest`` checked whole before any work.

:func:`parse_encode` refuses a bad answer format first (``output_dtype``, ``transport``,
``readers``), then the images (their count, each one's pixels, resize plan and patch
limit), and returns an :class:`EncodeInput`: the pixels as numpy arrays with their
plans, ready for the engine's preprocessing. Nothing is resized, batched or held before
the whole request has passed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from qwenvl.common.v1 import tensor_pb2
from qwenvl.encoder.v1 import encoder_service_pb2 as pb

from vlcommon import tensors
from vlcommon.by_reference import by_reference
from vlcommon.handoff import MAX_READERS, Holder
from vlcommon.imaging import MAX_ASPECT_RATIO, ResizePlan
from vlcommon.model_info import VisionSpec
from vlcommon.refusals import Refusal
from vlcommon.request_rules import check_count

#: The ``output_dtype`` values Encode answers in (unspecified: the ViT's own dtype).
OUTPUT_DTYPES = (
    tensor_pb2.DATA_TYPE_UNSPECIFIED,
    tensor_pb2.DATA_TYPE_FP32,
    tensor_pb2.DATA_TYPE_BF16,
)


@dataclass(frozen=True)
class Limits:
    """Request limits of the encoder.

    Attributes:
        max_images: Images (and videos) per Encode call.
        max_patches: ViT patches (grid t*h*w) per image.
        max_video_patches: ViT patches per video.
    """

    max_images: int
    max_patches: int
    max_video_patches: int


@dataclass(frozen=True)
class ImageInput:
    """One image (or video) of the request, checked.

    Attributes:
        key: The request's key for it, echoed in the answer ("" when unset).
        dedup_key: Its in-flight de-duplication key (:class:`encoder_service.batcher.Batcher`):
            the key AND the plan, so one key never stands for two different resizes; ""
            when unset (never shared).
        pixels: uint8 [height, width, 3] for an image, [frames, height, width, 3] for a
            video (read-only, over the request's bytes).
        plan: Its resize plan, checked against the model's geometry.
    """

    key: str
    dedup_key: str
    pixels: np.ndarray
    plan: ResizePlan

    @property
    def patches(self) -> int:
        """ViT patches: grid t*h*w."""
        return self.plan.grid_t * self.plan.grid_h * self.plan.grid_w


@dataclass(frozen=True)
class EncodeInput:
    """One EncodeRequest, checked.

    Attributes:
        images: The images in request order.
        output_dtype: FP32, BF16, or unspecified (the ViT's own dtype).
        transport: The request's ``Transport`` (unspecified: inline).
        by_ref: Answer by reference (a transport named and a holder present).
        readers: Readers each held embedding waits for (1..MAX_READERS).
    """

    images: tuple[ImageInput, ...]
    output_dtype: int
    transport: int
    by_ref: bool
    readers: int


def parse_encode(
    request: pb.EncodeRequest, spec: VisionSpec, limits: Limits, holder: Holder | None
) -> EncodeInput:
    """Check a whole EncodeRequest: the answer's format, then every image.

    Args:
        spec: The model's vision geometry (patch size, merge size, temporal patch).
        limits: The service's image count and patch limits.
        holder: The service's holder; None answers inline whatever the transport.

    Raises:
        ServiceError: INVALID_ARGUMENT ``OUTPUT_DTYPE_UNSUPPORTED`` (``output_dtype``),
            ``TRANSPORT_UNSUPPORTED`` (``transport``), ``READERS_OUT_OF_RANGE`` (``readers``,
            limit MAX_READERS), ``IMAGES_EMPTY`` / ``TOO_MANY_IMAGES`` (``images``), and as
            :func:`check_image`.
    """
    if request.output_dtype not in OUTPUT_DTYPES:
        raise Refusal.OUTPUT_DTYPE_UNSUPPORTED.error(
            "output_dtype must be FP32 or BF16", field="output_dtype"
        )
    by_ref = by_reference(request.transport, holder)
    if not 0 <= request.readers <= MAX_READERS:
        raise Refusal.READERS_OUT_OF_RANGE.error(
            f"readers is {request.readers}; allowed 0..{MAX_READERS}",
            field="readers",
            limit=MAX_READERS,
        )
    check_count(len(request.images), field="images", limit=limits.max_images, noun="images")
    return EncodeInput(
        images=tuple(
            check_image(im, f"images[{i}]", spec, limits) for i, im in enumerate(request.images)
        ),
        output_dtype=request.output_dtype,
        transport=request.transport,
        by_ref=by_ref,
        readers=request.readers or 1,
    )


def check_image(image: pb.EncodeImage, field: str, spec: VisionSpec, limits: Limits) -> ImageInput:
    """Check one image's (or video's) pixels, plan and patches.

    Raises:
        ServiceError: INVALID_ARGUMENT naming ``field``: a tensor that is not UINT8 of 3
            dimensions (an image) or 4 (a video), ``PIXELS_SHAPE_INVALID`` (not [..., 3],
            a side under 1, or a video's frames not already of the plan's size), and as
            :func:`plan_from_proto`; RESOURCE_EXHAUSTED ``IMAGE_TOO_MANY_PATCHES`` /
            ``VIDEO_TOO_MANY_PATCHES`` with the limit.
    """
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
    plan = plan_from_proto(image.plan, spec, f"{field}.plan", shape[0] if video else 0)
    if video and shape[1:3] != [plan.resized_height, plan.resized_width]:
        # Frames come resized by the gateway (one resize per frame, its plan).
        raise Refusal.PIXELS_SHAPE_INVALID.error(
            f"{field}.pixels.shape is {shape}; a video's frames must already have the "
            f"plan's size {plan.resized_height}x{plan.resized_width}",
            field=f"{field}.pixels.shape",
        )
    patches = plan.grid_t * plan.grid_h * plan.grid_w
    limit = limits.max_video_patches if video else limits.max_patches
    if patches > limit:
        too_many = Refusal.VIDEO_TOO_MANY_PATCHES if video else Refusal.IMAGE_TOO_MANY_PATCHES
        raise too_many.error(
            f"{field} has {patches} patches; the limit is {limit}", field=field, limit=limit
        )
    dedup_key = (
        f"{image.key}|{plan.grid_t}x{plan.resized_height}x{plan.resized_width}" if image.key else ""
    )
    return ImageInput(image.key, dedup_key, tensors.to_numpy(image.pixels, pixels), plan)


def plan_from_proto(
    msg: tensor_pb2.ResizePlan, spec: VisionSpec, field: str, frames: int = 0
) -> ResizePlan:
    """Check a ResizePlan against the model's geometry.

    Args:
        frames: 0 for an image (grid t = 1); a video's frame count, a positive multiple
            of temporal_patch_size (grid t = frames / temporal_patch_size).

    Raises:
        ServiceError: INVALID_ARGUMENT naming ``field``: ``RESIZE_PLAN_INVALID`` when sizes
            are not positive multiples of patch_size * spatial_merge_size, the grid does
            not follow or the aspect ratio is over MAX_ASPECT_RATIO;
            ``VIDEO_FRAMES_INVALID`` for a frame count that is not a multiple of
            temporal_patch_size.
    """
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
