"""TLS, mTLS, bearer tokens and the internal token, on real servers on loopback.

A throwaway CA and certificates are made at test time with ``cryptography``. The servers
are the real bootstrap (``vlcommon.server.serve``) serving the real cache servicer (no
model needed); tests/e2e/test_security.py runs the four services with TLS + mTLS +
tokens on every hop and checks that the decoder refuses a direct call without the
internal credential.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from qwenvl.cache.v1 import cache_service_pb2, cache_service_pb2_grpc

from vlcommon.auth import _digest as digest
from vlcommon.auth import load_tokens, token_matches
from vlcommon.errors import error_info
from vlcommon.tls import ClientSecurity, aio_channel

CACHE = cache_service_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name


# -- a throwaway PKI ---------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path
    rogue_cert: Path
    rogue_key: Path


def _key():  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key, path: Path) -> Path:  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def _write_cert(cert, path: Path) -> Path:  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _ca(name: str):  # type: ignore[no-untyped-def]
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(ca_key, ca_cert, name: str):  # type: ignore[no-untyped-def]
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def make_pki(root: Path) -> Pki:
    """An internal CA with a server and a client certificate, and a rogue CA's client."""
    root.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("splitvl test internal CA")
    s_key, s_cert = _leaf(ca_key, ca_cert, "splitvl-service")
    c_key, c_cert = _leaf(ca_key, ca_cert, "splitvl-client")
    r_ca_key, r_ca_cert = _ca("rogue CA")
    r_key, r_cert = _leaf(r_ca_key, r_ca_cert, "rogue-client")
    return Pki(
        ca=_write_cert(ca_cert, root / "ca.pem"),
        server_cert=_write_cert(s_cert, root / "server.pem"),
        server_key=_write_key(s_key, root / "server.key"),
        client_cert=_write_cert(c_cert, root / "client.pem"),
        client_key=_write_key(c_key, root / "client.key"),
        rogue_ca=_write_cert(r_ca_cert, root / "rogue-ca.pem"),
        rogue_cert=_write_cert(r_cert, root / "rogue.pem"),
        rogue_key=_write_key(r_key, root / "rogue.key"),
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


# -- a real server through the real bootstrap ----------------------------------------------


@contextlib.asynccontextmanager
async def cache_server(public: bool = False, **settings: object) -> AsyncIterator[int]:
    """The cache service (real servicer, real ``serve``) on 127.0.0.1:0; yields its port."""
    from cache_service.__main__ import build_servicer
    from cache_service.settings import CacheSettings
    from vlcommon.server import serve

    cache_settings = CacheSettings(port=0, **settings)  # type: ignore[arg-type]
    servicer = build_servicer(cache_settings)
    stop = asyncio.Event()
    started = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(
        serve(
            service_name="cache",
            service_full_names=[CACHE],
            settings=cache_settings,
            register=lambda s: cache_service_pb2_grpc.add_CacheServiceServicer_to_server(
                servicer, s
            ),
            stop_event=stop,
            on_started=started.set_result,
            public=public,
        )
    )
    port = await started
    try:
        yield port
    finally:
        stop.set()
        await task


async def get_stats(port: int, security: ClientSecurity | None = None, **kw: object) -> int:
    """One GetStats call; returns the number of entries (0 on an empty cache)."""
    async with aio_channel(f"127.0.0.1:{port}", security) as channel:
        stub = cache_service_pb2_grpc.CacheServiceStub(channel)
        response = await stub.GetStats(cache_service_pb2.GetStatsRequest(), timeout=10, **kw)  # type: ignore[arg-type]
        return response.ByteSize()


async def health(port: int, security: ClientSecurity | None = None) -> str:
    async with aio_channel(f"127.0.0.1:{port}", security) as channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


# -- unit checks of the token helpers ----------------------------------------------------


def test_token_helpers(tmp_path: Path) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text("# operators\nalpha\n\n  beta  \n")
    assert load_tokens("gamma, alpha,", str(token_file)) == ("gamma", "alpha", "beta")
    accepted = [digest("alpha"), digest("beta")]
    assert token_matches("beta", accepted)
    assert not token_matches("bet", accepted)
    assert not token_matches("", accepted)
    with pytest.raises(ValueError, match="cannot be read"):
        load_tokens("", str(tmp_path / "missing"))


# -- TLS / mTLS ----------------------------------------------------------------------------


async def test_tls_call_works_and_plaintext_client_fails(pki: Pki) -> None:
    async with cache_server(
        tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.server_key)
    ) as port:
        trusted = ClientSecurity(ca_file=str(pki.ca))
        assert await health(port, trusted) == "SERVING"
        await get_stats(port, trusted)  # a real RPC over TLS
        with pytest.raises(grpc.aio.AioRpcError) as plain:
            await get_stats(port, None)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
        # A client that does not trust the server's CA refuses the server.
        with pytest.raises(grpc.aio.AioRpcError) as untrusted:
            await get_stats(port, ClientSecurity(ca_file=str(pki.rogue_ca)))
        assert untrusted.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_mtls_requires_a_client_certificate_from_the_ca(pki: Pki) -> None:
    async with cache_server(
        tls_cert_file=str(pki.server_cert),
        tls_key_file=str(pki.server_key),
        tls_client_ca_file=str(pki.ca),
    ) as port:
        good = ClientSecurity(
            ca_file=str(pki.ca), cert_file=str(pki.client_cert), key_file=str(pki.client_key)
        )
        await get_stats(port, good)
        for bad in (
            ClientSecurity(ca_file=str(pki.ca)),  # no client certificate
            ClientSecurity(  # a certificate from another CA
                ca_file=str(pki.ca), cert_file=str(pki.rogue_cert), key_file=str(pki.rogue_key)
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await get_stats(port, bad)
            assert err.value.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.UNAUTHENTICATED,
            ), err.value


def test_tls_settings_must_be_complete(pki: Pki) -> None:
    from vlcommon.settings import ServerSettings
    from vlcommon.tls import server_credentials

    with pytest.raises(ValueError, match="tls_key_file"):
        server_credentials(ServerSettings(tls_cert_file=str(pki.server_cert)))
    with pytest.raises(ValueError, match="mTLS"):
        server_credentials(ServerSettings(tls_client_ca_file=str(pki.ca)))
    assert server_credentials(ServerSettings()) is None


# -- bearer token (the gateway's public API) ----------------------------------------------


async def test_bearer_token_ok_missing_wrong(tmp_path: Path) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text("from-file\n")
    async with cache_server(
        public=True, auth_tokens="s3cret,other", auth_token_file=str(token_file)
    ) as port:
        for token in ("s3cret", "other", "from-file"):
            await get_stats(port, ClientSecurity(bearer_token=token))
        cases = {
            "AUTH_TOKEN_MISSING": None,
            "AUTH_TOKEN_INVALID": ClientSecurity(bearer_token="s3cre"),
        }
        for reason, security in cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await get_stats(port, security)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            info = error_info(err.value)
            assert info is not None and info.reason == reason
            assert info.metadata["field"] == "authorization"
        with pytest.raises(grpc.aio.AioRpcError) as basic:
            await get_stats(port, None, metadata=(("authorization", "Basic czNjcmV0"),))
        assert basic.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health and reflection stay open.
        assert await health(port) == "SERVING"
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            names = []
            async for resp in stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            ):
                names = [s.name for s in resp.list_services_response.service]
            assert CACHE in names


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"GATEWAY_AUTH_TOKENS": " , "}, "GATEWAY_AUTH_TOKENS"),
        ({"GATEWAY_AUTH_TOKEN_FILE": "COMMENTS"}, "GATEWAY_AUTH_TOKEN_FILE"),
        ({"GATEWAY_AUTH_TOKEN_FILE": "MISSING"}, "GATEWAY_AUTH_TOKEN_FILE"),
        ({"GATEWAY_INTERNAL_TOKEN": " \t "}, "GATEWAY_INTERNAL_TOKEN"),
    ],
)
async def test_auth_asked_for_but_empty_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str
) -> None:
    # These used to start a gateway with no auth at all, silently (fail-open).
    from gateway.settings import GatewaySettings
    from vlcommon.errors import ConfigError
    from vlcommon.server import serve

    comments = tmp_path / "tokens"
    comments.write_text("# tokens go here\n\n   # none yet\n")
    files = {"COMMENTS": str(comments), "MISSING": str(tmp_path / "absent")}
    for key, value in env.items():
        monkeypatch.setenv(key, files.get(value, value))
    started = asyncio.get_running_loop().create_future()
    with pytest.raises(ConfigError, match=named):
        await serve(
            service_name="gateway",
            service_full_names=[],
            settings=GatewaySettings(port=0),
            register=lambda s: None,
            stop_event=asyncio.Event(),
            on_started=started.set_result,
            public=True,
        )
    assert not started.done()  # it never listened


