"""Video intake: decode only the frames qwen-vl-utils' sampling keeps, upright, resized.

Usage::

    config = load_video_config(model_dir, spec)  # gateway.video_config: the checkpoint's
    video = decode_video(data, index=0, spec=spec, config=config, limits=limits,
                         request=VideoRequest(...), revision=rev)
    video.frames      # uint8 [frames, resized_height, resized_width, 3], padded to 2
    video.plan.grid   # video_grid_thw (t = frames / temporal_patch_size, h, w)
    video.timestamps  # seconds, one per kept frame (real presentation times)

Sampling and sizing are qwen-vl-utils' (``qwen_vl_utils.vision_process``, the reference
implementation Qwen names): ``smart_nframes`` picks the frame count (fps, min/max frames,
an even count), ``torch.linspace(0, total - 1, n).round()`` the indices, and each frame is
resized with its ``smart_resize`` within ``[min_pixels, max(min(VIDEO_MAX_TOKEN_NUM * f**2,
total_pixels / n * 2), 1.05 * min_pixels)]`` with ``f = 2 * image_patch_size`` (32 for
Qwen3-VL). The container is read with PyAV (FFmpeg): its packets are demuxed first (no
decoding) to count the frames and get their presentation times, then the decoder seeks to
the key frame before each kept frame and decodes forward to it, so a 5-minute clip sampled
to a few frames decodes a few GOPs, not the file.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gateway.media import check_bytes
from gateway.video_config import VideoConfig
from vlcommon.deadline import Deadline
from vlcommon.errors import ServiceError
from vlcommon.imaging import ResizePlan, resize_to_plan
from vlcommon.model_info import VisionSpec
from vlcommon.refusals import Refusal

# qwen-vl-utils' sample_fps for a list of frames given without a rate.
DEFAULT_FRAMES_FPS = 2.0
KEY_VERSION = b"splitvl-video-v1\0"
Check = Callable[[], None]


@dataclass(frozen=True)
class VideoLimits:
    """The gateway's bounds on one video (GATEWAY_* settings; see gateway.settings)."""

    max_bytes: int
    max_duration_s: float
    max_frames: int
    max_fps: float
    max_decoded_pixels: int  # stored width*height of one frame


@dataclass(frozen=True)
class VideoRequest:
    """Per-request overrides (VideoInput), 0 meaning the server's default."""

    sample_fps: float = 0.0
    max_frames: int = 0
    max_pixels: int = 0


@dataclass(frozen=True)
class SamplingPlan:
    """Which frames of the source are kept and when they are shown.

    Attributes:
        source_frames: Frames in the file (or given).
        video_fps: The source's average rate, frames per second.
        indices: Kept frame indices in presentation order, padded (last one repeated).
        timestamps: Presentation time of each kept frame, seconds from the first frame.
    """

    source_frames: int
    video_fps: float
    indices: tuple[int, ...]
    timestamps: tuple[float, ...]


@dataclass
class DecodedVideo:
    """One video, sampled, upright and resized: what the encoder and the cache need.

    Attributes:
        frames: uint8 ``[n, resized_height, resized_width, 3]``, n even.
        plan: Resize plan; ``grid_t = n / temporal_patch_size``, ``tokens`` for the video.
        sampling: The sampling plan.
        key: Exact cache key (SHA-256 hex over the decoded upright kept frames before
            resizing, the sampling plan, the resize plan and the model revision).
        container, codec: Format names as FFmpeg gives them ("" for given frames).
        duration_s: Length of the source, seconds.
        frames_decoded: Frames the codec produced (from each seek's key frame to the kept
            frame): the cost of sampling, well under ``source_frames`` for a long clip.
    """

    frames: np.ndarray
    plan: ResizePlan
    sampling: SamplingPlan
    key: str
    container: str = ""
    codec: str = ""
    duration_s: float = 0.0
    frames_decoded: int = 0

    @property
    def patch_timestamps(self) -> list[float]:
        """One time per temporal patch, seconds, exactly as Qwen3-VL's processor computes the
        ``<t seconds>`` prompt text (transformers' and vLLM's ``_calculate_timestamps``):
        each kept frame's index over the source's average rate, then the mean of a patch's
        first and last frame.

        Not the presentation times (``sampling.timestamps``): their float sums differ in the
        last bit, and the prompt rounds to one decimal, so a 10 fps clip's patch of frames
        14-15 read ``<1.5 seconds>`` (1.4 + 1.5000000000000002) where the processor writes
        ``<1.4 seconds>`` (15 / 10 ... 1.45 rounds down), and the answer changed. Frames
        given without a rate (``video_fps`` 0) keep their presentation times.
        """
        sampling = self.sampling
        if sampling.video_fps > 0:
            times = [index / sampling.video_fps for index in sampling.indices]
        else:
            times = list(sampling.timestamps)
        n = len(times) // max(1, self.plan.grid_t)
        return [(times[i] + times[i + n - 1]) / 2 for i in range(0, len(times), n)]


