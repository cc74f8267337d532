"""A hung (not dead) encoder never hangs a request, even one sent without a deadline.

The gateway is the real GatewayServicer on a loopback server; the encoder is a real gRPC
EncoderService whose Encode never answers (a stuck process keeps its socket open, so
keepalive alone would not notice). The request carries no client deadline: the gateway's
``encode_timeout_s`` bounds the encode, and the client gets DEADLINE_EXCEEDED naming the
encoder.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from qwenvl.encoder.v1 import encoder_service_pb2_grpc as epb_grpc
from qwenvl.gateway.v1 import gateway_service_pb2_grpc as gpb_grpc

from splitvl.client import build_request
from splitvl.launcher import free_port
from tests.conftest import in_process_server, photo

ENCODE_TIMEOUT_S = 1.5


class HungEncoder(epb_grpc.EncoderServiceServicer):
    def __init__(self) -> None:
        self.calls = 0
        self.cancelled = 0

    async def Encode(self, request, context):  # type: ignore[no-untyped-def]
        self.calls += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1  # the gateway's deadline reached the encoder
            raise


async def test_hung_encoder_gives_deadline_exceeded_naming_it_without_a_client_deadline(
    tiny_model,
) -> None:
    from gateway.__main__ import channel, forbidden_tokens
    from gateway.pipeline import Downstream, Pipeline
    from gateway.servicer import GatewayServicer
    from gateway.settings import GatewaySettings
    from vlcommon.model_info import load_vision_spec, model_revision

    hung = HungEncoder()
    async with in_process_server(
        epb_grpc.add_EncoderServiceServicer_to_server, hung, "qwenvl.encoder.v1.EncoderService"
    ) as enc:
        settings = GatewaySettings(
            model=str(tiny_model), cache_address="", encode_timeout_s=ENCODE_TIMEOUT_S
        )
        from qwenvl.decoder.v1 import decoder_service_pb2_grpc

        decoder_channel = channel(f"127.0.0.1:{free_port()}")  # never reached
        servicer = GatewayServicer(
            Pipeline(
                settings,
                load_vision_spec(tiny_model),
                model_revision(tiny_model),
                forbidden_tokens(tiny_model),
                Downstream(
                    encoder=epb_grpc.EncoderServiceStub(enc),
                    decoder=decoder_service_pb2_grpc.DecoderServiceStub(decoder_channel),
                    cache=None,
                ),
            )
        )
        async with in_process_server(
            gpb_grpc.add_GatewayServiceServicer_to_server,
            servicer,
            "qwenvl.gateway.v1.GatewayService",
        ) as gw:
            stub = gpb_grpc.GatewayServiceStub(gw)
            request = build_request([photo("coffee.png")], "Describe this image.", max_tokens=4)
            start = time.monotonic()
            try:
                # No timeout: the client sets no deadline at all.
                async for _ in stub.Generate(request):
                    raise AssertionError("nothing may be streamed")
                raise AssertionError("the request succeeded against a hung encoder")
            except grpc.aio.AioRpcError as err:
                elapsed = time.monotonic() - start
                assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
                assert "encoder" in (err.details() or ""), err.details()
        await decoder_channel.close()
    assert hung.calls == 1
    assert hung.cancelled == 1
    # Generous upper bound (shared, slow machine): well under the hang, near the cap.
    assert ENCODE_TIMEOUT_S <= elapsed < ENCODE_TIMEOUT_S + 10
