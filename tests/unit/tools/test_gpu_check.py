"""The GPU check (scripts/gpu_check.py): its CPU dry run (scripts/gpu_check.sh --dry-run),
so the script that waits for a lent GPU machine is known to work before one is lent, and
each of its comparisons fed a wrong result, so a pass on the GPU means something.

The check is there to say three things on a GPU: packing images into one ViT call does
not change any image's embedding; the monolithic model and the same model fed the
encoder's embeddings give the same greedy tokens; the similarity search finds what an
exhaustive search finds. Here (no GPU) each comparison runs on the CPU, right and broken.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _gpu_check() -> ModuleType:
    """scripts/gpu_check.py as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_check_dry_run_writes_every_step(tmp_path: Path) -> None:
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    assert "gpu check passed" in run.stdout
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["dry_run"] is True and report["device"] == "cpu"
    assert report["checkpoint"]["like"] == "tiny" and report["checkpoint"]["bytes"] > 0

    batching = report["encoder_batching"]
    assert batching["images"] == 4 and len(batching["tokens"]) == 4
    # The speedup is the two medians' ratio (what the GPU run is read for).
    one, batched = batching["ms_per_image_one_at_a_time"], batching["ms_per_image_batched"]
    assert batching["batching_speedup"] == pytest.approx(
        one["median"] / batched["median"], rel=0.01
    )
    # An image's embedding does not depend on the others packed beside it (bf16 rounding
    # aside): a batch that mixed images up differs by the embeddings' own scale (the
    # broken batch below).
    assert batching["max_abs_diff_alone_vs_batched"] < 0.05 * batching["max_abs_embedding"]

    # The monolithic model and the same model fed the encoder's embeddings agree, and the
    # fed embeddings do reach the model: reversed, they change the answer.
    equality = report["equality"]
    assert equality["all_equal"] is True and equality["controls_differ"] is True
    assert [r["image"] for r in equality["images"]] == ["astronaut.png", "chelsea.png"]
    for r in equality["images"]:
        assert r["monolithic"] == r["encoder_fed"] and len(r["monolithic"]) == 8
        assert r["first_difference"] is None
    first, second = (r["monolithic"] for r in equality["images"])
    assert first != second  # the image decides the answer

    index = report["similarity_index"]
    assert index["faiss_gpu"] is False and "carry limit" in index["faiss_gpu_note"]
    assert index["entries"] == 2_000 and index["queries"] == 50
    # The exact search finds the brute-force answer, which is the entry each query copies.
    assert index["recall_at_1"] == 1.0 and index["truth_is_the_copied_entry"] == 1.0


def _broken_encode(monkeypatch: pytest.MonkeyPatch, broken: Any) -> None:
    """VisionEngine.encode with ``broken(outputs)`` applied to what it returns."""
    from encoder_service.engine import VisionEngine

    real = VisionEngine.encode
    monkeypatch.setattr(VisionEngine, "encode", lambda self, images: broken(real(self, images)))


def test_the_batching_check_flags_a_batch_that_mixes_images_up(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A packed call whose outputs are split at the wrong rows (each image gets some of
    its neighbour's tokens, as an offset bug in the packing would): the difference from
    the images encoded alone is past the dry run's bound."""
    import torch

    def misaligned(out: list[Any]) -> list[Any]:
        if len(out) == 1:
            return out
        rows = [len(e) for e in out]
        return list(torch.cat(out).roll(rows[0] // 2, dims=0).split(rows))

    _broken_encode(monkeypatch, misaligned)
    gpu_check = _gpu_check()
    report = gpu_check.check_batching(tiny_model, "cpu", images=4, reps=1)
    assert report["max_abs_diff_alone_vs_batched"] >= 0.05 * report["max_abs_embedding"]
    # ...and the check's verdict fails on it (a GPU run would print FAILED, exit 1).
    fine = {"equality": {"all_equal": True, "controls_differ": True}}
    assert gpu_check.verdict_failures(fine) == []
    [why] = gpu_check.verdict_failures({**fine, "encoder_batching": report})
    assert why.startswith("a packed batch differs")
    [why] = gpu_check.verdict_failures({**fine, "similarity_index": {"recall_at_1": 0.5}})
    assert why.startswith("recall@1 0.5")


def test_the_equality_check_fails_when_the_encoder_feeds_wrong_embeddings(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The encoder's embeddings with their tokens in reverse order reach the model: the
    fed answer differs from the monolithic one for every photo, and the check fails."""
    _broken_encode(monkeypatch, lambda out: [e.flip(0) for e in out])
    names = ["astronaut.png", "chelsea.png"]
    report = _gpu_check().check_equality(tiny_model, "cpu", names, max_tokens=8)
    assert report["all_equal"] is False
    for r in report["images"]:
        assert r["tokens_equal"] is False and r["monolithic"] != r["encoder_fed"], r["image"]
        assert r["first_difference"] == next(
            i
            for i, (a, b) in enumerate(zip(r["monolithic"], r["encoder_fed"], strict=True))
            if a != b
        )


def test_recall_is_measured_against_brute_force_and_falls_with_a_wrong_index() -> None:
    """Recall is counted against an exhaustive float64 search, not against the index's own
    answers: an index wrong for every other query has recall 0.5, one always wrong 0."""
    gpu_check = _gpu_check()

    def wrong_every_other(index: Any, queries: Any) -> Any:
        ids = gpu_check.exact_search(index, queries).clone()
        ids[::2] = (ids[::2] + 1) % len(index)  # the next entry: a different vector
        return ids

    def always_wrong(index: Any, queries: Any) -> Any:
        return (gpu_check.exact_search(index, queries) + 1) % len(index)

    right = gpu_check.check_similarity_index("cpu", entries=2_000, queries=50)
    assert right["recall_at_1"] == 1.0 and right["truth_is_the_copied_entry"] == 1.0
    half = gpu_check.check_similarity_index("cpu", 2_000, 50, search=wrong_every_other)
    assert half["recall_at_1"] == 0.5
    assert (
        gpu_check.check_similarity_index("cpu", 2_000, 50, search=always_wrong)["recall_at_1"]
        == 0.0
    )
