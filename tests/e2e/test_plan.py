"""The end-to-end tests of tests/unit/tools/test_plan.py
(the services started); the rest of that file runs without them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from splitvl_tools import plan_measure
from splitvl_tools.plan import (
    Replicas,
    Workload,
    simulate,
)


def test_calibration_on_the_services(cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration measures every stage on the real services, and the simulation of an
    open-loop run's own arrivals predicts that run's TTFT.

    At 3 requests/s the services are idle most of the time, so the predicted TTFT is the
    sum of the stage times the calibration has just measured (preprocess, lookup, encode
    for a miss, prefill, the client's share), drawn call by call, plus a little queueing.
    The run differs from it by this shared host's drift between the two (docs/planner.md:
    tens of percent within minutes) and by the noise of a median of 16 calls split
    between hits (about 35 ms here) and misses (about 55 ms). On this 2-core host, busy
    with other tests, 14 such runs gave predicted / measured p50 0.91-1.32 overall and
    0.93-1.29 for the misses: hence 1.5x either way. That is no accuracy test (the runs of
    docs/planner.md are); it fails a prediction of the wrong thing: a time in the wrong
    unit, TTFT taken at the last of the 8 tokens (about 1.7x), queueing the run did not
    have, repeats that do not hit as they did.
    """
    import os

    from splitvl.client import build_request
    from splitvl_tools.plan import Arrival
    from splitvl_tools.workload import ImageFactory, make_workload

    monkeypatch.setattr(plan_measure, "CALIBRATE_REQUESTS", 10)
    monkeypatch.setattr(plan_measure, "BURST_REQUESTS", 12)
    address = cluster.ports.address("gateway")
    encoders = [cluster.ports.metrics[n] for n in cluster.instances("encoder")]
    p = plan_measure.calibrate(
        address,
        encoders,
        sides=[96],
        max_tokens=8,
        seed=4242,
        log=lambda line: None,
        processes=plan_measure.processes(cluster),
    )
    side = p.sides[96]
    # Every call's own time is kept (the simulation draws from them): 10 calls, 5 repeats.
    assert sum(len(side.lookup_ms[t]) for t in ("miss", "hit")) == 10  # type: ignore[arg-type]
    # Open loop on the same services right after: 16 calls, half of them repeats.
    n, rate = 16, 3.0
    work = make_workload(ImageFactory(side=96, seed=77), requests=n, repeat_fraction=0.5, seed=77)
    requests = [build_request(r.images, r.prompt, max_tokens=8, ignore_eos=True) for r in work]
    gaps = plan_measure.poisson_gaps(n, rate, seed=1)
    assert gaps[0] == 0 and all(g > 0 for g in gaps[1:])
    calls, elapsed = asyncio.run(plan_measure.run_calls(address, requests, gaps_s=gaps))
    real = plan_measure.measured(calls, elapsed)
    assert real["answered"] == n and real["failed"] == 0
    # The same arrivals and repeats simulated, as `splitvl plan --validate` does.
    trace = [
        Arrival(gap * 1000, 96, r.kinds[0], r.sources[0]) for gap, r in zip(gaps, work, strict=True)
    ]
    replicas = Replicas(host_cores=len(os.sched_getaffinity(0)))
    pred = plan_measure._median_prediction(
        [
            simulate(p, Workload(rate, {96: 1.0}, 0.5, 8), replicas, seed=s, trace=trace)
            for s in range(plan_measure.PREDICTION_SEEDS)
        ]
    )
    # The repeats hit as often as in the calibration: within two calls of 16.
    assert pred["hit_rate"] == pytest.approx(real["hit_rate"], abs=2 / n), (pred, real)
    ratios = {
        "p50": pred["ttft_p50_ms"] / real["ttft_p50_ms"],
        "p50 miss": pred["ttft_p50_ms_by_tier"]["miss"] / real["ttft_p50_ms_by_tier"]["miss"],
    }
    assert all(1 / 1.5 <= r <= 1.5 for r in ratios.values()), (ratios, pred, real)
