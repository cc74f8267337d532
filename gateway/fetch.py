"""Images by URL: an http/https fetch with an SSRF guard, a size cap and bounded time.

Used by the gateway for ``ImageInput.url`` when ``GATEWAY_ALLOW_URLS`` is set::

    fetcher = UrlFetcher(settings)
    data = await fetcher.fetch(url, index=0, time_left=context.time_remaining())

The HTTP client is aiohttp. The guard sits at the socket: aiohttp's ``TCPConnector``
hands every address it is about to connect to (from DNS or an IP literal) to our
``socket_factory``, which refuses loopback, private, link-local, multicast, reserved,
unspecified, shared (CGNAT) and cloud-metadata addresses before the socket exists. The
address checked is the one connected to, so DNS rebinding (a name that resolves to a
public address for a check and to 127.0.0.1 for the connection) has no gap to use, and
the Host header and TLS SNI stay the URL's own host. Environment proxies are ignored
(``trust_env=False``): through a proxy the socket would see only the proxy's address.

Statuses (each names the URL's host, never the full URL, whose query may hold secrets):

- URLs disabled: FAILED_PRECONDITION ``IMAGE_URLS_DISABLED``.
- Not http/https, no host, too long, bad redirect target, too many redirects, a
  forbidden address: INVALID_ARGUMENT.
- Upstream HTTP 4xx: INVALID_ARGUMENT ``URL_FETCH_REJECTED`` with the status (the
  caller's URL is wrong; retrying will not help).
- Upstream HTTP 5xx, refused/reset connection, DNS failure, a connect or read timeout:
  UNAVAILABLE ``URL_FETCH_FAILED`` (may succeed on retry).
- Body over ``max_image_bytes`` (by Content-Length, or while streaming): RESOURCE_EXHAUSTED.
- More than ``url_max_inflight`` fetches at once over all requests: RESOURCE_EXHAUSTED
  ``URL_FETCHES_BUSY`` at once (each fetch may buffer ``max_image_bytes``).
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
import grpc
from yarl import URL

from gateway.settings import GatewaySettings
from vlcommon.errors import ServiceError, invalid_argument, resource_exhausted

# AWS/GCP/Azure/OpenStack instance metadata (IPv4, and AWS's IPv6 endpoint). Refused even
# when private addresses are allowed: credentials live there.
METADATA_ADDRESSES = frozenset(
    {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
)
# Leave this much of the request's deadline for decoding, encoding and the first token.
DEADLINE_MARGIN_S = 0.25
_FORBIDDEN = "splitvl-forbidden-address"
_FORBIDDEN_KIND = re.compile(_FORBIDDEN + r":([a-z-]+)")
_CHUNK = 64 * 1024
_REDIRECTS = (301, 302, 303, 307, 308)


def address_kind(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why ``ip`` is not a public unicast address (e.g. ``"loopback"``), or None if it is."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    if ip in METADATA_ADDRESSES:
        return "cloud-metadata"
    for kind in ("loopback", "link_local", "multicast", "unspecified", "reserved", "private"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    if not ip.is_global:
        return "non-global"  # e.g. 100.64.0.0/10 (CGNAT), 192.0.0.0/24
    return None


def refused_kind(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address, *, allow_private: bool
) -> str | None:
    """The reason ``ip`` may not be connected to under the policy, or None."""
    kind = address_kind(ip)
    if kind is None or (allow_private and kind != "cloud-metadata"):
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

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.inflight = 0  # URL fetches running now, over all requests (one event loop)

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
            raise resource_exhausted(
                "URL_FETCHES_BUSY",
                f"{self.inflight} image URL fetches are in flight; this request's "
                f"{len(pending)} would pass the limit of {s.url_max_inflight}; retry shortly",
                field="images",
                limit=s.url_max_inflight,
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
            headers={"User-Agent": "splitvl-gateway", "Accept": "image/*"},
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
                raise ServiceError(
                    grpc.StatusCode.UNAVAILABLE,
                    "URL_FETCH_FAILED",
                    f"fetching image URLs failed ({type(first).__name__})",
                    {"field": "images"},
                ) from first
            except TimeoutError as exc:
                if deadline_bound:
                    raise ServiceError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        "DEADLINE_EXCEEDED",
                        "the request's deadline expired while fetching image URLs",
                    ) from exc
                hosts = ", ".join(sorted({_host(URL(u)) for _, u in pending}))
                raise ServiceError(
                    grpc.StatusCode.UNAVAILABLE,
                    "URL_FETCH_FAILED",
                    f"fetching image URLs from {hosts} took longer than the limit of "
                    f"{s.url_total_timeout_s:g} s",
                    {"field": "images", "limit": f"{s.url_total_timeout_s:g}s"},
                ) from exc
        return {index: task.result() for (index, _), task in zip(pending, tasks, strict=True)}

    def check_url(self, url: str, *, index: int) -> URL:
        """Refuse a URL before any network work (INVALID_ARGUMENT / FAILED_PRECONDITION)."""
        s = self.settings
        field = f"images[{index}].url"
        if not s.allow_urls:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "IMAGE_URLS_DISABLED",
                f"{field}: image URLs are disabled on this server (GATEWAY_ALLOW_URLS); "
                "send the bytes or a data URL",
                {"field": field},
            )
        if len(url) > s.url_max_chars:
            raise invalid_argument(
                "URL_TOO_LONG",
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
            raise invalid_argument("URL_INVALID", message, field=field) from exc
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise invalid_argument(
                "URL_INVALID",
                f"{what} must be an http or https URL with a host (scheme {parsed.scheme!r})",
                field=field,
            )
        try:
            literal = ipaddress.ip_address(parsed.host)
        except ValueError:
            return parsed  # a name: checked at connect time, on the address it resolves to
        kind = refused_kind(literal, allow_private=self.settings.url_allow_private)
        if kind is not None:
            raise self._forbidden(field, parsed, kind)
        return parsed

    def _forbidden(self, field: str, url: URL, kind: str) -> ServiceError:
        return invalid_argument(
            "URL_ADDRESS_FORBIDDEN",
            f"{field}: host {_host(url)} is refused: its address is {kind} (image URLs may "
            "reach only public addresses)",
            field=field,
            host=_host(url),
            address_kind=kind,
        )

    async def _fetch(self, session: aiohttp.ClientSession, url: URL, index: int) -> bytes:
        s = self.settings
        field = f"images[{index}].url"
        for hop in range(s.url_max_redirects + 1):
            try:
                async with session.get(url, allow_redirects=False) as response:
                    if response.status in _REDIRECTS:
                        location = response.headers.get("Location")
                        if not location:
                            raise invalid_argument(
                                "URL_FETCH_REJECTED",
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
                            raise invalid_argument(
                                "URL_INVALID", f"{what} has an invalid Location", field=field
                            ) from exc
                        url = self._check_target(target, field=field, what=what)
                        continue
                    self._check_status(response.status, url, field)
                    return await self._read(response, url, field)
            except aiohttp.ClientConnectorCertificateError as exc:
                raise self._unavailable(
                    field, url, "failed TLS certificate verification"
                ) from exc
            except aiohttp.ClientSSLError as exc:
                raise self._unavailable(field, url, "failed the TLS handshake") from exc
            except aiohttp.ClientConnectorError as exc:
                # The guard's refusal surfaces as a connection error (possibly one of
                # several, one per resolved address); its marker names the address class.
                found = _FORBIDDEN_KIND.search(f"{exc.os_error} {exc}")
                if found is not None:
                    raise self._forbidden(field, url, found.group(1)) from exc
                raise self._unavailable(field, url, "could not be reached") from exc
            except aiohttp.InvalidURL as exc:
                # e.g. a legacy numeric IPv4 form (2130706433, 127.1), which aiohttp refuses.
                raise invalid_argument(
                    "URL_INVALID",
                    f"{field}: host {_host(url)} is not a valid host name or canonical address",
                    field=field,
                ) from exc
            except TimeoutError as exc:
                raise self._unavailable(field, url, "timed out") from exc
            except aiohttp.ClientError as exc:
                raise self._unavailable(field, url, f"failed ({type(exc).__name__})") from exc
        raise invalid_argument(
            "URL_TOO_MANY_REDIRECTS",
            f"{field}: more than {s.url_max_redirects} redirects (last host {_host(url)})",
            field=field,
            limit=s.url_max_redirects,
        )

    def _unavailable(self, field: str, url: URL, what: str) -> ServiceError:
        return ServiceError(
            grpc.StatusCode.UNAVAILABLE,
            "URL_FETCH_FAILED",
            f"{field}: host {_host(url)} {what}",
            {"field": field, "host": _host(url)},
        )

    def _check_status(self, status: int, url: URL, field: str) -> None:
        if 200 <= status < 300:
            return
        code = grpc.StatusCode.INVALID_ARGUMENT
        reason = "URL_FETCH_REJECTED"
        if status >= 500:
            code, reason = grpc.StatusCode.UNAVAILABLE, "URL_FETCH_FAILED"
        raise ServiceError(
            code,
            reason,
            f"{field}: host {_host(url)} answered HTTP {status}",
            {"field": field, "host": _host(url), "http_status": str(status)},
        )

    async def _read(self, response: aiohttp.ClientResponse, url: URL, field: str) -> bytes:
        """The body, streamed and stopped past ``max_image_bytes`` (after decompression)."""
        limit = self.settings.max_image_bytes
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
        return resource_exhausted(
            "IMAGE_BYTES_TOO_LARGE",
            f"{field}: host {_host(url)} {what}; the image limit is {limit} bytes",
            field=field,
            limit=limit,
            host=_host(url),
        )
