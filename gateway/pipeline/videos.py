"""The video intake: video URLs fetched, then each video decoded, sampled and resized on a
preprocess thread (``gateway.video``), within the request's video-token budget."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
from opentelemetry import trace

from gateway import metrics
from gateway.fetch import UrlFetcher
from gateway.media import ImageUrl
from gateway.pipeline.preprocess import check_live
from gateway.pipeline.types import PreparedVideo
from gateway.request import VideoSource
from gateway.settings import GatewaySettings
from gateway.video import (
    DecodedVideo,
    VideoConfig,
    VideoLimits,
    decode_video,
    frames_video,
    live_check,
)
from vlcommon.deadline import NO_DEADLINE, Deadline
from vlcommon.imaging import decode_image
from vlcommon.model_info import VisionSpec

tracer = trace.get_tracer("splitvl.gateway")


class VideoIntake:
    """Fetches and prepares a request's videos.

    Args:
        settings: Byte, frame, pixel and token limits (``GATEWAY_*VIDEO*``).
        spec: Vision geometry of the served checkpoint.
        revision: Model revision folded into every key.
        config: The checkpoint's video processor config.
        limits: The limits :func:`gateway.video.decode_video` applies.
        fetcher: Fetches video files given by URL (the image URLs' SSRF guard).
    """

    def __init__(
        self,
        settings: GatewaySettings,
        spec: VisionSpec,
        revision: str,
        config: VideoConfig,
        limits: VideoLimits,
        fetcher: UrlFetcher,
    ) -> None:
        self.settings = settings
        self.spec = spec
        self.revision = revision
        self.config = config
        self.limits = limits
        self.fetcher = fetcher

    async def fetch_urls(self, videos: list[VideoSource], deadline: Deadline) -> list[VideoSource]:
        """Fetch the videos given by URL (the image URLs' guard, the video byte limit)."""
        urls = [(v.index, v.file.url) for v in videos if isinstance(v.file, ImageUrl)]
        if not urls:
            return videos
        with tracer.start_as_current_span("gateway.fetch_urls") as span:
            span.set_attribute("splitvl.videos", len(urls))
            fetched = await self.fetcher.fetch_all(urls, deadline.remaining())
            span.set_attribute("splitvl.transfer_bytes", sum(map(len, fetched.values())))
        return [
            dataclasses.replace(v, file=fetched[v.index]) if isinstance(v.file, ImageUrl) else v
            for v in videos
        ]

    def prepare(
        self,
        videos: list[VideoSource],
        stop: threading.Event | None = None,
        deadline: Deadline = NO_DEADLINE,
    ) -> list[PreparedVideo]:
        """Decode, sample and resize each video (on a preprocess thread), one
        ``video.decode`` span each; stops between frames when the request is cancelled or
        its deadline passes.

        Raises:
            ServiceError: as gateway.video (RESOURCE_EXHAUSTED ``VIDEO_TOKENS_TOO_MANY``
                for the video that needs more than the request has left of
                GATEWAY_MAX_VIDEO_TOKENS); CANCELLED / DEADLINE_EXCEEDED when stopped.
        """
        stop = stop or threading.Event()
        out: list[PreparedVideo] = []
        tokens = 0
        limit = self.settings.max_video_tokens
        for v in videos:
            check_live(stop, deadline)
            t0 = time.perf_counter()
            with tracer.start_as_current_span("video.decode") as span:
                span.set_attribute("splitvl.video.index", v.index)
                # With what is left of the budget: gateway.video refuses the video that
                # passes it at its first frame, before the rest is decoded.
                decoded = self._decode(v, stop, deadline, limit - tokens, span)
                _record(span, decoded, time.perf_counter() - t0)
            tokens += decoded.plan.tokens
            out.append(
                PreparedVideo(
                    index=v.index,
                    plan=decoded.plan,
                    key=decoded.key,
                    decoded=True,
                    pixels=decoded.frames,
                    video=decoded,
                )
            )
        return out

    def _decode(
        self,
        v: VideoSource,
        stop: threading.Event,
        deadline: Deadline,
        max_tokens: int,
        span: trace.Span,
    ) -> DecodedVideo:
        """One video, from its file or from its frames."""
        if v.file is not None:
            assert isinstance(v.file, bytes)
            span.set_attribute("splitvl.video.encoded_bytes", len(v.file))
            return decode_video(
                v.file,
                index=v.index,
                spec=self.spec,
                config=self.config,
                limits=self.limits,
                request=v.overrides,
                revision=self.revision,
                check=live_check(stop, deadline, v.index),
                max_tokens=max_tokens,
            )
        images = []
        for j, data in enumerate(v.frames):
            check_live(stop, deadline)
            assert isinstance(data, bytes)
            image = decode_image(
                data, index=j, max_decoded_pixels=self.settings.video_max_decoded_pixels
            )
            images.append(np.asarray(image, dtype=np.uint8))
        return frames_video(
            images,
            index=v.index,
            fps=v.fps,
            spec=self.spec,
            config=self.config,
            request=v.overrides,
            revision=self.revision,
            max_tokens=max_tokens,
        )


def _record(span: trace.Span, decoded: DecodedVideo, seconds: float) -> None:
    """A decoded video's span attributes and metrics."""
    span.set_attribute("splitvl.video.container", decoded.container or "frames")
    span.set_attribute("splitvl.video.codec", decoded.codec or "image")
    span.set_attribute("splitvl.video.duration_s", decoded.duration_s)
    span.set_attribute("splitvl.video.source_frames", decoded.sampling.source_frames)
    span.set_attribute("splitvl.video.frames_kept", len(decoded.sampling.indices))
    span.set_attribute("splitvl.video.frames_decoded", decoded.frames_decoded)
    span.set_attribute("splitvl.video.grid_thw", list(decoded.plan.grid))
    span.set_attribute("splitvl.video.tokens", decoded.plan.tokens)
    span.set_attribute("splitvl.video.decode_ms", seconds * 1000)
    metrics.VIDEO_DECODE_SECONDS.observe(seconds)
    metrics.VIDEO_FRAMES.inc(len(decoded.sampling.indices))
