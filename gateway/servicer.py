"""``qwenvl.gateway.v1.GatewayService``: the orchestration of one request.

This servicer runs the intake (step 1: parsing, headers, digests, decoding, plans) and
the stages of ``gateway.stages`` in order: :class:`~gateway.stages.CacheStage` (steps 1-3:
the lookups and the put), :class:`~gateway.stages.EncodeStage` (step 3) and
:class:`~gateway.stages.DecodeStage` (step 4); it builds the responses and the timings.

1. Validate messages and parts; read each image's header (size, EXIF orientation), plan
   its resize from it and digest the encoded file (the bytes key, ``vlcommon.imaging``).
   ``CacheService/Lookup`` by bytes key (all images in one call): a file seen before is
   an exact hit and is never decoded. Decode the others once (EXIF-upright RGB), plan
   their resize (``image_grid_thw``), compute their pixel key and similarity descriptor.
2. ``CacheService/Lookup`` by pixel key for the decoded images, in one call (both lookups
   are skipped when the policy is off; when the cache is down or slow, every image is a
   miss and the failure is counted once).
3. ``EncoderService/Encode`` for the misses: the encoder holds their embeddings and
   answers refs (``vlcommon.handoff``; ``GATEWAY_EMBEDDING_TRANSPORT``: shm or grpc);
   ``CacheService/Put`` of those refs beside the decode (the cache reads the bytes from
   the encoder), under the pixel key with the bytes key as its alias. Hits come back from
   the cache as refs too: no embedding byte passes through the gateway.
4. ``DecoderService/Generate`` with the messages and one ref per image (the decoder reads
   each from its holder; when one is gone, every image is encoded again and the decode
   runs once more, within the deadline); its tokens stream back. Nothing is streamed
   before the decoder's first token, so every bad input fails with a status before the
   stream starts. A cancelled client cancels the decoder call, which aborts the vLLM
   request. Each hop gets the deadline that remains.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import io
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np
from opentelemetry import trace
from PIL import Image
from qwenvl.cache.v1 import cache_service_pb2_grpc
from qwenvl.common.v1 import generation_pb2
from qwenvl.decoder.v1 import decoder_service_pb2, decoder_service_pb2_grpc
from qwenvl.encoder.v1 import encoder_service_pb2_grpc
from qwenvl.gateway.v1 import gateway_service_pb2 as pb
from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

from gateway import metrics
from gateway.fetch import UrlFetcher
from gateway.media import ImageUrl, image_bytes, video_file_bytes
from gateway.settings import GatewaySettings
from gateway.stages import (
    CacheStage,
    DecodeStage,
    EncodedFile,
    EncodeStage,
    HeldRefs,
    PreparedImage,
    PreparedVideo,
    RefsLost,
    SameFileFlights,
    grid_message,
    inline_bytes,
    ref_attributes,
    remaining,
    thw_message,
)
from gateway.video import (
    VideoLimits,
    VideoRequest,
    check_request,
    decode_video,
    frames_video,
    live_check,
    load_video_config,
)
from vlcommon import handoff
from vlcommon.errors import (
    ServiceError,
    invalid_argument,
    resource_exhausted,
)
from vlcommon.grid_reuse import reusable_grids
from vlcommon.imaging import (
    ImageHeader,
    bytes_key,
    decode_image,
    exact_key,
    plan_resize,
    read_header,
    resize_to_plan,
    similarity_descriptor,
)
from vlcommon.model_info import VisionSpec, resolve_model_dir
from vlcommon.request_rules import (
    CACHE_POLICIES,
    check_message_counts,
    check_no_control_tokens,
    check_role,
)
from vlcommon.sampling import check_max_tokens, check_sampling_ranges
from vlcommon.verification import verifiable, verification_image

log = logging.getLogger(__name__)
tracer = trace.get_tracer("splitvl.gateway")

T = TypeVar("T")


@dataclass(frozen=True)
class VideoSource:
    """A video part as parsed: its file (bytes or a URL still to fetch) or its frames."""

    index: int  # position among the request's videos
    field: str  # e.g. messages[0].parts[1].video
    file: bytes | ImageUrl | None
    frames: tuple[bytes | ImageUrl, ...]
    fps: float
    overrides: VideoRequest


@dataclass(frozen=True)
class Downstream:
    """Stubs of the three services the gateway calls (cache may be None), and the client
    that releases held embeddings the gateway received but no reader will read (None: a
    plaintext one of its own)."""

    encoder: encoder_service_pb2_grpc.EncoderServiceStub
    decoder: decoder_service_pb2_grpc.DecoderServiceStub
    cache: cache_service_pb2_grpc.CacheServiceStub | None
    releaser: handoff.Reader | None = None


# The warm-up's photo: a phone camera's 12 MP (4032x3024), the size the first request is
# most likely to bring. Smaller files left the first 12 MP image cold: its first decode
# touches fresh memory (Pillow's 16 MB blocks, glibc then keeps such blocks in the heap).
WARM_UP_PHOTO_SIZE = (4032, 3024)


def _warm_up_files() -> list[bytes]:
    """Two files for :meth:`GatewayServicer.warm_up`: a 4032x3024 JPEG stored sideways
    (EXIF orientation 6, quality 90) and a 1024x768 RGBA PNG, gradients with tiled noise so
    the codecs do a photo's work, both over the real model's pixel budget, so the resize
    runs (downscaling, antialiased)."""
    width, height = WARM_UP_PHOTO_SIZE
    tile = np.random.default_rng(0).integers(0, 24, size=(256, 256, 3), dtype=np.uint8)
    noise = np.tile(tile, (-(-height // 256), -(-width // 256), 1))[:height, :width]
    x = np.arange(width, dtype=np.uint16) * 200 // width
    y = np.arange(height, dtype=np.uint16) * 200 // height
    gradient = np.stack(
        np.broadcast_arrays(x[None, :], y[:, None], (x[None, :] + y[:, None]) // 2), -1
    )
    photo = (gradient + noise).astype(np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6
    jpeg = io.BytesIO()
    Image.fromarray(photo).save(jpeg, format="JPEG", quality=90, exif=exif)
    alpha = np.broadcast_to(y[:768, None].astype(np.uint8), (768, 1024))[..., None]
    rgba = np.concatenate([photo[:768, :1024], alpha], axis=-1)
    png = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(png, format="PNG")
    return [jpeg.getvalue(), png.getvalue()]


def _video_info(v: PreparedVideo) -> pb.VideoInfo:
    """The response's per-video information."""
    assert v.video is not None
    sampling = v.video.sampling
    return pb.VideoInfo(
        index=v.index,
        tier=v.tier,
        grid=grid_message(v.plan),
        tokens=v.plan.tokens,
        frames=len(sampling.indices),
        timestamps=sampling.timestamps,
        key=v.key,
        source_frames=sampling.source_frames,
        frame_indices=sampling.indices,
    )


