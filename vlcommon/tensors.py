"""Tensor codec: numpy/torch arrays <-> ``qwenvl.common.v1.Tensor`` (dtype + shape + raw bytes).

Row-major, little-endian bytes with Open Inference Protocol dtype names. BF16 has no
numpy dtype: it travels as the upper 16 bits of each float32 and is decoded to torch
directly (``torch.frombuffer``) or widened to float32 for numpy.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
from qwenvl.common.v1 import tensor_pb2

from vlcommon.refusals import Refusal

if TYPE_CHECKING:
    import torch

DataType = tensor_pb2.DataType

ITEMSIZE: dict[int, int] = {
    tensor_pb2.DATA_TYPE_UINT8: 1,
    tensor_pb2.DATA_TYPE_FP32: 4,
    tensor_pb2.DATA_TYPE_FP16: 2,
    tensor_pb2.DATA_TYPE_BF16: 2,
    tensor_pb2.DATA_TYPE_INT64: 8,
}
#: The dtypes an image's or video's embeddings may travel in (the decoder casts them to
#: the engine's dtype; FACTS.md: bf16 into a float32 engine is accepted).
EMBEDDING_DTYPES = (
    tensor_pb2.DATA_TYPE_FP32,
    tensor_pb2.DATA_TYPE_BF16,
    tensor_pb2.DATA_TYPE_FP16,
)
_NUMPY: dict[int, Any] = {
    tensor_pb2.DATA_TYPE_UINT8: np.dtype("<u1"),
    tensor_pb2.DATA_TYPE_FP32: np.dtype("<f4"),
    tensor_pb2.DATA_TYPE_FP16: np.dtype("<f2"),
    tensor_pb2.DATA_TYPE_INT64: np.dtype("<i8"),
}


def dtype_name(dtype: int) -> str:
    """Open Inference Protocol name of a DataType value, e.g. ``FP32``."""
    return tensor_pb2.DataType.Name(dtype).removeprefix("DATA_TYPE_")


def numel(shape: list[int] | tuple[int, ...]) -> int:
    """Number of elements of ``shape``."""
    return math.prod(int(s) for s in shape)


# No tensor of the contracts has more than 3 dimensions. The bound is checked before
# anything else looks at the shape: the byte count needs prod(shape), and for a shape of
# 130,000 dimensions of 2**62 Python's big integers took 42 s on the decoder's event loop
# (health checks and every stream in flight stalled).
MAX_NDIM = 8


def validate(
    msg: tensor_pb2.Tensor,
    *,
    field: str,
    dtypes: tuple[int, ...] | None = None,
    ndim: int | None = None,
    data: bytes | bytearray | None = None,
) -> bytes | bytearray:
    """Check that a Tensor is self-consistent; return its payload.

    ``data``: the payload when it did not travel in the message (read by reference,
    :mod:`vlcommon.handoff`); it is checked against ``msg``'s dtype and shape instead of
    ``msg.data``.

    Reading a bytes field of a protobuf message copies it every time (upb): 125 ms for
    200 MiB here, holding the GIL. ``data`` is read once, and the returned bytes are for
    the caller to decode (``to_numpy(msg, data)``, ``to_torch(msg, data)``) or keep.

    Raises:
        ServiceError: INVALID_ARGUMENT naming ``field`` when the dtype is not allowed, the
            shape has more than ``MAX_NDIM`` dimensions, a dimension is negative, ``ndim``
            differs, or ``len(data)`` is not ``prod(shape) * itemsize``.
    """
    if len(msg.shape) > MAX_NDIM:
        raise Refusal.TENSOR_SHAPE_INVALID.error(
            f"{field}.shape has {len(msg.shape)} dimensions; at most {MAX_NDIM} are allowed",
            field=f"{field}.shape",
            limit=MAX_NDIM,
        )
    if msg.dtype not in ITEMSIZE or (dtypes is not None and msg.dtype not in dtypes):
        allowed = ", ".join(dtype_name(d) for d in (dtypes or tuple(ITEMSIZE)))
        raise Refusal.TENSOR_DTYPE_UNSUPPORTED.error(
            f"{field}.dtype is {dtype_name(msg.dtype) if msg.dtype in ITEMSIZE else msg.dtype}; "
            f"expected one of {allowed}",
            field=f"{field}.dtype",
        )
    if ndim is not None and len(msg.shape) != ndim:
        raise Refusal.TENSOR_SHAPE_INVALID.error(
            f"{field}.shape is {list(msg.shape)}; expected {ndim} dimensions",
            field=f"{field}.shape",
        )
    if any(s < 0 for s in msg.shape):
        raise Refusal.TENSOR_SHAPE_INVALID.error(
            f"{field}.shape {list(msg.shape)} has a negative dimension", field=f"{field}.shape"
        )
    expected = numel(msg.shape) * ITEMSIZE[msg.dtype]
    if data is None:
        data = msg.data
    if len(data) != expected:
        raise Refusal.TENSOR_SIZE_MISMATCH.error(
            f"{field}.data has {len(data)} bytes; shape {list(msg.shape)} of "
            f"{dtype_name(msg.dtype)} needs {expected}",
            field=f"{field}.data",
            expected=expected,
            actual=len(data),
        )
    return data


def payload_nbytes(msg: tensor_pb2.Tensor) -> int:
    """Bytes of a tensor's payload from its dtype and shape, without copying ``data``.

    Equal to ``len(msg.data)`` for a tensor that passed :func:`validate` or was built by
    this module; for counting (metrics, span attributes), not for checking. A shape that
    could not pass (too many or negative dimensions, an unknown dtype) counts 0, so a
    malformed downstream response never feeds a Prometheus counter a negative (which
    raises).
    """
    if len(msg.shape) > MAX_NDIM or msg.dtype not in ITEMSIZE or any(s < 0 for s in msg.shape):
        return 0
    return numel(msg.shape) * ITEMSIZE[msg.dtype]


def from_numpy(array: np.ndarray) -> tensor_pb2.Tensor:
    """Encode a numpy array (uint8, float32, float16 or int64)."""
    arr = np.ascontiguousarray(array)
    for code, dt in _NUMPY.items():
        if arr.dtype == dt or arr.dtype == dt.newbyteorder("="):
            return tensor_pb2.Tensor(
                dtype=code, shape=list(arr.shape), data=arr.astype(dt, copy=False).tobytes()
            )
    raise TypeError(f"unsupported numpy dtype {arr.dtype}")


def to_numpy(msg: tensor_pb2.Tensor, data: bytes | bytearray | None = None) -> np.ndarray:
    """Decode to numpy (BF16 is widened to float32). The result is read-only.

    ``data``: the payload already read (what :func:`validate` returns), so it is not
    copied out of the message again.
    """
    if data is None:
        data = msg.data
    if msg.dtype == tensor_pb2.DATA_TYPE_BF16:
        upper = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        return upper.view(np.float32).reshape(tuple(msg.shape))
    return np.frombuffer(data, dtype=_NUMPY[msg.dtype]).reshape(tuple(msg.shape))


# IEEE-754 exponent field, all ones, of the 16-bit float types: an element whose magnitude
# bits (sign masked off) reach it is inf or NaN.
_NONFINITE_16 = {tensor_pb2.DATA_TYPE_BF16: 0x7F80, tensor_pb2.DATA_TYPE_FP16: 0x7C00}


def all_finite(msg: tensor_pb2.Tensor, data: bytes | bytearray | None = None) -> bool:
    """True when no element of a float tensor is NaN or +-inf (integer dtypes: always).

    ``data`` as for :func:`to_numpy`. One pass over the payload where it lies, with no
    float conversion: BF16 and FP16 by their exponent bits (``abs_bits < 0x7F80`` /
    ``0x7C00``), FP32 by numpy's ``isfinite``. Over one 1,024-token image of Qwen3-VL-2B's
    width in bf16 (16 MiB), on one thread: ``torch.isfinite`` 21 ms, ``np.isfinite`` over
    ``to_numpy``'s float32 widening 8.6 ms, this 1.6 ms
    (``scripts/measure_finite_check.py``; docs/benchmarks.md, "The finiteness check").
    """
    if data is None:
        data = msg.data
    if not data:
        return True
    limit = _NONFINITE_16.get(msg.dtype)
    if limit is not None:
        bits = np.frombuffer(data, dtype="<u2")
        return int((bits & 0x7FFF).max()) < limit
    if msg.dtype == tensor_pb2.DATA_TYPE_FP32:
        return bool(np.isfinite(np.frombuffer(data, dtype="<f4")).all())
    return True


def check_finite(msg: tensor_pb2.Tensor, data: bytes | bytearray | None, field: str) -> None:
    """Refuse embeddings holding NaN or inf (the decoder's inputs, the cache's entries):
    :func:`all_finite` over ``data`` (as for :func:`to_numpy`).

    Raises:
        ServiceError: INVALID_ARGUMENT ``EMBEDDING_NOT_FINITE`` naming ``field``.
    """
    if not all_finite(msg, data):
        raise Refusal.EMBEDDING_NOT_FINITE.error(f"{field} holds NaN or inf", field=field)


def from_torch(tensor: torch.Tensor) -> tensor_pb2.Tensor:
    """Encode a CPU or GPU torch tensor (float32, bfloat16, float16, uint8 or int64)."""
    import torch

    t = tensor.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return tensor_pb2.Tensor(
            dtype=tensor_pb2.DATA_TYPE_BF16,
            shape=list(t.shape),
            data=t.view(torch.int16).numpy().tobytes(),
        )
    return from_numpy(t.numpy())


def torch_payload(tensor: torch.Tensor) -> tuple[int, memoryview]:
    """(DataType, row-major bytes) of a torch tensor, for holding it by reference
    (:mod:`vlcommon.handoff`); the view shares the CPU copy's memory, which nobody
    writes afterwards."""
    import torch

    t = tensor.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return tensor_pb2.DATA_TYPE_BF16, t.view(torch.int16).numpy().data.cast("B")
    msg_dtype = {torch.float32: tensor_pb2.DATA_TYPE_FP32, torch.float16: tensor_pb2.DATA_TYPE_FP16}
    if t.dtype not in msg_dtype:
        raise TypeError(f"unsupported embedding dtype {t.dtype}")
    return msg_dtype[t.dtype], t.numpy().data.cast("B")


def to_torch(msg: tensor_pb2.Tensor, data: bytes | bytearray | None = None) -> torch.Tensor:
    """Decode to a CPU torch tensor of the message's dtype (BF16 stays bfloat16).

    ``data`` as for :func:`to_numpy`. The tensor owns a writable copy (of a bytearray
    ``data``, read by reference and owned by the caller, it takes that buffer itself).
    """
    import torch

    if data is None:
        data = msg.data
    if msg.dtype == tensor_pb2.DATA_TYPE_BF16:
        if not data:
            return torch.empty(tuple(msg.shape), dtype=torch.bfloat16)
        # A bytearray (read by reference) is the caller's own: no second copy.
        own = data if isinstance(data, bytearray) else bytearray(data)
        raw = torch.frombuffer(own, dtype=torch.int16)
        return raw.view(torch.bfloat16).reshape(tuple(msg.shape))
    array = to_numpy(msg, data)
    return torch.from_numpy(array if isinstance(data, bytearray) else array.copy())
