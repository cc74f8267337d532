"""Server bootstrap shared by the four services.

``serve()`` builds a ``grpc.aio`` server with explicit message limits and keepalive,
OpenTelemetry interceptors, optional TLS/mTLS (:mod:`vlcommon.tls`), token checks
(:mod:`vlcommon.auth`) and admission control (:mod:`vlcommon.admission`), a readiness
gate (UNAVAILABLE ``<service> is starting`` until the engine is ready) and the error
mapping (:mod:`vlcommon.interceptors`: handlers raise ``ServiceError``), grpc.health.v1
(NOT_SERVING until the engine is ready, SERVING after, ``enter_graceful_shutdown()`` on
SIGTERM/SIGINT), server reflection and an optional Prometheus endpoint, then runs until a signal:
signal -> stop event -> health NOT_SERVING -> ``server.stop(grace)`` (new RPCs refused)
-> in-flight RPCs finish (at most ``grace_s``) -> leftover streams such as health
``Watch`` cancelled -> engine shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from vlcommon import telemetry
from vlcommon.admission import AdmissionInterceptor
from vlcommon.auth import AuthInterceptor, auth_settings
from vlcommon.errors import ConfigError, ServiceError, abort
from vlcommon.interceptors import (
    AroundChain,
    AroundInterceptor,
    ErrorInterceptor,
    ReadinessInterceptor,
)
from vlcommon.metrics import MetricsInterceptor
from vlcommon.refusals import Refusal
from vlcommon.settings import ServerSettings, server_options
from vlcommon.tls import is_loopback
from vlcommon.tls import server_credentials as tls_server_credentials

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
    public: bool = False,
    admission: AdmissionInterceptor | None = None,
    on_drain: Callable[[], None] | None = None,
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
        public: True for the gateway: its callers are users, so ``internal_token`` is only
            sent downstream, never required of them (``auth_tokens`` guards it instead).
            False (encoder, cache, decoder): ``internal_token``, when set, is required.
        admission: Admission control to share with another front (the gateway's HTTP
            one); default: one built from ``max_concurrent_rpcs`` and ``retry_after_ms``.
        on_drain: Called when the drain begins (the gateway's HTTP front stops accepting
            connections, so that a shared port's other processes take the new ones).

    With ``settings.reuse_port`` and an ``instance_port``, the shared ``port`` is served by
    a second grpc server, bound and started once the service is SERVING; the instance
    port, bound without ``SO_REUSEPORT``, serves from the start.
    """
    front = _front(service_name, service_full_names, settings, register, public, admission)
    server, port = _first_server(front)
    stop = _stop_on_signals(stop_event)
    await front.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    log.info(
        "%s listening on %s:%d (%s%s)",
        service_name,
        settings.host,
        port,
        "plaintext" if front.credentials is None else "TLS",
        "+mTLS" if settings.tls_client_ca_file else "",
    )
    if on_started is not None:
        on_started(port)
    try:
        await _start_engine(startup, stop)
        late: grpc.aio.Server | None = None
        if not stop.is_set():
            late = await _serve_until_stopped(front, port, stop)
        if on_drain is not None:
            on_drain()
        servers = [server] if late is None else [late, server]
        await drain(servers, front.health_servicer, front.admission, settings.grace_s, service_name)
    finally:
        try:
            if shutdown is not None:
                await shutdown()
        finally:
            telemetry.shutdown_tracing()
            log.info("%s stopped", service_name)