def _field(index: int) -> str:
    return f"videos[{index}]"


def _undecodable(index: int, what: str) -> ServiceError:
    return Refusal.VIDEO_UNDECODABLE.error(
        f"{_field(index)} could not be decoded: {what}", field=_field(index)
    )


def _truncated(index: int, what: str) -> ServiceError:
    return Refusal.VIDEO_TRUNCATED.error(
        f"{_field(index)} is truncated or undecodable: {what}", field=_field(index)
    )


def check_frames_present(n: int, field: str) -> None:
    """Refuse a video of no frames (``field``: the video; ``n``: its frames), the one rule
    of the gateway's request and of :func:`frames_video`.

    Raises:
        ServiceError: INVALID_ARGUMENT ``VIDEO_TOO_FEW_FRAMES`` naming ``<field>.frames``.
    """
    if n == 0:
        raise Refusal.VIDEO_TOO_FEW_FRAMES.error(
            f"{field} has neither a file nor frames (0 frames)", field=f"{field}.frames", limit=1
        )


def check_request(req: VideoRequest, config: VideoConfig, limits: VideoLimits, field: str) -> None:
    """Refuse per-request overrides outside the server's bounds (INVALID_ARGUMENT)."""
    if not (0 <= req.sample_fps <= limits.max_fps) or math.isnan(req.sample_fps):
        raise Refusal.VIDEO_FPS_OUT_OF_RANGE.error(
            f"{field}.sample_fps is {req.sample_fps}; allowed 0 (default {config.fps:g}) to "
            f"{limits.max_fps:g} (GATEWAY_VIDEO_MAX_FPS)",
            field=f"{field}.sample_fps",
            limit=limits.max_fps,
        )
    if not (0 <= req.max_frames <= limits.max_frames):
        raise Refusal.VIDEO_MAX_FRAMES_OUT_OF_RANGE.error(
            f"{field}.max_frames is {req.max_frames}; allowed 0 (default) to "
            f"{limits.max_frames} (GATEWAY_VIDEO_MAX_FRAMES)",
            field=f"{field}.max_frames",
            limit=limits.max_frames,
        )
    floor = config.frame_min_pixels
    if req.max_pixels and not (floor <= req.max_pixels <= config.frame_max_pixels):
        raise Refusal.VIDEO_MAX_PIXELS_OUT_OF_RANGE.error(
            f"{field}.max_pixels is {req.max_pixels}; allowed 0 (default) or {floor} to "
            f"{config.frame_max_pixels} (the per-frame bounds of the checkpoint's video "
            "processor)",
            field=f"{field}.max_pixels",
            limit=config.frame_max_pixels,
        )


def _max_frames(config: VideoConfig, limits: VideoLimits, req: VideoRequest) -> int:
    return min(req.max_frames or config.max_frames, limits.max_frames)


def sample_indices(
    total_frames: int, video_fps: float, fps: float, min_frames: int, max_frames: int
) -> list[int]:
    """qwen-vl-utils' frame choice: ``smart_nframes`` then ``linspace(...).round()``.

    A source of fewer frames than the temporal patch size (2) keeps all of them (the caller
    pads): ``smart_nframes`` would refuse it, while its list-of-frames path pads, and a
    one-frame video (case C16) is better answered than refused.
    """
    import torch
    from qwen_vl_utils.vision_process import FRAME_FACTOR, smart_nframes

    if total_frames < FRAME_FACTOR:
        return list(range(total_frames))
    n = smart_nframes(
        {"fps": fps, "min_frames": min_frames, "max_frames": max_frames}, total_frames, video_fps
    )
    return [int(i) for i in torch.linspace(0, total_frames - 1, n).round().long().tolist()]


