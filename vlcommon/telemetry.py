"""OpenTelemetry setup: one trace per request across the four services.

Spans are exported over OTLP/gRPC when the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set, through a BatchSpanProcessor so a slow or
closed collector never blocks a request (spans are dropped when its queue is full).
Without an endpoint, spans are created (for context propagation) but not exported.
The gRPC server/client interceptors come from opentelemetry-instrumentation-grpc;
health checks are filtered out. Span names and ``splitvl.*`` attributes:
docs/observability.md.

Shutdown is bounded (case C12): the SDK's ``force_flush`` ignores its timeout
(opentelemetry-python#4568) and an export to a dead collector retries for up to
``OTEL_EXPORTER_OTLP_TIMEOUT`` (10 s) per batch, 26 s measured at exit with a closed port;
so flush and shutdown run on a daemon thread that :func:`shutdown_tracing` waits on for at
most its timeout, the exporter is shut down in between (which interrupts its retry sleep),
and the SDK's own at-exit shutdown is disabled.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

_provider: TracerProvider | None = None
_exporter: SpanExporter | None = None


def setup_tracing(service_name: str) -> TracerProvider:
    """Install the process's TracerProvider (idempotent) and return it."""
    global _provider, _exporter
    if _provider is not None:
        return _provider
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(
        resource=Resource.create({"service.name": name}), shutdown_on_exit=False
    )
    if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    ):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        _exporter = OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(_exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def _bounded(target: Any, timeout_s: float) -> bool:
    """Run ``target`` on a daemon thread; True when it finished within ``timeout_s``."""
    worker = threading.Thread(target=target, name="otel-shutdown", daemon=True)
    worker.start()
    worker.join(max(timeout_s, 0.0))
    return not worker.is_alive()


def shutdown_tracing(timeout_s: float = 3.0) -> None:
    """Flush and stop the exporter, returning within about ``timeout_s`` seconds.

    Spans that a dead or slow collector has not taken by then are dropped.
    """
    provider, exporter = _provider, _exporter
    if provider is None:
        return
    deadline = time.monotonic() + timeout_s
    flushed = _bounded(provider.force_flush, timeout_s * 0.7)
    if not flushed and exporter is not None:
        exporter.shutdown()  # interrupts the export's retry back-off
    _bounded(provider.shutdown, deadline - time.monotonic())


def _not_health() -> Any:
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(filters.health_check())


def server_interceptors() -> list[Any]:
    """grpc.aio server interceptors that continue the caller's trace."""
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(filter_=_not_health())]


def client_interceptors() -> list[Any]:
    """grpc.aio client interceptors that propagate the W3C trace context."""
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors(filter_=_not_health()))


def tracer(name: str) -> trace.Tracer:
    """A tracer for explicit work spans."""
    return trace.get_tracer(name)
