"""Transport security: TLS / mTLS on every hop, and the channels clients make.

Server side, :func:`server_credentials` turns a service's ``tls_cert_file``/``tls_key_file``
into TLS, and ``tls_client_ca_file`` into mTLS (a client certificate chaining to that CA
is required at the handshake; a client without one never reaches a handler). Client side,
:func:`aio_channel` / :func:`sync_channel` make the matching channels from a
:class:`ClientSecurity`, which also carries the tokens a client sends
(:mod:`vlcommon.auth` checks them).

Usage::

    security = ClientSecurity.from_settings(settings)      # gateway -> its dependencies
    channel = aio_channel("127.0.0.1:50054", security, options=channel_options())
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from vlcommon.auth import INTERNAL_TOKEN_KEY

if TYPE_CHECKING:
    from vlcommon.settings import ServerSettings


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

    def named(self, name: str | None) -> ClientSecurity:
        """This security for an address resolved from DNS ``name``: TLS checks the
        certificate against ``name`` (unless a server name is configured), not the IP
        dialled (a decoder replica of a headless Service, ``gateway.pipeline.endpoints``)."""
        if not name or self.server_name:
            return self
        return dataclasses.replace(self, server_name=name)

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
