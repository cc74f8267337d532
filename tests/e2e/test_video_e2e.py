"""Videos end to end: the four services against transformers and vLLM on the same frames.

Clips are made here with PyAV from scikit-image's photos (a pan, a zoom); the reference
frames are the gateway's own sampling of the same file (gateway.video.decode_video, whose
indices, times and sizes equal qwen-vl-utils' fetch_video: tests/unit/gateway/test_video_intake.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from PIL import Image
from qwenvl.gateway.v1 import gateway_service_pb2 as gpb

from gateway.video import VideoLimits, VideoRequest, decode_video
from gateway.video_config import load_video_config
from splitvl.client import build_request, generate
from splitvl.video_clips import pan_clip, zoom_clip
from tests.conftest import case_file, photo, rgb
from tests.e2e.test_e2e import metric
from vlcommon.imaging import plan_resize, resize_to_plan
from vlcommon.model_info import load_vision_spec

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
PROMPT = "What happens in this video?"
MAX_TOKENS = 16


def clips() -> dict[str, bytes]:
    return {
        "pan": pan_clip("astronaut.png", seconds=3.0, fps=10, size=(96, 128)),
        "zoom": zoom_clip("chelsea.png", seconds=2.5, fps=12, size=(112, 144)),
    }


def video_part(data: bytes) -> gpb.VideoInput:
    return gpb.VideoInput(file=gpb.VideoFile(data=data))


def sampled(tiny_model: Path, data: bytes):  # type: ignore[no-untyped-def]
    spec = load_vision_spec(tiny_model)
    return decode_video(
        data,
        index=0,
        spec=spec,
        config=load_video_config(tiny_model, spec),
        limits=VideoLimits(1 << 30, 600.0, 768, 8.0, 8_294_400),
        request=VideoRequest(),
        revision="",
    )


def chat(tiny_model: Path, kinds: list[str], text: str = PROMPT) -> str:
    """The checkpoint's chat template over one user turn: ``kinds`` placeholders
    ("image", "video") in order, then ``text``."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_model)
    content = [{"type": k} for k in kinds] + [{"type": "text", "text": text}]
    return proc.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


def metadata(video) -> dict:  # type: ignore[no-untyped-def]
    s = video.sampling
    return {
        "fps": s.video_fps,
        "frames_indices": list(s.indices),
        "total_num_frames": s.source_frames,
        "duration": video.duration_s,
        "do_sample_frames": False,
    }


