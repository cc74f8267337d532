"""Images by URL: an http/https fetch with an SSRF guard, a size cap and bounded time.

Used by the gateway for ``ImageInput.url`` when ``GATEWAY_ALLOW_URLS`` is set::

    fetcher = UrlFetcher(settings)
    data = await fetcher.fetch(url, index=0, time_left=deadline.remaining())

The HTTP client is aiohttp. The guard sits at the socket: aiohttp's ``TCPConnector``
hands every address it is about to connect to (from DNS or an IP literal) to our
``socket_factory``, which refuses loopback, private, link-local, multicast, reserved,
unspecified, shared (CGNAT) and cloud-metadata addresses before the socket exists. The
address checked is the one connected to, so DNS rebinding (a name that resolves to a
public address for a check and to 127.0.0.1 for the connection) has no gap to use, and
the Host header and TLS SNI stay the URL's own host. Environment proxies are ignored
(``trust_env=False``): through a proxy the socket would see only the proxy's address.

Statuses (each names the URL's host, never the full URL, whose query may hold secrets):

- URLs disabled: FAILED_PRECONDITION ``IMAGE_URLS_DISABLED`` (``VIDEO_URLS_DISABLED`` for
  the video fetcher; every message and field names its noun).
- Not http/https, no host, too long, a host name that cannot be encoded (IDNA), bad
  redirect target, too many redirects, a forbidden address: INVALID_ARGUMENT.
- Upstream HTTP 4xx: INVALID_ARGUMENT ``URL_FETCH_REJECTED`` with the status (the
  caller's URL is wrong; retrying will not help).
- Upstream HTTP 5xx, refused/reset connection, DNS failure, a connect or read timeout:
  UNAVAILABLE ``URL_FETCH_FAILED`` (may succeed on retry).
- Body over ``max_image_bytes`` (by Content-Length, or while streaming): RESOURCE_EXHAUSTED.
- More than ``url_max_inflight`` fetches at once over all requests: RESOURCE_EXHAUSTED
  ``URL_FETCHES_BUSY`` at once (each fetch may buffer ``max_image_bytes``), with a
  RetryInfo / ``retry-after-ms`` hint of ``GATEWAY_RETRY_AFTER_MS``.
- The request's own deadline ran out during the fetch: DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import ssl
from collections.abc import Iterable

import aiohttp
from yarl import URL

from gateway.media import bytes_too_large
from gateway.settings import GatewaySettings
from vlcommon.deadline import expired_error
from vlcommon.errors import ServiceError
from vlcommon.refusals import Refusal

_URLS_DISABLED = {"image": Refusal.IMAGE_URLS_DISABLED, "video": Refusal.VIDEO_URLS_DISABLED}

# Cloud metadata and credential endpoints: AWS/GCP/Azure/OpenStack instance metadata
# (169.254.169.254, AWS's IPv6 fd00:ec2::254), AWS ECS task credentials (169.254.170.2),
# EKS Pod Identity (169.254.170.23, fd00:ec2::23) and Alibaba Cloud metadata
# (100.100.100.200). Refused even when private addresses are allowed: credentials live there.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",
        "fd00:ec2::254",
        "169.254.170.2",
        "169.254.170.23",
        "fd00:ec2::23",
        "100.100.100.200",
    )
)
# Kinds refused even under GATEWAY_URL_ALLOW_PRIVATE: metadata, and link-local as a whole
# (169.254.0.0/16, fe80::/10), where clouds put their credential endpoints (new ones
# appear there; a list cannot keep up). There is no allowlist for them.
ALWAYS_REFUSED = frozenset({"cloud-metadata", "link-local"})
# IPv6 prefixes that embed an IPv4 address a packet may be relayed to: NAT64 (RFC 6052 well
# known, RFC 8215 local use). 6to4 (2002::/16) and Teredo (2001::/32) come from ipaddress.
_TUNNELS = ("6to4-", "teredo-", "nat64-")
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
# Leave this much of the request's deadline for decoding, encoding and the first token.
DEADLINE_MARGIN_S = 0.25
_FORBIDDEN = "splitvl-forbidden-address"
_FORBIDDEN_KIND = re.compile(_FORBIDDEN + r":([a-z0-9-]+)")
_CHUNK = 64 * 1024
_REDIRECTS = (301, 302, 303, 307, 308)


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> tuple[str, ipaddress.IPv4Address] | None:
    """The IPv4 address a 6to4, Teredo or NAT64 address leads to, with the tunnel's name."""
    if ip.sixtofour is not None:
        return "6to4", ip.sixtofour
    if ip.teredo is not None:
        return "teredo", ip.teredo[1]  # (server, client): packets go to the client
    if any(ip in net for net in _NAT64):
        return "nat64", ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def address_kind(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why ``ip`` is not a public unicast address (e.g. ``"loopback"``), or None if it is.

    An IPv6 address that embeds an IPv4 one (IPv4-mapped, 6to4, Teredo, NAT64) is judged by
    the IPv4 address: ``"6to4-loopback"`` for 2002:7f00:1::, ``"nat64-cloud-metadata"``
    for 64:ff9b::a9fe:a9fe. Deprecated site-local fec0::/10 is ``"site-local"``.
    """
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
        else:
            embedded = _embedded_ipv4(ip)
            if embedded is not None:
                tunnel, inner = embedded
                kind = address_kind(inner)
                if kind is not None:
                    return f"{tunnel}-{kind}"
                # a public IPv4 behind the tunnel: the prefix's own class decides below
    if ip in METADATA_ADDRESSES:
        return "cloud-metadata"
    for kind in ("loopback", "link_local", "multicast", "unspecified", "reserved", "private"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
        return "site-local"  # fec0::/10: deprecated (RFC 3879), yet ipaddress calls it global
    if not ip.is_global:
        return "non-global"  # e.g. 100.64.0.0/10 (CGNAT), 192.0.0.0/24
    return None


def refused_kind(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address, *, allow_private: bool
) -> str | None:
    """The reason ``ip`` may not be connected to under the policy, or None.

    ``allow_private`` lets loopback, private, site-local, CGNAT and the like through, never
    cloud metadata or link-local (:data:`ALWAYS_REFUSED`), also not when embedded in a
    6to4/Teredo/NAT64 address.
    """
    kind = address_kind(ip)
    if kind is None:
        return None
    base = kind.split("-", 1)[1] if kind.startswith(_TUNNELS) else kind
    if allow_private and base not in ALWAYS_REFUSED:
        return None
    return kind


class _ForbiddenAddressError(OSError):
    pass


def _guarded_socket_factory(allow_private: bool):  # type: ignore[no-untyped-def]
    """aiohttp ``socket_factory``: refuse a forbidden peer before creating its socket."""

    def factory(addr_info: tuple) -> socket.socket:  # type: ignore[type-arg]
        family, type_, proto, _, sockaddr = addr_info
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        kind = refused_kind(ip, allow_private=allow_private)
        if kind is not None:
            raise _ForbiddenAddressError(f"{_FORBIDDEN}:{kind}")
        return socket.socket(family=family, type=type_, proto=proto)

    return factory


def _host(url: URL) -> str:
    return url.host or "?"


class UrlFetcher:
    """Fetches image URLs under the gateway's settings.

    One aiohttp session (and connector) per call of :meth:`fetch_all`: the gateway has no
    shutdown hook for a shared session, and a request's connections then close with it.
    Connection setup is small beside decoding the image it fetches.
    """

    def __init__(
        self, settings: GatewaySettings, *, noun: str = "images", max_bytes: int = 0
    ) -> None:
        self.settings = settings
        self.inflight = 0  # URL fetches running now, over all requests (one event loop)
        # The gateway's video fetcher is another instance: fields read videos[i].url and
        # bodies stop at the video byte limit (GATEWAY_MAX_VIDEO_BYTES).
        self.noun = noun
        self.item = noun[:-1]  # "image" or "video", in messages and reasons
        self.max_bytes = max_bytes or settings.max_image_bytes

    async def fetch_all(
        self, urls: Iterable[tuple[int, str]], time_left: float | None
    ) -> dict[int, bytes]:
        """Fetch ``(image index, url)`` pairs concurrently; returns bytes by image index.

        Args:
            urls: The request's URL images with their indexes.
            time_left: Seconds left of the request's deadline (None: no deadline).

        Raises:
            ServiceError: the first failure, as listed in the module docstring.
        """
        pending = list(urls)
        if not pending:
            return {}
        s = self.settings
        for index, url in pending:
            self.check_url(url, index=index)
        if self.inflight + len(pending) > s.url_max_inflight:
            # Each fetch may buffer max_image_bytes: a bound on memory, answered at once.
            raise Refusal.URL_FETCHES_BUSY.error(
                f"{self.inflight} {self.item} URL fetches are in flight; this request's "
                f"{len(pending)} would pass the limit of {s.url_max_inflight}; retry shortly",
                field=self.noun,
                limit=s.url_max_inflight,
                retry_after_ms=s.retry_after_ms,
            )
        self.inflight += len(pending)
        try:
            return await self._fetch_all(pending, time_left)
        finally:
            self.inflight -= len(pending)

    async def _fetch_all(
        self, pending: list[tuple[int, str]], time_left: float | None
    ) -> dict[int, bytes]:
        s = self.settings
        budget = s.url_total_timeout_s
        deadline_bound = False
        if time_left is not None and time_left - DEADLINE_MARGIN_S < budget:
            budget, deadline_bound = max(0.001, time_left - DEADLINE_MARGIN_S), True
        tls = ssl.create_default_context()  # certificate and host name verified
        if s.url_ca_file:
            tls.load_verify_locations(cafile=s.url_ca_file)
        connector = aiohttp.TCPConnector(
            ssl=tls,
            socket_factory=_guarded_socket_factory(s.url_allow_private),
            limit=len(pending),
            use_dns_cache=False,
        )
        async with aiohttp.ClientSession(
            connector=connector,
            trust_env=False,  # no proxies from the environment: the guard must see the peer
            timeout=aiohttp.ClientTimeout(
                sock_connect=min(s.url_connect_timeout_s, budget),
                sock_read=min(s.url_read_timeout_s, budget),
            ),
            headers={"User-Agent": "splitvl-gateway", "Accept": f"{self.item}/*"},
        ) as session:
            try:
                async with asyncio.timeout(budget):
                    # A TaskGroup cancels the other fetches as soon as one fails.
                    async with asyncio.TaskGroup() as group:
                        tasks = [
                            group.create_task(self._fetch(session, URL(url), index))
                            for index, url in pending
                        ]
            except ExceptionGroup as group_error:
                # One task's failure cancels the rest; report the first real failure.
                first = group_error.exceptions[0]
                if isinstance(first, ServiceError):
                    raise first from None
                # Anything unforeseen is still the upstream's doing: never INTERNAL.
                raise Refusal.URL_FETCH_FAILED.error(
                    f"fetching {self.item} URLs failed ({type(first).__name__})", field=self.noun
                ) from first
            except TimeoutError as exc:
                if deadline_bound:
                    raise expired_error(f"fetching {self.item} URLs") from exc
                hosts = ", ".join(sorted({_host(URL(u)) for _, u in pending}))
                raise Refusal.URL_FETCH_FAILED.error(
                    f"fetching {self.item} URLs from {hosts} took longer than the limit of "
                    f"{s.url_total_timeout_s:g} s",
                    field=self.noun,
                    limit=f"{s.url_total_timeout_s:g}s",
                ) from exc
        return {index: task.result() for (index, _), task in zip(pending, tasks, strict=True)}

    def check_url(self, url: str, *, index: int) -> URL:
        """Refuse a URL before any network work (INVALID_ARGUMENT / FAILED_PRECONDITION)."""
        s = self.settings
        field = f"{self.noun}[{index}].url"
        if not s.allow_urls:
            raise _URLS_DISABLED[self.item].error(
                f"{field}: {self.item} URLs are disabled on this server "
                "(GATEWAY_ALLOW_URLS); "
                "send the bytes or a data URL",
                field=field,
            )
        if len(url) > s.url_max_chars:
            raise Refusal.URL_TOO_LONG.error(
                f"{field} is {len(url)} characters; the limit is {s.url_max_chars}",
                field=field,
                limit=s.url_max_chars,
            )
        return self._check_target(url, field=field, what=field)

    def _check_target(self, url: str | URL, *, field: str, what: str) -> URL:
        try:
            parsed = url if isinstance(url, URL) else URL(url)
        except (ValueError, TypeError) as exc:
            message = f"{what} is not a valid URL"
            raise Refusal.URL_INVALID.error(message, field=field) from exc
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise Refusal.URL_INVALID.error(
                f"{what} must be an http or https URL with a host (scheme {parsed.scheme!r})",
                field=field,
            )
        try:
            literal = ipaddress.ip_address(parsed.host)
        except ValueError:
            # A name: checked at connect time, on the address it resolves to. It must encode
            # as the resolver will (IDNA: labels of 1-63 characters), or the fetch would fail
            # later with a UnicodeError that says nothing about the caller's URL.
            try:
                str(parsed)
                (parsed.raw_host or "").encode("idna")
            except (UnicodeError, ValueError) as exc:
                raise Refusal.URL_INVALID.error(
                    f"{what} has a host name that cannot be encoded (IDNA: each label 1-63 "
                    "characters)",
                    field=field,
                ) from exc
            return parsed
        kind = refused_kind(literal, allow_private=self.settings.url_allow_private)
        if kind is not None:
            raise self._forbidden(field, parsed, kind)
        return parsed

    def _forbidden(self, field: str, url: URL, kind: str) -> ServiceError:
        return Refusal.URL_ADDRESS_FORBIDDEN.error(
            f"{field}: host {_host(url)} is refused: its address is {kind} "
            f"({self.item} URLs may reach only public addresses)",
            field=field,
            host=_host(url),
            address_kind=kind,
        )

    async def _fetch(self, session: aiohttp.ClientSession, url: URL, index: int) -> bytes:
        s = self.settings
        field = f"{self.noun}[{index}].url"
        for hop in range(s.url_max_redirects + 1):
            try:
                async with session.get(url, allow_redirects=False) as response:
                    if response.status in _REDIRECTS:
                        location = response.headers.get("Location")
                        if not location:
                            raise Refusal.URL_FETCH_REJECTED.error(
                                f"{field}: host {_host(url)} answered HTTP {response.status} "
                                "without a Location",
                                field=field,
                                host=_host(url),
                                http_status=response.status,
                            )
                        what = f"{field} (redirect {hop + 1} from {_host(url)})"
                        try:
                            target = url.join(URL(location))
                        except ValueError as exc:
                            raise Refusal.URL_INVALID.error(
                                f"{what} has an invalid Location", field=field
                            ) from exc
                        url = self._check_target(target, field=field, what=what)
                        continue
                    self._check_status(response.status, url, field)
                    return await self._read(response, url, field)
            except aiohttp.ClientConnectorCertificateError as exc:
                raise self._unavailable(field, url, "failed TLS certificate verification") from exc
            except aiohttp.ClientSSLError as exc:
                raise self._unavailable(field, url, "failed the TLS handshake") from exc
            except aiohttp.ClientConnectorError as exc:
                # The guard's refusal surfaces as a connection error (possibly one of
                # several, one per resolved address); its marker names the address class.
                found = _FORBIDDEN_KIND.search(f"{exc.os_error} {exc}")
                if found is not None:
                    raise self._forbidden(field, url, found.group(1)) from exc
                raise self._unavailable(field, url, "could not be reached") from exc
            except (aiohttp.InvalidURL, UnicodeError) as exc:
                # Whatever URL the client library cannot parse or encode is the caller's
                # (e.g. a legacy numeric IPv4 form, or a host the resolver cannot encode).
                raise Refusal.URL_INVALID.error(
                    f"{field}: host {_host(url)} is not a valid host name or canonical address",
                    field=field,
                ) from exc
            except TimeoutError as exc:
                raise self._unavailable(field, url, "timed out") from exc
            except aiohttp.ClientError as exc:
                raise self._unavailable(field, url, f"failed ({type(exc).__name__})") from exc
        raise Refusal.URL_TOO_MANY_REDIRECTS.error(
            f"{field}: more than {s.url_max_redirects} redirects (last host {_host(url)})",
            field=field,
            limit=s.url_max_redirects,
        )

    def _unavailable(self, field: str, url: URL, what: str) -> ServiceError:
        return Refusal.URL_FETCH_FAILED.error(
            f"{field}: host {_host(url)} {what}", field=field, host=_host(url)
        )

    def _check_status(self, status: int, url: URL, field: str) -> None:
        if 200 <= status < 300:
            return
        refusal = Refusal.URL_FETCH_FAILED if status >= 500 else Refusal.URL_FETCH_REJECTED
        raise refusal.error(
            f"{field}: host {_host(url)} answered HTTP {status}",
            field=field,
            host=_host(url),
            http_status=status,
        )

    async def _read(self, response: aiohttp.ClientResponse, url: URL, field: str) -> bytes:
        """The body, streamed and stopped past ``max_image_bytes`` (after decompression)."""
        limit = self.max_bytes
        if response.content_length is not None and response.content_length > limit:
            raise self._too_large(field, url, f"declares {response.content_length} bytes", limit)
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.content.iter_chunked(_CHUNK):
            size += len(chunk)
            if size > limit:
                raise self._too_large(field, url, f"sent over {limit} bytes", limit)
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self, field: str, url: URL, what: str, limit: int) -> ServiceError:
        return bytes_too_large(
            self.item,
            f"{field}: host {_host(url)} {what}; the {self.item} limit is {limit} bytes",
            field=field,
            limit=limit,
            host=_host(url),
        )
