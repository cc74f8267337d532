"""Errors that travel in the gRPC status, with google.rpc.ErrorInfo details.

Every service raises :class:`ServiceError` (or a subclass) from its domain code; the
server's :class:`~vlcommon.interceptors.ErrorInterceptor` turns it into the call's status
with :func:`abort`, so servicers map nothing by hand. The status carries a
``google.rpc.ErrorInfo`` (reason in UPPER_SNAKE, metadata naming the field and the
limit), packed with grpcio-status as in grpc's ``examples/python/errors/``.

Services name each reason through the registry, :class:`vlcommon.refusals.Refusal`
(``Refusal.IMAGE_DECODE_FAILED.error(message, field=...)``), which gives it its one
status; :func:`invalid_argument`, :func:`resource_exhausted` and :func:`unavailable` stay
for tests and tools that build an error of their own.
"""

from __future__ import annotations

from typing import NoReturn, TypeVar

import grpc
from google.protobuf import any_pb2, message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

_D = TypeVar("_D", error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo)

ERROR_DOMAIN = "splitvl.qwenvl"
#: Trailing metadata key with the retry hint of a RESOURCE_EXHAUSTED answer, milliseconds.
RETRY_AFTER_KEY = "retry-after-ms"


# gRPC refuses trailing metadata over 16 KiB (its hard limit, on the client side too), and
# the message travels twice (grpc-message, and inside grpc-status-details-bin): a message
# that quotes a long input (a 9,000-character role, a 100,000-dimension shape) turned the
# answer into RESOURCE_EXHAUSTED "received metadata size exceeds hard limit", without the
# field. Messages and metadata values are therefore shortened in the middle, keeping the
# start (the field) and the end (the limit).
MAX_MESSAGE_CHARS = 1024
MAX_METADATA_CHARS = 256


def shorten(text: str, limit: int) -> str:
    """``text``, or its start and end around a note of how many characters were left out."""
    if len(text) <= limit:
        return text
    tail = limit // 4
    head = limit - tail - 40
    return f"{text[:head]} ... [{len(text) - head - tail} characters left out] ... {text[-tail:]}"


class ServiceError(Exception):
    """A failure with the gRPC status it must produce.

    Args:
        code: The gRPC status code.
        reason: UPPER_SNAKE reason for ErrorInfo, e.g. ``IMAGE_DECODE_FAILED``.
        message: Human-readable message naming the field and, where one applies, the limit;
            over ``MAX_MESSAGE_CHARS`` it is shortened in the middle.
        metadata: ErrorInfo metadata, e.g. ``{"field": "images[1]", "limit": "200"}``;
            values over ``MAX_METADATA_CHARS`` are shortened in the middle.
        retry_after_ms: A retry hint (over-capacity answers): sent as a
            ``google.rpc.RetryInfo`` detail and ``retry-after-ms`` trailing metadata.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        reason: str,
        message: str,
        metadata: dict[str, str] | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        message = shorten(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.metadata = {
            k: shorten(str(v), MAX_METADATA_CHARS) for k, v in (metadata or {}).items()
        }
        self.retry_after_ms = retry_after_ms

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


def invalid_argument(reason: str, message: str, *, field: str, **metadata: object) -> ServiceError:
    """A ServiceError with INVALID_ARGUMENT naming ``field``."""
    return ServiceError(
        grpc.StatusCode.INVALID_ARGUMENT,
        reason,
        message,
        {"field": field, **{k: str(v) for k, v in metadata.items()}},
    )


def resource_exhausted(
    reason: str,
    message: str,
    *,
    field: str,
    limit: object,
    retry_after_ms: int | None = None,
    **metadata: object,
) -> ServiceError:
    """A ServiceError with RESOURCE_EXHAUSTED naming ``field`` and ``limit``; with
    ``retry_after_ms`` (a full queue, a concurrency limit) it carries a RetryInfo hint."""
    return ServiceError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        reason,
        message,
        {"field": field, "limit": str(limit), **{k: str(v) for k, v in metadata.items()}},
        retry_after_ms=retry_after_ms,
    )


def unavailable(reason: str, message: str, *, service: str, **metadata: object) -> ServiceError:
    """A ServiceError with UNAVAILABLE naming the ``service`` that cannot answer now."""
    return ServiceError(
        grpc.StatusCode.UNAVAILABLE,
        reason,
        message,
        {"service": service, **{k: str(v) for k, v in metadata.items()}},
    )


class ConfigError(ValueError):
    """A service's settings cannot work (e.g. an auth token file that yields no token);
    raised before anything listens, and turned into exit status 1 by ``server.run``."""


def to_status(err: ServiceError) -> grpc.Status:
    """Pack ``err`` as a grpc.Status whose trailing metadata holds google.rpc.Status
    (ErrorInfo, plus RetryInfo and ``retry-after-ms`` when ``err`` has a retry hint)."""
    info = error_details_pb2.ErrorInfo(
        reason=err.reason, domain=ERROR_DOMAIN, metadata=err.metadata
    )
    detail = any_pb2.Any()
    detail.Pack(info)
    details = [detail]
    if err.retry_after_ms is not None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromMilliseconds(int(err.retry_after_ms))
        details.append(any_pb2.Any())
        details[-1].Pack(retry)
    status = status_pb2.Status(
        code=getattr(code_pb2, err.code.name, code_pb2.UNKNOWN),
        message=err.message,
        details=details,
    )
    packed = rpc_status.to_status(status)
    if err.retry_after_ms is None:
        return packed
    # Plain metadata too, for clients that do not parse google.rpc details.
    return _Status(
        packed.code,
        packed.details,
        (*packed.trailing_metadata, (RETRY_AFTER_KEY, str(int(err.retry_after_ms)))),
    )


class _Status(grpc.Status):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple) -> None:  # type: ignore[type-arg]
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata


async def abort(context: grpc.aio.ServicerContext, err: ServiceError) -> NoReturn:
    """Abort the RPC with ``err``'s code, message and ErrorInfo details."""
    status = to_status(err)
    await context.abort(status.code, status.details, status.trailing_metadata)
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


def _detail(error: grpc.aio.AioRpcError | grpc.RpcError, message_type: type[_D]) -> _D | None:
    """The first ``message_type`` detail in a failed call's google.rpc.Status, or None.

    A status whose code disagrees with the call's (grpcio-status raises ValueError: e.g. a
    local deadline fired over a server's detailed error) carries no trustworthy detail, nor
    does one whose bytes do not parse (a misbehaving proxy: protobuf's DecodeError), nor an
    ErrorInfo without a reason.
    """
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
        if status is None:
            return None
        for detail in status.details:
            if detail.Is(message_type.DESCRIPTOR):
                info = message_type()
                detail.Unpack(info)
                if isinstance(info, error_details_pb2.ErrorInfo) and not info.reason:
                    return None
                return info
    except (ValueError, message.DecodeError):
        return None
    return None


def error_info(error: grpc.aio.AioRpcError | grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo carried by a failed call, or None."""
    return _detail(error, error_details_pb2.ErrorInfo)


def retry_info(error: grpc.aio.AioRpcError | grpc.RpcError) -> error_details_pb2.RetryInfo | None:
    """The RetryInfo carried by a failed call, or None."""
    return _detail(error, error_details_pb2.RetryInfo)
