"""Tokens: who may call a service (docs/security.md).

:class:`AuthInterceptor` checks ``authorization: Bearer <token>`` against the configured
public tokens (the gateway's ``GATEWAY_AUTH_TOKENS`` or a token file) and, on internal
services (encoder, cache, decoder), ``x-splitvl-internal-token`` against the cluster's
shared ``*_INTERNAL_TOKEN``; comparisons are constant-time (``hmac.compare_digest`` over
SHA-256 digests, every configured token compared). A missing or wrong credential is
UNAUTHENTICATED before the servicer runs. Health and reflection stay open, so probes and
``grpcurl list`` need no secret.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from vlcommon.errors import ConfigError, ServiceError, abort
from vlcommon.interceptors import Around, AroundInterceptor, is_open_method
from vlcommon.refusals import Refusal

if TYPE_CHECKING:
    from vlcommon.settings import ServerSettings

log = logging.getLogger(__name__)

#: Metadata key carrying the cluster's shared secret on service-to-service calls.
INTERNAL_TOKEN_KEY = "x-splitvl-internal-token"


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


def bearer_token(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The token of a call's ``authorization: Bearer <token>`` metadata, if any (who
    the caller is, e.g. for its priority floor; checked by :class:`AuthInterceptor`)."""
    return _bearer(_metadata_value(metadata, "authorization"))


class AuthInterceptor(AroundInterceptor):
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
                return Refusal.INTERNAL_TOKEN_MISSING.error(
                    f"this service accepts calls only from splitvl's own services: metadata "
                    f"{INTERNAL_TOKEN_KEY!r} is missing",
                    field=INTERNAL_TOKEN_KEY,
                )
            if not token_matches(presented, self._internal):
                return Refusal.INTERNAL_TOKEN_INVALID.error(
                    f"metadata {INTERNAL_TOKEN_KEY!r} does not match this cluster's token",
                    field=INTERNAL_TOKEN_KEY,
                )
        if self._bearer:
            value = _metadata_value(metadata, "authorization")
            token = _bearer(value)
            if token is None:
                return Refusal.AUTH_TOKEN_MISSING.error(
                    "metadata 'authorization' must be 'Bearer <token>'"
                    + ("" if value is None else " (the scheme is not Bearer)"),
                    field="authorization",
                )
            if not token_matches(token, self._bearer):
                return Refusal.AUTH_TOKEN_INVALID.error(
                    "the bearer token in metadata 'authorization' is not accepted",
                    field="authorization",
                )
        return None

    def around(self, method: str, handler_call_details: grpc.HandlerCallDetails) -> Around | None:
        err = self.check(method, handler_call_details.invocation_metadata)
        if err is None:
            return None
        log.warning("refused %s: %s", method, err.reason)

        @contextlib.asynccontextmanager
        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
            await abort(context, err)
            yield  # pragma: no cover - abort raises

        return refuse
