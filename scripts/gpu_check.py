"""The GPU check: what a lent GPU machine can show without vLLM, in one JSON.

The lent machine (docs/benchmarks.md, "GPU") has Python 3.12 with CUDA torch, transformers,
numpy, Pillow and scikit-image, no network and no vLLM; at most 64 MiB travel with the
tree. This script uses only that (plus two small pure-Python wheels that
``scripts/gpu_check.sh --prepare`` carries) and measures, on a checkpoint it builds:

1. ``checkpoint``: ``make_tiny_model(like="Qwen/Qwen3-VL-2B-Instruct")``, every dimension
   of the real model with random weights (seconds to build, bytes on disk).
2. ``encoder_batching``: the encoder's vision tower (:class:`encoder_service.engine.
   VisionEngine`, in the serving dtype, bf16) on N different photos, one call per image
   against one packed call for all N (what the encoder's dynamic batcher does with N
   requests in flight): milliseconds per image, medians of ``--reps`` runs with their
   spread, the speedup; and the largest difference between an image's embedding encoded
   alone and inside the batch.
3. ``equality``: greedy tokens of transformers' monolithic model on the raw photos against
   the same model fed the encoder's embeddings (its vision tower swapped for the encoder's
   output, as the decoder gets them), float32 with TF32 off (random weights in bf16 make
   greedy decoding a coin toss at near ties); as a control, the embedding with its tokens
   reversed must change the answer.
4. ``similarity_index``: FAISS on the GPU when a faiss-gpu wheel for this Python fits the
   carry limit; it does not (``FAISS_GPU_CU12``, ``CUBLAS_CU12``: faiss-gpu-cu12 needs
   CUDA 12's cuBLAS beside the machine's CUDA 13 torch), so the JSON says so and times an
   exact cosine search in torch on the GPU instead (flat inner product over unit descriptors of
   ``vlcommon.imaging.DESCRIPTOR_DIM``), to compare with the CPU HNSW figures.

``--dry-run`` runs the same steps on the CPU with the tiny checkpoint and small counts:
``tests/unit/tools/test_gpu_check.py`` runs it, so the script is known to work before a GPU is lent.

Usage:
    python scripts/gpu_check.py --out OUT/gpu-check.json [--dry-run] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: Why FAISS on the GPU cannot travel (checked 2026-12-06 with ``pip download``, cp312,
#: manylinux x86_64): wheel sizes in bytes against the 64 MiB carry limit. faiss-gpu-cu12
#: needs CUDA 12's cuBLAS, which the machine's CUDA 13 torch does not bring.
FAISS_GPU_CU12 = ("faiss-gpu-cu12 1.14.1.post1", 48_391_873)
CUBLAS_CU12 = ("nvidia-cublas-cu12 12.6.4.1", 393_138_322)
FAISS_GPU = ("faiss-gpu 1.15.1", 135_286_937)
CARRY_LIMIT_BYTES = 64 * 2**20
#: A similarity index under test: (entries [N, D], queries [Q, D]) -> top-1 ids [Q].
Search = Callable[[Any, Any], Any]
PHOTOS = (
    "astronaut.png",
    "chelsea.png",
    "coffee.png",
    "rocket.jpg",
    "motorcycle_left.png",
    "hubble_deep_field.jpg",
    "immunohistochemistry.png",
    "retina.jpg",
)


def _spread(samples: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(samples), 3),
        "min": round(min(samples), 3),
        "max": round(max(samples), 3),
    }


def _photos(count: int, sizes: list[tuple[int, int]]) -> list[Any]:
    """``count`` different uint8 [H, W, 3] photos: scikit-image's bundled ones, each
    resized to the next of ``sizes`` (a mix of shapes, as real traffic has)."""
    import numpy as np
    from PIL import Image

    from splitvl.video_clips import photo

    out = []
    for i in range(count):
        width, height = sizes[i % len(sizes)]
        image = photo(PHOTOS[i % len(PHOTOS)])
        out.append(np.asarray(image.resize((width, height), Image.Resampling.BICUBIC)))
    return out


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_batching(model: Path, device: str, images: int, reps: int) -> dict[str, Any]:
    """Item 2 of the module docstring."""
    import torch

    from encoder_service.engine import VisionEngine
    from vlcommon.imaging import plan_resize

    engine = VisionEngine.load(str(model), device=device, dtype="bfloat16")
    sizes = [(448, 448), (640, 480), (480, 640), (1024, 768), (512, 384), (336, 336)]
    pixels = _photos(images, sizes)
    prepared = [
        engine.preprocess(p, plan_resize(p.shape[0], p.shape[1], engine.spec, index=i))
        for i, p in enumerate(pixels)
    ]
    engine.encode(prepared[:2])  # warm-up: kernels, allocator
    engine.encode(prepared[:1])
    one_ms: list[float] = []
    batch_ms: list[float] = []
    alone: list[torch.Tensor] = []
    batched: list[torch.Tensor] = []
    for _rep in range(reps):  # interleaved, so a slow moment hits both
        _sync(engine.device)
        t0 = time.perf_counter()
        alone = [engine.encode([p])[0] for p in prepared]
        one_ms.append((time.perf_counter() - t0) * 1000 / images)
        t0 = time.perf_counter()
        batched = engine.encode(prepared)
        batch_ms.append((time.perf_counter() - t0) * 1000 / images)
    diff = max(
        float((a.float() - b.float()).abs().max()) for a, b in zip(alone, batched, strict=True)
    )
    scale = max(float(a.float().abs().max()) for a in alone)
    return {
        "images": images,
        "sizes": sorted({f"{w}x{h}" for w, h in sizes[:images]}),
        "tokens": [p.tokens for p in prepared],
        "dtype": "bfloat16",
        "reps": reps,
        "ms_per_image_one_at_a_time": _spread(one_ms),
        "ms_per_image_batched": _spread(batch_ms),
        "batching_speedup": round(statistics.median(one_ms) / statistics.median(batch_ms), 3),
        "max_abs_diff_alone_vs_batched": diff,
        "max_abs_embedding": scale,
    }


def check_equality(model: Path, device: str, names: list[str], max_tokens: int) -> dict[str, Any]:
    """Item 3 of the module docstring: per photo, the monolithic model's greedy tokens and
    those of the same model fed the encoder's embeddings."""
    import numpy as np
    import torch
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    from encoder_service.engine import VisionEngine
    from splitvl.video_clips import photo
    from vlcommon.imaging import plan_resize

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(device)
    engine = VisionEngine.load(str(model), device=device, dtype="float32")
    proc = AutoProcessor.from_pretrained(model)
    lm = Qwen3VLForConditionalGeneration.from_pretrained(model, dtype=torch.float32)
    lm = lm.to(dev).eval()  # type: ignore[arg-type]  # transformers' stub for .to
    tower = lm.model.visual

    class _Precomputed(torch.nn.Module):
        """Stands in for the vision tower: returns the encoder's output, split back into
        the merged tokens and the deepstack levels, whatever pixels it is given."""

        def __init__(self, embedding: torch.Tensor, levels: int) -> None:
            super().__init__()
            parts = embedding.to(dev).chunk(levels + 1, dim=1)
            self.pooler_output, self.deepstack = parts[0], list(parts[1:])
            self.dtype, self.device = tower.dtype, dev
            self.spatial_merge_size = tower.spatial_merge_size

        def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, **_: Any) -> Any:
            return SimpleNamespace(
                pooler_output=self.pooler_output,
                deepstack_features=self.deepstack,
                last_hidden_state=None,
            )

    levels = len(lm.config.vision_config.deepstack_visual_indexes)
    results = []
    for name in names:
        image = photo(name)
        content = [{"type": "image"}, {"type": "text", "text": "Describe the image."}]
        prompt = proc.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        inputs = proc(text=[prompt], images=[image], return_tensors="pt").to(dev)
        kw = {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "do_sample": False}
        with torch.inference_mode():
            lm.model.visual = tower
            mono = lm.generate(**inputs, **kw)[0, inputs["input_ids"].shape[1] :].tolist()
            pixels = np.asarray(image)
            plan = plan_resize(pixels.shape[0], pixels.shape[1], engine.spec, index=0)
            [embedding] = engine.encode([engine.preprocess(pixels, plan)])
            try:
                lm.model.visual = _Precomputed(embedding, levels)
                fed = lm.generate(**inputs, **kw)[0, inputs["input_ids"].shape[1] :].tolist()
                # The control: the same embedding with its tokens in reverse order must
                # change the answer, or equality above would prove nothing.
                lm.model.visual = _Precomputed(embedding.flip(0), levels)
                control = lm.generate(**inputs, **kw)[0, inputs["input_ids"].shape[1] :]
            finally:
                lm.model.visual = tower
        first_diff = next(
            (i for i, (a, b) in enumerate(zip(mono, fed, strict=True)) if a != b), None
        )
        results.append(
            {
                "image": name,
                "grid": list(plan.grid),
                "tokens_equal": mono == fed,
                "control_differs": control.tolist() != mono,
                "first_difference": first_diff,
                "monolithic": mono,
                "encoder_fed": fed,
            }
        )
    return {
        "dtype": "float32 (TF32 off)",
        "max_new_tokens": max_tokens,
        "all_equal": all(r["tokens_equal"] for r in results),
        "controls_differ": all(r["control_differs"] for r in results),
        "images": results,
    }