def test_empty_auth_exits_non_zero_with_the_setting_named() -> None:
    # The real entry point of a service (the cache: no model to load) exits, not serves.
    import os
    import subprocess
    import sys

    env = {**os.environ, "CACHE_AUTH_TOKENS": " , ", "CACHE_PORT": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "cache_service", "--gpu", "off"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "CACHE_AUTH_TOKENS" in proc.stderr and "refusing to start" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- the internal token (encoder, cache, decoder) -----------------------------------------


async def test_internal_service_requires_the_internal_token() -> None:
    async with cache_server(internal_token="cluster-secret") as port:
        await get_stats(port, ClientSecurity(internal_token="cluster-secret"))
        for reason, security in {
            "INTERNAL_TOKEN_MISSING": None,
            "INTERNAL_TOKEN_INVALID": ClientSecurity(internal_token="cluster-secreT"),
            # A user's bearer token is not the internal credential.
            "INTERNAL_TOKEN_MISSING ": ClientSecurity(bearer_token="cluster-secret"),
        }.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await get_stats(port, security)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            info = error_info(err.value)
            assert info is not None and info.reason == reason.strip()
        assert await health(port) == "SERVING"
    # The same setting on a public service (the gateway) is only sent, not required.
    async with cache_server(public=True, internal_token="cluster-secret") as port:
        await get_stats(port, None)


# -- every hop, end to end -----------------------------------------------------------------
