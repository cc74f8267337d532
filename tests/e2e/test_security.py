"""The end-to-end tests of tests/unit/vlcommon/test_security.py
(the services started); the rest of that file runs without them."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from tests.unit.vlcommon import test_security as unit_part
from tests.unit.vlcommon.test_security import Pki
from vlcommon.tls import ClientSecurity

# The unit part's fixtures, under their names (pytest finds fixtures by name here).
pki = unit_part.pki


@pytest.mark.e2e
def test_secure_cluster_end_to_end(tiny_model: Path, pki: Pki, tmp_path: Path) -> None:
    """The four services with TLS on every hop, mTLS on the internal ones, the internal
    token and a bearer token on the gateway: a request is answered; the decoder refuses a
    caller without a client certificate, and one with a certificate but no internal token.
    """
    from qwenvl.decoder.v1 import decoder_service_pb2, decoder_service_pb2_grpc

    from splitvl.client import build_request, generate
    from splitvl.launcher import Cluster, Ports, health_status
    from tests.conftest import photo
    from vlcommon.tls import sync_channel

    env = {
        "SPLITVL_TLS_CERT_FILE": str(pki.server_cert),
        "SPLITVL_TLS_KEY_FILE": str(pki.server_key),
        "SPLITVL_TLS_CA_FILE": str(pki.ca),
        "SPLITVL_TLS_CLIENT_CA_FILE": str(pki.ca),
        "SPLITVL_INTERNAL_TOKEN": "internal-e2e-secret",
        "GATEWAY_AUTH_TOKENS": "user-token",
    }
    cluster = Cluster(
        model=str(tiny_model),
        ports=Ports.free(),
        log_dir=tmp_path / "logs",
        env=env,
        decoder_args=["--max-num-batched-tokens", "2048"],
    )
    with cluster:
        user = ClientSecurity(ca_file=str(pki.ca), bearer_token="user-token")
        request = build_request(
            [photo("astronaut.png")], "Describe.", max_tokens=4, ignore_eos=True
        )
        result = generate(cluster.ports.address("gateway"), request, security=user)
        assert len(result.token_ids) == 4 and result.finish_reason == "length"
        assert result.images[0]["tier"] == "miss"

        with pytest.raises(grpc.RpcError) as no_token:
            generate(
                cluster.ports.address("gateway"),
                request,
                security=ClientSecurity(ca_file=str(pki.ca)),
            )
        assert no_token.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]

        # Health of every service answers over TLS (with the launcher's client cert).
        for name in ("gateway", "encoder", "cache", "decoder"):
            assert (
                health_status(cluster.ports.address(name), security=cluster.security()) == "SERVING"
            )

        decoder = cluster.ports.address("decoder")
        direct = decoder_service_pb2.GenerateRequest(request_id="direct")
        direct.messages.add(role="user").parts.add(text="hello")
        direct.sampling.max_tokens = 2
        direct.sampling.ignore_eos = True
        cases = {
            "no client certificate": (ClientSecurity(ca_file=str(pki.ca)), ()),
            "certificate, no internal token": (
                ClientSecurity(
                    ca_file=str(pki.ca),
                    cert_file=str(pki.client_cert),
                    key_file=str(pki.client_key),
                ),
                (),
            ),
            "certificate, user's bearer token": (
                ClientSecurity(
                    ca_file=str(pki.ca),
                    cert_file=str(pki.client_cert),
                    key_file=str(pki.client_key),
                    bearer_token="user-token",
                ),
                (),
            ),
        }
        codes = {}
        for label, (security, _) in cases.items():
            with sync_channel(decoder, security) as channel:
                stub = decoder_service_pb2_grpc.DecoderServiceStub(channel)
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Generate(direct, timeout=30, metadata=security.metadata() or None))
                codes[label] = err.value.code()  # type: ignore[attr-defined]
        assert codes["no client certificate"] in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.UNAUTHENTICATED,
        )
        assert codes["certificate, no internal token"] == grpc.StatusCode.UNAUTHENTICATED
        assert codes["certificate, user's bearer token"] == grpc.StatusCode.UNAUTHENTICATED
        # With both credentials the same direct call is served (2 tokens of text).
        internal = ClientSecurity(
            ca_file=str(pki.ca),
            cert_file=str(pki.client_cert),
            key_file=str(pki.client_key),
            internal_token="internal-e2e-secret",
        )
        with sync_channel(decoder, internal) as channel:
            stub = decoder_service_pb2_grpc.DecoderServiceStub(channel)
            chunks = list(stub.Generate(direct, timeout=60, metadata=internal.metadata()))
        assert sum(len(c.token_ids) for c in chunks) == 2