def plan_video(
    height: int,
    width: int,
    frames: int,
    spec: VisionSpec,
    config: VideoConfig,
    *,
    index: int,
    max_pixels: int = 0,
) -> ResizePlan:
    """Resize plan of every frame of a video of ``frames`` frames (already padded).

    qwen-vl-utils' ``fetch_video`` bounds: ``max_pixels = max(min(frame_max_pixels,
    total_pixels / frames * 2), int(frame_min_pixels * 1.05))``, lowered to the request's
    ``max_pixels``; then its ``smart_resize`` with ``factor = 2 * patch_size``.

    Raises:
        ServiceError: INVALID_ARGUMENT ``VIDEO_ASPECT_RATIO_TOO_LARGE`` past 200.
    """
    from qwen_vl_utils.vision_process import FRAME_FACTOR, MAX_RATIO, smart_resize

    ratio = max(height, width) / max(1, min(height, width))
    if ratio > MAX_RATIO:
        raise Refusal.VIDEO_ASPECT_RATIO_TOO_LARGE.error(
            f"{_field(index)} is {width}x{height}: aspect ratio {ratio:.1f} exceeds the limit "
            f"of {MAX_RATIO}",
            field=_field(index),
            limit=MAX_RATIO,
        )
    lo = config.frame_min_pixels
    hi = max(
        min(config.frame_max_pixels, config.total_pixels / frames * FRAME_FACTOR), int(lo * 1.05)
    )
    if max_pixels:
        hi = min(hi, max_pixels)
    rh, rw = smart_resize(height, width, factor=spec.factor, min_pixels=lo, max_pixels=hi)
    grid_t = frames // spec.temporal_patch_size
    grid_h, grid_w = rh // spec.patch_size, rw // spec.patch_size
    return ResizePlan(
        resized_height=rh,
        resized_width=rw,
        grid_t=grid_t,
        grid_h=grid_h,
        grid_w=grid_w,
        tokens=spec.tokens(grid_t, grid_h, grid_w),
    )


def _pad(indices: list[int], times: list[float], multiple: int) -> tuple[list[int], list[float]]:
    """Repeat the last frame up to a multiple of the temporal patch size (qwen-vl-utils'
    list-of-frames path and transformers' ``patchify`` both pad this way)."""
    pad = -len(indices) % multiple
    return indices + [indices[-1]] * pad, times + [times[-1]] * pad


def _key(digest: hashlib._Hash, sampling: SamplingPlan, plan: ResizePlan, revision: str) -> str:
    digest.update(
        f"\0{sampling.source_frames}\0{sampling.indices}\0"
        f"{[round(t, 6) for t in sampling.timestamps]}\0"
        f"{plan.resized_height}x{plan.resized_width}\0{plan.grid}\0{revision}\0".encode()
    )
    return digest.hexdigest()


def _rotate(rgb: np.ndarray, rotation: float) -> np.ndarray:
    """Turn a frame as its display matrix says (FFmpeg's ``av_display_rotation_get``: degrees
    counterclockwise), the way ffmpeg's autorotate and players show it (case C15)."""
    k = round(rotation / 90) % 4
    return np.ascontiguousarray(np.rot90(rgb, k)) if k else rgb


def _open(data: bytes, limits: VideoLimits, index: int) -> Any:
    """The PyAV container over ``data``. Raises RESOURCE_EXHAUSTED ``VIDEO_BYTES_TOO_LARGE``,
    INVALID_ARGUMENT ``VIDEO_UNDECODABLE`` (empty, or not a container FFmpeg reads)."""
    import av

    check_bytes(
        data,
        item="video",
        field=_field(index),
        limit=limits.max_bytes,
        where=" (GATEWAY_MAX_VIDEO_BYTES)",
    )
    if not data:
        raise _undecodable(index, "the file is empty")
    try:
        return av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise _undecodable(index, f"not a video container FFmpeg can read ({exc})") from exc


