"""The gateway's preprocess stage under hostile load, through a real in-process gateway
(grpc.aio on loopback, the real servicer; its dependencies are a closed port, so a request
that passes preprocessing ends UNAVAILABLE).

- A request's images are held to a total of decoded pixels, read from their headers.
- A cancelled or expired request stops decoding its images (counted by the
  ``splitvl_gateway_images_decoded_total`` metric), so a good request is not stuck behind
  seconds of work for nobody.
- Requests waiting for the preprocess threads are bounded: RESOURCE_EXHAUSTED with a retry hint.
"""

from __future__ import annotations

import asyncio
import io
import time

import grpc
import pytest
from PIL import Image
from prometheus_client import REGISTRY

from tests.conftest import png_bytes
from tests.unit.gateway.test_intake import accepted, image, refused, request, status
from tests.unit.gateway.test_intake import gateway as intake_gateway
from vlcommon.errors import error_info, retry_info
from vlcommon.settings import MiB

BIG = 6000  # a 1-bit 6000x6000 PNG is a few KB and 36 M pixels (108 MB as RGB)
N_BIG = 8


def decoded() -> float:
    return REGISTRY.get_sample_value("splitvl_gateway_images_decoded_total") or 0.0


def stopped(reason: str) -> float:
    value = REGISTRY.get_sample_value(
        "splitvl_gateway_preprocess_stopped_total", {"reason": reason}
    )
    return value or 0.0


@pytest.fixture(scope="module")
def big_png() -> bytes:
    out = io.BytesIO()
    Image.new("1", (BIG, BIG), 1).save(out, "PNG")
    return out.getvalue()


def bomb_settings(**overrides: object) -> dict[str, object]:
    return {
        "max_images": N_BIG,
        "max_image_bytes": 1 * MiB,
        "max_decoded_pixels": 40_000_000,
        "max_request_pixels": N_BIG * BIG * BIG,
        **overrides,
    }


async def settle() -> float:
    """The decoded-image count once it stops moving (the preprocess threads are idle)."""
    last, quiet_since = decoded(), time.monotonic()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        now = decoded()
        if now != last:
            last, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since > 2.0:
            break
    return last


async def test_request_pixel_total_is_checked_from_headers(tiny_model) -> None:
    limit = 5_000  # two 50x50 images fit exactly; 50x50 + 50x51 is 5,050
    square = png_bytes(Image.new("RGB", (50, 50), "red"))
    taller = png_bytes(Image.new("RGB", (50, 51), "red"))
    async with intake_gateway(tiny_model, max_request_pixels=limit) as stub:
        await accepted(stub, request(image(square), image(square)))
        before = decoded()
        err = await refused(
            stub,
            request(image(square), image(taller)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            limit,
            "hold 5050 decoded pixels",
            "GATEWAY_MAX_REQUEST_PIXELS",
        )
        assert error_info(err).reason == "REQUEST_PIXELS_TOO_LARGE"
        assert decoded() == before  # refused before any image was decoded


@pytest.mark.parametrize("how", ["deadline", "cancel"])
async def test_abandoned_request_stops_decoding(tiny_model, big_png, how: str) -> None:
    small = png_bytes(Image.new("RGB", (40, 40), "blue"))
    async with intake_gateway(tiny_model, **bomb_settings()) as stub:
        await settle()
        before, stops = decoded(), stopped("deadline") + stopped("cancelled")
        bomb = request(*[image(big_png)] * N_BIG)
        if how == "deadline":
            err = await status_with_timeout(stub, bomb, 1.0)
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.details()
        else:
            call = stub.Generate(bomb, timeout=120)
            while decoded() == before:  # it is in a preprocess thread
                await asyncio.sleep(0.02)
            call.cancel()
        # A good request is served (here: reaches its absent dependencies) afterwards.
        await accepted(stub, request(image(small)))
        total = await settle() - before - 1  # less the good request's image
        # Before the fix the thread decoded all 8 for nobody (~7 s of CPU).
        assert 1 <= total < N_BIG, total
        # grpc cancels the handler at the deadline too; either way the thread stopped once.
        assert stopped("deadline") + stopped("cancelled") == stops + 1


async def status_with_timeout(stub, r, timeout: float) -> grpc.aio.AioRpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        async for _ in stub.Generate(r, timeout=timeout):
            pass
    return exc.value


async def test_preprocess_queue_is_bounded_with_a_retry_hint(tiny_model, big_png) -> None:
    small = png_bytes(Image.new("RGB", (40, 40), "blue"))
    settings = bomb_settings(preprocess_threads=1, preprocess_queue=0, retry_after_ms=750)
    async with intake_gateway(tiny_model, **settings) as stub:
        await settle()
        before = decoded()
        call = stub.Generate(request(*[image(big_png)] * N_BIG), timeout=120)
        while decoded() == before:  # the one thread is busy with it
            await asyncio.sleep(0.02)
        err = await status(stub, request(image(small)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
        assert "GATEWAY_PREPROCESS_QUEUE" in err.details()
        assert error_info(err).reason == "PREPROCESS_BUSY"
        assert error_info(err).metadata["limit"] == "1"
        hint = retry_info(err)
        assert hint is not None and hint.retry_delay.ToMilliseconds() == 750
        assert dict(err.trailing_metadata())["retry-after-ms"] == "750"
        call.cancel()
        for _ in range(240):  # the slot frees once the thread sees the cancel
            err = await status(stub, request(image(small)))
            if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                break
            await asyncio.sleep(0.25)
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
