"""A dependency's failed call, relayed to this service's caller with its own status.

The gateway calls the encoder and the decoder; when one fails, :func:`from_rpc_error`
keeps what the dependency said (its code, message and ErrorInfo) and adds which
dependency it was, reading a status that came without ErrorInfo (the transport's own) by
the registry's reasons of that dependency (:data:`DEPENDENCY_FAILURES`).
"""

from __future__ import annotations

import grpc

from vlcommon.errors import ServiceError, error_info, retry_info
from vlcommon.refusals import Refusal

_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
_DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED
_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
_UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED
_DENIED = grpc.StatusCode.PERMISSION_DENIED
_UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


#: The reasons of a dependency's status that came without ErrorInfo (the transport's own:
#: unreachable, a local deadline, a message over the size limit, a method it lacks; or a
#: proxy's or mesh's authorization in front of it, kept as a configuration error); any
#: other such status is read as the dependency failing (UNAVAILABLE).
DEPENDENCY_FAILURES: dict[str, dict[grpc.StatusCode, Refusal]] = {
    "encoder": {
        _UNAVAILABLE: Refusal.ENCODER_UNAVAILABLE,
        _DEADLINE: Refusal.ENCODER_DEADLINE_EXCEEDED,
        _EXHAUSTED: Refusal.ENCODER_RESOURCE_EXHAUSTED,
        _UNIMPLEMENTED: Refusal.ENCODER_UNIMPLEMENTED,
        _DENIED: Refusal.ENCODER_PERMISSION_DENIED,
        _UNAUTHENTICATED: Refusal.ENCODER_UNAUTHENTICATED,
    },
    "decoder": {
        _UNAVAILABLE: Refusal.DECODER_UNAVAILABLE,
        _DEADLINE: Refusal.DECODER_DEADLINE_EXCEEDED,
        _EXHAUSTED: Refusal.DECODER_RESOURCE_EXHAUSTED,
        _UNIMPLEMENTED: Refusal.DECODER_UNIMPLEMENTED,
        _DENIED: Refusal.DECODER_PERMISSION_DENIED,
        _UNAUTHENTICATED: Refusal.DECODER_UNAUTHENTICATED,
    },
}


def from_rpc_error(error: grpc.aio.AioRpcError, *, dependency: str) -> ServiceError:
    """Re-raise a downstream failure with its own code, message and ErrorInfo.

    Bad input found downstream stays INVALID_ARGUMENT; a dependency that cannot be
    reached is UNAVAILABLE naming it; an INTERNAL error downstream is reported as
    UNAVAILABLE of that dependency rather than as our own INTERNAL; a call the dependency
    cancelled (a replica shutting down) is UNAVAILABLE of it, never CANCELLED, which the
    caller would read as its own cancel. A status without ErrorInfo (the transport's own)
    gets the registry's reason of ``dependency`` and that status
    (:data:`DEPENDENCY_FAILURES`: ``ENCODER_UNAVAILABLE``,
    ``DECODER_DEADLINE_EXCEEDED``, ...); one gRPC never produces by itself is read as the
    dependency failing.

    Args:
        error: The dependency's failed call.
        dependency: ``encoder`` or ``decoder`` (a key of ``DEPENDENCY_FAILURES``).
    """
    info = error_info(error)
    code = error.code()
    message = error.details() or code.name
    fallbacks = DEPENDENCY_FAILURES[dependency]
    if info is None and code not in fallbacks and code != grpc.StatusCode.CANCELLED:
        code = grpc.StatusCode.INTERNAL  # read below as the dependency failing
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        code = grpc.StatusCode.UNAVAILABLE
        message = f"{dependency} failed: {message}"
    elif code == grpc.StatusCode.UNAVAILABLE:
        message = f"{dependency} unavailable: {message}"
    elif code == grpc.StatusCode.CANCELLED:
        # Our own cancel never comes back as a status: the dependency cancelled the call
        # (a replica stopping). That is its unavailability, not the caller's cancel.
        code = grpc.StatusCode.UNAVAILABLE
        message = f"{dependency} cancelled the call (shutting down?): {message}"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        message = f"{dependency} did not answer in time: {message}"
    reason = info.reason if info is not None else fallbacks[code]
    metadata = dict(info.metadata) if info is not None else {}
    metadata.setdefault("dependency", dependency)
    retry = retry_info(error)  # a full queue downstream keeps its retry hint
    retry_ms = retry.retry_delay.ToMilliseconds() if retry is not None else None
    return ServiceError(code, reason, message, metadata, retry_after_ms=retry_ms)