def _video_stream(container: Any, index: int) -> Any:
    """The first video stream. Raises INVALID_ARGUMENT ``VIDEO_NO_VIDEO_STREAM``, or
    ``VIDEO_IS_AN_IMAGE`` when FFmpeg read a still image."""
    field = _field(index)
    streams = [s for s in container.streams if s.type == "video"]
    if not streams:
        kinds = sorted({str(s.type) for s in container.streams}) or ["none"]
        raise Refusal.VIDEO_NO_VIDEO_STREAM.error(
            f"{field} has no video stream (streams: {', '.join(kinds)})", field=field
        )
    fmt = container.format.name
    if fmt.endswith("_pipe"):
        # FFmpeg's image demuxers (png_pipe, jpeg_pipe, ...) read a photo as a one-frame video.
        kind = fmt.removesuffix("_pipe").upper()  # an animated GIF ("gif") stays a video
        raise Refusal.VIDEO_IS_AN_IMAGE.error(
            f"{field} is a still image ({kind}), not a video; send it as an image part", field=field
        )
    return streams[0]


def _demux(
    container: Any, stream: Any, limits: VideoLimits, index: int, check: Check
) -> tuple[list[tuple[int, bool]], list[float], float, float]:
    """Demux without decoding (``check`` every 256 packets): sorted ``(pts, is_keyframe)`` and
    time (s from the first) of each frame, duration (s), rate (fps). Raises INVALID_ARGUMENT
    ``VIDEO_TRUNCATED``, RESOURCE_EXHAUSTED ``VIDEO_TOO_LONG``, ``VIDEO_FRAME_TOO_LARGE``."""
    import av

    field, time_base = _field(index), float(stream.time_base or 0) or 1e-6
    packets: list[tuple[int, bool]] = []
    demux_error = ""
    try:
        for packet in container.demux(stream):
            if packet.size and packet.pts is not None:
                packets.append((int(packet.pts), bool(packet.is_keyframe)))
            if len(packets) % 256 == 0:
                check()
    except av.FFmpegError as exc:
        demux_error = str(exc)
    packets.sort()
    listed, total = int(stream.frames or 0), len(packets)
    if demux_error or not packets or (listed and total < listed):
        detail = f" ({demux_error})" if demux_error else ""
        raise _truncated(index, f"its index lists {listed} frames, {total} could be read{detail}")
    times = [(pts - packets[0][0]) * time_base for pts, _ in packets]
    duration = times[-1] + ((times[-1] / (total - 1)) if total > 1 else 0.0)
    if duration > limits.max_duration_s:
        raise Refusal.VIDEO_TOO_LONG.error(
            f"{field} lasts {duration:.1f} s; the limit is {limits.max_duration_s:g} s "
            "(GATEWAY_MAX_VIDEO_DURATION_S)",
            field=field,
            limit=limits.max_duration_s,
        )
    rate = stream.average_rate or stream.guessed_rate
    video_fps = float(rate) if rate else (total / duration if duration > 0 else 1.0)
    width, height = stream.codec_context.width, stream.codec_context.height
    if width * height > limits.max_decoded_pixels:
        raise Refusal.VIDEO_FRAME_TOO_LARGE.error(
            f"{field} has {width}x{height} frames ({width * height} pixels); the limit is "
            f"{limits.max_decoded_pixels} per frame (GATEWAY_VIDEO_MAX_DECODED_PIXELS)",
            field=field,
            limit=limits.max_decoded_pixels,
        )
    return packets, times, duration, video_fps