def check_similarity_index(
    device: str, entries: int, queries: int, search: Search | None = None
) -> dict[str, Any]:
    """Item 4 of the module docstring: ``queries`` noisy copies of random entries searched
    in an index of ``entries`` unit descriptors; recall@1 against the brute-force truth
    (every inner product, float64), which is the search under test's own answer only when
    that search is right.

    Args:
        search: The index under test, ``(entries [N, D], queries [Q, D]) -> top-1 ids
            [Q]`` (int64, on the entries' device); None: the exact cosine search in torch.
    """
    import torch

    from vlcommon.imaging import DESCRIPTOR_DIM

    wheels_mib = {
        name: round(size / 2**20, 1) for name, size in (FAISS_GPU_CU12, CUBLAS_CU12, FAISS_GPU)
    }
    smallest = FAISS_GPU_CU12[1] + CUBLAS_CU12[1]
    try:
        import faiss  # noqa: F401

        faiss_gpu = hasattr(faiss, "StandardGpuResources")
    except ImportError:
        faiss_gpu = False
    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    unit = torch.nn.functional.normalize
    index = unit(torch.randn(entries, DESCRIPTOR_DIM, generator=gen), dim=1).to(dev)
    picks = torch.randint(0, entries, (queries,), generator=gen)
    noise = torch.randn(queries, DESCRIPTOR_DIM, generator=gen).to(dev)
    noisy = unit(index[picks.to(dev)] + 0.01 * noise, dim=1)

    find = search or exact_search

    def run(q: torch.Tensor) -> torch.Tensor:
        return find(index, q)

    run(noisy[:1])
    _sync(dev)
    one_ms = []
    for i in range(queries):
        t0 = time.perf_counter()
        run(noisy[i : i + 1])
        _sync(dev)
        one_ms.append((time.perf_counter() - t0) * 1000)
    found = run(noisy).cpu()
    truth = brute_force_top1(index, noisy).cpu()
    t0 = time.perf_counter()
    run(noisy)
    _sync(dev)
    batch_ms = (time.perf_counter() - t0) * 1000 / queries
    return {
        "faiss_gpu": faiss_gpu,
        "faiss_gpu_note": (
            "faiss-gpu importable here"
            if faiss_gpu
            else f"no faiss-gpu: the smallest wheel set for Python 3.12 is "
            f"{smallest / 2**20:.0f} MiB against the {CARRY_LIMIT_BYTES / 2**20:.0f} MiB carry "
            f"limit ({wheels_mib})"
        ),
        "stand_in": "exact cosine search in torch (unit descriptors, inner product, top-1)",
        "entries": entries,
        "dim": DESCRIPTOR_DIM,
        "queries": queries,
        "ms_per_query_one_at_a_time": {
            **_spread(one_ms),
            "p99": round(sorted(one_ms)[int(0.99 * (len(one_ms) - 1))], 3),
        },
        "ms_per_query_batched": round(batch_ms, 4),
        "recall_at_1": float((found == truth).float().mean()),
        # Each query is a noisy copy of one entry (noise 1% per dimension): the truth is
        # that entry unless the noise moved it, which it should not at this scale.
        "truth_is_the_copied_entry": float((truth == picks).float().mean()),
    }


