"""Transport security, authentication and admission control shared by the four services.

Three independent, optional layers (all off by default, so a loopback development
cluster needs no setup; see docs/security.md for the settings and the defaults):

* **TLS / mTLS** on every hop: :func:`server_credentials` turns a service's
  ``tls_cert_file``/``tls_key_file`` into TLS, and ``tls_client_ca_file`` into mTLS (a
  client certificate chaining to that CA is required at the handshake; a client without
  one never reaches a handler). :func:`aio_channel` / :func:`sync_channel` make the
  matching client channels from a :class:`ClientSecurity`.
* **Tokens**: :class:`AuthInterceptor` checks ``authorization: Bearer <token>`` against
  the configured public tokens (the gateway's ``GATEWAY_AUTH_TOKENS`` or a token file)
  and, on internal services (encoder, cache, decoder), ``x-splitvl-internal-token``
  against the cluster's shared ``*_INTERNAL_TOKEN``; comparisons are constant-time
  (``hmac.compare_digest`` over SHA-256 digests, every configured token compared).
  A missing or wrong credential is UNAUTHENTICATED. Health and reflection stay open, so
  probes and ``grpcurl list`` need no secret.
* **Admission**: :class:`AdmissionInterceptor` bounds the RPCs a service runs at once
  (``max_concurrent_rpcs``, health and reflection exempt) and answers the one over the
  limit with RESOURCE_EXHAUSTED at once, carrying a ``google.rpc.RetryInfo`` detail and
  ``retry-after-ms`` trailing metadata. It also counts in-flight RPCs, so a draining
  server can stop as soon as they finish instead of waiting out its grace period.

Usage (the bootstrap in :mod:`vlcommon.server` wires all of this from ServerSettings)::

    security = ClientSecurity.from_settings(settings)      # gateway -> its dependencies
    channel = aio_channel("127.0.0.1:50054", security, options=channel_options())
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from vlcommon.errors import ServiceError, resource_exhausted, to_status

if TYPE_CHECKING:
    from vlcommon.settings import ServerSettings

log = logging.getLogger(__name__)

#: Metadata key carrying the cluster's shared secret on service-to-service calls.
INTERNAL_TOKEN_KEY = "x-splitvl-internal-token"
#: Trailing metadata key with the retry hint of a RESOURCE_EXHAUSTED answer, milliseconds.
RETRY_AFTER_KEY = "retry-after-ms"
#: Methods that never need a credential and never count against admission.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def is_open_method(method: str) -> bool:
    """True for health checks and server reflection (no auth, no admission limit)."""
    return method.startswith(OPEN_METHOD_PREFIXES)


# -- tokens ------------------------------------------------------------------------------


def load_tokens(tokens: str = "", token_file: str = "") -> tuple[str, ...]:
    """The accepted bearer tokens: comma-separated ``tokens`` plus one per line of
    ``token_file`` (blank lines and ``#`` comments skipped).

    Raises:
        ValueError: the token file cannot be read.
    """
    found = [t.strip() for t in tokens.split(",") if t.strip()]
    if token_file:
        try:
            lines = Path(token_file).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"auth_token_file {token_file!r} cannot be read: {exc}") from exc
        found += [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    return tuple(dict.fromkeys(found))


class ConfigError(ValueError):
    """A setting that would leave the service less protected than asked: it refuses to start."""


def auth_settings(settings: ServerSettings, *, public: bool) -> tuple[tuple[str, ...], str]:
    """The bearer tokens and the internal token a server requires, checked for fail-open.

    An operator who sets ``*_AUTH_TOKENS`` or ``*_AUTH_TOKEN_FILE`` asked for auth: if they
    yield no token (``" , "``, a file of comments), serving without auth would silently
    ignore that, so this refuses. The same for an ``*_INTERNAL_TOKEN`` of only whitespace.

    Returns:
        ``(bearer_tokens, internal_token)``; the internal token is "" when ``public``
        (the gateway sends it downstream but does not require it of its callers).

    Raises:
        ConfigError: naming the environment variable that yields no token, or a token
            file that cannot be read.
    """
    prefix = str(settings.model_config.get("env_prefix", "")).upper()
    raw_tokens = settings.auth_tokens.get_secret_value()
    try:
        bearer = load_tokens(raw_tokens, settings.auth_token_file)
    except ValueError as exc:
        raise ConfigError(f"{prefix}AUTH_TOKEN_FILE: {exc}") from exc
    if (raw_tokens or settings.auth_token_file) and not bearer:
        given = [
            name
            for name, value in (
                (f"{prefix}AUTH_TOKENS", raw_tokens),
                (f"{prefix}AUTH_TOKEN_FILE", settings.auth_token_file),
            )
            if value
        ]
        raise ConfigError(
            f"{' and '.join(given)} set but yield no token (blank entries and '#' comments "
            "are skipped): refusing to start without the bearer auth that was asked for"
        )
    internal = settings.internal_token.get_secret_value()
    if internal and not internal.strip():
        raise ConfigError(
            f"{prefix}INTERNAL_TOKEN is only whitespace: refusing to start with an empty "
            "shared secret"
        )
    return bearer, "" if public else internal


def _digest(token: str) -> bytes:
    # Digests have one length, so compare_digest's time does not reveal a token's length.
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def token_matches(presented: str, accepted: Sequence[bytes]) -> bool:
    """Constant-time check of ``presented`` against every accepted token digest
    (no early exit: the time does not depend on which one matched)."""
    digest = _digest(presented)
    ok = False
    for candidate in accepted:
        ok |= hmac.compare_digest(digest, candidate)
    return ok


def _metadata_value(metadata: Sequence[tuple[str, Any]] | None, key: str) -> str | None:
    for k, v in metadata or ():
        if k == key:
            return v.decode() if isinstance(v, bytes) else str(v)
    return None


def _bearer(value: str | None) -> str | None:
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _refusing_handler(
    handler: grpc.RpcMethodHandler, err: ServiceError, on_refuse: Callable[[], None] | None = None
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that aborts with ``err``."""
    status = to_status(err)

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if on_refuse is not None:
            on_refuse()
        await context.abort(status.code, status.details, status.trailing_metadata)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await refuse(request, context)
        yield  # pragma: no cover - abort raises

    if handler.unary_unary is not None:
        return handler._replace(unary_unary=refuse)  # type: ignore[attr-defined,no-any-return]
    if handler.unary_stream is not None:
        return handler._replace(unary_stream=refuse_stream)  # type: ignore[attr-defined,no-any-return]
    if handler.stream_unary is not None:
        return handler._replace(stream_unary=refuse)  # type: ignore[attr-defined,no-any-return]
    return handler._replace(stream_stream=refuse_stream)  # type: ignore[attr-defined,no-any-return]


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Requires a bearer token and/or the internal token on every RPC but health/reflection.

    Args:
        bearer_tokens: Accepted ``authorization: Bearer`` tokens; empty = not required.
        internal_token: The cluster's shared secret in ``x-splitvl-internal-token``;
            empty = not required.

    A call without a required credential, or with a wrong one, ends UNAUTHENTICATED with
    an ErrorInfo (reason ``AUTH_TOKEN_MISSING`` / ``AUTH_TOKEN_INVALID`` /
    ``INTERNAL_TOKEN_MISSING`` / ``INTERNAL_TOKEN_INVALID``) before the servicer runs.
    """

    def __init__(self, bearer_tokens: Sequence[str] = (), internal_token: str = "") -> None:
        self._bearer = tuple(_digest(t) for t in bearer_tokens)
        self._internal = (_digest(internal_token),) if internal_token else ()

    def check(self, method: str, metadata: Sequence[tuple[str, Any]] | None) -> ServiceError | None:
        """The error to answer with, or None when the call may proceed."""
        if is_open_method(method):
            return None
        if self._internal:
            presented = _metadata_value(metadata, INTERNAL_TOKEN_KEY)
            if presented is None:
                return _unauthenticated(
                    "INTERNAL_TOKEN_MISSING",
                    f"this service accepts calls only from splitvl's own services: metadata "
                    f"{INTERNAL_TOKEN_KEY!r} is missing",
                    INTERNAL_TOKEN_KEY,
                )
            if not token_matches(presented, self._internal):
                return _unauthenticated(
                    "INTERNAL_TOKEN_INVALID",
                    f"metadata {INTERNAL_TOKEN_KEY!r} does not match this cluster's token",
                    INTERNAL_TOKEN_KEY,
                )
        if self._bearer:
            value = _metadata_value(metadata, "authorization")
            token = _bearer(value)
            if token is None:
                return _unauthenticated(
                    "AUTH_TOKEN_MISSING",
                    "metadata 'authorization' must be 'Bearer <token>'"
                    + ("" if value is None else " (the scheme is not Bearer)"),
                    "authorization",
                )
            if not token_matches(token, self._bearer):
                return _unauthenticated(
                    "AUTH_TOKEN_INVALID",
                    "the bearer token in metadata 'authorization' is not accepted",
                    "authorization",
                )
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        err = self.check(handler_call_details.method, handler_call_details.invocation_metadata)
        if err is None:
            return handler
        log.warning("refused %s: %s", handler_call_details.method, err.reason)
        return _refusing_handler(handler, err)


def _unauthenticated(reason: str, message: str, field: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAUTHENTICATED, reason, message, {"field": field})


# -- admission ---------------------------------------------------------------------------


class AdmissionInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
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
        return resource_exhausted(
            "TOO_MANY_REQUESTS",
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

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no counted RPC is in flight; False when ``timeout_s`` ran out first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or is_open_method(handler_call_details.method):
            return handler
        status = to_status(self._error())
        admission = self
        # grpc.aio runs a handler on the event loop only if it is a coroutine function or
        # an async generator function (a lambda returning a coroutine would go to a
        # thread pool), hence one named wrapper per kind.
        if handler.unary_unary is not None or handler.stream_unary is not None:
            inner = handler.unary_unary or handler.stream_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if not admission._enter():
                    await context.abort(status.code, status.details, status.trailing_metadata)
                try:
                    return await inner(request, context)
                finally:
                    admission._exit()

            kind = "unary_unary" if handler.unary_unary is not None else "stream_unary"
            return handler._replace(**{kind: unary})  # type: ignore[attr-defined,no-any-return]

        inner_stream = handler.unary_stream or handler.stream_stream

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if not admission._enter():
                await context.abort(status.code, status.details, status.trailing_metadata)
            try:
                async for item in inner_stream(request, context):
                    yield item
            finally:
                admission._exit()

        kind = "unary_stream" if handler.unary_stream is not None else "stream_stream"
        return handler._replace(**{kind: streaming})  # type: ignore[attr-defined,no-any-return]


# -- TLS ---------------------------------------------------------------------------------


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {path!r} cannot be read: {exc}") from exc


def server_credentials(settings: ServerSettings) -> grpc.ServerCredentials | None:
    """TLS credentials for a server, or None for plaintext.

    TLS is on when ``tls_cert_file`` and ``tls_key_file`` are set; with
    ``tls_client_ca_file`` too, every client must present a certificate chaining to that
    CA (mTLS), checked in the handshake.

    Raises:
        ValueError: only one of cert/key is set, or a file cannot be read.
    """
    cert, key = settings.tls_cert_file, settings.tls_key_file
    client_ca = settings.tls_client_ca_file
    if not cert and not key:
        if client_ca:
            raise ValueError("tls_client_ca_file (mTLS) needs tls_cert_file and tls_key_file")
        return None
    if not (cert and key):
        raise ValueError("TLS needs both tls_cert_file and tls_key_file")
    return grpc.ssl_server_credentials(
        [(_read(key, "tls_key_file"), _read(cert, "tls_cert_file"))],
        root_certificates=_read(client_ca, "tls_client_ca_file") if client_ca else None,
        require_client_auth=bool(client_ca),
    )


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches splitvl services: TLS roots, client certificate, tokens.

    Attributes:
        ca_file: PEM CA bundle that signs the servers' certificates; set = TLS.
        cert_file: PEM client certificate chain (mTLS); needs ``key_file``.
        key_file: PEM private key of ``cert_file``.
        server_name: Overrides the name checked against the server's certificate.
        tls: Use TLS even without ``ca_file`` (the system's trust roots).
        internal_token: Sent as ``x-splitvl-internal-token`` (service-to-service calls).
        bearer_token: Sent as ``authorization: Bearer <token>`` (calls to the gateway).
    """

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""
    tls: bool = False
    internal_token: str = ""
    bearer_token: str = ""

    @property
    def uses_tls(self) -> bool:
        return self.tls or bool(self.ca_file or self.cert_file)

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> ClientSecurity:
        """What a service uses for its own outbound calls (``*_CLIENT_TLS_*``,
        ``*_INTERNAL_TOKEN``)."""
        return cls(
            ca_file=settings.client_tls_ca_file,
            cert_file=settings.client_tls_cert_file,
            key_file=settings.client_tls_key_file,
            server_name=settings.client_tls_server_name,
            internal_token=settings.internal_token.get_secret_value(),
        )

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ClientSecurity:
        """From ``SPLITVL_TLS_CA_FILE``, ``SPLITVL_TLS_CERT_FILE``, ``SPLITVL_TLS_KEY_FILE``,
        ``SPLITVL_TLS_SERVER_NAME``, ``SPLITVL_INTERNAL_TOKEN`` and ``SPLITVL_AUTH_TOKEN``
        (the CLI, the launcher's health checks and tests)."""
        e = os.environ if env is None else env
        return cls(
            ca_file=e.get("SPLITVL_TLS_CA_FILE", ""),
            cert_file=e.get("SPLITVL_TLS_CERT_FILE", ""),
            key_file=e.get("SPLITVL_TLS_KEY_FILE", ""),
            server_name=e.get("SPLITVL_TLS_SERVER_NAME", ""),
            internal_token=e.get("SPLITVL_INTERNAL_TOKEN", ""),
            bearer_token=e.get("SPLITVL_AUTH_TOKEN", ""),
        )

    def credentials(self) -> grpc.ChannelCredentials | None:
        """Channel credentials, or None for plaintext.

        Raises:
            ValueError: only one of cert/key is set, or a file cannot be read.
        """
        if not self.uses_tls:
            return None
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("a client certificate needs both cert_file and key_file")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "ca_file") if self.ca_file else None,
            private_key=_read(self.key_file, "key_file") if self.key_file else None,
            certificate_chain=_read(self.cert_file, "cert_file") if self.cert_file else None,
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata carrying the configured tokens."""
        out: list[tuple[str, str]] = []
        if self.internal_token:
            out.append((INTERNAL_TOKEN_KEY, self.internal_token))
        if self.bearer_token:
            out.append(("authorization", f"Bearer {self.bearer_token}"))
        return tuple(out)

    def channel_options(self) -> list[tuple[str, str]]:
        if self.server_name and self.uses_tls:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []


class _AddMetadata:
    """Adds fixed metadata (the tokens) to the details of a call."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: Any) -> Any:
        merged = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return details._replace(metadata=merged)


