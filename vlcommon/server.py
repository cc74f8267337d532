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

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from vlcommon import telemetry
from vlcommon.settings import ServerSettings, server_options

log = logging.getLogger(__name__)


def configure_logging(service: str) -> None:
    """Plain line logging to stderr, one format for all services."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
    )


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
    register(server)
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
