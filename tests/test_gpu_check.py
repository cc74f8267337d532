"""The GPU check's CPU dry run (scripts/gpu_check.sh --dry-run): the script that waits
for a lent GPU machine runs every step here, so it is known to work before one is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_check_dry_run_writes_every_step(tmp_path: Path) -> None:
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["dry_run"] is True and report["device"] == "cpu"
    assert report["checkpoint"]["like"] == "tiny" and report["checkpoint"]["bytes"] > 0

    batching = report["encoder_batching"]
    assert batching["images"] == 4 and len(batching["tokens"]) == 4
    assert all(t > 0 for t in batching["tokens"])
    assert batching["ms_per_image_batched"]["median"] > 0
    assert batching["batching_speedup"] > 0
    # An image's embedding does not depend on the others packed beside it (bf16 rounding
    # aside): a batch that mixed images up would differ by the embeddings' own scale.
    assert batching["max_abs_diff_alone_vs_batched"] < 0.05 * batching["max_abs_embedding"]

    # The monolithic model and the same model fed the encoder's embeddings agree, and the
    # fed embeddings do reach the model: reversed, they change the answer.
    equality = report["equality"]
    assert equality["all_equal"] is True and equality["controls_differ"] is True
    assert [r["image"] for r in equality["images"]] == ["astronaut.png", "chelsea.png"]
    assert all(len(r["monolithic"]) == 8 for r in equality["images"])
    first, second = (r["monolithic"] for r in equality["images"])
    assert first != second  # the image decides the answer

    index = report["similarity_index"]
    assert index["faiss_gpu"] is False and "carry limit" in index["faiss_gpu_note"]
    assert index["recall_at_1"] == 1.0 and index["entries"] == 2_000
