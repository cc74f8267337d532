"""Images by URL (gateway/fetch.py): a real HTTP server on loopback and the real fetcher.
tests/e2e/test_url_fetch.py puts a real gateway (in process) in front of the session
cluster's encoder, cache and decoder."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest

from gateway.fetch import UrlFetcher, address_kind, refused_kind
from gateway.settings import GatewaySettings
from tests.conftest import photo
from vlcommon.errors import ServiceError

LIMIT = 4096  # max_image_bytes for the fetcher tests


class ImageServer:
    """http.server on 127.0.0.1:0 in a thread; counts the requests it answers."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        server = self
        self.hits: list[str] = []
        self.body = b""

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                server.hits.append(self.path)
                parts = self.path.split("?", 1)[0].strip("/").split("/")
                route, arg = parts[0], (parts[1] if len(parts) > 1 else "")
                if route == "img":
                    self._send(200, server.body)
                elif route == "bytes":  # /bytes/N: N bytes with a Content-Length
                    self._send(200, b"x" * int(arg))
                elif route == "chunked":  # /chunked/N: N bytes, chunked, no Content-Length
                    self.send_response(200)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    left = int(arg)
                    while left:
                        n = min(left, 1000)
                        self.wfile.write(b"%x\r\n" % n + b"y" * n + b"\r\n")
                        left -= n
                    self.wfile.write(b"0\r\n\r\n")
                elif route == "status":
                    self._send(int(arg), b"nope")
                elif route == "redirect":  # /redirect/N -> ... -> /img after N hops
                    n = int(arg)
                    self._redirect("/img" if n <= 1 else f"/redirect/{n - 1}")
                elif route == "loop":
                    self._redirect("/loop")
                elif route == "to":  # /to/metadata or /to/localhost
                    target = {
                        "metadata": "http://169.254.169.254/latest/meta-data/",
                        "file": "file:///etc/passwd",
                        "bad": "http://[::1",
                    }[arg]
                    self._redirect(target)
                elif route == "slow":  # headers, then silence for float(arg) seconds
                    self.send_response(200)
                    self.send_header("Content-Length", "10")
                    self.end_headers()
                    self.wfile.flush()
                    time.sleep(float(arg))
                    self.wfile.write(b"z" * 10)
                else:
                    self._send(404, b"")

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _redirect(self, location: str) -> None:
                self.send_response(302)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.scheme = "http"
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
            self.scheme = "https"
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def server() -> Iterator[ImageServer]:
    s = ImageServer()
    yield s
    s.stop()


def fetcher(**kw: object) -> UrlFetcher:
    values: dict[str, object] = {
        "allow_urls": True,
        "url_allow_private": True,
        "max_image_bytes": LIMIT,
        "url_connect_timeout_s": 2.0,
        "url_read_timeout_s": 2.0,
    }
    values.update(kw)
    return UrlFetcher(GatewaySettings(**values))  # type: ignore[arg-type]


async def fetch_error(f: UrlFetcher, url: str, time_left: float | None = 30.0) -> ServiceError:
    with pytest.raises(ServiceError) as exc:
        await f.fetch_all([(1, url)], time_left)
    return exc.value


# -- the SSRF guard ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped IPv6
        ("10.1.2.3", "private"),
        ("192.168.0.1", "private"),
        ("172.16.0.1", "private"),
        ("fd12::1", "private"),
        ("169.254.169.254", "cloud-metadata"),
        ("fd00:ec2::254", "cloud-metadata"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        # More credential endpoints: ECS task role, EKS Pod Identity, Alibaba Cloud.
        ("169.254.170.2", "cloud-metadata"),
        ("169.254.170.23", "cloud-metadata"),
        ("fd00:ec2::23", "cloud-metadata"),
        ("100.100.100.200", "cloud-metadata"),
        ("fec0::1", "site-local"),  # deprecated site-local; ipaddress calls it global
        # IPv6 transition addresses are judged by the IPv4 address they lead to.
        ("2002:7f00:1::", "6to4-loopback"),
        ("2002:a9fe:a9fe::", "6to4-cloud-metadata"),
        ("2002:a00:1::", "6to4-private"),
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", "teredo-loopback"),  # client 127.0.0.1
        ("64:ff9b::a9fe:a9fe", "nat64-cloud-metadata"),
        ("64:ff9b:1::a00:1", "nat64-private"),
        ("2002:808:808::", None),  # 6to4 to a public address
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("240.0.0.1", "reserved"),
        ("100.64.0.1", "non-global"),  # carrier-grade NAT
        ("8.8.8.8", None),
        ("2606:4700::1111", None),
    ],
)
def test_address_classes(address: str, kind: str | None) -> None:
    ip = ipaddress.ip_address(address)
    assert address_kind(ip) == kind
    assert refused_kind(ip, allow_private=False) == kind
    # The test switch opens private ranges but never metadata or link-local (also not
    # behind a 6to4/Teredo/NAT64 address).
    always = ("cloud-metadata", "link-local")
    expected = kind if kind is not None and kind.endswith(always) else None
    assert refused_kind(ip, allow_private=True) == expected


