"""Admission control: a bounded number of RPCs at once per service, the one over the
limit refused at once with RESOURCE_EXHAUSTED and a retry hint (never a queue, never a
hang), and an in-flight count for a prompt graceful drain."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from vlcommon.errors import ServiceError, abort
from vlcommon.interceptors import Around, AroundInterceptor
from vlcommon.refusals import Refusal


class AdmissionInterceptor(AroundInterceptor):
    """Bounds the RPCs a service runs at once; the one over the limit gets
    RESOURCE_EXHAUSTED at once (never a queue, never a hang).

    grpc's own ``maximum_concurrent_rpcs`` answers RESOURCE_EXHAUSTED too, but counts
    health checks (a loaded service would fail its liveness probe and be restarted) and
    carries no retry hint; this interceptor exempts health and reflection, attaches
    ``google.rpc.RetryInfo`` plus ``retry-after-ms`` trailing metadata, and counts
    in-flight RPCs for a prompt graceful drain (:meth:`wait_idle`).

    Args:
        max_in_flight: RPCs (streams count until their last message) served at once.
        retry_after_ms: The retry hint given to a refused caller, milliseconds.
    """

    def __init__(self, max_in_flight: int, retry_after_ms: int) -> None:
        self.max_in_flight = max_in_flight
        self.retry_after_ms = retry_after_ms
        self.in_flight = 0
        self.refused = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def _error(self) -> ServiceError:
        return Refusal.TOO_MANY_REQUESTS.error(
            f"the service is at its limit of {self.max_in_flight} concurrent requests; "
            f"retry after {self.retry_after_ms} ms",
            field="max_concurrent_rpcs",
            limit=self.max_in_flight,
            retry_after_ms=self.retry_after_ms,
        )

    def _enter(self) -> bool:
        if self.in_flight >= self.max_in_flight:
            self.refused += 1
            return False
        self.in_flight += 1
        self._idle.clear()
        return True

    def _exit(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    # The same count for callers that are not gRPC handlers (the gateway's HTTP front).
    def try_acquire(self) -> bool:
        """Take a slot; False (counted as refused) when the service is at its limit."""
        return self._enter()

    def release(self) -> None:
        """Give back a slot taken with :meth:`try_acquire`."""
        self._exit()

    def refusal(self) -> ServiceError:
        """The RESOURCE_EXHAUSTED error (with its retry hint) a refused caller gets."""
        return self._error()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no counted RPC is in flight; False when ``timeout_s`` ran out first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def around(self, method: str, handler_call_details: grpc.HandlerCallDetails) -> Around:
        admission = self

        @contextlib.asynccontextmanager
        async def admitted(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
            if not admission._enter():
                await abort(context, admission._error())
            try:
                yield
            finally:
                admission._exit()

        return admitted
