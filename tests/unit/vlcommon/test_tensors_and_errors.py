"""Tensor codec and error packing."""

from __future__ import annotations

import re

import grpc
import numpy as np
import pytest
import torch
from qwenvl.common.v1 import tensor_pb2

from vlcommon import tensors
from vlcommon.errors import ServiceError, invalid_argument, to_status


def test_fp32_round_trip_is_exact() -> None:
    x = torch.randn(5, 7)
    msg = tensors.from_torch(x)
    assert msg.dtype == tensor_pb2.DATA_TYPE_FP32 and list(msg.shape) == [5, 7]
    assert len(msg.data) == 5 * 7 * 4
    assert torch.equal(tensors.to_torch(msg), x)


def test_bf16_round_trip_keeps_bits_and_widens_for_numpy() -> None:
    x = torch.randn(3, 4).to(torch.bfloat16)
    msg = tensors.from_torch(x)
    assert msg.dtype == tensor_pb2.DATA_TYPE_BF16 and len(msg.data) == 3 * 4 * 2
    back = tensors.to_torch(msg)
    assert back.dtype == torch.bfloat16 and torch.equal(back, x)
    assert np.array_equal(tensors.to_numpy(msg), x.float().numpy())


@pytest.mark.parametrize(
    ("dtype", "torch_dtype"),
    [
        (tensor_pb2.DATA_TYPE_BF16, torch.bfloat16),
        (tensor_pb2.DATA_TYPE_FP16, torch.float16),
    ],
)
def test_all_finite_agrees_with_torch_on_every_16_bit_pattern(dtype: int, torch_dtype) -> None:
    """The exponent-bit test (no float conversion) against torch.isfinite, element by
    element, over all 65,536 bit patterns of the type; and on a whole tensor, one bad
    element anywhere (first, middle, last) makes it False."""
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    expected = torch.isfinite(patterns.view(torch_dtype))
    msg = tensor_pb2.Tensor(dtype=dtype, shape=[1])
    got = torch.tensor(
        [tensors.all_finite(msg, p.numpy().tobytes()) for p in patterns.view(torch.int16)]
    )
    assert torch.equal(got, expected)
    assert 0 < int(expected.sum()) < 65536  # both answers occur
    finite = torch.randn(64, 96).to(torch_dtype)
    msg = tensors.from_torch(finite) if dtype == tensor_pb2.DATA_TYPE_BF16 else None
    msg = msg or tensor_pb2.Tensor(dtype=dtype, shape=[64, 96], data=finite.numpy().tobytes())
    assert tensors.all_finite(msg)
    for index in (0, 64 * 96 // 2, 64 * 96 - 1):
        for bad in (float("nan"), float("inf"), float("-inf")):
            broken = finite.clone().view(-1)
            broken[index] = bad
            data = broken.view(torch.int16).numpy().tobytes()
            assert not tensors.all_finite(msg, data), (index, bad)


def test_all_finite_fp32_and_empty_and_integers() -> None:
    x = torch.randn(32, 16)
    x[0, 0] = torch.finfo(torch.float32).max
    x[1, 1] = torch.finfo(torch.float32).tiny / 4  # subnormal
    x[2, 2] = -0.0
    msg = tensors.from_torch(x)
    assert tensors.all_finite(msg)
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[31, 15] = bad
        assert not tensors.all_finite(tensors.from_torch(y))
    assert tensors.all_finite(tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_BF16, shape=[0, 8]))
    ints = tensors.from_numpy(np.full((4,), 255, dtype=np.uint8))  # 0xFF bytes: no floats
    assert tensors.all_finite(ints)


def test_validate_names_field_and_sizes() -> None:
    msg = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FP32, shape=[2, 3], data=b"\0" * 20)
    with pytest.raises(ServiceError) as exc:
        tensors.validate(msg, field="images[1].embeddings")
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "images[1].embeddings.data has 20 bytes" in exc.value.message
    assert "needs 24" in exc.value.message
    with pytest.raises(ServiceError, match="expected one of UINT8"):
        tensors.validate(msg, field="x", dtypes=(tensor_pb2.DATA_TYPE_UINT8,))


def test_validate_hands_back_the_payload_it_read_for_decoding() -> None:
    """Every read of a protobuf bytes field copies it (125 ms for 200 MiB), so validate
    returns the payload it read and the decoders take it instead of reading ``data``
    again: decoding the handed-in bytes, not the message's. ``payload_nbytes`` counts
    bytes from dtype and shape without a copy."""
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    msg = tensors.from_numpy(array)
    data = tensors.validate(msg, field="x", ndim=2)
    assert data == msg.data
    other = (array + 100).tobytes()  # same size: proves the given bytes are what is decoded
    np.testing.assert_array_equal(tensors.to_numpy(msg, other), array + 100)
    assert torch.equal(tensors.to_torch(msg, other), torch.from_numpy(array + 100))
    bf16 = tensors.from_torch(torch.from_numpy(array).to(torch.bfloat16))
    raw = tensors.validate(bf16, field="y")
    assert torch.equal(tensors.to_torch(bf16, raw), torch.from_numpy(array).to(torch.bfloat16))
    assert tensors.payload_nbytes(msg) == len(msg.data) == 48
    assert tensors.payload_nbytes(bf16) == len(bf16.data) == 24
    assert tensors.payload_nbytes(tensor_pb2.Tensor(shape=[2] * 9, dtype=1)) == 0  # > MAX_NDIM
    # A negative dimension (a malformed response counted before it is checked) counts 0,
    # never a negative number of bytes.
    negative = tensor_pb2.Tensor(shape=[-3, 4], dtype=tensor_pb2.DATA_TYPE_FP32)
    assert tensors.payload_nbytes(negative) == 0