async def test_loopback_is_refused_by_default_without_a_request(server: ImageServer) -> None:
    server.body = photo("coffee.png")
    before = len(server.hits)
    err = await fetch_error(fetcher(url_allow_private=False), server.url("/img"))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.reason == "URL_ADDRESS_FORBIDDEN"
    assert "images[1].url" in err.message and "loopback" in err.message
    assert len(server.hits) == before


async def test_a_name_resolving_to_loopback_is_refused_at_connect(server: ImageServer) -> None:
    # "localhost" is no IP literal: only the connect-time check on the resolved address
    # (aiohttp socket_factory) can refuse it, so this is the DNS-rebinding path.
    before = len(server.hits)
    err = await fetch_error(fetcher(url_allow_private=False), server.url("/img", "localhost"))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.reason == "URL_ADDRESS_FORBIDDEN"
    assert "host localhost" in err.message and "loopback" in err.message
    assert len(server.hits) == before


@pytest.mark.parametrize(
    "host",
    ["[::1]", "[::ffff:127.0.0.1]", "0.0.0.0", "2130706433", "127.1", "0x7f000001"],
)
async def test_other_spellings_of_loopback_are_refused(server: ImageServer, host: str) -> None:
    before = len(server.hits)
    err = await fetch_error(fetcher(url_allow_private=False), server.url("/img", host))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT, err.message
    assert err.reason in ("URL_ADDRESS_FORBIDDEN", "URL_INVALID")
    assert len(server.hits) == before


@pytest.mark.parametrize(
    "host",
    ["a" * 64 + ".example.com", "a" * 300 + ".com", "ex..ample.com", "\u00fc" * 70 + ".de"],
)
async def test_hosts_the_client_cannot_encode_are_invalid_argument(host: str) -> None:
    # A label over 63 characters used to reach the resolver and end UNAVAILABLE
    # "(UnicodeError)"; it is the caller's URL that is wrong.
    err = await fetch_error(fetcher(), f"http://{host}/img.png")
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT, err.message
    assert err.reason == "URL_INVALID"
    assert err.metadata["field"] == "images[1].url" and "images[1].url" in err.message


async def test_redirect_targets_are_checked_again(server: ImageServer) -> None:
    err = await fetch_error(fetcher(), server.url("/to/metadata"))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.reason == "URL_ADDRESS_FORBIDDEN"
    assert "169.254.169.254" in err.message and "cloud-metadata" in err.message
    err = await fetch_error(fetcher(), server.url("/to/file"))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "'file'" in err.message
    err = await fetch_error(fetcher(), server.url("/to/bad"))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "invalid Location" in err.message


async def test_switch_off_scheme_and_length_are_refused_before_any_request(server) -> None:
    before = len(server.hits)
    err = await fetch_error(fetcher(allow_urls=False), server.url("/img"))
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "GATEWAY_ALLOW_URLS" in err.message
    for url in ("ftp://example.com/a.png", "file:///etc/passwd", "http:///nohost"):
        err = await fetch_error(fetcher(), url)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT, url
        assert err.reason == "URL_INVALID"
    edge = server.url("/bytes/1?") + "a" * (100 - len(server.url("/bytes/1?")))
    assert len(edge) == 100
    await fetcher(url_max_chars=100).fetch_all([(0, edge)], 30.0)  # the limit is accepted
    err = await fetch_error(fetcher(url_max_chars=100), edge + "a")
    assert err.reason == "URL_TOO_LONG" and "101 characters; the limit is 100" in err.message
    assert len(server.hits) == before + 1


# -- what comes back --------------------------------------------------------------------------
async def test_fetched_bytes_are_the_served_bytes(server: ImageServer) -> None:
    server.body = photo("coffee.png")
    big = fetcher(max_image_bytes=len(server.body))
    got = await big.fetch_all([(0, server.url("/img")), (3, server.url("/redirect/2"))], 30.0)
    assert got == {0: server.body, 3: server.body}


async def test_size_cap_at_its_edge_with_and_without_content_length(server) -> None:
    f = fetcher()
    for route in ("bytes", "chunked"):
        got = await f.fetch_all([(0, server.url(f"/{route}/{LIMIT}"))], 30.0)
        assert len(got[0]) == LIMIT, route
        err = await fetch_error(f, server.url(f"/{route}/{LIMIT + 1}"))
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED, route
        assert err.metadata["limit"] == str(LIMIT)
        assert f"the image limit is {LIMIT} bytes" in err.message


