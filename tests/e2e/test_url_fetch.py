"""The end-to-end tests of tests/unit/gateway/test_url_fetch.py
(the services started); the rest of that file runs without them."""

from __future__ import annotations

import io

import grpc
import pytest
from PIL import Image
from qwenvl.gateway.v1 import gateway_service_pb2 as gpb

from gateway.settings import GatewaySettings
from tests.conftest import photo
from tests.unit.gateway import test_url_fetch as unit_part

# The unit part's fixtures, under their names (pytest finds fixtures by name here).
server = unit_part.server


# -- through a real gateway -------------------------------------------------------------------
def _gateway_servicer(cluster, tiny_model, **kw: object):  # type: ignore[no-untyped-def]
    from qwenvl.cache.v1 import cache_service_pb2_grpc
    from qwenvl.decoder.v1 import decoder_service_pb2_grpc
    from qwenvl.encoder.v1 import encoder_service_pb2_grpc

    from gateway.__main__ import forbidden_tokens
    from gateway.pipeline import Downstream, Pipeline
    from gateway.servicer import GatewayServicer
    from vlcommon.model_info import load_vision_spec, model_revision
    from vlcommon.settings import channel_options

    channels = [
        grpc.aio.insecure_channel(cluster.ports.address(name), options=channel_options())
        for name in ("encoder", "decoder", "cache")
    ]
    downstream = Downstream(
        encoder=encoder_service_pb2_grpc.EncoderServiceStub(channels[0]),
        decoder=decoder_service_pb2_grpc.DecoderServiceStub(channels[1]),
        cache=cache_service_pb2_grpc.CacheServiceStub(channels[2]),
    )
    settings = GatewaySettings(model=str(tiny_model), **kw)  # type: ignore[arg-type]
    servicer = GatewayServicer(
        Pipeline(
            settings,
            load_vision_spec(tiny_model),
            model_revision(tiny_model),
            forbidden_tokens(tiny_model),
            downstream,
        )
    )
    return servicer, channels


async def _ask(channel: grpc.aio.Channel, image: gpb.ImageInput) -> tuple[list[int], list]:
    from qwenvl.gateway.v1 import gateway_service_pb2_grpc as gpb_grpc

    request = gpb.GenerateRequest()
    message = request.messages.add(role="user")
    message.parts.add(image=image)
    message.parts.add(text="Describe this image.")
    request.sampling.max_tokens = 6
    request.sampling.ignore_eos = True
    tokens: list[int] = []
    infos: list = []
    async for chunk in gpb_grpc.GatewayServiceStub(channel).Generate(request, timeout=120):
        tokens.extend(chunk.token_ids)
        infos.extend(chunk.images)
    return tokens, infos


@pytest.mark.e2e
async def test_url_image_through_a_real_gateway(cluster, tiny_model, server) -> None:
    from qwenvl.gateway.v1 import gateway_service_pb2_grpc as gpb_grpc

    from tests.conftest import in_process_server

    # A fresh image (not cached by other tests): a URL and its bytes give the same tokens,
    # and the second is an exact cache hit on the first one's key.
    img = Image.open(io.BytesIO(photo("chelsea.png"))).convert("RGB").rotate(7)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    server.body = buf.getvalue()
    name = gpb.DESCRIPTOR.services_by_name["GatewayService"].full_name
    add = gpb_grpc.add_GatewayServiceServicer_to_server

    servicer, channels = _gateway_servicer(
        cluster, tiny_model, allow_urls=True, url_allow_private=True
    )
    async with in_process_server(add, servicer, name) as channel:
        by_url, url_infos = await _ask(channel, gpb.ImageInput(url=server.url("/img?k=1")))
        by_bytes, byte_infos = await _ask(channel, gpb.ImageInput(data=server.body))
        assert len(by_url) == 6 and by_url == by_bytes
        assert url_infos[0].key == byte_infos[0].key
        # An upstream 404 fails before the stream, naming host and status.
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await _ask(channel, gpb.ImageInput(url=server.url("/status/404")))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "images[0].url: host 127.0.0.1 answered HTTP 404" in exc.value.details()
    for ch in channels:
        await ch.close()

    # The same gateway with default URL settings: loopback refused, nothing fetched.
    servicer, channels = _gateway_servicer(cluster, tiny_model, allow_urls=True)
    before = len(server.hits)
    async with in_process_server(add, servicer, name) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await _ask(channel, gpb.ImageInput(url=server.url("/img")))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "loopback" in exc.value.details()
    assert len(server.hits) == before
    for ch in channels:
        await ch.close()


@pytest.mark.e2e
def test_cluster_gateway_refuses_urls_when_switched_off(cluster, server) -> None:
    from splitvl.client import build_request, generate

    request = build_request([], "Describe this image.", max_tokens=2)
    request.messages[0].parts.add(image=gpb.ImageInput(url=server.url("/img")))
    with pytest.raises(grpc.RpcError) as exc:
        generate(cluster.ports.address("gateway"), request, timeout_s=60)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "images[0].url" in exc.value.details()
