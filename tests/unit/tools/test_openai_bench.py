"""The inputs of ``splitvl bench --openai``: every run sends images no other run sent.

The first version gave every run vLLM's client ``--seed 0`` and one repeat50 file, so the
"distinct" runs after the first (and after the warm-up) were served from splitvl's cache.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from splitvl_tools.openai_bench import (
    DATASETS,
    PRE_ENCODE_SYSTEM,
    WARM_UP,
    WARM_UP_LOAD,
    client_args,
    parse_datasets,
    pre_encode_requests,
    prompts_for,
    run_inputs,
    summarize,
)


def _images(jsonl: Path) -> list[str]:
    return [
        hashlib.sha256(Path(json.loads(line)["image_files"][0]).read_bytes()).hexdigest()
        for line in jsonl.read_text().splitlines()
    ]


def test_no_two_runs_share_an_image_and_each_repeats_about_half(tmp_path: Path) -> None:
    seeds, all_files = run_inputs(
        tmp_path, rounds=2, concurrencies=[1, 8], n=12, side=64, seed=0, datasets=DATASETS
    )
    files = all_files["repeat50"]
    assert set(files) == {WARM_UP} | {(r, c) for r in (0, 1) for c in (1, 8)}
    assert set(seeds) == set(files) | {WARM_UP_LOAD}  # the warm-up under load: random-mm
    assert len(set(seeds.values())) == len(seeds)  # random-mm: a seed per run
    per_run = {
        (dataset, key): _images(path)
        for dataset in ("repeat50", "reencoded50", "preencoded50")
        for key, path in all_files[dataset].items()
    }
    for (dataset, key), images in per_run.items():
        assert len(images) == (4 if key == WARM_UP else 12)
        if key != WARM_UP and dataset in ("repeat50", "preencoded50"):
            repeats = len(images) - len(set(images))
            assert 3 <= repeats <= 9, (key, repeats)  # about half of 12
        others = {h for k, hs in per_run.items() if k != (dataset, key) for h in hs}
        assert not set(images) & others, (dataset, key)


def _pixels(path: str) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"), dtype=np.float64)


def test_reencoded_repeats_are_new_pixels_close_to_their_original(tmp_path: Path) -> None:
    """reencoded50: no two requests send the same bytes or the same pixels (vLLM's caches and
    splitvl's exact key both miss), yet about half are JPEG copies of an earlier image of
    the run, within a re-encode's error of it (what the similarity tier is for)."""
    _, files = run_inputs(tmp_path, rounds=1, concurrencies=[8], n=24, side=64, seed=3)
    lines = [json.loads(line) for line in files["reencoded50"][0, 8].read_text().splitlines()]
    paths = [line["image_files"][0] for line in lines]
    assert len(set(_images(files["reencoded50"][0, 8]))) == 24  # all bytes distinct
    pixels = [_pixels(p).tobytes() for p in paths]
    assert len(set(pixels)) == 24  # all pixels distinct
    originals = [p for p in paths if p.endswith(".png")]
    copies = [p for p in paths if p.endswith(".jpg")]
    assert 6 <= len(copies) <= 18, len(copies)
    for copy in copies:
        stem = Path(copy).stem.split("-")[1]
        (original,) = [p for p in originals if Path(p).stem == stem]
        assert paths.index(original) < paths.index(copy)  # the original was sent first
        diff = _pixels(copy) - _pixels(original)
        psnr = 10 * np.log10(255.0**2 / float(np.mean(diff**2)))
        assert psnr > 28, (copy, psnr)
        # Not a near-copy of any other original: the factory's images are dissimilar.
        for other in originals:
            if other != original:
                assert float(np.abs(_pixels(copy) - _pixels(other)).mean()) > 10


def test_repeat100_sends_only_the_warm_ups_images(tmp_path: Path) -> None:
    _, files = run_inputs(tmp_path, rounds=2, concurrencies=[1, 8], n=10, side=64, seed=0)
    warm = set(_images(files["repeat50"][WARM_UP]))
    assert WARM_UP not in files["repeat100"]
    for key, path in files["repeat100"].items():
        images = _images(path)
        assert len(images) == 10 and set(images) == warm, key
    # Only what runs gets files; repeat50 always (its warm-up is repeat100's).
    (tmp_path / "only").mkdir()
    _, only = run_inputs(tmp_path / "only", 1, [1], 4, 64, 0, ["distinct", "repeat100"])
    assert sorted(only) == ["distinct", "repeat100", "repeat50"]
    assert set(only["repeat100"]) == {(0, 1)} and only["distinct"] == {}


def test_the_ceiling_divides_splitvls_all_hits_rate_by_vllms_repeat50_rate() -> None:
    def run(rps: float) -> dict[str, Any]:
        return {"request_throughput": rps, "failed": 0}

    results = {
        "vllm_serve": {
            "repeat50": {"32": [run(2.0), run(4.0)]},
            "repeat100": {"32": [run(5.0)] * 2},
        },
        "splitvl": {
            "repeat50": {"32": [run(3.0), run(5.0)]},
            "repeat100": {"32": [run(6.0), run(6.0)]},
        },
    }
    results["splitvl"]["repeat50"]["32"][0]["cache_tiers"] = {"exact": 2.0, "miss": 3.0}
    results["splitvl"]["repeat50"]["32"][1]["cache_tiers"] = {"exact": 1.0, "miss": 4.0}
    report = summarize(results, [32], ["repeat50", "repeat100"])
    assert report["table"]["repeat50_c32"]["splitvl"]["cache_tiers"] == {"exact": 3, "miss": 7}
    ratios = report["ratios"]
    assert ratios["rps_ratio_repeat50_c32"] == {"median": 1.375, "min": 1.25, "max": 1.5}
    assert ratios["ceiling_rps_ratio_repeat50_c32"] == {"median": 2.25, "min": 1.5, "max": 3.0}
    assert parse_datasets("repeat100, distinct") == ["distinct", "repeat100"]
    with pytest.raises(ValueError, match="repeat75"):
        parse_datasets("distinct,repeat75")


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
    assert {key: len(_images(path)) for key, path in files["repeat50"].items()} == {
        WARM_UP: 4,
        (0, 1): 16,
        (0, 8): 32,
    }


def test_preencoded50_has_repeat50s_mix_and_its_pre_encode_sends_each_image_once_elsewhere(
    tmp_path: Path,
) -> None:
    """preencoded50's file repeats the same requests as repeat50's of its run (one seed for
    the mix) over images of its own; the pre-encode sends each distinct image once, the
    pixels of the file, after a system message the measured requests lack (so vLLM's
    prefix cache cannot serve the run's blocks from it)."""
    import base64
    import io

    _, files = run_inputs(tmp_path, 1, [8], 12, 64, 5, ["repeat50", "preencoded50"])
    pre, rep = files["preencoded50"][0, 8], files["repeat50"][0, 8]

    def mix(path: Path) -> list[int]:  # which earlier request each request repeats
        images = _images(path)
        return [images.index(h) for h in images]

    assert mix(pre) == mix(rep) and not set(_images(pre)) & set(_images(rep))
    bodies = pre_encode_requests(pre, "m")
    paths = list(
        dict.fromkeys(json.loads(x)["image_files"][0] for x in pre.read_text().splitlines())
    )
    assert len(bodies) == len(set(_images(pre))) == len(paths) < 12
    for body, path in zip(bodies, paths, strict=True):
        system, user = body["messages"]
        assert system == {"role": "system", "content": PRE_ENCODE_SYSTEM}
        assert body["max_tokens"] == 1 and body["model"] == "m"
        url = user["content"][0]["image_url"]["url"]
        data = base64.b64decode(url.split(",", 1)[1])
        with Image.open(io.BytesIO(data)) as sent:
            assert np.array_equal(np.asarray(sent.convert("RGB"), dtype=np.float64), _pixels(path))


def test_the_vit_free_ceiling_divides_splitvls_preencoded_rate_by_vllms_repeat50_rate() -> None:
    def run(rps: float) -> dict[str, Any]:
        return {"request_throughput": rps, "failed": 0}

    results: dict[str, Any] = {
        "vllm_serve": {"repeat50": {"32": [run(2.0), run(4.0)]}, "preencoded50": {}},
        "splitvl": {
            "repeat50": {"32": [run(3.0), run(5.0)]},
            "preencoded50": {"32": [run(4.0), run(4.4)]},
        },
    }
    report = summarize(results, [32], ["repeat50", "preencoded50"])
    ratios = report["ratios"]
    assert ratios["vit_free_ceiling_rps_ratio_repeat50_c32"] == {
        "median": 1.55,
        "min": 1.1,
        "max": 2.0,
    }
    assert "rps_ratio_preencoded50_c32" not in ratios  # vllm serve never runs it
    assert report["table"]["preencoded50_c32"]["vllm_serve"] == {}
