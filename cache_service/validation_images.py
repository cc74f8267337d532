"""The verification image of a Lookup query or a Put entry, checked into
:class:`vlcommon.verification.VerificationImage` (its luma, chroma and JPEG fields): the
largest part of :mod:`cache_service.validation`, apart so that module reads as the
requests' rules."""

from __future__ import annotations

import numpy as np
from qwenvl.cache.v1 import cache_service_pb2 as pb
from qwenvl.common.v1 import tensor_pb2

from vlcommon import tensors
from vlcommon.refusals import Refusal
from vlcommon.verification import (
    CHROMA_SCALE,
    JPEG_MAX_CLIPPED_SHARE,
    JPEG_MAX_SIDE,
    MAX_VERIFICATION_BYTES,
    JpegLuma,
    VerificationImage,
    chroma_shape,
)


def verification_image(msg: pb.LookupQuery | pb.PutEntry, prefix: str) -> VerificationImage | None:
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
