"""Server bootstrap shared by the four services.

``serve()`` builds a ``grpc.aio`` server with explicit message limits and keepalive,
OpenTelemetry interceptors, grpc.health.v1 (NOT_SERVING until the engine is ready,
SERVING after, ``enter_graceful_shutdown()`` on SIGTERM/SIGINT), server reflection and
an optional Prometheus endpoint, then runs until a signal:
signal -> stop event -> health NOT_SERVING -> ``server.stop(grace)`` -> engine shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from vlcommon import telemetry
from vlcommon.errors import ServiceError, abort, invalid_argument
from vlcommon.settings import ServerSettings, server_options

log = logging.getLogger(__name__)


def limit_torch_threads(threads: int = 1) -> None:
    """Keep a service's incidental torch ops (validation, resizes) on one thread.

    With torch's default of one OpenMP thread per core, every small op in a process that
    shares the machine with vLLM's pinned, always-busy CPU worker waits at an OpenMP
    barrier for a thread that cannot run: py-spy showed ``torch.isfinite`` over one image's
    embeddings taking most of the decoder front-end's time at 32 concurrent requests.
    """
    try:
        import torch
    except ImportError:  # pragma: no cover
        return
    torch.set_num_threads(threads)


def configure_logging(service: str) -> None:
    """Plain line logging to stderr, one format for all services."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
    )
    # OpenTelemetry's gRPC aio interceptors log "Failed to detach context" with a traceback
    # whenever a streaming call is cancelled (the span's context token belongs to another
    # task); the span is still ended and exported, so this is noise for an operator.
    logging.getLogger("opentelemetry.context").setLevel(logging.CRITICAL)


async def serve(
    *,
    service_name: str,
    service_full_names: Sequence[str],
    settings: ServerSettings,
    register: Callable[[grpc.aio.Server], None],
    startup: Callable[[], Awaitable[None]] | None = None,
    shutdown: Callable[[], Awaitable[None]] | None = None,
    stop_event: asyncio.Event | None = None,
    on_started: Callable[[int], None] | None = None,
) -> None:
    """Run one service until SIGTERM/SIGINT (or ``stop_event``).

    Args:
        service_name: Name for logs and the trace resource, e.g. ``encoder``.
        service_full_names: Fully qualified gRPC service names for health and reflection.
        settings: Bind address, port, limits, keepalive and grace period.
        register: Adds the servicers to the server.
        startup: Loads the engine; health turns SERVING when it returns.
        shutdown: Releases the engine; always awaited after the server stops.
        stop_event: Set to stop (tests); signals set it too.
        on_started: Called with the bound port once the server listens.
    """
    telemetry.setup_tracing(f"splitvl-{service_name}")
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port, addr=settings.host)
    server = grpc.aio.server(
        interceptors=telemetry.server_interceptors(),
        options=server_options(settings),
        maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # Through the registrar, a request that does not parse gets INVALID_ARGUMENT, not UNKNOWN.
    register(_Registrar(server))  # type: ignore[arg-type]
    reflection.enable_server_reflection(
        [*service_full_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    for name in ("", *service_full_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    log.info("%s listening on %s:%d", service_name, settings.host, port)
    if on_started is not None:
        on_started(port)
    try:
        if startup is not None:
            startup_task = asyncio.ensure_future(startup())
            stop_task = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait(
                {startup_task, stop_task}, return_when=asyncio.FIRST_COMPLETED
            )
            if startup_task not in done:
                startup_task.cancel()
            else:
                stop_task.cancel()
                startup_task.result()  # re-raise a failed startup
        if not stop.is_set():
            for name in ("", *service_full_names):
                await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
            log.info("%s SERVING", service_name)
            await stop.wait()
        log.info("%s stopping (grace %.1fs)", service_name, settings.grace_s)
        await health_servicer.enter_graceful_shutdown()
        await server.stop(settings.grace_s)
    finally:
        try:
            if shutdown is not None:
                await shutdown()
        finally:
            telemetry.shutdown_tracing()
            log.info("%s stopped", service_name)


def run(coro: Awaitable[None]) -> None:
    """asyncio.run for a service's main coroutine (stock asyncio: grpc.aio's poller is
    only supported on the default event loop)."""
    asyncio.run(coro)  # type: ignore[arg-type]


class _Undecodable:
    """Stands in for a request whose bytes did not parse (e.g. invalid UTF-8 in a string)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _safe_deserializer(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError and others
            return _Undecodable(exc)

    return parse


def _refuse(request: _Undecodable) -> ServiceError:
    return invalid_argument(
        "REQUEST_UNDECODABLE",
        f"the request could not be parsed as protobuf: {request.error}",
        field="request",
    )


def _wrap(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """Parse failures become INVALID_ARGUMENT instead of grpc-python's UNKNOWN."""
    deserializer = _safe_deserializer(handler.request_deserializer)
    if handler.unary_unary is not None:
        behavior = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await abort(context, _refuse(request))
            return await behavior(request, context)

        return handler._replace(request_deserializer=deserializer, unary_unary=unary_unary)  # type: ignore[attr-defined,no-any-return]
    if handler.unary_stream is not None:
        stream = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await abort(context, _refuse(request))
            async for item in stream(request, context):
                yield item

        return handler._replace(request_deserializer=deserializer, unary_stream=unary_stream)  # type: ignore[attr-defined,no-any-return]
    return handler


class _Registrar:
    """Stands in for the server while generated ``add_*Servicer_to_server`` runs."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # registered below, from the same dictionary, with wrapped handlers

    def add_registered_method_handlers(self, name: str, handlers: dict[str, Any]) -> None:
        wrapped = {method: _wrap(h) for method, h in handlers.items()}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, wrapped),))
        self.server.add_registered_method_handlers(name, wrapped)


def add_servicer(
    add_to_server: Callable[[Any, Any], None], servicer: Any, server: grpc.aio.Server
) -> None:
    """Register ``servicer`` with the generated ``add_*Servicer_to_server`` function, so that
    a request that does not parse gets INVALID_ARGUMENT naming ``request`` (grpc-python
    would answer UNKNOWN)."""
    add_to_server(servicer, _Registrar(server))
