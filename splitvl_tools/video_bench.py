"""``splitvl bench --video``: videos through splitvl against vLLM alone on the same files.

Workload: 10-second clips (pans and zooms over scikit-image's photos, 10 fps, made with
PyAV: ``splitvl.video_clips``), sampled at 2 fps, ``--concurrency`` (8) at a time in
a closed loop; ``video_repeat0`` has every clip distinct, ``video_repeat50`` repeats an
earlier clip in every other request. Greedy, eos ignored, ``--max-tokens`` tokens.

* ``vllm``  vLLM alone (``AsyncLLM``, its own ViT): each timed request decodes and samples
  its file (the same sampling, qwen-vl-utils' rules, ``gateway.video.decode_video`` on a
  worker thread) and hands vLLM the frames with their metadata.
* ``split`` splitvl's four services (the gateway decodes, the cache answers repeats).

Each figure is the median over ``--reps`` runs on fresh clips; ratios are splitvl over vLLM
alone in the same run: ``rps_ratio_video`` (requests/s, no repeats) and
``ttft_ratio_video_repeat50`` (mean TTFT at 50% repeats; below 1 is better).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png")
SCENARIOS = ("video_repeat0", "video_repeat50")
SOURCE_FPS = 10


@dataclass
class Sample:
    """One request's time to first token and end to end, seconds."""

    ttft: float
    e2e: float


