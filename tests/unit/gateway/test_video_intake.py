"""Video intake (gateway/video.py): sampling equal to qwen-vl-utils, cases C14-C19, limits.

No service is started: these call the gateway's decode functions on real files made with
PyAV from scikit-image's photos, and on the case files in ../shared/cases.
"""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image

from gateway.video import VideoLimits, VideoRequest, check_request, decode_video, frames_video
from gateway.video_config import VideoConfig, load_video_config
from splitvl.video_clips import encode_clip, pan_clip, pan_frames, zoom_clip
from tests.conftest import case_file as case
from vlcommon.errors import ServiceError
from vlcommon.model_info import load_vision_spec

LIMITS = VideoLimits(
    max_bytes=64 << 20,
    max_duration_s=600.0,
    max_frames=768,
    max_fps=10.0,
    max_decoded_pixels=40_000_000,
)


@pytest.fixture(scope="module")
def spec(tiny_model: Path):  # type: ignore[no-untyped-def]
    return load_vision_spec(tiny_model)


@pytest.fixture(scope="module")
def config(tiny_model: Path, spec) -> VideoConfig:  # type: ignore[no-untyped-def]
    return load_video_config(tiny_model, spec)


def decode(data: bytes, spec, config, request=None, limits=LIMITS):  # type: ignore[no-untyped-def]
    return decode_video(
        data,
        index=0,
        spec=spec,
        config=config,
        limits=limits,
        request=request or VideoRequest(),
        revision="r",
    )


def refused(data: bytes, spec, config, **kw) -> ServiceError:  # type: ignore[no-untyped-def]
    with pytest.raises(ServiceError) as info:
        decode(data, spec, config, **kw)
    assert info.value.code != grpc.StatusCode.INTERNAL
    return info.value


def test_config_comes_from_the_checkpoints_video_processor(config: VideoConfig) -> None:
    # splitvl.tiny_model's video processor: size {shortest 4096, longest 4 * 65536}, fps 2.
    assert (config.fps, config.min_frames, config.max_frames) == (2.0, 4, 768)
    assert (config.frame_min_pixels, config.total_pixels) == (4096, 262144)
    assert config.frame_max_pixels == 768 * 32 * 32


def _read_video_with_pyav(path, start_pts=0.0, end_pts=None, pts_unit="sec", output_format="TCHW"):  # type: ignore[no-untyped-def]
    """torchvision.io.read_video as torchvision < 0.24 had it (all frames through PyAV,
    ``info["video_fps"]`` the stream's average rate): qwen-vl-utils' fallback reader calls
    it, and torchvision 0.28 no longer ships it (decord and torchcodec are absent here)."""
    import av
    import torch

    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(stream)]
        fps = float(stream.average_rate)
    video = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2)
    return video, torch.empty(0), {"video_fps": fps}


