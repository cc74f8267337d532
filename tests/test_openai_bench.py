"""The inputs of ``splitvl bench --openai``: every run sends images no other run sent.

The first version gave every run vLLM's client ``--seed 0`` and one repeat50 file, so the
"distinct" runs after the first (and after the warm-up) were served from splitvl's cache.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from splitvl_tools.openai_bench import WARM_UP, client_args, prompts_for, run_inputs


def _images(jsonl: Path) -> list[str]:
    return [
        hashlib.sha256(Path(json.loads(line)["image_files"][0]).read_bytes()).hexdigest()
        for line in jsonl.read_text().splitlines()
    ]


def test_no_two_runs_share_an_image_and_each_repeats_about_half(tmp_path: Path) -> None:
    seeds, files = run_inputs(tmp_path, rounds=2, concurrencies=[1, 8], n=12, side=64, seed=0)
    assert set(seeds) == set(files) == {WARM_UP} | {(r, c) for r in (0, 1) for c in (1, 8)}
    assert len(set(seeds.values())) == len(seeds)  # random-mm: a seed per run
    per_run = {key: _images(path) for key, path in files.items()}
    for key, images in per_run.items():
        assert len(images) == (4 if key == WARM_UP else 12)
        if key != WARM_UP:
            repeats = len(images) - len(set(images))
            assert 3 <= repeats <= 9, (key, repeats)  # about half of 12
        others = {h for k, hs in per_run.items() if k != key for h in hs}
        assert not set(images) & others, key


def test_the_seed_reaches_vllms_client(tmp_path: Path) -> None:
    argv = client_args(
        "http://x", "m", "distinct", tmp_path / "f.jsonl", 1, 4, 8, 64, tmp_path / "r.json", 1234
    )
    assert argv[argv.index("--seed") + 1] == "1234"


def test_without_requests_each_concurrency_runs_four_times_its_prompts(tmp_path: Path) -> None:
    """One burst of exactly 32 requests at concurrency 32 measured the ramp, not the steady
    state; the default is now four bursts' worth (at least 16)."""
    assert [prompts_for(c) for c in (1, 8, 32)] == [16, 32, 128]
    assert prompts_for(32, requests=10) == 10
    _, files = run_inputs(tmp_path, rounds=1, concurrencies=[1, 8], n=0, side=64, seed=0)
    assert {key: len(_images(path)) for key, path in files.items()} == {
        WARM_UP: 4,
        (0, 1): 16,
        (0, 8): 32,
    }