def test_a_shape_of_too_many_dimensions_is_refused_before_its_size_is_computed() -> None:
    """The dimension count is bounded first: for 130,000 dimensions of 2**62 the byte count
    (Python big integers) held the decoder's event loop for 42 s before the size mismatch
    was found. The answer names the shape and the bound, not the size."""
    msg = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FP32, shape=[2**62] * 2000 + [0])
    with pytest.raises(ServiceError) as exc:
        tensors.validate(msg, field="images[0].embeddings")
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.reason == "TENSOR_SHAPE_INVALID"
    assert exc.value.message == (
        f"images[0].embeddings.shape has 2001 dimensions; at most {tensors.MAX_NDIM} are allowed"
    )
    assert exc.value.metadata == {"field": "images[0].embeddings.shape", "limit": "8"}
    ok = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_UINT8, shape=[1] * 8, data=b"\0")
    tensors.validate(ok, field="x")


def test_a_message_quoting_a_long_input_is_shortened_in_the_middle() -> None:
    """gRPC refuses trailing metadata over 16 KiB and the message travels twice, so an
    error quoting a 9,000-character input reached the client as RESOURCE_EXHAUSTED without
    the field. Messages keep their start (the field) and end (the limit)."""
    from vlcommon.errors import MAX_MESSAGE_CHARS, MAX_METADATA_CHARS

    role = "u" * 9000
    full = f"messages[0].role is {role!r}; expected one of system, user, assistant"
    err = invalid_argument("ROLE_INVALID", full, field="messages[0].role", actual=role)
    assert len(err.message) <= MAX_MESSAGE_CHARS
    assert err.message.startswith("messages[0].role is 'uuu")
    assert err.message.endswith("; expected one of system, user, assistant")
    # What is kept plus what the note counts is the whole message.
    note = re.search(r" \.\.\. \[(\d+) characters left out\] \.\.\. ", err.message)
    assert note is not None
    head, tail = err.message[: note.start()], err.message[note.end() :]
    assert full.startswith(head) and full.endswith(tail)
    assert len(head) + int(note[1]) + len(tail) == len(full)
    assert err.metadata["field"] == "messages[0].role"
    assert len(err.metadata["actual"]) <= MAX_METADATA_CHARS
    short = invalid_argument("X", "images[0] is bad", field="images[0]")
    assert short.message == "images[0] is bad"
    status = to_status(err)
    assert sum(len(k) + len(v) for k, v in status.trailing_metadata) < 4096


def test_status_carries_error_info() -> None:
    from google.rpc import error_details_pb2, status_pb2

    status = to_status(
        invalid_argument("IMAGE_DECODE_FAILED", "images[0] could not be decoded", field="images[0]")
    )
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT
    [(key, value)] = [m for m in status.trailing_metadata if m[0] == "grpc-status-details-bin"]
    rpc = status_pb2.Status.FromString(value)
    info = error_details_pb2.ErrorInfo()
    rpc.details[0].Unpack(info)
    assert info.reason == "IMAGE_DECODE_FAILED" and info.metadata["field"] == "images[0]"


def test_from_rpc_error_ignores_details_whose_code_disagrees_with_the_call() -> None:
    """A local deadline that fired over a server's detailed RESOURCE_EXHAUSTED: grpcio-status
    refuses the mismatched status (ValueError); the error keeps the call's own code and names
    the dependency instead of escaping as an exception."""
    from google.rpc import code_pb2, error_details_pb2, status_pb2
    from grpc.aio import AioRpcError, Metadata

    from vlcommon.errors import error_info, retry_info
    from vlcommon.relay import from_rpc_error

    detail = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message="queue full")
    detail.details.add().Pack(error_details_pb2.RetryInfo())
    err = AioRpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        Metadata(),
        Metadata(("grpc-status-details-bin", detail.SerializeToString())),
        details="Deadline Exceeded",
    )
    assert error_info(err) is None and retry_info(err) is None
    mapped = from_rpc_error(err, dependency="encoder")
    assert mapped.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert mapped.message == "encoder did not answer in time: Deadline Exceeded"
    assert mapped.retry_after_ms is None


def test_from_rpc_error_reads_a_dependency_cancel_as_its_unavailability() -> None:
    """Our own cancel never comes back as a status: a CANCELLED received means the
    dependency cancelled the call (a replica stopping). Passed on as CANCELLED, the caller
    read it as its own cancel (``splitvl faults``, a rolling restart); it is UNAVAILABLE
    of that dependency, which callers retry."""
    from grpc.aio import AioRpcError, Metadata

    from vlcommon.relay import from_rpc_error

    err = AioRpcError(grpc.StatusCode.CANCELLED, Metadata(), Metadata(), details="CANCELLED")
    mapped = from_rpc_error(err, dependency="encoder")
    assert mapped.code == grpc.StatusCode.UNAVAILABLE
    assert mapped.message == "encoder cancelled the call (shutting down?): CANCELLED"
    assert mapped.metadata["dependency"] == "encoder"
    assert mapped.reason == "ENCODER_UNAVAILABLE"