# grpc.aio files an interceptor under the FIRST of the four kinds it is an instance of
# (an if/elif chain in grpc/aio/_channel.py), so each kind needs its own class.
class _UnaryUnaryMetadata(_AddMetadata, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _UnaryStreamMetadata(_AddMetadata, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _StreamUnaryMetadata(_AddMetadata, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _StreamStreamMetadata(_AddMetadata, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def metadata_interceptors(metadata: tuple[tuple[str, str], ...]) -> list[Any]:
    """grpc.aio client interceptors adding ``metadata`` to calls of all four kinds."""
    kinds = (_UnaryUnaryMetadata, _UnaryStreamMetadata, _StreamUnaryMetadata, _StreamStreamMetadata)
    return [kind(metadata) for kind in kinds]


def aio_channel(
    address: str,
    security: ClientSecurity | None = None,
    *,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[Any] = (),
) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address``: TLS/mTLS and tokens as ``security`` says."""
    security = security or ClientSecurity()
    all_interceptors = list(interceptors)
    if security.metadata():
        all_interceptors += metadata_interceptors(security.metadata())
    opts = [*options, *security.channel_options()]
    creds = security.credentials()
    if creds is None:
        return grpc.aio.insecure_channel(address, options=opts, interceptors=all_interceptors)
    return grpc.aio.secure_channel(address, creds, options=opts, interceptors=all_interceptors)


def sync_channel(
    address: str, security: ClientSecurity | None = None, *, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A blocking channel to ``address`` (pass ``security.metadata()`` on each call)."""
    security = security or ClientSecurity()
    opts = [*options, *security.channel_options()]
    creds = security.credentials()
    if creds is None:
        return grpc.insecure_channel(address, options=opts)
    return grpc.secure_channel(address, creds, options=opts)


def is_loopback(host: str) -> bool:
    """True for a loopback bind address (``127.0.0.1``, ``::1``, ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


SERVICE_ENV_PREFIXES = {
    "gateway": "GATEWAY",
    "encoder": "ENCODER",
    "cache": "CACHE",
    "decoder": "DECODER",
}


def service_env(name: str, env: dict[str, str]) -> dict[str, str]:
    """Per-service settings derived from the cluster-wide ``SPLITVL_*`` security variables
    (what ``splitvl up`` and the test clusters use; a service's own ``<PREFIX>_*`` variable,
    when set, wins).

    * ``SPLITVL_TLS_CERT_FILE`` / ``SPLITVL_TLS_KEY_FILE``: every service's server
      certificate, and its client certificate on the calls it makes;
    * ``SPLITVL_TLS_CA_FILE``: the CA the services' certificates chain to (clients verify
      servers with it);
    * ``SPLITVL_TLS_CLIENT_CA_FILE``: mTLS on the internal services (encoder, cache,
      decoder): only clients with a certificate from this CA get through the handshake;
    * ``SPLITVL_INTERNAL_TOKEN``: the shared secret every internal hop carries and the
      internal services require.

    Args:
        name: ``gateway``, ``encoder``, ``cache`` or ``decoder``.
        env: The launcher's environment.

    Returns:
        Variables to add to that service's environment.
    """
    prefix = SERVICE_ENV_PREFIXES[name]
    mapping = {
        "SPLITVL_TLS_CERT_FILE": ("TLS_CERT_FILE", "CLIENT_TLS_CERT_FILE"),
        "SPLITVL_TLS_KEY_FILE": ("TLS_KEY_FILE", "CLIENT_TLS_KEY_FILE"),
        "SPLITVL_TLS_CA_FILE": ("CLIENT_TLS_CA_FILE",),
        "SPLITVL_TLS_SERVER_NAME": ("CLIENT_TLS_SERVER_NAME",),
        "SPLITVL_INTERNAL_TOKEN": ("INTERNAL_TOKEN",),
    }
    if name != "gateway":  # the gateway's callers are users: mTLS there is opt-in
        mapping["SPLITVL_TLS_CLIENT_CA_FILE"] = ("TLS_CLIENT_CA_FILE",)
    out: dict[str, str] = {}
    for source, targets in mapping.items():
        value = env.get(source, "")
        if not value:
            continue
        for target in targets:
            key = f"{prefix}_{target}"
            if not env.get(key):
                out[key] = value
    return out