def test_equality_transformers_vllm_raw_and_services(cluster, tiny_model, tmp_path) -> None:
    """Greedy float32, eos ignored: transformers generate on the sampled frames (with their
    metadata, do_sample_frames=False) = vLLM on the same frames = the four services, for
    two clips and for one prompt holding an image and a video."""
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration
    from transformers.video_utils import VideoMetadata

    files = clips()
    videos = {name: sampled(tiny_model, data) for name, data in files.items()}
    spec = load_vision_spec(tiny_model)
    # The image as the gateway plans and resizes it (the checkpoint's own smart_resize and
    # bicubic resize: bit-identical to the processor's), so do_resize=False keeps it.
    image = rgb("coffee.png")
    plan = plan_resize(image.height, image.width, spec, index=0)
    image_resized = Image.fromarray(resize_to_plan(image, plan).permute(1, 2, 0).numpy())
    image_path = tmp_path / "coffee_resized.png"
    image_resized.save(image_path)
    jobs = [
        {"kinds": ["video"], "videos": ["pan"], "image": False},
        {"kinds": ["video"], "videos": ["zoom"], "image": False},
        {"kinds": ["image", "video"], "videos": ["zoom"], "image": True},
    ]

    # (a) transformers generate on the sampled frames.
    proc = AutoProcessor.from_pretrained(tiny_model)
    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_model, dtype=torch.float32)
    hf = []
    for job in jobs:
        vs = [videos[n] for n in job["videos"]]
        inputs = proc(
            text=[chat(tiny_model, job["kinds"])],
            images=[image_resized] if job["image"] else None,
            videos=[torch.from_numpy(v.frames).permute(0, 3, 1, 2) for v in vs],
            video_metadata=[
                VideoMetadata(
                    total_num_frames=v.sampling.source_frames,
                    fps=v.sampling.video_fps,
                    frames_indices=list(v.sampling.indices),
                )
                for v in vs
            ],
            do_sample_frames=False,
            do_resize=False,
            return_tensors="pt",
        )
        assert [list(g) for g in inputs["video_grid_thw"].tolist()] == [
            list(v.plan.grid) for v in vs
        ]
        with torch.inference_mode():
            out = model.generate(
                **inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False
            )
        hf.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    del model

    # (b) vLLM on the same frames (its own ViT), in a process of its own.
    spec_jobs = []
    for k, job in enumerate(jobs):
        vids = []
        for n in job["videos"]:
            path = tmp_path / f"{k}_{n}.npy"
            np.save(path, videos[n].frames)
            vids.append({"frames": str(path), "metadata": metadata(videos[n])})
        spec_jobs.append(
            {
                "prompt": chat(tiny_model, job["kinds"]),
                "images": [str(image_path)] if job["image"] else [],
                "videos": vids,
            }
        )
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "vllm_raw_video.py"),
            str(tiny_model),
            str(MAX_TOKENS),
            json.dumps(spec_jobs),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    )
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("TOKENS ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    vllm_raw = json.loads(lines[-1].removeprefix("TOKENS "))

    # (c) the four services, from the encoded files.
    ours = []
    for job in jobs:
        parts: list = [photo("coffee.png")] if job["image"] else []
        parts += [video_part(files[n]) for n in job["videos"]]
        request = build_request(parts, PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
        ours.append(generate(cluster.ports.address("gateway"), request, timeout_s=300))

    assert all(len(t) == MAX_TOKENS for t in hf)
    assert vllm_raw == hf
    assert [r.token_ids for r in ours] == hf
    for job, result in zip(jobs, ours, strict=True):
        [info] = result.videos
        v = videos[job["videos"][0]]
        assert info["grid"] == list(v.plan.grid)
        assert info["tokens"] == v.plan.tokens
        assert info["frames"] == len(v.sampling.indices)
        assert info["timestamps"] == pytest.approx(list(v.sampling.timestamps))
        assert info["frame_indices"] == list(v.sampling.indices)
    assert ours[2].images[0]["grid"] == [1, plan.grid_h, plan.grid_w]


def test_repeated_video_is_an_exact_hit(cluster, tiny_model) -> None:
    data = pan_clip("rocket.jpg", seconds=2.0, fps=8, size=(64, 96))
    address = cluster.ports.address("gateway")
    request = build_request([video_part(data)], PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = generate(address, request, timeout_s=300)
    assert first.videos[0]["tier"] == "miss"
    encoded = metric(cluster, "encoder", "splitvl_encoder_images_total")
    calls = metric(cluster, "encoder", "splitvl_encoder_requests_total")
    second = generate(address, request, timeout_s=300)
    assert second.videos[0]["tier"] == "exact"
    assert second.videos[0]["key"] == first.videos[0]["key"]
    assert second.token_ids == first.token_ids
    assert metric(cluster, "encoder", "splitvl_encoder_images_total") == encoded
    assert metric(cluster, "encoder", "splitvl_encoder_requests_total") == calls
    assert second.timings["encode_ms"] == 0.0
    # Another sampling of the same file is another key: encoded again.
    # (16 frames at 8 fps: 2 fps keeps 4, 4 fps keeps 8.)
    more = build_request([video_part(data)], PROMPT, max_tokens=4, ignore_eos=True)
    more.messages[0].parts[0].video.sample_fps = 4.0
    third = generate(address, more, timeout_s=300)
    assert third.videos[0]["tier"] == "miss"
    assert (first.videos[0]["frames"], third.videos[0]["frames"]) == (4, 8)


@pytest.mark.parametrize(
    ("name", "reason"),
    [("c17_truncated.mp4", "VIDEO_TRUNCATED"), ("c18_audio_only.mp4", "VIDEO_NO_VIDEO_STREAM")],
)
def test_bad_files_are_invalid_argument_and_serving_goes_on(cluster, name, reason) -> None:
    address = cluster.ports.address("gateway")
    bad = build_request([video_part(case_file(name).read_bytes())], PROMPT, max_tokens=4)
    with pytest.raises(grpc.RpcError) as info:
        generate(address, bad, timeout_s=120)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "videos[0]" in info.value.details()
    ok = generate(address, build_request([photo("astronaut.png")], PROMPT, max_tokens=2))
    assert len(ok.token_ids) >= 1


def test_one_frame_and_rotated_clips_are_answered(cluster) -> None:
    address = cluster.ports.address("gateway")
    one = generate(
        address,
        build_request(
            [video_part(case_file("c16_one_frame.mp4").read_bytes())], PROMPT, max_tokens=4
        ),
        timeout_s=300,
    )
    assert one.videos[0]["frames"] == 2 and one.videos[0]["grid"][0] == 1
    assert one.videos[0]["timestamps"] == [0.0, 0.0]
    rotated = generate(
        address,
        build_request(
            [video_part(case_file("c15_rotated90_stored480x270.mp4").read_bytes())],
            PROMPT,
            max_tokens=4,
        ),
        timeout_s=300,
    )
    t, h, w = rotated.videos[0]["grid"]
    assert h > w  # upright portrait


def test_cli_generate_video_json(cluster, tmp_path) -> None:
    path = tmp_path / "zoom.mp4"
    path.write_bytes(zoom_clip("coffee.png", seconds=2.0, fps=10, size=(64, 96)))
    out = subprocess.run(
        [sys.executable, "-m", "splitvl.cli", "generate", "--video", str(path)]
        + ["--image", str(case_file("b01_tiny_26x28.png")), "--fps", "2", "--max-frames", "4"]
        + ["--prompt", "hi", "--max-tokens", "3", "--json"]
        + ["--address", cluster.ports.address("gateway")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    [video] = body["videos"]
    assert video["frames"] == 4 and video["grid"][0] == 2
    assert video["timestamps"] == pytest.approx([0.0, 0.6, 1.3, 1.9])  # linspace(0, 19, 4)
    assert set(video) >= {"tier", "grid", "tokens", "frames", "timestamps"}
    assert len(body["images"]) == 1


def test_a_video_given_as_frames_is_padded_and_answered(cluster, tiny_model) -> None:
    """C14 through the services: three frames (odd, under min_frames) are all kept, the
    last repeated to the temporal patch size, at i / fps, and answered."""
    from splitvl.video_clips import pan_frames
    from tests.conftest import png_bytes

    frames = pan_frames("astronaut.png", 3, (64, 96))
    video = gpb.VideoInput(
        frames=[gpb.ImageInput(data=png_bytes(Image.fromarray(f))) for f in frames], fps=4.0
    )
    request = build_request([video], PROMPT, max_tokens=8, ignore_eos=True)
    result = generate(cluster.ports.address("gateway"), request, timeout_s=300)
    [info] = result.videos
    assert info["frames"] == 4 and info["frame_indices"] == [0, 1, 2, 2]
    assert info["timestamps"] == [0.0, 0.25, 0.5, 0.5]
    assert info["grid"] == [2, 4, 6]
    assert len(result.token_ids) == 8