class _Cursor:
    """Decodes a stream forward to kept frames (increasing indices into ``packets``), seeking
    to a frame's key frame only when that lies past the next frame, or the frame was passed."""

    def __init__(self, container: Any, stream: Any, packets: list[tuple[int, bool]]) -> None:
        self._container, self._stream, self._packets = container, stream, packets
        self._keyframes = [i for i, (_, key) in enumerate(packets) if key] or [0]
        self._frames: Any = None  # the decoder's frames since the last seek
        self._position = -1  # index of the last frame decoded
        self.produced = 0  # frames the codec produced: the cost of sampling

    def upright(self, target: int, index: int, check: Check) -> np.ndarray:
        """Frame ``target`` upright, uint8 RGB ``[height, width, 3]``; ``check`` runs first and
        between frames. Raises INVALID_ARGUMENT ``VIDEO_TRUNCATED`` if the stream ends first."""
        check()
        keyframes, packets = self._keyframes, self._packets
        key_index = keyframes[max(0, bisect.bisect_right(keyframes, target) - 1)]
        if self._frames is None or self._position < key_index - 1 or self._position >= target:
            self._container.seek(packets[key_index][0], stream=self._stream, backward=True)
            self._frames = self._container.decode(self._stream)
            self._position = key_index - 1
        target_pts = packets[target][0]
        for frame in self._frames:
            self.produced += 1
            if frame.pts is None:
                continue
            self._position = bisect.bisect_left(packets, (int(frame.pts), False))
            if frame.pts >= target_pts:
                return _rotate(frame.to_ndarray(format="rgb24"), float(frame.rotation or 0))
            check()
        raise _truncated(index, f"frame {target} of {len(packets)} did not decode")


def _resize(
    frames: Iterable[np.ndarray],
    sampling: SamplingPlan,
    spec: VisionSpec,
    config: VideoConfig,
    request: VideoRequest,
    max_tokens: int | None,
    index: int,
) -> tuple[list[np.ndarray], ResizePlan, hashlib._Hash]:
    """Plan from the first frame, hash (upright, unresized) and resize each as it comes, so
    only resized frames stay in memory: uint8 ``[resized_height, resized_width, 3]`` each,
    the plan, the key's digest. Raises as :func:`plan_video`, RESOURCE_EXHAUSTED
    ``VIDEO_TOKENS_TOO_MANY``, INVALID_ARGUMENT ``VIDEO_FRAME_SIZE_MISMATCH``."""
    resized: list[np.ndarray] = []
    plan: ResizePlan | None = None
    first_shape: tuple[int, ...] = ()
    digest = hashlib.sha256(KEY_VERSION)
    for rgb in frames:
        if plan is None:
            h, w = rgb.shape[:2]
            n = len(sampling.indices)
            plan = plan_video(h, w, n, spec, config, index=index, max_pixels=request.max_pixels)
            if max_tokens is not None and plan.tokens > max_tokens:
                raise Refusal.VIDEO_TOKENS_TOO_MANY.error(
                    f"{_field(index)} needs {plan.tokens} video tokens (grid {list(plan.grid)}); "
                    f"the request has {max_tokens} left of GATEWAY_MAX_VIDEO_TOKENS: lower "
                    "sample_fps, max_frames or max_pixels",
                    field=_field(index),
                    limit=max_tokens,
                )
            digest.update(f"{h}x{w}\0".encode())
        elif rgb.shape[:2] != first_shape:
            raise Refusal.VIDEO_FRAME_SIZE_MISMATCH.error(
                f"{_field(index)} changes frame size mid-stream ({first_shape} to "
                f"{rgb.shape[:2]}); splitvl takes videos of one frame size",
                field=_field(index),
            )
        first_shape = rgb.shape[:2]
        digest.update(rgb.tobytes())
        resized.append(resize_to_plan(rgb, plan).permute(1, 2, 0).numpy())
        del rgb  # before the next frame decodes
    assert plan is not None  # a video keeps at least one frame
    return resized, plan, digest