@pytest.mark.parametrize(
    ("clip", "fps_request"),
    [
        (lambda: pan_clip("astronaut.png", seconds=3.2, fps=10, size=(96, 128)), 0.0),
        (lambda: zoom_clip("chelsea.png", seconds=2.5, fps=24, size=(120, 160)), 0.0),
        (lambda: pan_clip("coffee.png", seconds=6.0, fps=8, size=(72, 96)), 1.0),
    ],
)
def test_sampling_equals_qwen_vl_utils_fetch_video(
    clip, fps_request, spec, config, tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    import torchvision.io
    from qwen_vl_utils import vision_process

    monkeypatch.setattr(torchvision.io, "read_video", _read_video_with_pyav, raising=False)
    monkeypatch.setattr(vision_process, "get_video_reader_backend", lambda: "torchvision")
    data = clip()
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    fps = fps_request or config.fps
    ele = {
        "video": str(path),
        "fps": fps,
        "min_frames": config.min_frames,
        "max_frames": config.max_frames,
        "min_pixels": config.frame_min_pixels,
        "total_pixels": config.total_pixels,
    }
    ref, meta = vision_process.fetch_video(
        ele, image_patch_size=spec.patch_size, return_video_metadata=True
    )
    ours = decode(data, spec, config, VideoRequest(sample_fps=fps_request))
    ref_indices = [int(i) for i in meta["frames_indices"]]
    assert list(ours.sampling.indices) == ref_indices
    assert ours.sampling.source_frames == meta["total_num_frames"]
    assert ours.sampling.timestamps == pytest.approx([i / meta["fps"] for i in ref_indices])
    assert ours.frames.shape[1:3] == tuple(ref.shape[-2:])
    assert ours.plan.grid == (len(ref_indices) // 2, ref.shape[-2] // 16, ref.shape[-1] // 16)
    # Same decoder, same bicubic antialiased resize: the pixels agree within one level
    # (qwen-vl-utils resizes the stacked clip with torchvision's v1 resize, splitvl each
    # frame with v2, as its image path does; a few pixels round the other way).
    ref_hwc = ref.permute(0, 2, 3, 1).round().numpy().astype(np.int16)
    diff = np.abs(ours.frames.astype(np.int16) - ref_hwc)
    assert diff.max() <= 1
    assert (diff == 0).mean() > 0.99


def test_c15_rotated_clip_is_upright(spec, config) -> None:  # type: ignore[no-untyped-def]
    video = decode(case("c15_rotated90_stored480x270.mp4").read_bytes(), spec, config)
    h, w = video.frames.shape[1:3]
    assert h > w  # portrait, as viewers show it
    assert (video.plan.resized_height, video.plan.resized_width) == (h, w)
    assert video.plan.grid[1:] == (h // 16, w // 16)


def test_display_rotation_turns_pixels_as_a_viewer_does(spec, config) -> None:  # type: ignore[no-untyped-def]
    stored = np.zeros((64, 128, 3), np.uint8)
    stored[:32, :, 0] = 255  # red top half, stored landscape
    data = encode_clip([stored] * 4, fps=4, rotation=90)  # 90 degrees counterclockwise
    video = decode(data, spec, config)
    frame = video.frames[0].astype(int)
    assert frame.shape[:2] == (128, 64)
    # Turned counterclockwise: the stored top is now the left half.
    assert frame[:, :24, 0].mean() > 200 and frame[:, 40:, 0].mean() < 60


def test_c16_one_frame_is_padded_and_answered(spec, config) -> None:  # type: ignore[no-untyped-def]
    video = decode(case("c16_one_frame.mp4").read_bytes(), spec, config)
    assert video.sampling.source_frames == 1
    assert video.sampling.indices == (0, 0)
    assert video.sampling.timestamps == (0.0, 0.0)
    assert video.plan.grid_t == 1
    np.testing.assert_array_equal(video.frames[0], video.frames[1])


def test_c14_frames_below_the_temporal_patch_are_padded(spec, config) -> None:  # type: ignore[no-untyped-def]
    frames = pan_frames("astronaut.png", 3, (64, 64))
    video = frames_video(
        frames, index=0, fps=4.0, spec=spec, config=config, request=VideoRequest(), revision="r"
    )
    assert video.sampling.indices == (0, 1, 2, 2)
    assert video.sampling.timestamps == (0.0, 0.25, 0.5, 0.5)
    assert video.patch_timestamps == [0.125, 0.5]
    one = frames_video(
        frames[:1], index=0, fps=0, spec=spec, config=config, request=VideoRequest(), revision="r"
    )
    assert one.plan.grid_t == 1 and one.frames.shape[0] == 2


def test_c17_truncated_is_invalid_argument(spec, config) -> None:  # type: ignore[no-untyped-def]
    err = refused(case("c17_truncated.mp4").read_bytes(), spec, config)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.reason == "VIDEO_TRUNCATED"
    assert "videos[0] is truncated" in str(err)


def test_truncation_of_a_clean_clip_anywhere_is_invalid_argument(spec, config) -> None:  # type: ignore[no-untyped-def]
    data = pan_clip("astronaut.png", seconds=2, fps=10, size=(64, 64))
    for cut in (len(data) // 3, len(data) * 2 // 3, len(data) - 200, 100, 8):
        err = refused(data[:cut], spec, config)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT, cut
        assert err.reason in ("VIDEO_TRUNCATED", "VIDEO_UNDECODABLE"), cut


def test_c18_audio_only_has_no_video_stream(spec, config) -> None:  # type: ignore[no-untyped-def]
    err = refused(case("c18_audio_only.mp4").read_bytes(), spec, config)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.reason == "VIDEO_NO_VIDEO_STREAM"
    assert "videos[0] has no video stream (streams: audio)" in str(err)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_a_still_image_as_a_video_is_refused_by_name(spec, config, fmt) -> None:  # type: ignore[no-untyped-def]
    """FFmpeg reads a PNG as a one-frame video; it was served as one."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 40, 40)).save(out, fmt)
    err = refused(out.getvalue(), spec, config)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.reason == "VIDEO_IS_AN_IMAGE"
    assert f"videos[0] is a still image ({fmt}), not a video" in str(err)


def test_c19_long_clip_within_budgets(spec, config) -> None:  # type: ignore[no-untyped-def]
    data = case("c19_long_5min_1fps.mp4").read_bytes()
    video = decode(data, spec, config, VideoRequest(max_frames=64))
    n = video.frames.shape[0]
    assert n == 64
    # linspace over 300 frames at 1 fps: the real times of the kept frames.
    expected = np.linspace(0, 299, 64).round()
    assert video.sampling.timestamps == pytest.approx(list(expected))
    per_frame = video.plan.resized_height * video.plan.resized_width
    assert per_frame <= max(config.total_pixels / n * 2, config.frame_min_pixels * 1.05)
    assert video.duration_s == pytest.approx(300.0)
    short = VideoLimits(**{**LIMITS.__dict__, "max_duration_s": 120.0})
    err = refused(data, spec, config, limits=short)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.reason == "VIDEO_TOO_LONG"
    assert "120 s" in str(err) and "GATEWAY_MAX_VIDEO_DURATION_S" in str(err)
    small = VideoLimits(**{**LIMITS.__dict__, "max_bytes": len(data) - 1})
    err = refused(data, spec, config, limits=small)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.reason == "VIDEO_BYTES_TOO_LARGE"


def test_variable_frame_rate_keeps_real_times(spec, config) -> None:  # type: ignore[no-untyped-def]
    frames = pan_frames("rocket.jpg", 8, (64, 64))
    pts = [0, 100, 150, 400, 450, 900, 1000, 1500]  # milliseconds, irregular
    data = encode_clip(frames, fps=8, pts=pts, time_base=Fraction(1, 1000), container="matroska")
    video = decode(data, spec, config, VideoRequest(max_frames=8, sample_fps=10))
    assert video.sampling.indices == tuple(range(8))
    assert video.sampling.timestamps == pytest.approx([p / 1000 for p in pts])


def test_frame_pixels_and_overrides_are_bounded(spec, config) -> None:  # type: ignore[no-untyped-def]
    data = pan_clip("astronaut.png", seconds=1, fps=4, size=(64, 96))
    tight = VideoLimits(**{**LIMITS.__dict__, "max_decoded_pixels": 64 * 96 - 1})
    err = refused(data, spec, config, limits=tight)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.reason == "VIDEO_FRAME_TOO_LARGE"
    for req, reason in (
        (VideoRequest(sample_fps=11), "VIDEO_FPS_OUT_OF_RANGE"),
        (VideoRequest(sample_fps=-1), "VIDEO_FPS_OUT_OF_RANGE"),
        (VideoRequest(max_frames=769), "VIDEO_MAX_FRAMES_OUT_OF_RANGE"),
        (VideoRequest(max_pixels=100), "VIDEO_MAX_PIXELS_OUT_OF_RANGE"),
    ):
        with pytest.raises(ServiceError) as info:
            check_request(req, config, LIMITS, "messages[0].parts[0].video")
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.reason == reason
    small = decode(data, spec, config, VideoRequest(max_pixels=4096))
    assert small.plan.resized_height * small.plan.resized_width <= 4096


def test_images_and_junk_sent_as_video_never_internal(spec, config) -> None:  # type: ignore[no-untyped-def]
    png = io.BytesIO()
    Image.fromarray(pan_frames("astronaut.png", 1, (64, 64))[0]).save(png, format="PNG")
    # A PNG is a one-frame video to FFmpeg; it was served as one, now refused by name.
    assert refused(png.getvalue(), spec, config).reason == "VIDEO_IS_AN_IMAGE"
    frames = [Image.fromarray(f) for f in pan_frames("chelsea.png", 6, (64, 64))]
    animated = io.BytesIO()
    frames[0].save(animated, format="GIF", save_all=True, append_images=frames[1:], duration=100)
    video = decode(animated.getvalue(), spec, config)
    assert video.sampling.source_frames == 6
    for junk in (b"", b"not a video at all" * 10, case("b07_truncated.jpg").read_bytes()[:50]):
        err = refused(junk, spec, config)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT


def test_stop_check_interrupts_decoding(spec, config) -> None:  # type: ignore[no-untyped-def]
    data = case("c19_long_5min_1fps.mp4").read_bytes()
    calls = []

    def check() -> None:
        calls.append(1)
        if len(calls) > 3:
            raise ServiceError(grpc.StatusCode.CANCELLED, "CANCELLED", "the request was cancelled")

    with pytest.raises(ServiceError) as info:
        decode_video(
            data,
            index=0,
            spec=spec,
            config=config,
            limits=LIMITS,
            request=VideoRequest(),
            revision="r",
            check=check,
        )
    assert info.value.code == grpc.StatusCode.CANCELLED


def test_key_follows_frames_plan_and_revision(spec, config) -> None:  # type: ignore[no-untyped-def]
    data = pan_clip("astronaut.png", seconds=2, fps=10, size=(64, 64))
    a = decode(data, spec, config)
    assert decode(data, spec, config).key == a.key
    assert decode(data, spec, config, VideoRequest(sample_fps=4)).key != a.key
    other = decode_video(
        data,
        index=0,
        spec=spec,
        config=config,
        limits=LIMITS,
        request=VideoRequest(),
        revision="other",
    )
    assert other.key != a.key
    zoom = decode(zoom_clip("astronaut.png", seconds=2, fps=10, size=(64, 64)), spec, config)
    assert zoom.key != a.key


def test_cli_sends_images_and_videos_in_command_line_order(tmp_path) -> None:
    from qwenvl.gateway.v1 import gateway_service_pb2 as pb

    from splitvl import cli
    from splitvl.client import build_request

    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"not decoded by the client")
    png = tmp_path / "a.png"
    png.write_bytes(b"png bytes")
    argv = ["generate", "--image", str(png), "--video", str(clip), "--image", "https://h/b.png"]
    argv += ["--video", "https://h/c.mp4", "--fps", "1.5", "--max-frames", "8", "--prompt", "hi"]
    args = cli.build_parser().parse_args(argv)
    parts = build_request(cli.media_parts(args), args.prompt).messages[0].parts
    assert [p.WhichOneof("part") for p in parts] == ["image", "video", "image", "video", "text"]
    assert parts[1].video == pb.VideoInput(
        file=pb.VideoFile(data=b"not decoded by the client"), sample_fps=1.5, max_frames=8
    )
    assert parts[3].video.file.url == "https://h/c.mp4"
    assert parts[2].image.url == "https://h/b.png"
    missing = cli.build_parser().parse_args(["generate", "--video", "/nope.mp4", "--prompt", "x"])
    assert cli.cmd_generate(missing) == 2


def test_only_the_gops_of_kept_frames_are_decoded(spec, config) -> None:  # type: ignore[no-untyped-def]
    # 60 frames, a key frame every 5: keeping 4 frames decodes at most 4 GOPs' heads.
    data = pan_clip("astronaut.png", seconds=6.0, fps=10, size=(64, 64), gop=5)
    video = decode(data, spec, config, VideoRequest(max_frames=4, sample_fps=0.5))
    assert video.sampling.source_frames == 60
    assert video.sampling.indices == (0, 20, 39, 59)
    assert video.frames_decoded <= 4 * 5
    every = decode(data, spec, config, VideoRequest(max_frames=60, sample_fps=10))
    assert every.frames_decoded == 60  # one pass, no seek back


def test_a_video_over_the_token_budget_stops_at_its_first_frame(spec, config) -> None:  # type: ignore[no-untyped-def]
    data = pan_clip("astronaut.png", seconds=6.0, fps=10, size=(64, 64), gop=5)
    full = decode(data, spec, config)
    with pytest.raises(ServiceError) as info:
        decode_video(
            data,
            index=1,
            spec=spec,
            config=config,
            limits=LIMITS,
            request=VideoRequest(),
            revision="r",
            max_tokens=full.plan.tokens - 1,
        )
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.reason == "VIDEO_TOKENS_TOO_MANY"
    assert f"videos[1] needs {full.plan.tokens} video tokens" in str(info.value)
    exact = decode_video(
        data,
        index=1,
        spec=spec,
        config=config,
        limits=LIMITS,
        request=VideoRequest(),
        revision="r",
        max_tokens=full.plan.tokens,
    )
    assert exact.key == full.key


@pytest.mark.parametrize(
    ("fps", "seconds", "size"), [(10, 3.0, (96, 128)), (12, 2.5, (112, 144)), (30, 4.0, (64, 64))]
)
def test_patch_timestamps_are_the_processors_to_the_last_bit(  # type: ignore[no-untyped-def]
    tiny_model: Path, spec, config, fps: int, seconds: float, size: tuple[int, int]
) -> None:
    """The ``<t seconds>`` text must be the processor's: a 10 fps clip's presentation
    times made ``<1.5 seconds>`` where transformers and vLLM write ``<1.4 seconds>``
    (found by the MoE equality test: the answer changed)."""
    from transformers import AutoProcessor

    from gateway.video import VideoLimits, VideoRequest, decode_video
    from splitvl.video_clips import pan_clip

    clip = pan_clip("astronaut.png", seconds=seconds, fps=fps, size=size)
    video = decode_video(
        clip,
        index=0,
        spec=spec,
        config=config,
        limits=VideoLimits(1 << 30, 600.0, 768, 8.0, 8_294_400),
        request=VideoRequest(),
        revision="",
    )
    processor = AutoProcessor.from_pretrained(tiny_model)
    merge = len(video.sampling.indices) // video.plan.grid_t
    expected = processor._calculate_timestamps(
        list(video.sampling.indices), video.sampling.video_fps, merge
    )
    assert video.patch_timestamps == expected
    assert [f"{t:.1f}" for t in video.patch_timestamps] == [f"{t:.1f}" for t in expected]
