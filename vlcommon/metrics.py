"""Prometheus RPC metrics shared by the four services: one grpc.aio server interceptor.

Every service gets, in prometheus-client's default registry (served on its metrics port):

* ``splitvl_<service>_requests_total{method, code}``: RPCs finished, by the short method
  name (``Generate``) and the gRPC status code name the client saw (``OK``,
  ``INVALID_ARGUMENT``, ...);
* ``splitvl_<service>_request_duration_seconds{method}``: handling time (a server stream
  until its last message);
* ``splitvl_<service>_in_flight_requests{method}``: RPCs being handled now.

grpc.health.v1 and reflection calls are not counted (probes would drown the signal, as the
tracing interceptors filter them out too). Names: /work/notes/metrics_names.md and
docs/observability.md.

Why our own interceptor: the maintained gRPC Prometheus interceptors for Python
(py-grpc-prometheus) wrap the synchronous server only; this one is the grpc.aio analogue
of go-grpc-prometheus's ``grpc_server_handled_total``, in about sixty lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
from prometheus_client import Counter, Gauge, Histogram

from vlcommon.interceptors import Around, AroundInterceptor

# Seconds; Generate streams run long, lookups are sub-millisecond.
DURATION_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


class RpcMetrics:
    """The three RPC metrics of one service (created once per service name per process)."""

    def __init__(self, service: str) -> None:
        prefix = f"splitvl_{service}"
        self.requests = Counter(
            f"{prefix}_requests_total",
            "RPCs finished, by method and gRPC status code.",
            ["method", "code"],
        )
        self.duration = Histogram(
            f"{prefix}_request_duration_seconds",
            "RPC handling time in seconds (a server stream until its last message).",
            ["method"],
            buckets=DURATION_BUCKETS,
        )
        self.in_flight = Gauge(
            f"{prefix}_in_flight_requests", "RPCs being handled now.", ["method"]
        )


_BY_SERVICE: dict[str, RpcMetrics] = {}


def rpc_metrics(service: str) -> RpcMetrics:
    """The RPC metrics of ``service`` (idempotent: the default registry refuses duplicates)."""
    if service not in _BY_SERVICE:
        _BY_SERVICE[service] = RpcMetrics(service)
    return _BY_SERVICE[service]


def _code(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    """The status the client sees: what the handler set or aborted with, else OK/UNKNOWN.

    grpc ends a handler that outlives its call by cancelling it: CancelledError where the
    handler awaits, GeneratorExit where a streaming handler waits at a ``yield`` (its
    consumer was cancelled mid-write). Either way the client saw DEADLINE_EXCEEDED if its
    deadline has passed, else CANCELLED (a GeneratorExit used to be counted as UNKNOWN, which
    the gateway-errors alert reads as a bug, and a passed deadline as CANCELLED, which it
    leaves out).
    """
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED.name
        return grpc.StatusCode.CANCELLED.name
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # grpc.aio may hand back the raw status integer
        for status in grpc.StatusCode:
            if status.value[0] == code:
                return status.name
    if error is not None and not isinstance(error, grpc.aio.AbortError):
        return grpc.StatusCode.UNKNOWN.name  # what grpc answers for an uncaught exception
    return grpc.StatusCode.OK.name


@contextlib.contextmanager
def _observed(m: Any, method: str, context: grpc.aio.ServicerContext) -> Iterator[None]:
    """In-flight gauge, duration and the request count by final status of one RPC."""
    t0 = time.perf_counter()
    error: BaseException | None = None
    m.in_flight.labels(method).inc()
    try:
        yield
    except BaseException as exc:
        error = exc
        raise
    finally:
        m.in_flight.labels(method).dec()
        m.duration.labels(method).observe(time.perf_counter() - t0)
        m.requests.labels(method, _code(context, error)).inc()


class MetricsInterceptor(AroundInterceptor):
    """Counts and times every RPC of one service but health and reflection.

    Args:
        service: Short service name used in the metric names, e.g. ``encoder``.
    """

    def __init__(self, service: str) -> None:
        self.metrics = rpc_metrics(service)

    def around(self, method: str, handler_call_details: grpc.HandlerCallDetails) -> Around:
        name = method.rsplit("/", 1)[-1]
        m = self.metrics

        @contextlib.asynccontextmanager
        async def observed(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
            with _observed(m, name, context):
                yield

        return observed
