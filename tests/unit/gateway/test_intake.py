"""Gateway intake limits at their edges, through a real in-process gateway (grpc.aio on
loopback, the real servicer and its settings).

Every limit is checked before any downstream call, so the gateway's encoder, cache and
decoder addresses point at a closed port: a request AT the limit passes validation and then
fails with UNAVAILABLE (its dependency is down), a request ONE PAST the limit fails with
INVALID_ARGUMENT or RESOURCE_EXHAUSTED naming the limit. No service is faked.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
from collections.abc import AsyncIterator

import grpc
import pytest
from PIL import Image
from qwenvl.decoder.v1 import decoder_service_pb2_grpc
from qwenvl.encoder.v1 import encoder_service_pb2_grpc
from qwenvl.gateway.v1 import gateway_service_pb2 as gpb
from qwenvl.gateway.v1 import gateway_service_pb2_grpc as gpb_grpc

from gateway.pipeline import Downstream, Pipeline
from gateway.servicer import GatewayServicer
from gateway.settings import GatewaySettings
from tests.conftest import png_bytes
from vlcommon.errors import error_info
from vlcommon.model_info import load_vision_spec
from vlcommon.settings import MiB

LIMITS = {
    "max_images": 3,
    "max_image_bytes": 10_000,
    "max_decoded_pixels": 5_000,
    "max_text_chars": 100,
    "max_tokens_limit": 50,
    "max_messages": 4,
    "max_parts": 10,
    "max_message_bytes": 4 * MiB,  # the smallest the settings allow
}
SERVICE = gpb.DESCRIPTOR.services_by_name["GatewayService"].full_name


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def gateway(tiny_model, **overrides: object) -> AsyncIterator[gpb_grpc.GatewayServiceStub]:
    from gateway.__main__ import forbidden_tokens
    from vlcommon.server import serve

    nowhere = f"127.0.0.1:{closed_port()}"
    settings = GatewaySettings(
        model=str(tiny_model),
        port=0,
        encoder_address=nowhere,
        decoder_address=nowhere,
        cache_address="",
        # An override of None drops the setting (its default applies).
        **{k: v for k, v in {**LIMITS, **overrides}.items() if v is not None},  # type: ignore[arg-type]
    )
    down_channel = grpc.aio.insecure_channel(nowhere)
    servicer = GatewayServicer(
        Pipeline(
            settings,
            load_vision_spec(tiny_model),
            "test-revision",
            forbidden_tokens(tiny_model),
            Downstream(
                encoder=encoder_service_pb2_grpc.EncoderServiceStub(down_channel),
                decoder=decoder_service_pb2_grpc.DecoderServiceStub(down_channel),
                cache=None,
            ),
        )
    )
    stop = asyncio.Event()
    started = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(
        serve(
            service_name="intake",
            service_full_names=[SERVICE],
            settings=settings,
            stop_event=stop,
            on_started=started.set_result,
            public=True,
            register=lambda s: gpb_grpc.add_GatewayServiceServicer_to_server(servicer, s),
        )
    )
    port = await started
    options = [("grpc.max_send_message_length", 64 * MiB)]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            yield gpb_grpc.GatewayServiceStub(channel)
    finally:
        stop.set()
        await task
        await down_channel.close()


@pytest.fixture(scope="module")
def tiny_png() -> bytes:
    return png_bytes(Image.new("RGB", (40, 40), (90, 20, 200)))


def request(*parts: gpb.ContentPart, max_tokens: int | None = 4) -> gpb.GenerateRequest:
    r = gpb.GenerateRequest()
    r.messages.add(role="user").parts.extend(parts or [gpb.ContentPart(text="hi")])
    if max_tokens is not None:
        r.sampling.max_tokens = max_tokens
    return r


def image(data: bytes) -> gpb.ContentPart:
    return gpb.ContentPart(image=gpb.ImageInput(data=data))


def text(t: str) -> gpb.ContentPart:
    return gpb.ContentPart(text=t)


async def status(stub: gpb_grpc.GatewayServiceStub, r: gpb.GenerateRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        async for _ in stub.Generate(r, timeout=60):
            pass
    return exc.value


async def accepted(stub: gpb_grpc.GatewayServiceStub, r: gpb.GenerateRequest) -> None:
    """Validation passed: the request got as far as its (absent) dependencies."""
    err = await status(stub, r)
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()


async def refused(
    stub: gpb_grpc.GatewayServiceStub,
    r: gpb.GenerateRequest,
    code: grpc.StatusCode,
    limit: int,
    *phrases: str,
) -> grpc.aio.AioRpcError:
    err = await status(stub, r)
    assert err.code() == code, err.details()
    for phrase in phrases:
        assert phrase in err.details(), (phrase, err.details())
    info = error_info(err)
    assert info is not None and info.metadata.get("limit") == str(limit), info
    return err


def padded_png(tiny_png: bytes, size: int) -> bytes:
    # Bytes after IEND are ignored by decoders: a valid image of exactly ``size`` bytes.
    return tiny_png + b"\0" * (size - len(tiny_png))


async def test_image_bytes_edge(tiny_model, tiny_png) -> None:
    limit = LIMITS["max_image_bytes"]
    async with gateway(tiny_model) as stub:
        await accepted(stub, request(image(padded_png(tiny_png, limit))))
        await refused(
            stub,
            request(image(padded_png(tiny_png, limit + 1))),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            limit,
            f"images[0] is {limit + 1} bytes; the limit is {limit}",
        )

        # A data URL is held to the same limit on its decoded bytes.
        def data_url(n: int) -> gpb.ContentPart:
            b64 = base64.b64encode(padded_png(tiny_png, n)).decode()
            return gpb.ContentPart(image=gpb.ImageInput(data_url=f"data:image/png;base64,{b64}"))

        await accepted(stub, request(data_url(limit)))
        await refused(stub, request(data_url(limit + 1)), grpc.StatusCode.RESOURCE_EXHAUSTED, limit)


async def test_decoded_pixels_edge(tiny_model) -> None:
    limit = LIMITS["max_decoded_pixels"]  # 5,000 = 50 x 100; 5,001 = 3 x 1,667
    async with gateway(tiny_model) as stub:
        await accepted(stub, request(image(png_bytes(Image.new("RGB", (50, 100), "red")))))
        await refused(
            stub,
            request(image(png_bytes(Image.new("RGB", (3, 1667), "red")))),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            limit,
            f"3x1667 = 5001 pixels; the limit is {limit} decoded pixels",
        )


async def test_images_per_request_edge(tiny_model, tiny_png) -> None:
    limit = LIMITS["max_images"]
    async with gateway(tiny_model) as stub:
        await accepted(stub, request(*[image(tiny_png)] * limit))
        await refused(
            stub,
            request(*[image(tiny_png)] * (limit + 1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            limit,
            f"{limit + 1} images; the limit is {limit}",
        )


async def test_text_length_edge(tiny_model) -> None:
    limit = LIMITS["max_text_chars"]
    async with gateway(tiny_model) as stub:
        # Counted over all parts, in characters (not bytes): "é" is 2 bytes, 1 character.
        await accepted(stub, request(text("é" * (limit - 10)), text("a" * 10)))
        await refused(
            stub,
            request(text("é" * (limit - 10)), text("a" * 11)),
            grpc.StatusCode.INVALID_ARGUMENT,
            limit,
            f"{limit + 1} characters of text; the limit is {limit}",
        )


async def test_max_tokens_edges(tiny_model) -> None:
    limit = LIMITS["max_tokens_limit"]
    async with gateway(tiny_model) as stub:
        await accepted(stub, request(max_tokens=limit))
        await accepted(stub, request(max_tokens=1))
        for bad in (limit + 1, 0):
            await refused(
                stub,
                request(max_tokens=bad),
                grpc.StatusCode.INVALID_ARGUMENT,
                limit,
                f"sampling.max_tokens is {bad}; allowed 1..{limit}",
            )


async def test_messages_and_parts_edges(tiny_model) -> None:
    async with gateway(tiny_model) as stub:
        parts = LIMITS["max_parts"]
        await accepted(stub, request(*[text("x")] * parts))
        await refused(
            stub,
            request(*[text("x")] * (parts + 1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            parts,
            f"{parts + 1} parts; the limit is {parts}",
        )
        n = LIMITS["max_messages"]
        many = request()
        for _ in range(n - 1):
            many.messages.add(role="user").parts.add(text="x")
        await accepted(stub, many)
        many.messages.add(role="user").parts.add(text="x")
        await refused(
            stub, many, grpc.StatusCode.INVALID_ARGUMENT, n, f"{n + 1} entries; the limit is {n}"
        )


async def test_sampling_ranges_are_refused_before_any_image_work(tiny_model, tiny_png) -> None:
    """temperature, top_p and stop are checked by the gateway itself. Only the decoder
    used to check them, so a request with temperature NaN had its image encoded and cached
    before it was refused; here every dependency is down, and a request that got past
    intake would be UNAVAILABLE."""
    bad: list[tuple[str, object, str]] = [
        ("temperature", float("nan"), "sampling.temperature is nan; allowed 0..2"),
        ("temperature", -0.5, "sampling.temperature is -0.5; allowed 0..2"),
        ("top_p", 1.5, "sampling.top_p is 1.5; allowed (0, 1]"),
        ("stop", [""], "sampling.stop[0] has 0 characters; allowed 1..256"),
        ("stop", ["x"] * 17, "sampling.stop has 17 strings; the limit is 16"),
    ]
    async with gateway(tiny_model) as stub:
        for name, value, phrase in bad:
            r = request(image(tiny_png), text("hi"))
            if name == "stop":
                r.sampling.stop.extend(value)  # type: ignore[arg-type]
            else:
                setattr(r.sampling, name, value)
            err = await status(stub, r)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err.details())
            assert phrase in err.details(), (phrase, err.details())
            info = error_info(err)
            assert info is not None and info.metadata["field"].startswith(f"sampling.{name}")
        ok = request(image(tiny_png), text("hi"))
        ok.sampling.temperature, ok.sampling.top_p = 2.0, 0.5
        ok.sampling.stop.extend(["x" * 256] * 16)
        await accepted(stub, ok)


async def test_an_error_quoting_a_long_input_stays_invalid_argument(tiny_model) -> None:
    """A 9,000-character role used to come back as RESOURCE_EXHAUSTED "received metadata
    size exceeds hard limit" (the message quoting it travels twice in the trailers), without
    the field. It is INVALID_ARGUMENT ROLE_INVALID, its message shortened in the middle."""
    async with gateway(tiny_model) as stub:
        r = request()
        r.messages[0].role = "u" * 9000
        err = await status(stub, r)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert err.details().startswith("messages[0].role is 'uuu")
        assert err.details().endswith("expected one of system, user, assistant")
        assert "characters left out" in err.details()
        info = error_info(err)
        assert info is not None and info.reason == "ROLE_INVALID"
        assert info.metadata["field"] == "messages[0].role"


async def test_pixel_budget_bounds(tiny_model, tiny_png) -> None:
    spec = load_vision_spec(tiny_model)
    floor, top = spec.factor**2, spec.max_pixels  # 1,024 and 65,536 for the tiny checkpoint

    def budget(lo: int, hi: int) -> gpb.GenerateRequest:
        r = request(image(tiny_png))
        r.pixel_budget.min_pixels, r.pixel_budget.max_pixels = lo, hi
        return r

    async with gateway(tiny_model) as stub:
        await accepted(stub, budget(floor, top))
        await accepted(stub, budget(floor, floor))  # min == max is allowed
        for lo, hi in ((floor - 1, top), (floor, top + 1), (4096, 4095), (-5, 0)):
            await refused(
                stub,
                budget(lo, hi),
                grpc.StatusCode.INVALID_ARGUMENT,
                top,
                "pixel_budget",
                f"min_pixels >= {floor}",
            )


async def test_pixel_budget_message_says_which_fields_were_set(tiny_model, tiny_png) -> None:
    spec = load_vision_spec(tiny_model)
    r = request(image(tiny_png))
    r.pixel_budget.max_pixels = spec.min_pixels - 1  # only max set: below the default min
    async with gateway(tiny_model) as stub:
        err = await refused(stub, r, grpc.StatusCode.INVALID_ARGUMENT, spec.max_pixels)
        assert f"min_pixels={spec.min_pixels} (model default)" in err.details(), err.details()
        assert f"max_pixels={spec.min_pixels - 1} (set)" in err.details()
        r.pixel_budget.min_pixels = 1  # both set
        err = await refused(stub, r, grpc.StatusCode.INVALID_ARGUMENT, spec.max_pixels)
        assert "min_pixels=1 (set)" in err.details(), err.details()


@pytest.mark.parametrize(
    "prefix",
    ["DATA:image/png;base64,", "data:IMAGE/PNG;base64,", "data:image/png;BASE64,", "Data:;Base64,"],
)
async def test_data_url_scheme_type_and_base64_are_case_insensitive(
    tiny_model, tiny_png, prefix: str
) -> None:
    # RFC 2397 / RFC 2045: scheme, media type and the base64 token are case-insensitive.
    url = prefix + base64.b64encode(tiny_png).decode()
    async with gateway(tiny_model) as stub:
        await accepted(stub, request(gpb.ContentPart(image=gpb.ImageInput(data_url=url))))
        text_url = "DATA:TEXT/PLAIN;BASE64," + base64.b64encode(b"hi").decode()
        err = await status(stub, request(gpb.ContentPart(image=gpb.ImageInput(data_url=text_url))))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "media type 'text/plain'" in err.details()


async def test_public_message_limit_defaults_to_the_image_limits(tiny_model) -> None:
    # Unless GATEWAY_MAX_MESSAGE_BYTES is set, the public server takes max_images x
    # max_image_bytes + 1 MiB, not the 256 MiB internal hops need for embeddings.
    overrides = {k: v for k, v in LIMITS.items() if k != "max_message_bytes"}
    overrides.update(max_images=2, max_image_bytes=2 * MiB, max_videos=1, max_video_bytes=MiB)
    settings = GatewaySettings(**overrides)  # type: ignore[arg-type]
    limit = 2 * 2 * MiB + MiB
    assert settings.max_message_bytes == limit
    # Or max_videos x max_video_bytes + 1 MiB where that is larger.
    video_heavy = {**overrides, "max_video_bytes": 8 * MiB}
    assert GatewaySettings(**video_heavy).max_message_bytes == 9 * MiB  # type: ignore[arg-type]
    assert GatewaySettings().max_message_bytes == 8 * 20 * MiB + MiB  # the documented default
    assert GatewaySettings(max_message_bytes=64 * MiB).max_message_bytes == 64 * MiB

    def sized(n: int) -> gpb.GenerateRequest:
        r = request(image(b"\0" * (2 * MiB)), image(b"\0" * (2 * MiB)), text(""))
        r.messages[0].parts[2].text = "a" * (MiB // 2)
        # The text part fills the rest: between 16 KiB and 2 MiB its length prefixes keep
        # their size, so the message grows one for one with the text from here.
        overhead = r.ByteSize() - MiB // 2
        r.messages[0].parts[2].text = "a" * (n - overhead)
        return r

    async with gateway(tiny_model, **{**overrides, "max_message_bytes": None}) as stub:
        at = sized(limit)
        assert at.ByteSize() == limit
        err = await status(stub, at)
        # Past the transport: refused by the text limit, not by the message size.
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        over = sized(limit + 1)
        assert over.ByteSize() == limit + 1
        err = await status(stub, over)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"{limit + 1} vs. {limit}" in err.details()


async def test_request_bytes_edge(tiny_model, tiny_png) -> None:
    # The gRPC server's receive limit (max_message_bytes) bounds the whole request.
    limit = LIMITS["max_message_bytes"]

    def sized(n: int) -> gpb.GenerateRequest:
        r = request(image(b"\0" * (3 * MiB)))
        # Between 2 MiB and 256 MiB every nested length prefix is a 4-byte varint, so the
        # size grows one for one with the payload from here.
        overhead = r.ByteSize() - 3 * MiB
        r.messages[0].parts[0].image.data = b"\0" * (n - overhead)
        return r

    async with gateway(tiny_model, max_image_bytes=8 * MiB) as stub:
        at = sized(limit)
        assert at.ByteSize() == limit
        err = await status(stub, at)
        # Past the transport: refused only by the image decoder (zeros are no image).
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "images[0] could not be decoded" in err.details()
        over = sized(limit + 1)
        assert over.ByteSize() == limit + 1
        err = await status(stub, over)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"{limit + 1} vs. {limit}" in err.details()


async def test_c14_video_frames(tiny_model, tiny_png) -> None:
    """No frame is refused naming the count; one frame (under the temporal patch size of 2)
    is padded and passes intake: the request then reaches the encoder, absent here."""

    def video(n: int) -> gpb.ContentPart:
        return gpb.ContentPart(video=gpb.VideoInput(frames=[gpb.ImageInput(data=tiny_png)] * n))

    async with gateway(tiny_model) as stub:
        err = await refused(
            stub,
            request(video(0), text("what happens?")),
            grpc.StatusCode.INVALID_ARGUMENT,
            1,
            "messages[0].parts[0].video has neither a file nor frames (0 frames)",
        )
        assert error_info(err).reason == "VIDEO_TOO_FEW_FRAMES"
        for n in (1, 2):
            err = await status(stub, request(video(n), text("what happens?")))
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
            assert "encoder" in err.details()


async def test_url_images_are_refused_when_switched_off(tiny_model) -> None:
    async with gateway(tiny_model) as stub:
        err = await status(stub, request(gpb.ContentPart(image=gpb.ImageInput(url="http://a.b/"))))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "images[0].url" in err.details() and "GATEWAY_ALLOW_URLS" in err.details()
