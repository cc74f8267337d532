"""OpenTelemetry setup: one trace per request across the four services.

Spans are exported over OTLP/gRPC when the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set, through a BatchSpanProcessor so a slow or
closed collector never blocks a request (spans are dropped when its queue is full).
Without an endpoint, spans are created (for context propagation) but not exported.
The gRPC server/client interceptors come from opentelemetry-instrumentation-grpc;
health checks are filtered out.
"""

from __future__ import annotations

import os
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

_provider: TracerProvider | None = None


def setup_tracing(service_name: str) -> TracerProvider:
    """Install the process's TracerProvider (idempotent) and return it."""
    global _provider
    if _provider is not None:
        return _provider
    name = os.environ.get("OTEL_SERVICE_NAME", service_name)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    ):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown_tracing(timeout_s: float = 3.0) -> None:
    """Flush and stop the exporter, waiting at most ``timeout_s`` seconds."""
    if _provider is None:
        return
    _provider.force_flush(timeout_millis=int(timeout_s * 1000))
    _provider.shutdown()


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