@dataclass(frozen=True)
class _Front:
    """What every grpc server of one service process is built with (:func:`_front`).

    Attributes:
        service_name, service_full_names, settings, register: :func:`serve`'s.
        interceptors: Tracing first, then the project's own chain (:func:`_interceptors`).
        readiness: The gate that refuses calls until the engine is ready.
        admission: The admission control the drain waits on.
        credentials: TLS credentials; None serves plaintext.
        health_servicer: grpc.health.v1, one for every server of the process.
        shared: The service port is shared with other processes (``SO_REUSEPORT`` with an
            instance port): it gets a server of its own once the service is SERVING.
    """

    service_name: str
    service_full_names: Sequence[str]
    settings: ServerSettings
    register: Callable[[grpc.aio.Server], None]
    interceptors: list[Any]
    readiness: ReadinessInterceptor
    admission: AdmissionInterceptor
    credentials: grpc.ServerCredentials | None
    health_servicer: health.aio.HealthServicer
    shared: bool

    def new_server(self, reuse_port: bool) -> grpc.aio.Server:
        """A server with the interceptors, limits, health, the servicers and reflection."""
        server = grpc.aio.server(
            # Tracing first, so the metrics interceptor's time and status sit inside the span.
            interceptors=self.interceptors,
            options=server_options(self.settings, reuse_port=reuse_port),
            # Admission control is the interceptor (health exempt, RetryInfo hint); grpc's
            # own limit sits above it as a backstop with room for probes.
            maximum_concurrent_rpcs=self.settings.max_concurrent_rpcs + 64,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health_servicer, server)
        # Through the registrar, a request that does not parse gets INVALID_ARGUMENT, not
        # UNKNOWN.
        self.register(_Registrar(server))  # type: ignore[arg-type]
        reflection.enable_server_reflection(
            [*self.service_full_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        return server

    def bind(self, server: grpc.aio.Server, port: int) -> int:
        """:func:`_bind` on this service's host with its credentials."""
        return _bind(server, self.settings.host, port, self.credentials)

    async def set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        """Set the health of the server as a whole ("") and of each of its services."""
        for name in ("", *self.service_full_names):
            await self.health_servicer.set(name, status)


def _front(
    service_name: str,
    service_full_names: Sequence[str],
    settings: ServerSettings,
    register: Callable[[grpc.aio.Server], None],
    public: bool,
    admission: AdmissionInterceptor | None,
) -> _Front:
    """Set up what the servers are built with, from :func:`serve`'s arguments, in this
    order: the tokens, tracing, the Prometheus endpoint, the interceptors, the TLS
    credentials, the health servicer.

    Raises:
        ConfigError: auth that was asked for yields no token, or a token file cannot be
            read (:func:`vlcommon.auth.auth_settings`).
        ValueError: TLS settings that cannot be used (:func:`vlcommon.tls.server_credentials`).
    """
    # Before anything listens: auth that was asked for but yields no token fails here.
    bearer_tokens, internal_token = auth_settings(settings, public=public)
    telemetry.setup_tracing(f"splitvl-{service_name}")
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port, addr=settings.host)
    if admission is None:
        admission = AdmissionInterceptor(settings.max_concurrent_rpcs, settings.retry_after_ms)
    readiness = ReadinessInterceptor(service_name)
    interceptors = _interceptors(service_name, bearer_tokens, internal_token, readiness, admission)
    credentials = tls_server_credentials(settings)
    if not public and not internal_token and not settings.tls_client_ca_file:
        _warn_if_reachable(service_name, settings.host)
    health_servicer = health.aio.HealthServicer()
    # A port shared with other processes (SO_REUSEPORT) gets its own server, made and
    # bound only once this process is SERVING: grpc listens on a port as it binds it, the
    # kernel hands every listener in the group its share of new connections, and a
    # client's connection stays with the process it reached, so joining while the engine
    # loads would pin callers to a process that cannot answer them. The instance port
    # (this process alone, for its health probe) listens from the start.
    shared = settings.reuse_port and bool(settings.instance_port)
    return _Front(
        service_name,
        service_full_names,
        settings,
        register,
        interceptors,
        readiness,
        admission,
        credentials,
        health_servicer,
        shared,
    )


def _interceptors(
    service_name: str,
    bearer_tokens: Sequence[str],
    internal_token: str,
    readiness: ReadinessInterceptor,
    admission: AdmissionInterceptor,
) -> list[Any]:
    """The server's interceptors, outermost first: tracing, then one chain of the
    project's own (metrics, auth when tokens are set, readiness, admission, errors)."""
    chain: list[AroundInterceptor] = [MetricsInterceptor(service_name)]
    if bearer_tokens or internal_token:
        # Before admission: a caller without credentials never takes a slot.
        chain.append(AuthInterceptor(bearer_tokens, internal_token))
    # A call to a service still loading its engine is refused before it takes a slot; the
    # error mapping sits innermost, next to the handlers (they raise ServiceError).
    chain += [readiness, admission, ErrorInterceptor()]
    # One interceptor for the project's own: one generator per streamed message, not five.
    return [*telemetry.server_interceptors(), AroundChain(chain)]


def _warn_if_reachable(service_name: str, host: str) -> None:
    """Warn that an internal service without mTLS or an internal token listens beyond
    loopback."""
    if not is_loopback(host):
        log.warning(
            "%s listens on %s with neither mTLS nor an internal token: anyone who can "
            "reach it can call it directly (docs/security.md)",
            service_name,
            host,
        )


def _first_server(front: _Front) -> tuple[grpc.aio.Server, int]:
    """The server that listens from the start, bound (not started): on the service port
    and the instance port, or on the instance port alone when the service port is
    ``shared`` (its server comes once the service is SERVING).

    Returns:
        (server, port): the server and the service port (the bound one when it was 0).

    Raises:
        ConfigError: a port cannot be bound.
    """
    settings = front.settings
    server = front.new_server(reuse_port=settings.reuse_port and not front.shared)
    if front.shared:
        front.bind(server, settings.instance_port)
        return server, settings.port
    port = front.bind(server, settings.port)
    if settings.instance_port:
        front.bind(server, settings.instance_port)
    return server, port


def _stop_on_signals(stop_event: asyncio.Event | None) -> asyncio.Event:
    """``stop_event`` (a new event when None), set by SIGTERM and SIGINT where this
    thread can handle signals (the main thread's loop)."""
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    return stop


async def _start_engine(startup: Callable[[], Awaitable[None]] | None, stop: asyncio.Event) -> None:
    """Await ``startup`` unless ``stop`` is set first, which cancels it.

    Raises:
        Exception: whatever a failed ``startup`` raised.
    """
    if startup is None:
        return
    startup_task = asyncio.ensure_future(startup())
    stop_task = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({startup_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    if startup_task not in done:
        startup_task.cancel()
    else:
        stop_task.cancel()
        startup_task.result()  # re-raise a failed startup


async def _serve_until_stopped(
    front: _Front, port: int, stop: asyncio.Event
) -> grpc.aio.Server | None:
    """Take calls once the engine is ready, until ``stop`` is set: in this order the
    readiness gate opens, the startup heap is frozen (``gc_freeze``), health turns SERVING,
    and a ``shared`` service port gets its server, bound and started.

    Args:
        port: The service port, for the log.

    Returns:
        The shared port's server, to drain with the first one; None without one.

    Raises:
        ConfigError: the shared port cannot be bound.
    """
    front.readiness.set_ready()
    if front.settings.gc_freeze:
        freeze_startup_heap(front.service_name)
    await front.set_health(health_pb2.HealthCheckResponse.SERVING)
    late = None
    if front.shared:
        late = front.new_server(reuse_port=True)
        front.bind(late, front.settings.port)
        await late.start()
        log.info("%s takes calls on the shared port %d too", front.service_name, port)
    log.info("%s SERVING", front.service_name)
    await stop.wait()
    return late


def _bind(
    server: grpc.aio.Server,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None,
) -> int:
    """Add a listening port; returns the bound one (``port`` 0 picks one).

    Raises:
        ConfigError: the port cannot be bound (in use by a process that does not share it,
            or not this host's address).
    """
    address = f"{host}:{port}"
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError as err:  # grpc: "Failed to bind to address ..."
        raise ConfigError(f"cannot listen on {address}: {err}") from None


def freeze_startup_heap(service_name: str) -> int:
    """Collect, then freeze every object alive now (``gc.freeze``); returns how many.

    A service's startup heap (torch, transformers, vLLM's front-end, the checkpoint's
    processor: ~450,000 tracked objects in the gateway) lives as long as the process, yet
    every full (generation-2) collection walks it, holding the event loop and so every
    stream: per collection on this CPU, 233 ms in the gateway, 437 ms in the decoder's
    front-end, 291 ms in the encoder, 103 ms in the cache; 0.5-5 ms after the freeze.
    vLLM's API server and engine core do the same (``vllm.utils.gc_utils.freeze_gc_heap``).
    Frozen objects are never collected, so this runs once, after the engine has loaded.
    """
    import gc

    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info(
        "%s: %d startup objects frozen out of garbage collection (%.0f ms)",
        service_name,
        frozen,
        (time.perf_counter() - t0) * 1000,
    )
    return frozen


WATCH_NOTICE_S = 0.5


async def drain(
    server: grpc.aio.Server | Sequence[grpc.aio.Server],
    health_servicer: health.aio.HealthServicer,
    admission: AdmissionInterceptor,
    grace_s: float,
    service_name: str = "",
) -> None:
    """Graceful drain: NOT_SERVING, refuse new RPCs, let in-flight ones finish.

    ``server.stop(grace)`` alone waits out the whole grace period while any stream is open,
    and a health ``Watch`` (a load balancer's or a probe's) never ends by itself; so the
    in-flight RPCs are counted (health excluded) and, once none is left, the rest are
    cancelled with ``stop(0)``: the drain lasts as long as the slowest real RPC, at most
    ``grace_s``. ``server`` may be several servers of one process (a shared port's and
    the instance port's), drained together.
    """
    servers = [server] if isinstance(server, grpc.aio.Server) else list(server)
    t0 = time.monotonic()
    log.info(
        "%s draining: %d RPCs in flight (grace %.1fs)",
        service_name,
        admission.in_flight,
        grace_s,
    )
    await health_servicer.enter_graceful_shutdown()
    # New RPCs are refused from here.
    stopping = [asyncio.ensure_future(s.stop(grace_s)) for s in servers]
    drained = await admission.wait_idle(grace_s)
    # Let health Watch streams deliver NOT_SERVING before they are cancelled.
    settle = max(0.0, min(WATCH_NOTICE_S, grace_s) - (time.monotonic() - t0))
    while drained:
        await asyncio.sleep(settle)
        # An RPC the server accepted just before stop() is counted only once its handler
        # starts, a moment later; cancelling it then reached its caller as a bare
        # CANCELLED (splitvl faults, a rolling restart). Wait for those too.
        if admission.in_flight == 0:
            break
        drained = await admission.wait_idle(max(0.0, grace_s - (time.monotonic() - t0)))
        settle = 0.05
    if drained:
        for s in servers:
            await s.stop(0)
    await asyncio.gather(*stopping)
    log.info(
        "%s drained in %.2fs (%s)",
        service_name,
        time.monotonic() - t0,
        "all RPCs finished" if drained else f"{admission.in_flight} cancelled at the grace",
    )


def run(coro: Awaitable[None]) -> None:
    """asyncio.run for a service's main coroutine (stock asyncio: grpc.aio's poller is
    only supported on the default event loop).

    Raises:
        SystemExit: status 1 with the message on stderr for a :class:`ConfigError`
            (e.g. ``GATEWAY_AUTH_TOKENS`` set but empty), instead of a traceback.
    """
    try:
        asyncio.run(coro)  # type: ignore[arg-type]
    except ConfigError as exc:
        log.critical("refusing to start: %s", exc)
        raise SystemExit(f"refusing to start: {exc}") from None


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
    return Refusal.REQUEST_UNDECODABLE.error(
        f"the request could not be parsed as protobuf: {request.error}", field="request"
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
