"""The gateway's request model: one validated :class:`GenerateInput` for both fronts.

The gRPC adapter parses ``gateway.v1.GenerateRequest`` with :meth:`RequestParser.parse`;
the OpenAI front first maps a chat completion onto the same message
(``gateway.openai_protocol``), then parses it the same way. So every rule (counts, text,
roles, control tokens, sampling ranges, pixel budget, image and video sources) is written
once, here and in the shared modules it calls (``vlcommon.request_rules``,
``vlcommon.sampling``, ``gateway.media``, ``gateway.video``), and raises the same
ErrorInfo reason on both fronts. The decoder checks what it receives with the same shared
rules. Counts are checked before any content is scanned, so an oversized request is
refused without work proportional to its size.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from qwenvl.common.v1 import generation_pb2
from qwenvl.decoder.v1 import decoder_service_pb2
from qwenvl.gateway.v1 import gateway_service_pb2 as pb

from gateway.fetch import UrlFetcher
from gateway.media import ImageUrl, image_bytes, video_file_bytes
from gateway.priority import PriorityRules
from gateway.settings import GatewaySettings
from gateway.video import VideoLimits, VideoRequest, check_frames_present, check_request
from gateway.video_config import VideoConfig
from vlcommon.deadline import Deadline
from vlcommon.model_info import VisionSpec
from vlcommon.refusals import Refusal
from vlcommon.request_rules import (
    CACHE_POLICIES,
    check_cache_policy,
    check_media_count,
    check_message_counts,
    check_no_control_tokens,
    check_parts_present,
    check_reasoning_content,
    check_role,
    check_text_length,
    part_empty,
)
from vlcommon.sampling import check_max_tokens, check_sampling_ranges


@dataclass(frozen=True)
class VideoSource:
    """A video part as parsed: its file (bytes or a URL still to fetch) or its frames."""

    index: int  # position among the request's videos
    field: str  # e.g. messages[0].parts[1].video
    file: bytes | ImageUrl | None
    frames: tuple[bytes | ImageUrl, ...]
    fps: float
    overrides: VideoRequest


@dataclass
class GenerateInput:
    """One request, validated: what the pipeline runs.

    Attributes:
        messages: The chat, images and videos replaced by their indices.
        images: Each image's encoded bytes, or its URL still to fetch, in request order.
        videos: Each video's source, in request order.
        min_pixels: The resize plan's lower pixel budget (the request's, else the model's).
        max_pixels: The upper one.
        sampling: Sampling parameters, ranges checked (``max_tokens`` 0: the decoder's
            default).
        cache_policy: A ``CachePolicy`` value, the gateway's default applied.
        deadline: When the request must be answered.
        priority: The class the client asked (lower = sooner, as vLLM's), raised to its
            floor (:mod:`gateway.priority`); None: the gateway's policy decides.
        priority_raised: The client asked a class below its floor.
        arrived: ``time.perf_counter()`` when the front received it (stage timings).
        arrived_wall: ``time.time()`` then: the aged priority's arrival term.
    """

    messages: list[decoder_service_pb2.Message]
    images: list[bytes | ImageUrl]
    videos: list[VideoSource]
    min_pixels: int
    max_pixels: int
    sampling: generation_pb2.SamplingParams
    cache_policy: int
    deadline: Deadline = field(default_factory=Deadline)
    priority: int | None = None
    priority_raised: bool = False
    arrived: float = field(default_factory=time.perf_counter)
    arrived_wall: float = field(default_factory=time.time)


class RequestParser:
    """The gateway's request rules, applied to a ``gateway.v1.GenerateRequest``: roles,
    parts and their text, an assistant message's ``reasoning_content`` (passed on to the
    decoder), media, sampling, pixel budget.

    Args:
        settings: The limits (``GATEWAY_MAX_*``), the default cache policy.
        spec: Vision geometry: the pixel budget's bounds.
        forbidden_tokens: Control tokens user text may not spell (case C05).
        video_config: The checkpoint's video processor config; None refuses videos
            (UNIMPLEMENTED).
        fetcher: Checks image URLs (scheme, host, the URL switch) before any network work.
        video_fetcher: The same for video files.
    """

    def __init__(
        self,
        settings: GatewaySettings,
        spec: VisionSpec,
        forbidden_tokens: tuple[str, ...],
        video_config: VideoConfig | None,
        fetcher: UrlFetcher,
        video_fetcher: UrlFetcher,
    ) -> None:
        self.settings = settings
        self.spec = spec
        self.forbidden_tokens = forbidden_tokens
        self.video_config = video_config
        self.fetcher = fetcher
        self.video_fetcher = video_fetcher
        self.video_limits = VideoLimits(
            max_bytes=settings.max_video_bytes,
            max_duration_s=settings.max_video_duration_s,
            max_frames=settings.video_max_frames,
            max_fps=settings.video_max_fps,
            max_decoded_pixels=settings.video_max_decoded_pixels,
        )
        self.default_policy = CACHE_POLICIES[settings.default_cache_policy]
        self.priority = PriorityRules.from_settings(settings)

    def parse(
        self,
        request: pb.GenerateRequest,
        deadline: Deadline,
        arrived: float | None = None,
        caller: str | None = None,
    ) -> GenerateInput:
        """The validated request.

        Args:
            caller: The bearer token the call presented (its priority floor), if any.

        Raises:
            ServiceError: INVALID_ARGUMENT naming the field (and the limit) for each rule;
                RESOURCE_EXHAUSTED for a size over a byte or frame limit; UNIMPLEMENTED for
                a video on a server without a video config; FAILED_PRECONDITION for a URL
                with URLs off. Nothing has been fetched or decoded yet.
        """
        sampling = request.sampling
        if sampling.HasField("max_tokens"):
            check_max_tokens(sampling.max_tokens, self.settings.max_tokens_limit)
        check_sampling_ranges(sampling)
        check_cache_policy(request.cache_policy, "cache_policy")
        videos: list[VideoSource] = []
        messages, images = self._messages(request, videos)
        lo, hi = self._budget(request)
        priority, raised = (
            self.priority.asked(request.priority, caller)
            if request.HasField("priority")
            else (None, False)
        )
        return GenerateInput(
            messages=messages,
            images=images,
            videos=videos,
            min_pixels=lo,
            max_pixels=hi,
            sampling=sampling,
            cache_policy=request.cache_policy or self.default_policy,
            deadline=deadline,
            priority=priority,
            priority_raised=raised,
            arrived=time.perf_counter() if arrived is None else arrived,
        )

    def _check_counts(self, request: pb.GenerateRequest) -> None:
        """Messages, parts, images, videos and characters, before any content is read."""
        s = self.settings
        check_message_counts(request.messages, max_messages=s.max_messages, max_parts=s.max_parts)
        parts = [q for m in request.messages for q in m.parts]
        check_media_count(
            sum(1 for q in parts if q.HasField("image")), noun="images", limit=s.max_images
        )
        check_media_count(
            sum(1 for q in parts if q.HasField("video")),
            noun="videos",
            limit=s.max_videos,
            where=" (GATEWAY_MAX_VIDEOS)",
        )
        # An assistant turn's reasoning is prompt text like its parts.
        reasoning = sum(len(m.reasoning_content) for m in request.messages)
        check_text_length(sum(len(q.text) for q in parts) + reasoning, s.max_text_chars)

    def _messages(
        self, request: pb.GenerateRequest, videos: list[VideoSource]
    ) -> tuple[list[decoder_service_pb2.Message], list[bytes | ImageUrl]]:
        """The messages for the decoder and the images' encoded bytes (or URLs), in order;
        video parts are appended to ``videos``."""
        self._check_counts(request)
        messages: list[decoder_service_pb2.Message] = []
        images: list[bytes | ImageUrl] = []
        for i, message in enumerate(request.messages):
            check_role(message.role, f"messages[{i}].role")
            check_parts_present(
                message.parts, i, has_reasoning=message.HasField("reasoning_content")
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
                self._check_joined(run, i)
                run = []
                if kind == "image":
                    images.append(self._image(part.image, len(images)))
                    out.parts.add(image_index=len(images) - 1)
                elif kind == "video":
                    videos.append(self._video(part.video, len(videos), f"{field}.video"))
                    out.parts.add(video_index=len(videos) - 1)
                else:
                    raise part_empty(field, "text, image, video")
            self._check_joined(run, i)
            if message.HasField("reasoning_content"):
                check_reasoning_content(
                    message.role, message.reasoning_content, self.forbidden_tokens, i
                )
                out.reasoning_content = message.reasoning_content
            messages.append(out)
        return messages, images

    def _check_text(self, text: str, field: str) -> None:
        """Refuse a control token (``<|image_pad|>``, ``<|im_start|>``, ...) in user text."""
        check_no_control_tokens(text, self.forbidden_tokens, field)

    def _check_joined(self, run: list[str], message_index: int) -> None:
        """Adjacent text parts, joined as the chat template joins them: a control token
        may be formed across them (``<|im_`` + ``start|>``)."""
        if len(run) > 1:
            self._check_text("".join(run), f"messages[{message_index}].parts (joined text)")

    def _image(self, image: pb.ImageInput, index: int) -> bytes | ImageUrl:
        """An image part's bytes, or its URL (checked, not fetched)."""
        source = image_bytes(image, index=index, max_bytes=self.settings.max_image_bytes)
        if isinstance(source, ImageUrl):
            self.fetcher.check_url(source.url, index=index)
        return source

    def _video(self, video: pb.VideoInput, index: int, field: str) -> VideoSource:
        """One video part: its source resolved (URL checked, not fetched), overrides checked.

        Raises:
            ServiceError: UNIMPLEMENTED without a video config; INVALID_ARGUMENT for no
                source, a bad data URL, an override out of bounds; RESOURCE_EXHAUSTED past
                the byte limits or GATEWAY_VIDEO_MAX_FRAMES frames; FAILED_PRECONDITION for
                a URL with URLs off.
        """
        if self.video_config is None:
            raise Refusal.VIDEO_NOT_SUPPORTED.error(
                f"{field}: this server has no video processor config", field=field
            )
        s = self.settings
        overrides = VideoRequest(
            sample_fps=video.sample_fps, max_frames=video.max_frames, max_pixels=video.max_pixels
        )
        check_request(overrides, self.video_config, self.video_limits, field)
        if not math.isfinite(video.fps) or video.fps < 0:
            raise Refusal.VIDEO_FPS_OUT_OF_RANGE.error(
                f"{field}.fps is {video.fps}; it must be >= 0 (0: 2 frames per second)",
                field=f"{field}.fps",
            )
        if video.HasField("file"):
            if video.frames:
                raise Refusal.VIDEO_SOURCE_AMBIGUOUS.error(
                    f"{field} has both file and frames; send one", field=field
                )
            source = video_file_bytes(video.file, index=index, max_bytes=s.max_video_bytes)
            if isinstance(source, ImageUrl):
                self.video_fetcher.check_url(source.url, index=index)
            return VideoSource(index, field, source, (), 0.0, overrides)
        return VideoSource(index, field, None, self._frames(video, field), video.fps, overrides)

    def _frames(self, video: pb.VideoInput, field: str) -> tuple[bytes | ImageUrl, ...]:
        """A video given as frames: each frame's bytes (by value only)."""
        s = self.settings
        check_frames_present(len(video.frames), field)
        if len(video.frames) > s.video_max_frames:
            raise Refusal.VIDEO_TOO_MANY_FRAMES.error(
                f"{field}.frames has {len(video.frames)} frames; the limit is "
                f"{s.video_max_frames} (GATEWAY_VIDEO_MAX_FRAMES)",
                field=f"{field}.frames",
                limit=s.video_max_frames,
            )
        frames: list[bytes | ImageUrl] = []
        for j, frame in enumerate(video.frames):
            data = image_bytes(frame, index=j, max_bytes=s.max_image_bytes)
            if isinstance(data, ImageUrl):
                raise Refusal.VIDEO_FRAME_URL.error(
                    f"{field}.frames[{j}] is a URL; send video frames by value, or the video "
                    "file by URL",
                    field=f"{field}.frames[{j}]",
                )
            frames.append(data)
        return tuple(frames)

    def _budget(self, request: pb.GenerateRequest) -> tuple[int, int]:
        """The request's pixel budget ``(min_pixels, max_pixels)``, the model's defaults
        for unset bounds.

        Raises:
            ServiceError: INVALID_ARGUMENT ``PIXEL_BUDGET_INVALID`` naming both bounds and
                where each came from.
        """
        budget = request.pixel_budget
        lo = budget.min_pixels or self.spec.min_pixels
        hi = budget.max_pixels or self.spec.max_pixels
        floor = self.spec.factor**2
        if lo < floor or hi < lo or hi > self.spec.max_pixels:

            def origin(value: int, name: str) -> str:
                given = "set" if getattr(budget, name) else "model default"
                return f"{name}={value} ({given})"

            raise Refusal.PIXEL_BUDGET_INVALID.error(
                f"pixel_budget is out of range: {origin(lo, 'min_pixels')}, "
                f"{origin(hi, 'max_pixels')}; it needs min_pixels >= {floor} and "
                f"min_pixels <= max_pixels <= {self.spec.max_pixels} (an unset field takes "
                "the model default)",
                field="pixel_budget",
                limit=self.spec.max_pixels,
            )
        return lo, hi