def exact_search(index: Any, queries: Any) -> Any:
    """The stand-in index: top-1 inner product of unit vectors (exact cosine search)."""
    return (queries @ index.T).topk(1, dim=1).indices[:, 0]


def brute_force_top1(index: Any, queries: Any, chunk: int = 64) -> Any:
    """The truth recall is measured against: every inner product in float64 (``chunk``
    queries at a time, so 100,000 entries fit the device), the argmax."""
    import torch

    wide = index.double()
    parts = [(q.double() @ wide.T).argmax(dim=1) for q in torch.split(queries, chunk)]
    return torch.cat(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON written")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny checkpoint, small")
    parser.add_argument("--model", type=Path, help="a checkpoint built already")
    parser.add_argument("--work", type=Path, help="where the checkpoint is built (a temp dir)")
    args = parser.parse_args(argv)

    import torch

    from splitvl.tiny_model import make_tiny_model

    dry = args.dry_run
    device = "cpu" if dry or not torch.cuda.is_available() else "cuda"
    report: dict[str, Any] = {
        "dry_run": dry,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    t_all = time.perf_counter()
    model = args.model
    if model is None:
        t0 = time.perf_counter()
        like = None if dry else "Qwen/Qwen3-VL-2B-Instruct"
        model = make_tiny_model(work / "model", like=like)
        size = sum(f.stat().st_size for f in model.iterdir() if f.is_file())
        report["checkpoint"] = {
            "like": like or "tiny",
            "build_s": round(time.perf_counter() - t0, 1),
            "bytes": size,
        }
    steps = {
        "encoder_batching": lambda: check_batching(
            model, device, images=4 if dry else 16, reps=2 if dry else 7
        ),
        "equality": lambda: check_equality(
            model,
            device,
            ["astronaut.png", "chelsea.png"]
            if dry
            else ["astronaut.png", "chelsea.png", "coffee.png"],
            max_tokens=8 if dry else 32,
        ),
        "similarity_index": lambda: check_similarity_index(
            device, entries=2_000 if dry else 100_000, queries=50 if dry else 500
        ),
    }
    for name, step in steps.items():
        t0 = time.perf_counter()
        try:
            report[name] = step()
        except Exception as exc:  # one step failing must not lose the others' figures
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        report[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {json.dumps(report[name])[:300]}", flush=True)
    report["seconds"] = round(time.perf_counter() - t_all, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    failed = [n for n in steps if "error" in report[n]]
    ok = not failed and not verdict_failures(report)
    for why in verdict_failures(report) if not failed else []:
        print(f"FAILED: {why}", flush=True)
    print(f"gpu check {'passed' if ok else 'FAILED'}: {args.out}", flush=True)
    return 0 if ok else 1


#: A packed batch may differ from one-at-a-time encodes by bf16 rounding only: at most
#: this share of the largest embedding value (the dry run's bound,
#: tests/unit/tools/test_gpu_check.py).
BATCH_TOLERANCE = 0.05
#: The similarity index must find the copied entry for nearly every query.
MIN_RECALL_AT_1 = 0.99


def verdict_failures(report: dict[str, Any]) -> list[str]:
    """What makes the check fail beyond a step's error: tokens differing with the
    encoder's embeddings, a batch that differs from one-at-a-time encodes beyond
    :data:`BATCH_TOLERANCE`, or recall@1 under :data:`MIN_RECALL_AT_1`."""
    out = []
    equality = report.get("equality", {})
    if not (equality.get("all_equal") and equality.get("controls_differ")):
        out.append("the tokens with the encoder's embeddings differ from the model's own")
    batching = report.get("encoder_batching", {})
    if "max_abs_diff_alone_vs_batched" in batching:
        bound = BATCH_TOLERANCE * batching["max_abs_embedding"]
        if not batching["max_abs_diff_alone_vs_batched"] < bound:
            out.append(f"a packed batch differs from one-at-a-time encodes by more than {bound}")
    recall = report.get("similarity_index", {}).get("recall_at_1")
    if recall is not None and recall < MIN_RECALL_AT_1:
        out.append(f"recall@1 {recall} is under {MIN_RECALL_AT_1}")
    return out


if __name__ == "__main__":
    sys.exit(main())