def decode_video(
    data: bytes,
    *,
    index: int,
    spec: VisionSpec,
    config: VideoConfig,
    limits: VideoLimits,
    request: VideoRequest,
    revision: str,
    check: Check | None = None,
    max_tokens: int | None = None,
) -> DecodedVideo:
    """Demux, sample, decode (only the kept frames), rotate upright and resize one file.

    Args:
        data: The encoded file.
        index: The video's position among the request's videos (for messages).
        check: Called between frames; raises to stop (a cancelled or expired request).
        max_tokens: Video tokens this video may have (what the request's budget has left);
            checked once the first kept frame gives the plan, before the others decode.

    Raises:
        ServiceError: INVALID_ARGUMENT ``VIDEO_UNDECODABLE`` (empty, or not a container
            FFmpeg reads), ``VIDEO_NO_VIDEO_STREAM`` (e.g. audio only, case C18),
            ``VIDEO_IS_AN_IMAGE`` (a still image FFmpeg reads as one frame: PNG, JPEG, WebP,
            ...), ``VIDEO_TRUNCATED`` (the index lists frames the file does not hold, or a
            kept frame does not decode, case C17), ``VIDEO_ASPECT_RATIO_TOO_LARGE``,
            ``VIDEO_FRAME_SIZE_MISMATCH``; RESOURCE_EXHAUSTED ``VIDEO_BYTES_TOO_LARGE``,
            ``VIDEO_TOO_LONG``, ``VIDEO_FRAME_TOO_LARGE`` (naming the GATEWAY_* limit),
            ``VIDEO_TOKENS_TOO_MANY``; what ``check`` raises.
    """
    import av

    check = check or (lambda: None)
    with _open(data, limits, index) as container:
        stream = _video_stream(container, index)
        fmt, codec = container.format.name, stream.codec_context.name
        packets, times, duration, video_fps = _demux(container, stream, limits, index, check)
        fps, max_frames = request.sample_fps or config.fps, _max_frames(config, limits, request)
        kept = sample_indices(len(packets), video_fps, fps, config.min_frames, max_frames)
        indices, stamps = _pad(kept, [times[i] for i in kept], spec.temporal_patch_size)
        sampling = SamplingPlan(len(packets), video_fps, tuple(indices), tuple(stamps))
        targets = sorted(set(kept))
        cursor = _Cursor(container, stream, packets)
        frames = (cursor.upright(target, index, check) for target in targets)
        try:
            out, plan, digest = _resize(frames, sampling, spec, config, request, max_tokens, index)
        except av.FFmpegError as exc:
            raise _truncated(index, f"decoding failed ({exc})") from exc
    by_index = dict(zip(targets, out, strict=True))
    return DecodedVideo(
        frames=np.stack([by_index[i] for i in indices]),
        plan=plan,
        sampling=sampling,
        key=_key(digest, sampling, plan, revision),
        container=fmt,
        codec=codec,
        duration_s=duration,
        frames_decoded=cursor.produced,
    )


def frames_video(
    images: list[np.ndarray],
    *,
    index: int,
    fps: float,
    spec: VisionSpec,
    config: VideoConfig,
    request: VideoRequest,
    revision: str,
    max_tokens: int | None = None,
) -> DecodedVideo:
    """A video given as decoded frames (VideoInput.frames): all kept, padded to 2.

    Timestamps are ``i / fps`` (fps 0: qwen-vl-utils' default sample_fps, 2).

    Raises:
        ServiceError: INVALID_ARGUMENT ``VIDEO_FRAME_SIZE_MISMATCH`` when the frames differ
            in size, ``VIDEO_TOO_FEW_FRAMES`` when there is none.
    """
    field = _field(index)
    check_frames_present(len(images), field)
    h, w = images[0].shape[:2]
    for j, im in enumerate(images):
        if im.shape[:2] != (h, w):
            raise Refusal.VIDEO_FRAME_SIZE_MISMATCH.error(
                f"{field}.frames[{j}] is {im.shape[1]}x{im.shape[0]}; frames[0] is {w}x{h}: "
                "every frame of a video must have one size",
                field=f"{field}.frames[{j}]",
            )
    rate = fps or DEFAULT_FRAMES_FPS
    kept = list(range(len(images)))
    indices, stamps = _pad(kept, [i / rate for i in kept], spec.temporal_patch_size)
    sampling = SamplingPlan(len(images), rate, tuple(indices), tuple(stamps))
    frames = (images[i] for i in indices)  # the padding too, hashed as sent
    out, plan, digest = _resize(frames, sampling, spec, config, request, max_tokens, index)
    return DecodedVideo(
        frames=np.stack(out),
        plan=plan,
        sampling=sampling,
        key=_key(digest, sampling, plan, revision),
        duration_s=len(images) / rate,
    )


def live_check(stop: threading.Event, deadline: Deadline, index: int) -> Check:
    """A ``check`` for :func:`decode_video`: :meth:`Deadline.check` raises CANCELLED once
    ``stop`` is set, DEADLINE_EXCEEDED ("... while videos[i] was decoded") once past."""
    what = f"{_field(index)} was decoded"
    return lambda: deadline.check(stop, what)
