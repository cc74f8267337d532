"""``splitvl bench --photos``: what users send, against vLLM alone on the same files.

Files (issue 19): phone-sized JPEGs (4032x3024 stored, about 12 MP, EXIF orientation 1, 6
or 8, quality 85, 90 or 95), made from pairwise-dissimilar crops of scikit-image's photos
(:class:`splitvl_tools.workload.ImageFactory`) upscaled with film grain so that they
compress like photos (1.5-3 MB), and 1920x1080 / 2560x1440 PNG screenshots (a window with
text, panels and a photo). The pixel budget is the Qwen3-VL deployment guides'
``max_pixels`` 1280*32*32, set the way a deployment sets it: in the checkpoint's
processor config (a copy of the bench checkpoint whose ``size.longest_edge`` is that
budget), so vLLM alone and splitvl resize the same way with no per-request setting.

Scenarios: ``photos_repeat50`` (closed loop at ``--concurrency``) and
``photos_repeat50_conc1`` (one at a time). Half of each run's images are byte-identical
copies of files served before it (a warm-up set, sent unmeasured to both systems alike),
half are new files. vLLM alone (``AsyncLLM`` in this process) decodes each file from its
bytes inside the timed request with vLLM's own image loader (``ImageMediaIO.load_bytes``:
Pillow decode, ``exif_transpose``, RGB), as its API server does.

Preprocess per image, side by side in this process before any engine starts (vLLM's CPU
worker keeps a core busy even when idle), alternating on the same files, one torch thread
each: splitvl's gateway stage on a miss (:meth:`gateway.pipeline.preprocess.Preprocessor.read_files`
with file digests, then ``decode_images`` with the verification image: everything
``StageTimings.preprocess_ms`` counts but the lookups) against vLLM's processor (its image
loader, then the checkpoint's Qwen image processor: resize, rescale, normalise, patchify).
The byte-identical repeats' ``preprocess_ms`` comes from the live splitvl runs
(``StageTimings``).

Ratios: ``rps_ratio_photos_repeat50``, ``rps_ratio_photos_repeat50_conc1`` (splitvl over
vLLM alone), ``preprocess_ratio_photos_miss`` (splitvl's gateway stage over vLLM's
processor, median per file) and ``preprocess_ms_photos_repeat`` (median over repeats).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from splitvl_tools.bench import (
    RssSampler,
    Run,
    Sample,
    Stream,
    VllmAlone,
    closed_loop,
    machine,
    run_load,
    summarise,
)
from splitvl_tools.workload import PROMPTS, ImageFactory, Request

PHOTOS_MAX_PIXELS = 1280 * 32 * 32
PHONE_SIZE = (4032, 3024)  # stored width x height (upright 3024x4032 under orientation 6/8)
SCREEN_SIZES = ((1920, 1080), (2560, 1440))
ORIENTATIONS = (1, 6, 8)
QUALITIES = (85, 90, 95)
SCENARIOS = ("photos_repeat50", "photos_repeat50_conc1")


def photos_model(base: Path) -> Path:
    """The bench checkpoint with the deployment guides' pixel budget, made once beside it.

    Every file is linked except ``processor_config.json``, whose image processor gets
    ``size.longest_edge`` = 1280*32*32 (and the video processor's bound, which must not be
    smaller, the same).
    """
    out = base.with_name(base.name + "-photos")
    marker = out / "SPLITVL_PHOTOS_BUDGET"
    if marker.exists() and marker.read_text() == str(PHOTOS_MAX_PIXELS):
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in base.iterdir():
        if f.name == "processor_config.json":
            config = json.loads(f.read_text())
            config["image_processor"]["size"]["longest_edge"] = PHOTOS_MAX_PIXELS
            video = config.get("video_processor", {}).get("size")
            if video and video.get("longest_edge", 0) < PHOTOS_MAX_PIXELS:
                video["longest_edge"] = PHOTOS_MAX_PIXELS
            (tmp / f.name).write_text(json.dumps(config, indent=2))
        elif f.is_file():
            os.link(f, tmp / f.name)
    (tmp / marker.name).write_text(str(PHOTOS_MAX_PIXELS))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


class FileFactory:
    """Distinct phone JPEGs and PNG screenshots, in a fixed cycle of kinds.

    Kinds cycle JPEG, JPEG, PNG: JPEGs take orientation 1, 6, 8 and quality 85, 90, 95 in
    turn, PNGs 1920x1080 and 2560x1440 in turn. Scenes come from one
    :class:`ImageFactory`, so no two files are a similarity hit of each other.
    """

    def __init__(self, seed: int) -> None:
        self.scenes = ImageFactory(side=1024, seed=seed)
        self.rng = np.random.default_rng(seed)
        self.made = 0

    def make(self) -> tuple[bytes, str]:
        k = self.made
        self.made += 1
        if k % 3 == 2:
            w, h = SCREEN_SIZES[(k // 3) % 2]
            return self.screenshot(w, h), f"png-{w}x{h}"
        orientation = ORIENTATIONS[(k // 3 * 2 + k % 3) % 3]
        quality = QUALITIES[(k // 3 + k % 3) % 3]
        return self.phone_jpeg(orientation, quality), f"jpeg-o{orientation}-q{quality}"

    def phone_jpeg(self, orientation: int, quality: int) -> bytes:
        """A 4032x3024 scene with grain, stored as a phone stores it under ``orientation``."""
        scene = self.scenes.make()
        w, h = PHONE_SIZE
        if orientation in (6, 8):
            scene = scene.resize((h, w), Image.Resampling.BICUBIC)  # portrait upright
            # How the camera stores it: rotated so that the tag's transpose makes it upright.
            scene = scene.transpose(
                Image.Transpose.ROTATE_90 if orientation == 6 else Image.Transpose.ROTATE_270
            )
        else:
            scene = scene.resize((w, h), Image.Resampling.BICUBIC)
        pixels = np.asarray(scene, np.int16) + self.grain(h, w)
        pixels = np.clip(pixels, 0, 255).astype(np.uint8)
        exif = Image.Exif()
        exif[0x0112] = orientation
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="JPEG", quality=quality, exif=exif)
        return out.getvalue()

    def grain(self, h: int, w: int) -> np.ndarray:
        """int16 [h, w, 3] film grain (sigma 3 levels): a 509x509 tile of Gaussian noise
        (odd-sized, so its seams never line up with JPEG's 8x8 blocks), tiled from a
        random offset; drawing 36 M normal values per photo took seconds."""
        if not hasattr(self, "_tile"):
            self._tile = np.rint(self.rng.normal(0.0, 3.0, (509, 509, 3))).astype(np.int16)
        dy, dx = (int(v) for v in self.rng.integers(0, 509, 2))
        reps = (-(-(h + dy) // 509), -(-(w + dx) // 509), 1)
        return np.tile(self._tile, reps)[dy : dy + h, dx : dx + w]

    def screenshot(self, width: int, height: int) -> bytes:
        """A window: title bar, a sidebar of items, text lines, and a photo in the page."""
        shade = int(self.rng.integers(236, 256))
        image = Image.new("RGB", (width, height), (shade, shade, shade))
        draw = ImageDraw.Draw(image)
        accent = tuple(int(c) for c in self.rng.integers(30, 200, 3))
        draw.rectangle((0, 0, width, 48), fill=accent)
        font = ImageFont.load_default(size=18)
        draw.text((16, 12), f"Report {self.made} - Dashboard", fill="white", font=font)
        draw.rectangle((0, 48, 280, height), fill=(shade - 20,) * 3)
        for i in range(height // 40 - 2):
            draw.text((20, 70 + 40 * i), f"Item {int(self.rng.integers(100_000))}", "black", font)
        photo = self.scenes.make().resize((width // 3, width // 4), Image.Resampling.BICUBIC)
        image.paste(photo, (width - width // 3 - 40, 80))
        for i in range((height - 120) // 26):
            words = " ".join(f"w{int(x)}" for x in self.rng.integers(0, 9999, 12))
            draw.text((320, 80 + 26 * i), words, fill=(20, 20, 20), font=font)
        out = io.BytesIO()
        image.save(out, format="PNG")
        return out.getvalue()


def build_workloads(
    requests: int, requests_conc1: int, reps: int, seed: int
) -> tuple[dict[str, list[dict[str, Any]]], list[tuple[bytes, str]]]:
    """Per scenario and repetition: a warm-up set of distinct files and the measured
    requests, half of them byte-identical copies of the warm-up files (each once, at
    random positions), half new files. Also every distinct file made, with its kind.
    """
    factory = FileFactory(seed)
    files: list[tuple[bytes, str]] = []
    out: dict[str, list[dict[str, Any]]] = {s: [] for s in SCENARIOS}
    rng = np.random.default_rng(seed + 1)

    def new() -> tuple[bytes, str]:
        f = factory.make()
        files.append(f)
        return f

    for rep in range(reps):
        for scenario in SCENARIOS:
            n = requests_conc1 if scenario.endswith("conc1") else requests
            repeats = n // 2
            warm = [new() for _ in range(repeats)]
            slots = set(rng.choice(n, size=repeats, replace=False).tolist())
            measured, r = [], 0
            for i in range(n):
                prompt = f"{PROMPTS[i % len(PROMPTS)]} ({scenario} {rep} {i})"
                if i in slots:
                    data, kind = warm[r]
                    r += 1
                    measured.append(Request([data], prompt, [f"exact:{kind}"]))
                else:
                    data, kind = new()
                    measured.append(Request([data], prompt, [f"unique:{kind}"]))
            out[scenario].append(
                {
                    "warmup": [
                        Request([d], f"Describe this image. (warm {k})", [f"unique:{kind}"])
                        for k, (d, kind) in enumerate(warm)
                    ],
                    "requests": measured,
                }
            )
    return out, files


# -- preprocess, side by side -------------------------------------------------------------
def preprocess_side_by_side(
    model: Path, files: list[tuple[bytes, str]], runs: int
) -> dict[str, Any]:
    """Per distinct file: splitvl's gateway stage on a miss and vLLM's processor, median
    of ``runs`` alternating runs each, one torch thread (as the gateway's preprocess)."""
    import torch
    from transformers import AutoImageProcessor
    from vllm.multimodal.media.image import ImageMediaIO

    from gateway.pipeline.preprocess import Preprocessor
    from gateway.settings import GatewaySettings
    from vlcommon.model_info import load_vision_spec, model_revision
    from vlcommon.server import limit_torch_threads

    threads = torch.get_num_threads()
    limit_torch_threads()
    spec = load_vision_spec(model)
    processor = AutoImageProcessor.from_pretrained(model)
    loader = ImageMediaIO()
    env_only: dict[str, Any] = {}  # defaults and GATEWAY_* environment variables
    # for_cache: the miss path builds the verification image too, as a gateway with a
    # cache does.
    preprocessor = Preprocessor(
        GatewaySettings(**env_only), spec, model_revision(model), for_cache=True
    )
    lo, hi = spec.min_pixels, spec.max_pixels

    def gateway(data: bytes) -> None:
        headers = preprocessor.read_files([data], lo, hi, True)
        preprocessor.decode_images([data], [0], headers, lo, hi, warm_up=True)

    def vllm(data: bytes) -> None:
        image = loader.load_bytes(data).media
        processor(images=[image], return_tensors="pt")

    for data, _ in files[:2]:  # first-use costs out of the figures
        gateway(data)
        vllm(data)
    rows: list[dict[str, Any]] = []
    for data, kind in files:
        g: list[float] = []
        v: list[float] = []
        for _ in range(runs):
            for fn, into in ((gateway, g), (vllm, v)):
                t = time.perf_counter()
                fn(data)
                into.append((time.perf_counter() - t) * 1000)
        rows.append(
            {
                "kind": kind,
                "bytes": len(data),
                "gateway_ms": statistics.median(g),
                "vllm_processor_ms": statistics.median(v),
            }
        )
    torch.set_num_threads(threads)
    ratios = [r["gateway_ms"] / r["vllm_processor_ms"] for r in rows]
    by_kind: dict[str, dict[str, float]] = {}
    for family in ("jpeg", "png"):
        sel = [r for r in rows if r["kind"].startswith(family)]
        if sel:
            by_kind[family] = {
                "gateway_ms": statistics.median(r["gateway_ms"] for r in sel),
                "vllm_processor_ms": statistics.median(r["vllm_processor_ms"] for r in sel),
                "ratio": statistics.median(r["gateway_ms"] / r["vllm_processor_ms"] for r in sel),
            }
    return {"files": rows, "by_kind": by_kind, "ratio_median": statistics.median(ratios)}


# -- the two systems -----------------------------------------------------------------------
class VllmPhotos(VllmAlone):
    """vLLM alone, decoding each file as its API server does (``ImageMediaIO``)."""

    async def raw(self, req: Request) -> Sample:
        from vllm.multimodal.media.image import ImageMediaIO

        stream = Stream()
        loader = ImageMediaIO()
        images = [loader.load_bytes(b).media for b in req.images]
        inputs: Any = {"prompt": self.prompt(req), "multi_modal_data": {"image": images}}
        async for out in self.llm.generate(inputs, self.params, request_id=os.urandom(8).hex()):
            stream.tokens_arrived(len(out.outputs[0].token_ids))
        return stream.sample()


def bench_vllm(model: Path, work: dict, concurrency: int, max_tokens: int, log: Any) -> dict:
    import torch

    from decoder_service.engine import default_block_size
    from vlcommon.server import freeze_startup_heap

    # The decoder's block size, so both engines' prefix caches work alike.
    engine = VllmPhotos(
        str(model), max_tokens, 1, default_block_size(not torch.cuda.is_available())
    )
    results: dict[str, list[Run]] = {}

    async def main() -> None:
        await closed_loop(work[SCENARIOS[0]][0]["warmup"][:1], 1, engine.raw)
        freeze_startup_heap("bench photos (vLLM alone)")
        for scenario in SCENARIOS:
            conc = 1 if scenario.endswith("conc1") else concurrency
            for rep, w in enumerate(work[scenario]):
                await closed_loop(w["warmup"], conc, engine.raw)
                with RssSampler({"vllm": os.getpid()}) as rss:
                    samples, elapsed = await run_load(w["requests"], conc, engine.raw, None)
                results.setdefault(scenario, []).append(Run(samples, elapsed, rss.peak, rss.cpu_s))
                log(f"  vllm {scenario} rep {rep}: {len(samples) / elapsed:.3f} req/s")
                log(f"  summary: {json.dumps(results[scenario][-1].summary())}")

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    return results


def bench_split(
    model: Path, work: dict, concurrency: int, max_tokens: int, log_dir: Path, log: Any
) -> tuple[dict, dict[str, list[float]], dict[str, list[dict[str, Any]]]]:
    """splitvl with the cache on; also each request's ``preprocess_ms`` by image kind
    (``repeat``: byte-identical repeats, ``miss``: new files), and per scenario each
    measured request's timeline: its start and end (s from the run's first request), its
    kind and the gateway's stage timings (ms), to see where a run's time goes."""
    from qwenvl.common.v1 import generation_pb2
    from qwenvl.gateway.v1 import gateway_service_pb2 as pb
    from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

    from splitvl.client import TIER_NAMES, build_request
    from splitvl.launcher import Cluster, Ports
    from vlcommon.server import freeze_startup_heap

    results: dict[str, list[Run]] = {}
    preprocess: dict[str, list[float]] = {"repeat": [], "miss": [], "repeat_decoded": []}
    timeline: dict[str, list[dict[str, Any]]] = {}
    run_start = [0.0]
    cluster = Cluster(
        model=str(model),
        ports=Ports.free(),
        log_dir=log_dir,
        decoder_args=["--limit-mm-per-prompt", json.dumps({"image": 1, "video": 0})],
        env={"VLLM_CPU_KVCACHE_SPACE": "2"},
        progress=log,
    )
    policy = generation_pb2.CACHE_POLICY_SIMILAR

    async def main() -> None:
        async with cluster.gateway_channel() as channel:
            stub = pb_grpc.GatewayServiceStub(channel)

            async def call(req: Request, measured: str = "") -> Sample:
                t_begin = time.perf_counter()
                request = build_request(
                    req.images, req.prompt, max_tokens=max_tokens, ignore_eos=True,
                    cache_policy=policy,
                )  # fmt: skip
                stream = Stream()
                tiers: list[str] = []
                decoded: list[bool] = []
                timings = None
                async for chunk in stub.Generate(request, timeout=900):
                    assert isinstance(chunk, pb.GenerateResponse)
                    if chunk.images:
                        tiers = [TIER_NAMES.get(im.tier, "?") for im in chunk.images]
                        decoded = [im.decoded for im in chunk.images]
                    if chunk.HasField("timings"):
                        timings = chunk.timings
                    stream.tokens_arrived(len(chunk.token_ids))
                if measured and timings is not None:
                    repeat = req.kinds[0].startswith("exact")
                    preprocess["repeat" if repeat else "miss"].append(timings.preprocess_ms)
                    if repeat and any(decoded):
                        preprocess["repeat_decoded"].append(timings.preprocess_ms)
                    stages = {
                        name: round(getattr(timings, f"{name}_ms"), 1)
                        for name in ("preprocess", "lookup", "encode", "put", "ttft", "decode")
                    }
                    timeline.setdefault(measured, []).append(
                        {
                            "kind": "repeat" if repeat else "miss",
                            "start_s": round(t_begin - run_start[0], 3),
                            "end_s": round(time.perf_counter() - run_start[0], 3),
                            **stages,
                        }
                    )
                return stream.sample(tiers)

            await closed_loop(work[SCENARIOS[0]][0]["warmup"][:1], 1, call)
            freeze_startup_heap("bench photos (splitvl client)")
            pids = {n: p.pid for n, p in cluster.procs.items()}
            for scenario in SCENARIOS:
                conc = 1 if scenario.endswith("conc1") else concurrency
                for rep, w in enumerate(work[scenario]):
                    await closed_loop(w["warmup"], conc, call)

                    async def measured(r: Request, name: str = f"{scenario}/{rep}") -> Sample:
                        return await call(r, name)

                    run_start[0] = time.perf_counter()
                    with RssSampler(pids) as rss:
                        samples, elapsed = await run_load(w["requests"], conc, measured, None)
                    results.setdefault(scenario, []).append(
                        Run(samples, elapsed, rss.peak, rss.cpu_s)
                    )
                    log(f"  summary: {json.dumps(results[scenario][-1].summary())}")
                    log(f"  split_cache {scenario} rep {rep}: {len(samples) / elapsed:.3f} req/s")
                    log(f"  preprocess_ms so far: {json.dumps(preprocess)}")

    with cluster:
        asyncio.run(main())
    return results, preprocess, timeline


# -- report -------------------------------------------------------------------------------
COLUMNS = (
    ("requests_per_s", "req/s", 3),
    ("output_tokens_per_s", "tok/s", 1),
    ("ttft_mean_ms", "TTFT mean", 0),
    ("ttft_p50_ms", "TTFT p50", 0),
    ("ttft_p99_ms", "TTFT p99", 0),
    ("itl_p50_ms", "ITL p50", 1),
    ("itl_p99_ms", "ITL p99", 1),
    ("e2e_p50_ms", "E2E p50", 0),
    ("e2e_p99_ms", "E2E p99", 0),
    ("cache_hit_rate", "hit", 2),
    ("peak_rss_mib", "RSS MiB", 0),
)


def print_report(result: dict[str, Any], out: Any) -> None:
    head = f"| {'scenario':<21} | {'system':<11} | " + " | ".join(c[1] for c in COLUMNS) + " |"
    print(head, file=out)
    print("|" + "|".join("-" * len(x) for x in head.strip("|").split("|")) + "|", file=out)
    for scenario in SCENARIOS:
        for system in ("vllm", "split_cache"):
            row = result["systems"].get(system, {}).get(scenario)
            if row is None:
                continue
            cells = []
            for key, _, digits in COLUMNS:
                v = row[key]
                if v["median"] != v["median"]:
                    cells.append("-")
                elif key in ("requests_per_s", "ttft_mean_ms"):
                    cells.append(
                        f"{v['median']:.{digits}f} [{v['min']:.{digits}f}-{v['max']:.{digits}f}]"
                    )
                else:
                    cells.append(f"{v['median']:.{digits}f}")
            print(f"| {scenario:<21} | {system:<11} | " + " | ".join(cells) + " |", file=out)
    pre = result["preprocess"]
    print("\npreprocess per image, side by side (ms, median per file):", file=out)
    print("| file | bytes | splitvl gateway (miss) | vLLM's processor | ratio |", file=out)
    print("|---|---|---|---|---|", file=out)
    for r in pre["files"]:
        print(
            f"| {r['kind']} | {r['bytes']} | {r['gateway_ms']:.1f} | "
            f"{r['vllm_processor_ms']:.1f} | {r['gateway_ms'] / r['vllm_processor_ms']:.2f} |",
            file=out,
        )
    live = result["preprocess_live_ms"]
    for name, values in live.items():
        if values:
            print(
                f"live preprocess_ms ({name}): median {statistics.median(values):.2f}, "
                f"max {max(values):.2f}, n={len(values)}",
                file=out,
            )
    for k, v in result["ratios"].items():
        print(f"{k}: {'n/a' if v is None else f'{v:.3f}'}", file=out)


def run(args: argparse.Namespace) -> int:
    """The photos scenario end to end (``splitvl bench --photos``)."""
    from splitvl.home import splitvl_home
    from splitvl_tools.cluster import bench_model

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    t_start = time.perf_counter()
    model = photos_model(Path(args.model) if args.model else bench_model())
    requests = args.requests or (8 if args.quick else 32)
    requests_conc1 = args.requests_conc1 or (4 if args.quick else 8)
    reps = 1 if args.quick else args.reps
    log(f"photos: model {model}; {requests} requests at {args.concurrency}, {requests_conc1} "
        f"one at a time, {reps} rep(s), max_pixels {PHOTOS_MAX_PIXELS}")  # fmt: skip
    work, files = build_workloads(requests, requests_conc1, reps, args.seed)
    log(f"  {len(files)} distinct files made")
    pre = preprocess_side_by_side(model, files[: 6 if args.quick else 12], 3 if args.quick else 5)
    log(f"  preprocess ratio (gateway / vLLM's processor): {pre['ratio_median']:.2f}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Kept even if a system fails later (a full run takes minutes on a shared machine).
    (out_dir / "bench-photos-preprocess.json").write_text(json.dumps(pre, indent=2))
    runs: dict[str, dict[str, list[Run]]] = {}
    log("vLLM alone ...")
    runs["vllm"] = bench_vllm(model, work, args.concurrency, args.max_tokens, log)
    log("splitvl ...")
    runs["split_cache"], live, timeline = bench_split(
        model, work, args.concurrency, args.max_tokens, splitvl_home() / "bench-logs", log
    )
    table = summarise(runs)

    def rps(system: str, scenario: str) -> float | None:
        try:
            return float(table[system][scenario]["requests_per_s"]["median"])
        except KeyError:
            return None

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    result: dict[str, Any] = {
        "command": " ".join(["splitvl", "bench", *sys.argv[1:]]),
        "model": str(model),
        "max_pixels": PHOTOS_MAX_PIXELS,
        "plan": {
            "requests": requests,
            "requests_conc1": requests_conc1,
            "concurrency": args.concurrency,
            "reps": reps,
            "max_tokens": args.max_tokens,
        },
        "machine": machine(),
        "systems": table,
        "preprocess": pre,
        "preprocess_live_ms": live,
        "split_timeline": timeline,
        "ratios": {
            "rps_ratio_photos_repeat50": ratio(
                rps("split_cache", SCENARIOS[0]), rps("vllm", SCENARIOS[0])
            ),
            "rps_ratio_photos_repeat50_conc1": ratio(
                rps("split_cache", SCENARIOS[1]), rps("vllm", SCENARIOS[1])
            ),
            "preprocess_ratio_photos_miss": pre["ratio_median"],
            "preprocess_ms_photos_repeat": (
                statistics.median(live["repeat"]) if live["repeat"] else None
            ),
        },
    }
    result["seconds"] = time.perf_counter() - t_start
    (out_dir / "bench-photos.json").write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result))
    else:
        print_report(result, sys.stdout)
        print(f"raw: {out_dir / 'bench-photos.json'}; {result['seconds']:.0f} s")
    return 0


def main() -> int:
    """``python -m splitvl_tools.photos [splitvl bench options]``: what
    ``splitvl bench --photos`` runs."""
    from splitvl_tools.bench import add_parser

    parser = argparse.ArgumentParser(prog="splitvl bench --photos")
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", *sys.argv[1:]])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