# How much the decode threads lower their own OS priority (nice), relative to the
# process: enough that the header and digest threads (and the event loop) win a busy
# core, not so much that decodes starve behind the other services on the host.
DECODE_NICE = 5

# The longest a request waits for another request's encode of the same file bytes (half
# the time left to its deadline bounds it first, when shorter); then it decodes and
# encodes them itself.
SAME_FILE_WAIT_S = 60.0


def _yield_to_headers() -> None:
    """Preprocess thread initializer: lower this thread's priority by DECODE_NICE.

    Linux applies ``setpriority(PRIO_PROCESS, tid)`` to one thread; raising one's own nice
    needs no privilege. Elsewhere (or where refused) it does nothing: an optimisation, not
    a guarantee.
    """
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + DECODE_NICE)


class GatewayServicer(pb_grpc.GatewayServiceServicer):
    """Serves the public Generate RPC.

    Args:
        settings: Limits, addresses and cache policy.
        spec: Vision geometry of the served checkpoint.
        revision: Model revision folded into every exact key.
        forbidden_tokens: Control tokens that may not appear in user text (case C05).
        downstream: Stubs of encoder, decoder and cache.
    """

    def __init__(
        self,
        settings: GatewaySettings,
        spec: VisionSpec,
        revision: str,
        forbidden_tokens: tuple[str, ...],
        downstream: Downstream,
    ) -> None:
        self.settings = settings
        self.spec = spec
        self.revision = revision
        self.forbidden_tokens = forbidden_tokens
        self.down = downstream
        self.default_policy = CACHE_POLICIES[settings.default_cache_policy]
        self.transport = handoff.TRANSPORTS[settings.embedding_transport]
        # The stages over the downstream services (gateway.stages); this servicer runs the
        # intake and the decode itself and the stages in order.
        self.releaser = downstream.releaser or handoff.Reader()
        self.cache_stage = CacheStage(
            downstream.cache,
            spec=spec,
            revision=revision,
            transport=self.transport,
            timeout_s=settings.cache_timeout_s,
            put_timeout_s=settings.cache_put_timeout_s,
            releaser=self.releaser,
        )
        self.encode_stage = EncodeStage(
            downstream.encoder,
            transport=self.transport,
            timeout_s=settings.encode_timeout_s,
            releaser=self.releaser,
        )
        self.decode_stage = DecodeStage(downstream.decoder, releaser=self.releaser)
        self._background: set[asyncio.Task[None]] = set()
        # Files being encoded now, by bytes key: a request for the same bytes waits for
        # that put instead of decoding and encoding them again (gateway.stages).
        self.same_file = SameFileFlights()
        self.fetcher = UrlFetcher(settings)
        self._preprocess = ThreadPoolExecutor(
            max_workers=settings.preprocess_threads,
            thread_name_prefix="preprocess",
            initializer=_yield_to_headers,
        )
        # Headers and file digests (about 2 ms for a 12 MP JPEG) get threads of their own:
        # behind the decode threads, a byte-identical repeat waited for other requests'
        # 12 MP decodes (up to ~470 ms at 32 in flight, docs/benchmarks.md, photos) only
        # to learn it needed none. hashlib and Pillow release the GIL on large buffers.
        # They also run at a higher OS priority than the decode threads (which lower
        # theirs, _yield_to_headers): with 2 cores busy decoding new 12 MP files, a
        # repeat's digest still took 4-35 ms for lack of CPU.
        self._headers = ThreadPoolExecutor(
            max_workers=settings.preprocess_threads, thread_name_prefix="headers"
        )
        # Requests submitted to the preprocess threads and not finished there (running or
        # queued); updated from the worker threads too, hence the lock.
        self._preprocess_lock = threading.Lock()
        self.preprocess_pending = 0
        self.video_fetcher = UrlFetcher(settings, noun="videos", max_bytes=settings.max_video_bytes)
        self.video_limits = VideoLimits(
            max_bytes=settings.max_video_bytes,
            max_duration_s=settings.max_video_duration_s,
            max_frames=settings.video_max_frames,
            max_fps=settings.video_max_fps,
            max_decoded_pixels=settings.video_max_decoded_pixels,
        )
        self.video_config = (
            load_video_config(resolve_model_dir(settings.model), spec) if settings.model else None
        )

    # -- validation ---------------------------------------------------------------------
    def _parse(
        self, request: pb.GenerateRequest, videos: list[VideoSource] | None = None
    ) -> tuple[list[decoder_service_pb2.Message], list[bytes | ImageUrl]]:
        """Validate the messages and collect the images' encoded bytes (or URLs), in order.

        Video parts are collected into ``videos`` (their files or frames, in order, with
        their overrides checked); without that list a video part is refused.

        Counts (messages, parts, images, characters) are checked before any content is
        scanned, so an oversized request is refused without work proportional to its size.
        """
        s = self.settings
        check_message_counts(request.messages, max_messages=s.max_messages, max_parts=s.max_parts)
        n_images = sum(1 for m in request.messages for q in m.parts if q.HasField("image"))
        if n_images > s.max_images:
            raise invalid_argument(
                "TOO_MANY_IMAGES",
                f"the request has {n_images} images; the limit is {s.max_images}",
                field="images",
                limit=s.max_images,
            )
        n_videos = sum(1 for m in request.messages for q in m.parts if q.HasField("video"))
        if n_videos > s.max_videos:
            raise invalid_argument(
                "TOO_MANY_VIDEOS",
                f"the request has {n_videos} videos; the limit is {s.max_videos} "
                "(GATEWAY_MAX_VIDEOS)",
                field="videos",
                limit=s.max_videos,
            )
        chars = sum(len(q.text) for m in request.messages for q in m.parts)
        if chars > s.max_text_chars:
            raise invalid_argument(
                "TEXT_TOO_LONG",
                f"messages hold {chars} characters of text; the limit is {s.max_text_chars}",
                field="messages",
                limit=s.max_text_chars,
            )
        messages: list[decoder_service_pb2.Message] = []
        images: list[bytes | ImageUrl] = []
        for i, message in enumerate(request.messages):
            check_role(message.role, f"messages[{i}].role")
            if not message.parts:
                raise invalid_argument(
                    "PARTS_EMPTY", f"messages[{i}].parts is empty", field=f"messages[{i}].parts"
                )
            out = decoder_service_pb2.Message(role=message.role)
            run: list[str] = []  # adjacent text parts: the chat template joins them
            for j, part in enumerate(message.parts):
                field = f"messages[{i}].parts[{j}]"
                kind = part.WhichOneof("part")
                if kind == "text":
                    self._check_text(part.text, f"{field}.text")
                    run.append(part.text)
                    out.parts.add(text=part.text)
                    continue
                if len(run) > 1:
                    self._check_text("".join(run), f"messages[{i}].parts (joined text)")
                run = []
                if kind == "image":
                    source = image_bytes(part.image, index=len(images), max_bytes=s.max_image_bytes)
                    if isinstance(source, ImageUrl):
                        self.fetcher.check_url(source.url, index=len(images))
                    images.append(source)
                    out.parts.add(image_index=len(images) - 1)
                elif kind == "video":
                    if videos is None or self.video_config is None:
                        raise ServiceError(
                            grpc.StatusCode.UNIMPLEMENTED,
                            "VIDEO_NOT_SUPPORTED",
                            f"{field}.video: this server has no video processor config",
                            {"field": f"{field}.video"},
                        )
                    videos.append(self._parse_video(part.video, len(videos), f"{field}.video"))
                    out.parts.add(video_index=len(videos) - 1)
                else:
                    raise invalid_argument(
                        "PART_EMPTY", f"{field} has none of text, image, video", field=field
                    )
            if len(run) > 1:
                self._check_text("".join(run), f"messages[{i}].parts (joined text)")
            messages.append(out)
        return messages, images

    def _parse_video(self, video: pb.VideoInput, index: int, field: str) -> VideoSource:
        """One video part: its source resolved (URL checked, not fetched), overrides checked.

        Raises:
            ServiceError: INVALID_ARGUMENT for no source, a bad data URL, an override out of
                bounds, more frames than GATEWAY_VIDEO_MAX_FRAMES; RESOURCE_EXHAUSTED past
                the byte limits; FAILED_PRECONDITION for a URL with URLs off.
        """
        assert self.video_config is not None
        s = self.settings
        overrides = VideoRequest(
            sample_fps=video.sample_fps, max_frames=video.max_frames, max_pixels=video.max_pixels
        )
        check_request(overrides, self.video_config, self.video_limits, field)
        if not math.isfinite(video.fps) or video.fps < 0:
            raise invalid_argument(
                "VIDEO_FPS_OUT_OF_RANGE",
                f"{field}.fps is {video.fps}; it must be >= 0 (0: 2 frames per second)",
                field=f"{field}.fps",
            )
        if video.HasField("file"):
            if video.frames:
                raise invalid_argument(
                    "VIDEO_SOURCE_AMBIGUOUS",
                    f"{field} has both file and frames; send one",
                    field=field,
                )
            source = video_file_bytes(video.file, index=index, max_bytes=s.max_video_bytes)
            if isinstance(source, ImageUrl):
                self.video_fetcher.check_url(source.url, index=index)
            return VideoSource(index, field, source, (), 0.0, overrides)
        if not video.frames:
            raise invalid_argument(
                "VIDEO_TOO_FEW_FRAMES",
                f"{field} has neither a file nor frames (0 frames)",
                field=f"{field}.frames",
                limit=1,
            )
        if len(video.frames) > s.video_max_frames:
            raise resource_exhausted(
                "VIDEO_TOO_MANY_FRAMES",
                f"{field}.frames has {len(video.frames)} frames; the limit is "
                f"{s.video_max_frames} (GATEWAY_VIDEO_MAX_FRAMES)",
                field=f"{field}.frames",
                limit=s.video_max_frames,
            )
        frames: list[bytes | ImageUrl] = []
        for j, frame in enumerate(video.frames):
            data = image_bytes(frame, index=j, max_bytes=s.max_image_bytes)
            if isinstance(data, ImageUrl):
                raise invalid_argument(
                    "VIDEO_FRAME_URL",
                    f"{field}.frames[{j}] is a URL; send video frames by value, or the video "
                    "file by URL",
                    field=f"{field}.frames[{j}]",
                )
            frames.append(data)
        return VideoSource(index, field, None, tuple(frames), video.fps, overrides)

    async def _fetch_video_urls(
        self, videos: list[VideoSource], context: grpc.aio.ServicerContext
    ) -> list[VideoSource]:
        """Fetch the videos given by URL (the image URLs' guard, the video byte limit)."""
        urls = [(v.index, v.file.url) for v in videos if isinstance(v.file, ImageUrl)]
        if not urls:
            return videos
        with tracer.start_as_current_span("gateway.fetch_urls") as span:
            span.set_attribute("splitvl.videos", len(urls))
            fetched = await self.video_fetcher.fetch_all(urls, remaining(context))
            span.set_attribute("splitvl.transfer_bytes", sum(map(len, fetched.values())))
        return [
            dataclasses.replace(v, file=fetched[v.index]) if isinstance(v.file, ImageUrl) else v
            for v in videos
        ]

    def _prepare_videos(
        self,
        videos: list[VideoSource],
        stop: threading.Event | None = None,
        deadline: float | None = None,
    ) -> list[PreparedVideo]:
        """Decode, sample and resize each video on a preprocess thread (gateway.video), one
        ``video.decode`` span each; stops between frames when the request is cancelled or
        its deadline passes.

        Raises:
            ServiceError: as gateway.video; RESOURCE_EXHAUSTED ``VIDEO_TOKENS_TOO_MANY`` when
                the videos' tokens pass GATEWAY_MAX_VIDEO_TOKENS; CANCELLED /
                DEADLINE_EXCEEDED when stopped.
        """
        assert self.video_config is not None
        stop = stop or threading.Event()
        out: list[PreparedVideo] = []
        tokens = 0
        for v in videos:
            self._check_live(stop, deadline)
            t0 = time.perf_counter()
            with tracer.start_as_current_span("video.decode") as span:
                span.set_attribute("splitvl.video.index", v.index)
                if v.file is not None:
                    assert isinstance(v.file, bytes)
                    span.set_attribute("splitvl.video.encoded_bytes", len(v.file))
                    decoded = decode_video(
                        v.file,
                        index=v.index,
                        spec=self.spec,
                        config=self.video_config,
                        limits=self.video_limits,
                        request=v.overrides,
                        revision=self.revision,
                        check=live_check(stop, deadline, v.index),
                        max_tokens=self.settings.max_video_tokens - tokens,
                    )
                else:
                    images = []
                    for j, data in enumerate(v.frames):
                        self._check_live(stop, deadline)
                        assert isinstance(data, bytes)
                        image = decode_image(
                            data,
                            index=j,
                            max_decoded_pixels=self.settings.video_max_decoded_pixels,
                        )
                        images.append(np.asarray(image, dtype=np.uint8))
                    decoded = frames_video(
                        images,
                        index=v.index,
                        fps=v.fps,
                        spec=self.spec,
                        config=self.video_config,
                        request=v.overrides,
                        revision=self.revision,
                        max_tokens=self.settings.max_video_tokens - tokens,
                    )
                seconds = time.perf_counter() - t0
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
            tokens += decoded.plan.tokens
            limit = self.settings.max_video_tokens
            if tokens > limit:
                raise resource_exhausted(
                    "VIDEO_TOKENS_TOO_MANY",
                    f"the request's videos need {tokens} video tokens (videos[0..{v.index}]); "
                    f"the limit is {limit} per request (GATEWAY_MAX_VIDEO_TOKENS): lower "
                    "sample_fps, max_frames or max_pixels",
                    field="videos",
                    limit=limit,
                )
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

    async def _fetch_urls(
        self, sources: list[bytes | ImageUrl], context: grpc.aio.ServicerContext
    ) -> list[bytes]:
        """Fetch the URL images (concurrently, within the deadline); bytes stay as they are.

        Raises:
            ServiceError: as :class:`gateway.fetch.UrlFetcher` documents.
        """
        urls = [(i, src.url) for i, src in enumerate(sources) if isinstance(src, ImageUrl)]
        if not urls:
            return [src for src in sources if isinstance(src, bytes)]
        with tracer.start_as_current_span("gateway.fetch_urls") as span:
            span.set_attribute("splitvl.images", len(urls))
            fetched = await self.fetcher.fetch_all(urls, remaining(context))
            span.set_attribute("splitvl.transfer_bytes", sum(map(len, fetched.values())))
        return [fetched[i] if isinstance(src, ImageUrl) else src for i, src in enumerate(sources)]

    def _check_text(self, text: str, field: str) -> None:
        """Refuse a control token (``<|image_pad|>``, ``<|im_start|>``, ...) in user text."""
        check_no_control_tokens(text, self.forbidden_tokens, field)

    def _budget(self, request: pb.GenerateRequest) -> tuple[int, int]:
        budget = request.pixel_budget
        lo = budget.min_pixels or self.spec.min_pixels
        hi = budget.max_pixels or self.spec.max_pixels
        floor = self.spec.factor**2
        if lo < floor or hi < lo or hi > self.spec.max_pixels:
            # Say which bound the client sent and which is the model's default, so that
            # e.g. {max_pixels: 1024} is not reported as a mysterious [4096, 1024].
            def origin(value: int, name: str) -> str:
                given = "set" if getattr(budget, name) else "model default"
                return f"{name}={value} ({given})"

            raise invalid_argument(
                "PIXEL_BUDGET_INVALID",
                f"pixel_budget is out of range: {origin(lo, 'min_pixels')}, "
                f"{origin(hi, 'max_pixels')}; it needs min_pixels >= {floor} and "
                f"min_pixels <= max_pixels <= {self.spec.max_pixels} (an unset field takes "
                "the model default)",
                field="pixel_budget",
                limit=self.spec.max_pixels,
            )
        return lo, hi

    def _check_request_pixels(self, headers: list[ImageHeader | None]) -> None:
        """Refuse a request whose images sum to over ``max_request_pixels`` (headers only).

        Raises:
            ServiceError: RESOURCE_EXHAUSTED ``REQUEST_PIXELS_TOO_LARGE`` naming
                GATEWAY_MAX_REQUEST_PIXELS. An unreadable header is left to decode_image.
        """
        limit = self.settings.max_request_pixels
        total = sum(h.stored_width * h.stored_height for h in headers if h is not None)
        if total > limit:
            raise resource_exhausted(
                "REQUEST_PIXELS_TOO_LARGE",
                f"the request's {len(headers)} images hold {total} decoded pixels (width*height "
                f"summed); the limit is {limit} per request (GATEWAY_MAX_REQUEST_PIXELS)",
                field="images",
                limit=limit,
            )

    @staticmethod
    def _check_live(stop: threading.Event, deadline: float | None) -> None:
        """Stop preparing images for a request that was cancelled or ran out of time."""
        if stop.is_set():
            metrics.PREPROCESS_STOPPED.labels(reason="cancelled").inc()
            raise ServiceError(grpc.StatusCode.CANCELLED, "CANCELLED", "the request was cancelled")
        if deadline is not None and time.monotonic() >= deadline:
            metrics.PREPROCESS_STOPPED.labels(reason="deadline").inc()
            raise ServiceError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "DEADLINE_EXCEEDED",
                "the request's deadline expired while its images were prepared",
            )

    def _read_files(
        self,
        datas: list[bytes],
        lo: int,
        hi: int,
        with_keys: bool,
        stop: threading.Event | None = None,
        deadline: float | None = None,
    ) -> list[EncodedFile | None]:
        """Read each file's header, plan its resize and (``with_keys``) digest it.

        No pixel is decoded: a 12 MP JPEG's header and the SHA-256 of its bytes take about
        2 ms together (0.6 ms per MB hashed). An image whose header cannot be read, is over
        ``max_decoded_pixels`` or cannot be planned gets None: decoding it reports the
        fault with the status it always had (decode_image, plan_resize).

        Raises:
            ServiceError: RESOURCE_EXHAUSTED ``REQUEST_PIXELS_TOO_LARGE``; CANCELLED /
                DEADLINE_EXCEEDED when stopped.
        """
        stop = stop or threading.Event()
        self._check_live(stop, deadline)
        headers = [read_header(data) for data in datas]
        self._check_request_pixels(headers)
        files: list[EncodedFile | None] = []
        for index, (data, header) in enumerate(zip(datas, headers, strict=True)):
            self._check_live(stop, deadline)
            with tracer.start_as_current_span("image.header") as span:
                span.set_attribute("splitvl.image.index", index)
                span.set_attribute("splitvl.image.encoded_bytes", len(data))
                if header is None:
                    files.append(None)
                    continue
                span.set_attribute("splitvl.image.format", header.format)
                span.set_attribute("splitvl.image.exif_orientation", header.orientation)
                span.set_attribute("splitvl.image.width", header.width)
                span.set_attribute("splitvl.image.height", header.height)
                if header.stored_width * header.stored_height > self.settings.max_decoded_pixels:
                    files.append(None)  # decode_image refuses it, naming the limit
                    continue
                try:
                    plan = plan_resize(
                        header.height,
                        header.width,
                        self.spec,
                        index=index,
                        min_pixels=lo,
                        max_pixels=hi,
                    )
                except ServiceError:
                    files.append(None)  # the same plan after decoding raises it in order
                    continue
                key = bytes_key(data, plan, self.revision) if with_keys else ""
                files.append(EncodedFile(header, plan, key))
        return files

    def _decode_images(
        self,
        datas: list[bytes],
        indices: list[int],
        files: list[EncodedFile | None],
        lo: int,
        hi: int,
        stop: threading.Event | None = None,
        deadline: float | None = None,
        *,
        warm_up: bool = False,
    ) -> list[PreparedImage]:
        """Decode, plan, key, describe and resize each image, one at a time.

        The pixels kept (and sent to the encoder) are the resized ones, produced by the one
        shared resize function: a 6000x6000 upload shrinks to the pixel budget here instead
        of travelling as 108 MB, and only one full-size decode is alive per thread. The
        plan is the decoded image's: where the header's plan differs (an orientation only
        found after the pixel data), the file's digest is not kept, so it never answers
        for this image.

        Args:
            datas: The encoded files to decode; ``indices`` their positions in the request
                (for error messages and spans); ``files`` their headers (None: unread).
            stop: Set (from the event loop) when the request is cancelled; checked, with
                ``deadline`` (``time.monotonic()`` seconds), before each image and stage.
            warm_up: The start-up run (:meth:`warm_up`): not counted as decoded images.

        Raises:
            ServiceError: as decode_image and plan_resize; CANCELLED / DEADLINE_EXCEEDED
                when stopped.
        """
        stop = stop or threading.Event()
        prepared = []
        for index, data, file in zip(indices, datas, files, strict=True):
            self._check_live(stop, deadline)
            with tracer.start_as_current_span("image.decode") as span:
                span.set_attribute("splitvl.image.index", index)
                span.set_attribute("splitvl.image.encoded_bytes", len(data))
                image = decode_image(
                    data, index=index, max_decoded_pixels=self.settings.max_decoded_pixels
                )
                if not warm_up:
                    metrics.IMAGES_DECODED.inc()
                span.set_attribute("splitvl.image.width", image.width)
                span.set_attribute("splitvl.image.height", image.height)
            self._check_live(stop, deadline)
            with tracer.start_as_current_span("image.resize") as span:
                plan = plan_resize(
                    image.height, image.width, self.spec, index=index, min_pixels=lo, max_pixels=hi
                )
                span.set_attribute("splitvl.image.index", index)
                span.set_attribute("splitvl.image.resized_width", plan.resized_width)
                span.set_attribute("splitvl.image.resized_height", plan.resized_height)
                span.set_attribute("splitvl.image.grid_thw", list(plan.grid))
                span.set_attribute("splitvl.image.tokens", plan.tokens)
                # The full-size pixels are read after the decode (and EXIF transpose) out
                # of Pillow (np.asarray), by the resize, and by the verification image's
                # capped downscale below (vlcommon.verification: it must not depend on the
                # plan). The key and the descriptor's thumbnail are computed from the
                # resized pixels (exactly what the ViT sees), a ninth of a 12 MP photo; the
                # document test looks at the full image, every k-th pixel.
                pixels = np.asarray(image, dtype=np.uint8)
                if pixels.shape[:2] == (plan.resized_height, plan.resized_width):
                    resized = pixels  # already the planned size
                else:
                    resized = resize_to_plan(pixels, plan).permute(1, 2, 0).contiguous().numpy()
                del pixels
                self._check_live(stop, deadline)
                key = exact_key(resized, plan, self.revision)
                descriptor = similarity_descriptor(image, resized)
                # From the decoded image, not the plan (vlcommon.verification), here on the
                # preprocess thread (up to ~30 ms for 12 MP; a JPEG's luma decoded again for
                # the JPEG-matched check, ~5 ms for 2 MP); only a cache can use it.
                verification = (
                    verification_image(image, data)
                    if self.down.cache is not None
                    and verifiable(
                        image.width, image.height, plan.resized_height * plan.resized_width
                    )
                    else None
                )
                # The stored grids a similarity hit may serve instead (about 1 ms).
                reusable = (
                    reusable_grids(
                        image.height,
                        image.width,
                        self.spec,
                        min_pixels=lo,
                        max_pixels=hi,
                        bound=self.settings.grid_reuse_scale,
                    )[1:]
                    if self.down.cache is not None
                    else []
                )
            del image
            prepared.append(
                PreparedImage(
                    index=index,
                    plan=plan,
                    key=key,
                    decoded=True,
                    pixels=resized,
                    descriptor=descriptor,
                    verification=verification,
                    reusable=reusable,
                    # Where the two plans disagree the pixel key alone stands for the image.
                    bytes_key=file.bytes_key if file is not None and file.plan == plan else "",
                )
            )
        return prepared

    def _prepare_images(
        self,
        datas: list[bytes],
        lo: int,
        hi: int,
        stop: threading.Event | None = None,
        deadline: float | None = None,
    ) -> list[PreparedImage]:
        """Headers (the request's pixel total) and then every image decoded: the path
        without a cache lookup, so no file digest is computed.

        Raises:
            ServiceError: as :meth:`_read_files` and :meth:`_decode_images`.
        """
        files = self._read_files(datas, lo, hi, False, stop, deadline)
        return self._decode_images(datas, list(range(len(datas))), files, lo, hi, stop, deadline)

    async def _run_preprocess(
        self,
        work: Callable[..., T],
        *args: object,
        context: grpc.aio.ServicerContext,
        headers_only: bool = False,
    ) -> T:
        """Run ``work(*args, stop, deadline)`` on a preprocess thread, bounded and cancellable.

        ``headers_only`` work (no pixel decoded: :meth:`_read_files`) runs on the header
        threads, not counted against ``preprocess_threads + preprocess_queue`` (it holds no
        decoded pixels; the gRPC admission bound limits how many requests reach it).

        Raises:
            ServiceError: RESOURCE_EXHAUSTED ``PREPROCESS_BUSY`` (with a retry hint) when
                ``preprocess_threads + preprocess_queue`` requests are already there; what
                ``work`` raises.
        """
        left = remaining(context)
        deadline = None if left is None else time.monotonic() + left
        stop = threading.Event()
        # In the thread, under the current span: image.decode/image.resize are its children.
        call = functools.partial(work, *args, stop, deadline)
        if headers_only:
            return await self._await_thread(
                self._headers.submit(contextvars.copy_context().run, call), stop
            )
        s = self.settings
        capacity = s.preprocess_threads + s.preprocess_queue
        with self._preprocess_lock:
            if self.preprocess_pending >= capacity:
                raise resource_exhausted(
                    "PREPROCESS_BUSY",
                    f"{self.preprocess_pending} requests are preparing or waiting to prepare "
                    f"images; the limit is {capacity} (GATEWAY_PREPROCESS_THREADS + "
                    "GATEWAY_PREPROCESS_QUEUE); retry shortly",
                    field="images",
                    limit=capacity,
                    retry_after_ms=s.retry_after_ms,
                )
            self.preprocess_pending += 1

        def finished(_: object) -> None:
            with self._preprocess_lock:
                self.preprocess_pending -= 1

        future = self._preprocess.submit(contextvars.copy_context().run, call)
        future.add_done_callback(finished)
        return await self._await_thread(future, stop)

    @staticmethod
    async def _await_thread(future: concurrent.futures.Future[T], stop: threading.Event) -> T:
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The client hung up or its deadline passed: the thread stops at its next check
            # instead of decoding the rest of the request's images for nobody.
            stop.set()
            raise

    async def _prepare(
        self,
        datas: list[bytes],
        lo: int,
        hi: int,
        policy: int,
        context: grpc.aio.ServicerContext,
        held: HeldRefs | None = None,
        owned: list[str] | None = None,
    ) -> tuple[list[PreparedImage], float, bool]:
        """Every image of the request, prepared; decoded only where its file's digest missed.

        With a cache and a policy that uses it: headers and file digests first (no
        decode), one ``Lookup`` by bytes key, then the decode of the images it did not
        answer. Without: every image decoded, no digest computed.

        With ``owned`` (the request's claims, :class:`SameFileFlights`): a request whose
        missed files are all being encoded by other requests waits for their puts and
        looks them up again (the wait counts as lookup time); otherwise it claims the
        missed files no one holds (appended to ``owned``, which the caller must land).

        Returns:
            The images in request order, the milliseconds spent in the bytes-key lookup
            and any wait for the same files (part of ``lookup_ms``, not of
            ``preprocess_ms``), and whether the cache is to
            be asked by pixel key (False without a cache, with policy off, or when the
            bytes-key lookup failed: the cache is then down or slow, asked no more).

        Raises:
            ServiceError: as :meth:`_read_files`, :meth:`_decode_images` and
                :meth:`_run_preprocess`.
        """
        if not datas:
            return [], 0.0, False
        if self.down.cache is None or policy == generation_pb2.CACHE_POLICY_OFF:
            images = await self._run_preprocess(
                self._prepare_images, datas, lo, hi, context=context
            )
            return images, 0.0, False
        files = await self._run_preprocess(
            self._read_files, datas, lo, hi, True, context=context, headers_only=True
        )
        t = time.perf_counter()
        hits = await self.cache_stage.lookup_files(files, context, held)
        if hits is not None and owned is not None:
            if not await self._follow_same_files(files, hits, context, held, owned):
                hits = None  # the second lookup failed: the cache is asked no more
        lookup_ms = (time.perf_counter() - t) * 1000
        todo = [i for i in range(len(datas)) if hits is None or i not in hits]
        decoded: list[PreparedImage] = []
        if todo:
            decoded = await self._run_preprocess(
                self._decode_images,
                [datas[i] for i in todo],
                todo,
                [files[i] for i in todo],
                lo,
                hi,
                context=context,
            )
        by_index = {im.index: im for im in decoded}
        by_index.update(hits or {})
        return [by_index[i] for i in range(len(datas))], lookup_ms, hits is not None

    async def _follow_same_files(
        self,
        files: list[EncodedFile | None],
        hits: dict[int, PreparedImage],
        context: grpc.aio.ServicerContext,
        held: HeldRefs | None,
        owned: list[str],
    ) -> bool:
        """Claims the missed files no request holds; when it claimed none, waits for the
        requests encoding them and adds what a second bytes-key lookup answers to
        ``hits``. The wait lasts at most half the time left to the deadline (the other
        half is for decoding and encoding the files itself, should they still miss) and
        at most :data:`SAME_FILE_WAIT_S`.

        Returns:
            False when the second lookup failed (then counted in
            ``splitvl_gateway_cache_failures_total{op="lookup"}``), else True.
        """
        if any(f is None for f in files):
            return True  # a file without a digest (unreadable header): fail it now, no wait
        missed = [i for i, f in enumerate(files) if f is not None and f.bytes_key and i not in hits]
        if not missed:
            return True
        keys = [files[i].bytes_key for i in missed]  # type: ignore[union-attr]
        follow = self.same_file.claim_or_follow(keys, owned)
        if not follow or owned:
            return True  # nothing to wait for, or a holder of claims: it never waits
        waited = {missed[pos] for pos in follow}
        left = remaining(context)
        wait_s = SAME_FILE_WAIT_S if left is None else min(SAME_FILE_WAIT_S, left / 2)
        with tracer.start_as_current_span("cache.same_file_wait") as span:
            span.set_attribute("splitvl.images", sorted(waited))
            await asyncio.wait(set(follow.values()), timeout=wait_s)
            again = await self.cache_stage.lookup_files(
                [f if i in waited else None for i, f in enumerate(files)], context, held
            )
            if again is None:
                return False
            span.set_attribute(
                "splitvl.cache.tiers", ["exact" if i in again else "miss" for i in sorted(waited)]
            )
        hits.update(again)
        metrics.SAME_FILE_WAITS.labels(outcome="hit").inc(len(again))
        metrics.SAME_FILE_WAITS.labels(outcome="miss").inc(len(waited) - len(again))
        return True

    async def warm_up(self) -> None:
        """Run the whole preprocess path once on every preprocess thread, before SERVING.

        A fresh gateway's first large image paid for lazy work that later images do not:
        starting the preprocess threads, importing torchvision's resize and creating
        torch's thread pool on first use, libjpeg/zlib's first decode, Pillow's transpose
        and RGBA compositing, the first SHA-256 over megabytes. Each thread here reads the
        header of, digests and decodes a 12 MP JPEG stored sideways (EXIF orientation 6)
        and an RGBA PNG, then plans, keys, describes and resizes them down (antialiased
        bicubic) with the model's own pixel budget, as a request would. Nothing is counted
        in ``splitvl_gateway_images_decoded_total``. About 0.3 s of CPU per thread plus
        0.4 s to build the files (measured: ~1.1 s in all for 2 threads on 2 busy cores);
        the first 12 MP photo then costs what later ones do (docs/benchmarks.md).

        Raises:
            ServiceError: if the pipeline itself fails on these files (a broken install
                should fail at start, not on the first request).
        """
        started = time.perf_counter()
        files = _warm_up_files()
        threads = self.settings.preprocess_threads
        # Every task waits for the others, so each runs on its own thread: the pool starts
        # a new thread only when no idle one is there.
        barrier = threading.Barrier(threads)

        def run() -> None:
            try:
                barrier.wait(timeout=30)
            except threading.BrokenBarrierError:
                pass  # a machine too busy to start them all in time: warm those that ran
            lo, hi = self.spec.min_pixels, self.spec.max_pixels
            headers = self._read_files(files, lo, hi, True)
            self._decode_images(files, list(range(len(files))), headers, lo, hi, warm_up=True)

        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._preprocess, run) for _ in range(threads)))
        log.info(
            "preprocess warmed up on %d threads in %.0f ms",
            threads,
            (time.perf_counter() - started) * 1000,
        )

    # -- the RPC ------------------------------------------------------------------------
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        held = HeldRefs()
        owned: list[str] = []  # this request's claims on files being encoded (same_file)
        try:
            async with contextlib.aclosing(
                self._generate(request, context, held, owned)
            ) as responses:
                async for response in responses:
                    yield response
        finally:
            # Claims not handed to a put (failed, cancelled, or hits after all): their
            # followers look up again and, missing, decode as before.
            self.same_file.land(owned)
            # Failed (or cancelled) before the decoder took its refs over: release them,
            # so no hit stays leased and no segment stays held until its TTL.
            if held.refs:
                self.releaser.release_unread(held.refs)

    async def _generate(
        self,
        request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext,
        held: HeldRefs,
        owned: list[str],
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        t_start = time.perf_counter()
        request_span = trace.get_current_span()  # the Generate server span
        timings = pb.StageTimings()
        sampling = request.sampling
        if sampling.HasField("max_tokens"):
            check_max_tokens(sampling.max_tokens, self.settings.max_tokens_limit)
        check_sampling_ranges(sampling)  # before any image is decoded or encoded
        if request.cache_policy not in generation_pb2.CachePolicy.values():
            raise invalid_argument(
                "CACHE_POLICY_INVALID",
                f"cache_policy {request.cache_policy} is not a CachePolicy value",
                field="cache_policy",
            )
        policy = request.cache_policy or self.default_policy
        with tracer.start_as_current_span("gateway.preprocess") as span:
            video_sources: list[VideoSource] = []
            messages, sources = self._parse(request, video_sources)
            lo, hi = self._budget(request)
            datas = await self._fetch_urls(sources, context)
            # Only a request of one image and no video takes part in the same-file
            # flights: a waiter waits for its holder's whole encode and put, which is
            # one image's then (a holder with more images, or a video to fetch and
            # decode, would make it wait for all of them).
            single = len(datas) == 1 and not video_sources
            images, bytes_lookup_ms, ask_cache = await self._prepare(
                datas, lo, hi, policy, context, held, owned if single else None
            )
            videos: list[PreparedVideo] = []
            if video_sources:
                video_sources = await self._fetch_video_urls(video_sources, context)
                videos = await self._run_preprocess(
                    self._prepare_videos, video_sources, context=context
                )
            span.set_attribute("splitvl.videos", len(videos))
            span.set_attribute("splitvl.images", len(images))
            span.set_attribute("splitvl.grids", [str(im.plan.grid) for im in images])
            span.set_attribute("splitvl.decoded", [im.decoded for im in images])
        # The bytes-key lookup ran inside this span; its time is the lookup stage's.
        timings.preprocess_ms = (time.perf_counter() - t_start) * 1000 - bytes_lookup_ms
        metrics.IMAGES.inc(len(images))
        metrics.VIDEOS.inc(len(videos))
        request_span.set_attribute("splitvl.request.model", self.settings.model)
        request_span.set_attribute("splitvl.request.images", len(images))
        request_span.set_attribute("splitvl.request.videos", len(videos))
        request_span.set_attribute(
            "splitvl.request.video_tokens", sum(v.plan.tokens for v in videos)
        )

        t = time.perf_counter()
        lookups = []
        if ask_cache:
            lookups.append(
                self.cache_stage.lookup([im for im in images if im.decoded], policy, context, held)
            )
        if videos and self.down.cache is not None and policy != generation_pb2.CACHE_POLICY_OFF:
            # Videos have no similarity tier: exact keys only, whatever the policy.
            lookups.append(
                self.cache_stage.lookup(
                    list(videos), generation_pb2.CACHE_POLICY_EXACT_ONLY, context, held
                )
            )
        await asyncio.gather(*lookups)
        timings.lookup_ms = (time.perf_counter() - t) * 1000 + bytes_lookup_ms

        misses = [im for im in [*images, *videos] if im.embedding is None]
        # Claims on files that were hits by pixel key after all, or that the put will not
        # store under their digest (a plan that differs from the header's): land them now.
        put_keys = {im.bytes_key for im in misses if im.bytes_key}
        self.same_file.land([k for k in owned if k not in put_keys])
        owned[:] = [k for k in owned if k in put_keys]
        if misses:
            t = time.perf_counter()
            stores = self.down.cache is not None and policy != generation_pb2.CACHE_POLICY_OFF
            await self.encode_stage.encode(misses, context, readers=2 if stores else 1, held=held)
            timings.encode_ms = (time.perf_counter() - t) * 1000
            # The put runs beside the decode: the decoder already has the embeddings, so
            # TTFT does not wait for the cache (its duration lands in timings.put_ms).
            put = asyncio.create_task(self.cache_stage.put(misses, policy, None, timings))
            self._background.add(put)
            put.add_done_callback(self._background.discard)
            # The put lands the claims once the entries are stored (or it failed).
            landing, owned[:] = list(owned), []
            put.add_done_callback(lambda _: self.same_file.land(landing))

        for attempt in (0, 1):
            decode_request = decoder_service_pb2.GenerateRequest(
                request_id=uuid.uuid4().hex[:16], messages=messages, sampling=sampling
            )
            # The copy of every image's embeddings into the decoder's request; the bytes
            # then travel inside the DecoderService/Generate client span.
            with tracer.start_as_current_span("embedding.transfer") as span:
                for im in images:
                    decode_request.images.append(im.embedding)
                for v in videos:
                    assert v.video is not None
                    decode_request.videos.add(
                        embedding=v.embedding, timestamps=v.video.patch_timestamps
                    )
                sent = sum(inline_bytes(im.embedding) for im in [*images, *videos] if im.embedding)
                span.set_attribute("splitvl.embedding.bytes", sent)
                span.set_attribute("splitvl.embedding.destination", "decoder")
                ref_attributes(span, [im.embedding for im in [*images, *videos] if im.embedding])
                span.set_attribute("splitvl.request.images", len(images))
                metrics.EMBEDDING_SENT_BYTES.labels(destination="decoder").inc(sent)
            infos = [
                pb.ImageInfo(
                    index=i,
                    tier=im.tier,
                    similarity=im.similarity,
                    # What the language model got: the served grid and its token count.
                    grid=thw_message(im.served_grid),
                    tokens=self.spec.tokens(*im.served_grid),
                    key=im.key,
                    decoded=im.decoded,
                    served_grid=thw_message(im.served_grid),
                    requested_grid=grid_message(im.plan),
                )
                for i, im in enumerate(images)
            ]
            video_infos = [_video_info(v) for v in videos]
            request_span.set_attribute(
                "splitvl.served_grids", [str(im.served_grid) for im in images]
            )

            t_decode = time.perf_counter()
            with tracer.start_as_current_span("gateway.decode") as span:
                span.set_attribute("splitvl.transfer_bytes", decode_request.ByteSize())
                first = True
                try:
                    # aclosing: a cancelled client (GeneratorExit at the yield below)
                    # closes the stream, which cancels the decoder call, which aborts
                    # the vLLM request.
                    held.hand_over()  # the decoder reads or releases each ref
                    stream = self.decode_stage.stream(decode_request, context)
                    async with contextlib.aclosing(stream) as chunks:
                        async for chunk in chunks:
                            now = time.perf_counter()
                            response = pb.GenerateResponse(
                                token_ids=chunk.token_ids,
                                text=chunk.text,
                                finish_reason=chunk.finish_reason,
                            )
                            if first:
                                timings.ttft_ms = (now - t_decode) * 1000
                                metrics.TTFT.observe(now - t_start)
                                span.add_event("first_token", {"splitvl.ttft_ms": timings.ttft_ms})
                                response.images.extend(infos)
                                response.videos.extend(video_infos)
                                first = False
                            if chunk.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
                                response.usage.CopyFrom(chunk.usage)
                                request_span.set_attribute(
                                    "splitvl.usage.prompt_tokens", chunk.usage.prompt_tokens
                                )
                                request_span.set_attribute(
                                    "splitvl.usage.completion_tokens",
                                    chunk.usage.completion_tokens,
                                )
                                timings.decode_ms = (time.perf_counter() - t_decode) * 1000
                                timings.total_ms = (time.perf_counter() - t_start) * 1000
                                response.timings.CopyFrom(timings)
                            yield response
                    break
                except RefsLost as lost:
                    if attempt == 1:
                        raise lost.error from lost
                    # A held entry was gone when the decoder came to read it (its holder
                    # restarted, or it expired): encode every image again and decode once
                    # more, within the same deadline. Nothing was streamed yet.
                    log.warning(
                        "decoder could not read held embeddings (%s); re-encoding",
                        lost.error.reason,
                    )
                    metrics.REENCODED.inc()
                    span.set_attribute("splitvl.reencoded", True)
            # An image answered by its file's digest was never decoded: decode it now.
            undecoded = [i for i, im in enumerate(images) if im.pixels is None]
            if undecoded:
                off = generation_pb2.CACHE_POLICY_OFF
                again, _, _ = await self._prepare(
                    [datas[i] for i in undecoded], lo, hi, off, context
                )
                for i, im in zip(undecoded, again, strict=True):
                    im.index = i
                    images[i] = im
            retry = [*images, *videos]
            for im in retry:
                im.embedding, im.tier = None, generation_pb2.CACHE_TIER_MISS
            t = time.perf_counter()
            await self.encode_stage.encode(retry, context, readers=1, held=held)
            timings.encode_ms += (time.perf_counter() - t) * 1000
            misses = retry
        # Only the stages that ran: a 0 for an encode that every hit skipped (or a
        # lookup with the cache off) would dilute the histogram; the put observes
        # itself when it ends (_put).
        ran = ["preprocess"]
        if images and self.down.cache is not None and policy != generation_pb2.CACHE_POLICY_OFF:
            ran.append("lookup")
        if misses:
            ran.append("encode")
        for name in (*ran, "decode"):
            seconds = getattr(timings, f"{name}_ms") / 1000
            metrics.STAGE_SECONDS.labels(stage=name).observe(seconds)
