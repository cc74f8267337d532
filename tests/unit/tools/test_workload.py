"""The benchmark's workload generator and the FLOPs model behind the bench checkpoint."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from splitvl.tiny_model import BENCH_OVERRIDES
from splitvl_tools.flops import QWEN3_VL_2B, vit_to_llm_ratio
from splitvl_tools.workload import MAX_UNIQUE_SIMILARITY, ImageFactory, make_workload
from vlcommon.imaging import similarity_descriptor


def _descriptor(data: bytes) -> np.ndarray:
    return similarity_descriptor(Image.open(io.BytesIO(data)).convert("RGB"))


def test_unique_images_are_pairwise_dissimilar_and_repeats_are_designed() -> None:
    factory = ImageFactory(side=224, seed=3)
    work = make_workload(factory, requests=24, repeat_fraction=0.5, seed=11)
    kinds = [k for r in work for k in r.kinds]
    uniques = [r.images[0] for r in work if r.kinds[0] == "unique"]
    assert (kinds.count("unique"), kinds.count("exact"), kinds.count("near")) == (12, 6, 6)
    assert work[0].kinds == ["unique"]  # without a pool the first image has nothing to repeat
    d = np.stack([_descriptor(b) for b in uniques])
    sims = d @ d.T - np.eye(len(uniques)) * 2
    assert sims.max() < MAX_UNIQUE_SIMILARITY
    for req in work:
        assert Image.open(io.BytesIO(req.images[0])).size == (224, 224)
        if req.kinds[0] == "near":  # a JPEG re-encode of an earlier image: a similarity hit
            best = max(float(_descriptor(req.images[0]) @ e) for e in d)
            assert best > 0.95


def test_repeats_come_from_the_pool_only_and_their_count_is_exact() -> None:
    factory = ImageFactory(side=64, seed=8)
    pool = [factory.make() for _ in range(3)]
    pool_pixels = {np.asarray(im).tobytes() for im in pool}
    for requests in (1, 4, 7):
        work = make_workload(factory, requests=requests, repeat_fraction=0.5, seed=4, pool=pool)
        kinds = [r.kinds[0] for r in work]
        assert len(kinds) - kinds.count("unique") == round(0.5 * requests)
        for req in work:
            pixels = np.asarray(Image.open(io.BytesIO(req.images[0])).convert("RGB"))
            if req.kinds[0] == "exact":  # lossless copy of a pool image, never of a new one
                assert pixels.tobytes() in pool_pixels
            elif req.kinds[0] == "unique":
                assert pixels.tobytes() not in pool_pixels
    every = make_workload(factory, requests=5, repeat_fraction=1.0, seed=4, pool=pool)
    assert all(r.kinds[0] in ("exact", "near") for r in every)


def test_same_seed_same_workload() -> None:
    a = make_workload(ImageFactory(side=64, seed=5), requests=6, repeat_fraction=0.5, seed=2)
    b = make_workload(ImageFactory(side=64, seed=5), requests=6, repeat_fraction=0.5, seed=2)
    assert [r.images for r in a] == [r.images for r in b]
    assert [r.prompt for r in a] == [r.prompt for r in b]


def test_bench_checkpoint_matches_the_2b_vit_to_llm_ratio() -> None:
    ratio_2b = vit_to_llm_ratio(QWEN3_VL_2B)
    vision = {
        "spatial_merge_size": 2,
        "patch_size": 16,
        "temporal_patch_size": 2,
        **BENCH_OVERRIDES["vision"],
    }
    bench = {"vision": vision, "text": BENCH_OVERRIDES["text"]}
    assert 0.95 < ratio_2b < 1.1
    assert abs(vit_to_llm_ratio(bench) / ratio_2b - 1) < 0.1


async def test_open_loop_starts_every_request_without_waiting_for_answers() -> None:
    import asyncio

    from splitvl_tools.bench import Sample, run_load
    from splitvl_tools.workload import Request

    started: list[str] = []
    release = asyncio.Event()

    async def call(req: Request) -> Sample:
        started.append(req.prompt)
        await release.wait()  # no answer until every request has arrived
        return Sample(0.0, 0.0, [], 1)

    requests = [Request([], f"p{i}", []) for i in range(5)]
    task = asyncio.ensure_future(run_load(requests, 32, call, rate=500.0, seed=1))
    while len(started) < 5:
        await asyncio.sleep(0.01)
    assert started == [f"p{i}" for i in range(5)]  # arrivals did not wait for answers
    release.set()
    samples, _ = await task
    assert len(samples) == 5


def test_rss_sampler_counts_cpu_seconds_per_process_and_child() -> None:
    """The bench's per-process CPU accounting: a busy child is charged to ``tree/<name>``,
    not to the tree's own process, and the process's own spin to ``tree``."""
    import os
    import subprocess
    import sys
    import time

    from splitvl_tools.bench import RssSampler

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < {}: pass\n"
    # The child spins 0.5 s of CPU when told, says so, and stays alive until told again
    # (a child that has exited is no longer in the tree when the block ends).
    script = "import sys\nsys.stdin.readline()\n" + spin.format(0.5)
    script += "print('spun', flush=True)\nsys.stdin.readline()\n"
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        time.sleep(0.5)  # the child's interpreter start-up happens before the block
        with RssSampler({"bench": os.getpid()}) as sampler:
            child.stdin.write("go\n")
            child.stdin.flush()
            exec(spin.format(0.3))
            assert child.stdout.readline().strip() == "spun"
        name = next(k for k in sampler.cpu_s if k.startswith("bench/"))
        assert 0.25 <= sampler.cpu_s["bench"] < 0.5
        assert sampler.cpu_s[name] >= 0.3
    finally:
        child.kill()
        child.wait()
        child.stdin.close()
        child.stdout.close()


def test_conc1_pairs_get_fresh_images_and_their_ratio_is_the_median_over_pairs() -> None:
    """Issue 14: the one-at-a-time ratios come from alternating pairs, each on images of
    its own, as the median of the pairs' ratios (not a ratio of medians over phases)."""
    from splitvl_tools.bench import CONC1, Plan, build_workloads, pair_ratios, ratios

    plan = Plan(
        concurrency=4, requests=4, requests_conc1=2, max_tokens=4, reps=1, side=64,
        images_per_request=1, seed=3, conc1_pairs=3,
    )  # fmt: skip
    works = build_workloads(plan, seed_offset=900, scenarios=CONC1, reps=plan.conc1_pairs)
    assert set(works) == set(CONC1) and all(len(w) == 3 for w in works.values())
    firsts = [w["requests"][0].images[0] for w in works["repeat0_conc1"]]
    assert len(set(firsts)) == 3  # fresh images in every pair
    assert "warmup" in works["repeat50_conc1"][0] and "warmup" not in works["repeat0_conc1"][0]

    rows = [
        {"pair": i, "scenario": s, "first": "vllm", "rps_ratio": r, "ttft_ratio": 1 / r}
        for s, values in (("repeat0_conc1", (0.9, 1.2, 1.0)), ("repeat50_conc1", (1.1, 2.0)))
        for i, r in enumerate(values)
    ]
    pairs = pair_ratios(rows)
    assert pairs["rps_ratio_repeat0_conc1"] == {"median": 1.0, "min": 0.9, "max": 1.2, "pairs": 3}
    assert pairs["rps_ratio_repeat50_conc1"]["median"] == 1.55
    # The phase medians (2.0 / 1.0 here) would give another answer: the pairs win.
    table = {
        system: {
            scenario: {"requests_per_s": {"median": value}}
            for scenario in ("repeat0_conc1", "repeat50_conc1")
        }
        for system, value in (("split_cache", 2.0), ("vllm", 1.0))
    }
    assert ratios(table, [], None, pairs)["rps_ratio_repeat0_conc1"] == 1.0
    assert ratios(table, [], None)["rps_ratio_repeat0_conc1"] == 2.0