async def test_upstream_status_and_host_are_named_without_the_query(server) -> None:
    f = fetcher()
    err = await fetch_error(f, server.url("/status/404?token=s3cret"))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.reason == "URL_FETCH_REJECTED"
    assert "host 127.0.0.1 answered HTTP 404" in err.message
    assert "s3cret" not in err.message and "/status" not in err.message
    err = await fetch_error(f, server.url("/status/503"))
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert "host 127.0.0.1 answered HTTP 503" in err.message
    assert err.metadata["http_status"] == "503"


async def test_redirects_are_bounded(server: ImageServer) -> None:
    server.body = b"ok"
    f = fetcher(url_max_redirects=3)
    assert (await f.fetch_all([(0, server.url("/redirect/3"))], 30.0))[0] == b"ok"
    err = await fetch_error(f, server.url("/redirect/4"))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.reason == "URL_TOO_MANY_REDIRECTS" and "more than 3 redirects" in err.message
    err = await fetch_error(f, server.url("/loop"))
    assert err.reason == "URL_TOO_MANY_REDIRECTS"


async def test_fetches_in_flight_are_bounded(server: ImageServer) -> None:
    f = fetcher(url_max_inflight=2)
    slow = asyncio.ensure_future(f.fetch_all([(0, server.url("/slow/1.5"))], 30.0))
    while f.inflight == 0:
        await asyncio.sleep(0.01)
    two = [(0, server.url("/bytes/5")), (1, server.url("/bytes/6"))]
    with pytest.raises(ServiceError) as exc:
        await f.fetch_all(two, 30.0)  # 1 in flight + 2 > 2: refused at once
    assert not slow.done()  # it did not wait for a slot
    assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert exc.value.reason == "URL_FETCHES_BUSY" and exc.value.metadata["limit"] == "2"
    # A concurrency limit: the answer carries the retry hint (RetryInfo, retry-after-ms).
    assert exc.value.retry_after_ms == GatewaySettings().retry_after_ms > 0
    assert (await f.fetch_all(two[:1], 30.0))[0] == b"x" * 5  # 1 + 1 fits
    assert (await slow)[0] == b"z" * 10
    assert f.inflight == 0
    assert await f.fetch_all(two, 30.0) == {0: b"x" * 5, 1: b"x" * 6}


async def test_read_timeout_and_deadline(server: ImageServer) -> None:
    t0 = time.monotonic()
    err = await fetch_error(fetcher(url_read_timeout_s=0.5), server.url("/slow/5"))
    assert err.code == grpc.StatusCode.UNAVAILABLE and "timed out" in err.message
    assert "host 127.0.0.1" in err.message
    assert time.monotonic() - t0 < 4.5  # well before the server's 5 s
    # The request's deadline, not the 15 s fetch budget, bounds the wait.
    t0 = time.monotonic()
    err = await fetch_error(fetcher(url_read_timeout_s=30), server.url("/slow/5"), time_left=1.5)
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 4.5
    # A refused connection (nothing listens on the port) is UNAVAILABLE naming the host.
    err = await fetch_error(fetcher(), "http://127.0.0.1:9/x.png")
    assert err.code == grpc.StatusCode.UNAVAILABLE and "host 127.0.0.1" in err.message


def _tls_files(tmp: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for the name "localhost" only (no IP SAN)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key, issuer, signer, ca: bool):  # type: ignore[no-untyped-def]
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False
            )
        return builder.sign(signer, hashes.SHA256())

    ca_key, leaf_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    ca = cert("splitvl test CA", ca_key, "splitvl test CA", ca_key, True)
    leaf = cert("localhost", leaf_key, "splitvl test CA", ca_key, False)
    pem = serialization.Encoding.PEM
    paths = (tmp / "ca.pem", tmp / "leaf.pem", tmp / "leaf.key")
    paths[0].write_bytes(ca.public_bytes(pem))
    paths[1].write_bytes(leaf.public_bytes(pem))
    paths[2].write_bytes(
        leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


async def test_https_verifies_the_certificate_against_the_url_host(tmp_path: Path) -> None:
    ca, leaf, key = _tls_files(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(leaf, key)
    server = ImageServer(tls)
    try:
        server.body = b"over tls"
        trusted = fetcher(url_ca_file=str(ca))
        # Connected to 127.0.0.1 (the guard's address), verified as "localhost" (SNI, Host).
        got = await trusted.fetch_all([(0, server.url("/img", "localhost"))], 30.0)
        assert got == {0: b"over tls"}
        # The certificate does not name 127.0.0.1: verification by the URL's host fails.
        err = await fetch_error(trusted, server.url("/img"))
        assert err.code == grpc.StatusCode.UNAVAILABLE
        assert "host 127.0.0.1 failed TLS certificate verification" in err.message
        # Without the CA the chain is untrusted.
        err = await fetch_error(fetcher(), server.url("/img", "localhost"))
        assert "host localhost failed TLS certificate verification" in err.message
        assert server.hits == ["/img"]
    finally:
        server.stop()