class Stream:
    """TTFT and end-to-end time of one streamed request (as splitvl_tools.bench's, which
    imports this module: a class of its own keeps the two free of an import circle)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.first: float | None = None

    def tokens_arrived(self, n: int) -> None:
        if n > 0 and self.first is None:
            self.first = time.perf_counter()

    def sample(self, tiers: list[str] | None = None) -> Sample:
        end = time.perf_counter()
        return Sample((self.first or end) - self.t0, end - self.t0)


def make_clips(n: int, seed: int, size: tuple[int, int]) -> list[bytes]:
    """``n`` distinct 10-second clips: photo, motion and crop band vary with the index."""
    from splitvl.video_clips import encode_clip, pan_frames, zoom_frames

    clips = []
    for i in range(n):
        k = seed * 1000 + i
        photo = PHOTOS[k % len(PHOTOS)]
        make = pan_frames if (k // len(PHOTOS)) % 2 == 0 else zoom_frames
        frames = make(photo, 10 * SOURCE_FPS, size)
        # A per-clip tint keeps clips distinct where photo and motion repeat.
        shift = (k * 37) % 64
        frames = [((f.astype("int16") + shift) % 256).astype("uint8") for f in frames]
        clips.append(encode_clip(frames, fps=SOURCE_FPS, gop=10))
    return clips


def workload(n: int, repeat: bool, seed: int, size: tuple[int, int]) -> list[bytes]:
    """Request files in order: distinct clips, or every other one a repeat of an earlier."""
    if not repeat:
        return make_clips(n, seed, size)
    fresh = make_clips((n + 1) // 2, seed, size)
    out: list[bytes] = []
    for i in range(n):
        # Odd requests repeat the clip sent one pair earlier (the first pair: its own).
        out.append(fresh[i // 2] if i % 2 == 0 else fresh[max(0, i // 2 - 1)])
    return out


async def _closed_loop(files: list[bytes], concurrency: int, call: Any) -> tuple[list, float]:
    gate = asyncio.Semaphore(concurrency)

    async def one(data: bytes) -> Any:
        async with gate:
            return await call(data)

    t0 = time.perf_counter()
    samples = await asyncio.gather(*(one(f) for f in files))
    return list(samples), time.perf_counter() - t0


def _summary(samples: list[Any], elapsed: float) -> dict[str, float]:
    return {
        "rps": len(samples) / elapsed,
        "ttft_mean_ms": statistics.fmean(s.ttft for s in samples) * 1000,
        "e2e_mean_ms": statistics.fmean(s.e2e for s in samples) * 1000,
    }


def bench_vllm(model: str, plan: dict[str, Any], works: dict[str, list], log: Any) -> dict:
    from transformers import AutoProcessor
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from gateway.video import VideoLimits, VideoRequest, decode_video
    from gateway.video_config import load_video_config
    from vlcommon.model_info import load_vision_spec, resolve_model_dir

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model_dir = resolve_model_dir(model)
    spec = load_vision_spec(model_dir)
    config = load_video_config(model_dir, spec)
    limits = VideoLimits(1 << 30, 600.0, 768, 8.0, 8_294_400)
    llm = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=model,
            dtype="float32",
            enforce_eager=True,
            max_model_len=8192,
            seed=0,
            limit_mm_per_prompt={"image": 1, "video": 1},
            block_size=plan["block_size"],
        )
    )
    params = SamplingParams(
        max_tokens=plan["max_tokens"],
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    processor = AutoProcessor.from_pretrained(model_dir)
    content = [{"type": "video"}, {"type": "text", "text": "What happens in this video?"}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )

    async def call(data: bytes) -> Any:
        stream = Stream()
        video = await asyncio.to_thread(
            decode_video,
            data,
            index=0,
            spec=spec,
            config=config,
            limits=limits,
            request=VideoRequest(),
            revision="",
        )
        s = video.sampling
        meta = {
            "fps": s.video_fps,
            "frames_indices": list(s.indices),
            "total_num_frames": s.source_frames,
            "duration": video.duration_s,
            "do_sample_frames": False,
        }
        inputs: Any = {
            "prompt": prompt,
            "multi_modal_data": {"video": (video.frames, meta)},
            "mm_processor_kwargs": {"do_resize": False, "do_sample_frames": False},
        }
        async for out in llm.generate(inputs, params, request_id=uuid.uuid4().hex):
            stream.tokens_arrived(len(out.outputs[0].token_ids))
        return stream.sample()

    results: dict[str, list[dict[str, float]]] = {}

    async def main() -> None:
        await _closed_loop(works["warmup"], 2, call)
        for scenario in SCENARIOS:
            for rep, files in enumerate(works[scenario]):
                samples, elapsed = await _closed_loop(files, plan["concurrency"], call)
                results.setdefault(scenario, []).append(_summary(samples, elapsed))
                log(f"  vllm {scenario} rep {rep}: {len(samples) / elapsed:.2f} req/s")

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
    return results


def bench_split(model: str, plan: dict[str, Any], works: dict[str, list], log: Any) -> dict:
    from qwenvl.gateway.v1 import gateway_service_pb2 as pb
    from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

    from splitvl.client import build_request
    from splitvl.home import splitvl_home
    from splitvl.launcher import Cluster, Ports

    cluster = Cluster(
        model=model,
        ports=Ports.free(),
        log_dir=splitvl_home() / "bench-video-logs",
        decoder_args=[
            "--max-model-len",
            "8192",
            *(["--block-size", str(plan["block_size"])] if plan["block_size"] else []),
        ],
        env={"VLLM_CPU_KVCACHE_SPACE": "2"},
        progress=log,
    )
    results: dict[str, list[dict[str, float]]] = {}

    async def main() -> None:
        async with cluster.gateway_channel() as channel:
            stub = pb_grpc.GatewayServiceStub(channel)

            async def call(data: bytes) -> Any:
                request = build_request(
                    [pb.VideoInput(file=pb.VideoFile(data=data))],
                    "What happens in this video?",
                    max_tokens=plan["max_tokens"],
                    ignore_eos=True,
                )
                stream = Stream()
                tiers: list[str] = []
                async for chunk in stub.Generate(request, timeout=600):
                    if chunk.videos:
                        tiers = [str(v.tier) for v in chunk.videos]
                    stream.tokens_arrived(len(chunk.token_ids))
                return stream.sample(tiers)

            await _closed_loop(works["warmup"], 2, call)
            for scenario in SCENARIOS:
                for rep, files in enumerate(works[scenario]):
                    samples, elapsed = await _closed_loop(files, plan["concurrency"], call)
                    results.setdefault(scenario, []).append(_summary(samples, elapsed))
                    log(f"  split {scenario} rep {rep}: {len(samples) / elapsed:.2f} req/s")

    with cluster:
        asyncio.run(main())
    return results


def run(args: Any) -> int:
    """The ``--video`` scenario of ``splitvl bench``; prints a table (or ``--json``)."""
    import torch

    from decoder_service.engine import default_block_size
    from splitvl_tools.cluster import bench_model

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    model = args.model or str(bench_model())
    n = args.requests or (8 if args.quick else 16)
    plan = {
        "requests": n,
        "concurrency": args.video_concurrency,
        "max_tokens": args.max_tokens,
        "reps": args.reps,
        "block_size": args.block_size or default_block_size(not torch.cuda.is_available()),
        "clip": "10 s at 10 fps, 192x256, sampled at 2 fps (20 frames)",
    }
    log(f"video bench: model {model}; plan {plan}")
    t0 = time.perf_counter()
    size = (192, 256)
    works: dict[str, list] = {"warmup": make_clips(2, 999, size)}
    for s, scenario in enumerate(SCENARIOS):
        works[scenario] = [
            workload(n, scenario.endswith("50"), seed=10 * rep + s, size=size)
            for rep in range(args.reps)
        ]
    log("vLLM alone ...")
    table = {"vllm": bench_vllm(model, plan, works, log)}
    log("splitvl ...")
    table["split"] = bench_split(model, plan, works, log)

    def median(system: str, scenario: str, key: str) -> float:
        return statistics.median(r[key] for r in table[system][scenario])

    ratios = {
        "rps_ratio_video": median("split", "video_repeat0", "rps")
        / median("vllm", "video_repeat0", "rps"),
        "rps_ratio_video_repeat50": median("split", "video_repeat50", "rps")
        / median("vllm", "video_repeat50", "rps"),
        "ttft_ratio_video_repeat50": median("split", "video_repeat50", "ttft_mean_ms")
        / median("vllm", "video_repeat50", "ttft_mean_ms"),
    }
    result = {
        "command": " ".join(["splitvl", "bench", *sys.argv[2:]]),
        "plan": plan,
        "model": model,
        "runs": table,
        "ratios": ratios,
        "seconds": time.perf_counter() - t0,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_video.json").write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'system':8} {'scenario':16} {'req/s':>8} {'TTFT ms':>9} {'e2e ms':>9}  (medians)")
    for system, scenarios in table.items():
        for scenario in scenarios:
            print(
                f"{system:8} {scenario:16} {median(system, scenario, 'rps'):8.2f} "
                f"{median(system, scenario, 'ttft_mean_ms'):9.0f} "
                f"{median(system, scenario, 'e2e_mean_ms'):9.0f}"
            )
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    return 0
