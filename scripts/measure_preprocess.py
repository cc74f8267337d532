"""Measure the gateway's preprocess stage on a phone photo (issue 19).

Usage::

    .venv/bin/python scripts/measure_preprocess.py            # both measurements
    .venv/bin/python scripts/measure_preprocess.py --runs 7 --json

The photo: scikit-image's astronaut upscaled to 4032x3024 (12.2 MP) with film-grain noise
so that it compresses like a photo, stored sideways with EXIF orientation 6, JPEG quality
90. The pixel budget is the Qwen3-VL deployment guides' ``max_pixels`` 1280*32*32.

1. ``repeat``: the real gateway pipeline with a real cache service on loopback (in this
   process; no encoder or decoder). The photo is prepared once (decoded, and stored with
   embeddings of the right shape, as a miss would be), then sent again: ``preprocess_ms``
   is what ``StageTimings.preprocess_ms`` counts for it (headers, file digest; the lookup
   by digest is ``lookup_ms``). Printed beside the decode path (the same photo with the
   cache policy off: decode, key, descriptor, resize), what every repeat cost before.
2. ``cold``: a fresh Python process per run, set up as ``python -m gateway`` is (the
   resize implementation imported, torch on one thread), times its first photo through the
   decode path and then the median of five more (other photos of the same kind), with and
   without :meth:`gateway.pipeline.Pipeline.warm_up` before the first.

Medians over ``--runs`` runs. Only ratios within one run compare across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MAX_PIXELS = 1280 * 32 * 32
SIZE = (4032, 3024)  # stored width x height; upright 3024x4032 after orientation 6


def phone_jpeg(seed: int = 0) -> bytes:
    """A 12 MP photo stored sideways (EXIF orientation 6), JPEG quality 90."""
    import numpy as np
    import skimage
    from PIL import Image

    source = Image.open(Path(skimage.__file__).parent / "data" / "astronaut.png").convert("RGB")
    big = np.asarray(source.resize(SIZE, Image.Resampling.BICUBIC), dtype=np.int16)
    grain = np.random.default_rng(seed).normal(0, 4, big.shape)
    pixels = np.clip(big + grain, 0, 255).astype(np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90, exif=exif)
    return out.getvalue()


def make_pipeline(cache_stub=None, **settings):  # type: ignore[no-untyped-def]
    import grpc
    from qwenvl.decoder.v1 import decoder_service_pb2_grpc
    from qwenvl.encoder.v1 import encoder_service_pb2_grpc

    from gateway.pipeline import Downstream, Pipeline
    from gateway.settings import GatewaySettings
    from vlcommon.model_info import VisionSpec

    # Qwen3-VL's geometry and processor bounds (patch 16, merge 2; 64x64 .. 4096x4096).
    spec = VisionSpec(
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        min_pixels=65536,
        max_pixels=16777216,
        out_hidden_size=2048,
        n_deepstack=3,
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
    )
    nowhere = grpc.aio.insecure_channel("127.0.0.1:9")
    return Pipeline(
        GatewaySettings(max_decoded_pixels=40_000_000, **settings),
        spec,
        "measure",
        (),
        Downstream(
            encoder=encoder_service_pb2_grpc.EncoderServiceStub(nowhere),
            decoder=decoder_service_pb2_grpc.DecoderServiceStub(nowhere),
            cache=cache_stub,
        ),
    )


async def measure_repeat(runs: int) -> dict[str, object]:
    import grpc
    import numpy as np
    from qwenvl.cache.v1 import cache_service_pb2_grpc
    from qwenvl.common.v1 import generation_pb2, tensor_pb2

    from cache_service.servicer import CacheServicer
    from cache_service.store import EmbeddingStore
    from vlcommon import tensors
    from vlcommon.deadline import NO_DEADLINE
    from vlcommon.imaging import DESCRIPTOR_DIM
    from vlcommon.server import serve
    from vlcommon.settings import ServerSettings, channel_options

    data = phone_jpeg()
    similar, off = generation_pb2.CACHE_POLICY_SIMILAR, generation_pb2.CACHE_POLICY_OFF
    store = EmbeddingStore(descriptor_dim=DESCRIPTOR_DIM, capacity_bytes=2**30)
    cache = CacheServicer(store, default_policy=similar, max_queries=8)
    stop = asyncio.Event()
    started = asyncio.get_running_loop().create_future()
    server = asyncio.ensure_future(
        serve(
            service_name="cache",
            service_full_names=["qwenvl.cache.v1.CacheService"],
            settings=ServerSettings(port=0),
            stop_event=stop,
            on_started=started.set_result,
            register=lambda s: cache_service_pb2_grpc.add_CacheServiceServicer_to_server(cache, s),
        )
    )
    port = await started
    # The gateway's own channel limits: a 1,280-token entry is 42 MB of FP32 embeddings.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
        pipeline = make_pipeline(cache_service_pb2_grpc.CacheServiceStub(channel))
        await pipeline.warm_up()
        lo, hi = pipeline.spec.min_pixels, MAX_PIXELS

        async def prepare(policy: int) -> tuple[float, float, list]:  # type: ignore[type-arg]
            # The pipeline's stages 1-3, each timed as Pipeline._preprocess times them.
            t = time.perf_counter()
            intake = await pipeline.images.read([data], lo, hi, policy, NO_DEADLINE)
            t_lookup = time.perf_counter()
            await pipeline.images.lookup_files(intake, NO_DEADLINE)
            lookup_ms = (time.perf_counter() - t_lookup) * 1000
            images = await pipeline.images.decode(intake, NO_DEADLINE)
            return (time.perf_counter() - t) * 1000 - lookup_ms, lookup_ms, images

        _, _, (first,) = await prepare(similar)  # a miss: decoded, then stored
        values = np.zeros((first.plan.tokens, pipeline.spec.embedding_width), np.float32)
        first.embedding = tensor_pb2.ImageEmbedding(
            embeddings=tensors.from_numpy(values),
            grid=tensor_pb2.GridTHW(t=1, h=first.plan.grid_h, w=first.plan.grid_w),
            key=first.key,
        )
        await pipeline.cache.put([first], similar, NO_DEADLINE)
        repeat, lookup, decode = [], [], []
        for _ in range(runs):
            ms, lookup_ms, (im,) = await prepare(similar)
            assert not im.decoded and im.key == first.key, "the repeat was decoded"
            repeat.append(ms)
            lookup.append(lookup_ms)
            decode.append((await prepare(off))[0])
    stop.set()
    await server
    return {
        "file_bytes": len(data),
        "plan": [first.plan.resized_height, first.plan.resized_width],
        "tokens": first.plan.tokens,
        "repeat_preprocess_ms": repeat,
        "repeat_preprocess_ms_median": statistics.median(repeat),
        "repeat_lookup_ms_median": statistics.median(lookup),
        "decode_path_preprocess_ms": decode,
        "decode_path_preprocess_ms_median": statistics.median(decode),
    }


async def _cold_child(warm: bool) -> dict[str, float]:
    """One fresh gateway: its first photo through the decode path, then five more."""
    from transformers.models.qwen2_vl import image_processing_qwen2_vl  # noqa: F401

    from vlcommon.deadline import NO_DEADLINE
    from vlcommon.server import limit_torch_threads

    limit_torch_threads()  # as python -m gateway does (vlcommon.server)
    from qwenvl.common.v1 import generation_pb2

    photos = [phone_jpeg(seed) for seed in range(6)]
    pipeline = make_pipeline(cache_address="")
    t = time.perf_counter()
    if warm:
        await pipeline.warm_up()
    warm_up_ms = (time.perf_counter() - t) * 1000
    lo, hi = pipeline.spec.min_pixels, MAX_PIXELS
    times = []
    for data in photos:
        t = time.perf_counter()
        await pipeline.images.prepare([data], lo, hi, generation_pb2.CACHE_POLICY_OFF, NO_DEADLINE)
        times.append((time.perf_counter() - t) * 1000)
    return {"warm_up_ms": warm_up_ms, "first_ms": times[0], "warm_ms": statistics.median(times[1:])}


def measure_cold(runs: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for warm in (False, True):
        results = []
        for _ in range(runs):
            proc = subprocess.run(
                [sys.executable, __file__, "--child", "warm" if warm else "cold"],
                capture_output=True,
                text=True,
                cwd=ROOT,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"measurement process failed:\n{proc.stderr[-3000:]}")
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        first = [r["first_ms"] for r in results]
        warm_ms = [r["warm_ms"] for r in results]
        ratios = [r["first_ms"] / r["warm_ms"] for r in results]
        out["with_warm_up" if warm else "without_warm_up"] = {
            "first_ms": first,
            "warm_ms": warm_ms,
            "first_over_warm": ratios,
            "first_ms_median": statistics.median(first),
            "warm_ms_median": statistics.median(warm_ms),
            "first_over_warm_median": statistics.median(ratios),
            "warm_up_ms_median": statistics.median(r["warm_up_ms"] for r in results),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per figure (median)")
    parser.add_argument("--only", choices=("repeat", "cold"), help="one measurement")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--child", choices=("cold", "warm"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(_cold_child(args.child == "warm"))))
        return
    result: dict[str, object] = {}
    if args.only in (None, "repeat"):
        result["repeat"] = asyncio.run(measure_repeat(args.runs))
    if args.only in (None, "cold"):
        result["cold"] = measure_cold(args.runs)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    if "repeat" in result:
        r = result["repeat"]
        assert isinstance(r, dict)
        print(
            f"12 MP EXIF-6 JPEG ({r['file_bytes']} bytes, plan {r['plan']}, {r['tokens']} tokens)"
        )
        print(
            f"  byte-identical repeat: preprocess {r['repeat_preprocess_ms_median']:.2f} ms "
            f"(lookup by digest {r['repeat_lookup_ms_median']:.2f} ms); decode path "
            f"{r['decode_path_preprocess_ms_median']:.1f} ms (medians of {args.runs})"
        )
    if "cold" in result:
        c = result["cold"]
        assert isinstance(c, dict)
        for name, v in c.items():
            print(
                f"  {name}: first {v['first_ms_median']:.1f} ms, warm {v['warm_ms_median']:.1f} ms,"
                f" first/warm {v['first_over_warm_median']:.2f} (warm-up "
                f"{v['warm_up_ms_median']:.0f} ms)"
            )


if __name__ == "__main__":
    main()
