"""Videos by URL: the image URLs' switch, SSRF guard and errors, with the video byte limit
and ``videos[i].url`` in every message (a real HTTP server on loopback)."""

from __future__ import annotations

import grpc
import pytest
from qwenvl.gateway.v1 import gateway_service_pb2 as gpb

from gateway.fetch import UrlFetcher
from gateway.settings import GatewaySettings
from splitvl.video_clips import pan_clip
from tests.unit.gateway.test_intake import gateway, request, status, text
from tests.unit.gateway.test_url_fetch import ImageServer
from vlcommon.errors import ServiceError


@pytest.fixture(scope="module")
def server():  # type: ignore[no-untyped-def]
    s = ImageServer()
    s.body = pan_clip("astronaut.png", seconds=1.0, fps=4, size=(64, 64))
    yield s
    s.stop()


def video_fetcher(**kw: object) -> UrlFetcher:
    settings = GatewaySettings(allow_urls=True, **kw)  # type: ignore[arg-type]
    return UrlFetcher(settings, noun="videos", max_bytes=settings.max_video_bytes)


async def test_a_video_url_is_fetched_within_the_video_limit(server) -> None:  # type: ignore[no-untyped-def]
    fetched = await video_fetcher(url_allow_private=True).fetch_all([(0, server.url("/img"))], 30)
    assert fetched[0] == server.body
    small = video_fetcher(url_allow_private=True, max_video_bytes=1000)
    with pytest.raises(ServiceError) as info:
        await small.fetch_all([(1, server.url("/bytes/5000"))], 30)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.reason == "VIDEO_BYTES_TOO_LARGE"
    assert "videos[1].url" in str(info.value) and "video limit is 1000 bytes" in str(info.value)


async def test_the_ssrf_guard_refuses_loopback_videos(server) -> None:  # type: ignore[no-untyped-def]
    before = len(server.hits)
    with pytest.raises(ServiceError) as info:
        await video_fetcher().fetch_all([(0, server.url("/img"))], 30)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.metadata["field"] == "videos[0].url"
    assert len(server.hits) == before  # refused before any byte reached the server


async def test_video_urls_follow_the_switch(tiny_model) -> None:
    part = gpb.ContentPart(video=gpb.VideoInput(file=gpb.VideoFile(url="http://a.b/c.mp4")))
    async with gateway(tiny_model) as stub:
        err = await status(stub, request(part, text("what happens?")))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "videos[0].url" in err.details() and "GATEWAY_ALLOW_URLS" in err.details()
        assert "video URLs are disabled" in err.details()  # it said "image URLs"
        from tests.unit.gateway.test_intake import error_info

        assert error_info(err).reason == "VIDEO_URLS_DISABLED"  # it was IMAGE_URLS_DISABLED


async def test_a_video_fetch_failure_names_videos_not_images() -> None:
    """Every message of the shared fetcher said "image URLs" and field "images"."""
    busy = video_fetcher(url_allow_private=True, url_max_inflight=1)
    with pytest.raises(ServiceError) as info:
        await busy.fetch_all([(0, "http://127.0.0.1:9/v.mp4"), (1, "http://127.0.0.1:9/w.mp4")], 30)
    assert info.value.reason == "URL_FETCHES_BUSY"
    assert "video URL fetches are in flight" in str(info.value)
    assert info.value.metadata["field"] == "videos"
    with pytest.raises(ServiceError) as info:
        await video_fetcher().fetch_all([(2, "http://10.0.0.1/v.mp4")], 30)
    assert info.value.reason == "URL_ADDRESS_FORBIDDEN"
    assert "video URLs may reach only public addresses" in str(info.value)


async def test_request_video_limits_name_field_and_limit(tiny_model, server) -> None:  # type: ignore[no-untyped-def]
    from tests.unit.gateway.test_intake import error_info

    part = gpb.ContentPart(video=gpb.VideoInput(file=gpb.VideoFile(data=server.body)))
    async with gateway(tiny_model, max_video_tokens=4, max_videos=1) as stub:
        err = await status(stub, request(part, text("what happens?")))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
        assert error_info(err).reason == "VIDEO_TOKENS_TOO_MANY"
        assert error_info(err).metadata["limit"] == "4"  # 8 tokens: grid [2, 4, 4]
        err = await status(stub, request(part, part, text("what happens?")))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(err).reason == "TOO_MANY_VIDEOS"
        assert "GATEWAY_MAX_VIDEOS" in err.details()
        big = gpb.ContentPart(
            video=gpb.VideoInput(file=gpb.VideoFile(data=server.body), max_frames=769)
        )
        err = await status(stub, request(big, text("what happens?")))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "messages[0].parts[0].video.max_frames is 769" in err.details()
