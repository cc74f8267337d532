"""A request's deadline, one helper for every service and front.

A gRPC call carries its deadline (``context.time_remaining()``); an HTTP call gets one
when it arrives (``GATEWAY_HTTP_TIMEOUT_S``). Both become a :class:`Deadline`, an instant
on ``time.monotonic()``, which the stages ask for the time that remains before each hop
(so every downstream call gets what is left, capped by its own timeout) and which the
preprocess threads check between images and frames.

Usage::

    deadline = Deadline.of(context)          # a gRPC servicer
    deadline = Deadline.after(600.0)         # an HTTP request
    await stub.Encode(request, timeout=deadline.remaining(cap=30.0))
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from vlcommon.errors import ServiceError
from vlcommon.refusals import Refusal


def expired_error(what: str = "") -> ServiceError:
    """DEADLINE_EXCEEDED, saying while what (``what``: e.g. ``its images were prepared``)."""
    message = "the request's deadline expired" + (f" while {what}" if what else "")
    return Refusal.DEADLINE_EXCEEDED.error(message)


def cancelled_error() -> ServiceError:
    """CANCELLED: the client went away (or cancelled) before its request was served."""
    return Refusal.CANCELLED.error("the request was cancelled")


@dataclass(frozen=True)
class Deadline:
    """The instant (``time.monotonic()`` seconds) a request must be answered by; ``at``
    None means no deadline."""

    at: float | None = None

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        """A deadline ``seconds`` from now (None: none)."""
        return cls(None if seconds is None else time.monotonic() + seconds)

    @classmethod
    def of(cls, context: Any) -> Deadline:
        """The deadline of a call: anything with ``time_remaining()`` (a
        ``grpc.aio.ServicerContext``); None gives no deadline."""
        left = context.time_remaining() if context is not None else None
        return cls.after(left)

    def left(self) -> float | None:
        """Seconds left (negative once passed); None without a deadline. Never raises."""
        return None if self.at is None else self.at - time.monotonic()

    def remaining(self, cap: float | None = None) -> float | None:
        """Seconds left for the next hop, at most ``cap``; None when neither bounds it.

        Raises:
            ServiceError: DEADLINE_EXCEEDED when no time is left.
        """
        left = self.left()
        if left is not None and left <= 0:
            raise expired_error()
        if cap is None:
            return left
        return cap if left is None else min(left, cap)

    def check(self, stop: threading.Event | None = None, what: str = "") -> None:
        """Raise when the request was cancelled (``stop`` set) or its deadline passed:
        the check a worker thread makes between units of work.

        Raises:
            ServiceError: CANCELLED, or DEADLINE_EXCEEDED saying while ``what``.
        """
        if stop is not None and stop.is_set():
            raise cancelled_error()
        if self.at is not None and time.monotonic() >= self.at:
            raise expired_error(what)


NO_DEADLINE = Deadline()
