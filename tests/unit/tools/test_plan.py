"""``splitvl plan``: the simulation against queueing results it must reproduce, the
planner's search and its command line; the calibration on real services is
tests/e2e/test_plan.py."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from splitvl_tools import plan_measure
from splitvl_tools.plan import (
    Profile,
    Replicas,
    SideTimes,
    Workload,
    answer,
    plan,
    simulate,
)


def profile(**over: Any) -> Profile:
    """A profile with every service time 0 except those given (ms)."""
    side = SideTimes(
        preprocess_ms={"miss": 0.0, "hit": 0.0},
        lookup_ms={"miss": 0.0, "hit": 0.0},
        encode_image_ms=0.0,
        prefill_ms={"miss": 0.0, "hit": 0.0},
    )
    base = Profile(
        sides={128: side},
        encode_batch_ms=0.0,
        encode_delay_ms=0.0,
        encoder_max_batch=8,
        encoder_max_wait_ms=0.0,
        decoder_delay_ms=0.0,
        step_ms=0.0,
        step_per_seq_ms=0.0,
        client_delay_ms={"miss": 0.0, "hit": 0.0},
    )
    side_over = {k: over.pop(k) for k in list(over) if hasattr(side, k)}
    return replace(base, sides={128: replace(side, **side_over)}, **over)


@pytest.mark.parametrize("rho", [0.3, 0.7])
@pytest.mark.parametrize("times", [[10.0], [5.0, 15.0]])
def test_one_server_is_an_mg1_queue(rho: float, times: list[float]) -> None:
    """Poisson arrivals at one server (the cache lookup) whose time is drawn from the
    observed ``times``: the mean time in the system is E[S] + lambda E[S^2] / (2 (1 - rho))
    (Pollaczek-Khinchine), the server's utilisation rho = lambda E[S]."""
    s_ms = sum(times) / len(times)
    s2 = sum(t * t for t in times) / len(times)
    p = profile(lookup_ms={"miss": times, "hit": times})
    rate = rho / (s_ms / 1000)
    pred = simulate(p, Workload(rate, {128: 1.0}, 0.5, 1), requests=40_000, seed=1)
    expected = s_ms + (rate / 1000) * s2 / (2 * (1 - rho))
    assert pred.ttft_mean_ms == pytest.approx(expected, rel=0.05)
    assert pred.utilisation["cache"] == pytest.approx(rho, abs=0.02)
    assert pred.req_per_s == pytest.approx(rate, rel=0.05)


def test_decoder_steps_serve_running_sequences_together() -> None:
    """A step serves every running sequence: with a step of 10 ms whatever the batch,
    one request alone takes max_tokens steps, and many at once take no longer each (the
    engine's throughput grows with the batch); with one sequence at a time it saturates
    at 1 / (max_tokens x 10 ms)."""
    p = profile(step_ms=10.0)
    alone = simulate(p, Workload(0.5, {128: 1.0}, 0.0, 8), requests=300)
    assert alone.ttft_p50_ms == pytest.approx(10.0, abs=0.01)
    assert alone.e2e_p50_ms == pytest.approx(80.0, abs=0.01)
    busy = simulate(p, Workload(200.0, {128: 1.0}, 0.0, 8), requests=4000)
    assert busy.e2e_p50_ms <= 90.0  # at most one step waiting for the batch's next step
    assert busy.req_per_s == pytest.approx(200.0, rel=0.05)
    one_at_a_time = replace(p, max_num_seqs=1)
    q = simulate(one_at_a_time, Workload(10.0, {128: 1.0}, 0.0, 8), requests=4000)
    assert q.utilisation["decoder"] == pytest.approx(10.0 * 0.080, abs=0.03)
    assert q.e2e_p50_ms > 100.0  # queued behind others: 80 ms of service, plus waiting


def test_encoder_batches_queued_images() -> None:
    """b0 = 8 ms per ViT call and b1 = 1 ms per image: one image at a time the encoder
    serves at most 1 / 9 ms = 111 images/s; batching up to 8 it keeps up with 300/s
    (busy nearly all the time, as a batching server is, its queue short)."""
    p = profile(encode_batch_ms=8.0, encode_image_ms=1.0)
    pred = simulate(p, Workload(300.0, {128: 1.0}, 0.0, 1), requests=6000)
    assert pred.req_per_s == pytest.approx(300.0, rel=0.05)
    assert pred.e2e_p50_ms < 30.0  # a batch or two of waiting, no growing queue
    single = simulate(replace(p, encoder_max_batch=1), Workload(100.0, {128: 1.0}, 0.0, 1))
    assert single.utilisation["encoder"] == pytest.approx(100 * 0.009, abs=0.03)


def test_affinity_routing_keeps_repeats_where_their_prefix_is() -> None:
    """Two decoders: routed by image, a repeat finds its image in the decoder's prefix
    cache nearly always; round robin only where an earlier turn of the spread happened to
    put it (an image served twice is held by both decoders)."""
    p = profile(step_ms=5.0, prefill_ms={"miss": 20.0, "hit": 2.0})
    work = Workload(5.0, {128: 1.0}, 0.5, 4)
    affinity = simulate(p, work, Replicas(decoder=2), requests=3000)
    spread = simulate(p, work, Replicas(decoder=2, routing="round_robin"), requests=3000)
    assert affinity.prefix_hit_rate > 0.9
    assert 0.4 < spread.prefix_hit_rate < affinity.prefix_hit_rate - 0.2
    assert affinity.ttft_mean_ms < spread.ttft_mean_ms  # fewer full prefills


def test_planner_grows_the_bottleneck_and_meets_the_target() -> None:
    """The decoder is the bottleneck (one sequence at a time, 40 ms a request): the answer
    adds decoders as the rate grows, never encoders or caches, and its prediction meets
    the target; a target below the no-queue TTFT has no answer."""
    p = replace(profile(step_ms=5.0, lookup_ms={"miss": 1.0, "hit": 1.0}), max_num_seqs=1)
    chosen = []
    for rate in (5.0, 30.0, 60.0):
        candidates = plan(p, Workload(rate, {128: 1.0}, 0.5, 8), p95_ttft_ms=200.0, requests=800)
        best = answer(candidates)
        assert best is not None
        assert best.prediction.ttft_p95_ms <= 200.0
        assert (best.replicas.encoder, best.replicas.cache) == (1, 1)
        chosen.append(best.replicas.decoder)
    assert chosen == sorted(chosen) and chosen[0] < chosen[-1]
    impossible = plan(p, Workload(5.0, {128: 1.0}, 0.5, 8), p95_ttft_ms=3.0, requests=400)
    assert answer(impossible) is None


def test_a_seed_whose_arrivals_came_slower_than_nominal_still_meets() -> None:
    """Seed 4's 100 counted arrivals come at 8.3/s for a nominal 10/s: a system that keeps
    up with every one of them meets the target (it was refused against the nominal rate,
    so the search said no configuration met it when the real run did)."""
    p = profile(lookup_ms={"miss": 1.0, "hit": 1.0})
    work = Workload(10.0, {128: 1.0}, 0.5, 8)
    drawn = simulate(p, work, Replicas(), requests=150, seed=4)
    assert drawn.offered_per_s < 0.9 * work.rate  # the draws came slow...
    assert drawn.req_per_s >= drawn.offered_per_s  # ...and every one was served at once
    best = answer(plan(p, work, p95_ttft_ms=50.0, max_replicas=1, requests=150, seed=4))
    assert best is not None and best.replicas.total() == 3


def test_a_side_without_times_is_refused() -> None:
    with pytest.raises(ValueError, match=r"image sides \[256\]"):
        simulate(profile(), Workload(1.0, {256: 1.0}))


def test_profile_round_trips_through_json() -> None:
    p = profile(step_ms=3.5, lookup_ms={"miss": 1.5, "hit": 0.5}, encode_batch_ms=2.0)
    assert Profile.from_json(p.to_json()) == p


def _splitvl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "splitvl.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_command_answers_from_a_profile(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(replace(profile(step_ms=5.0), max_num_seqs=1).to_json())
    common = ("--profile", str(path), "--rate", "30", "--p95-ttft-ms", "200", "--max-tokens", "8")
    done = _splitvl(*common, "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["answer"]["replicas"]["decoder"] >= 2  # 30/s x 40 ms: one cannot
    assert result["answer"]["prediction"]["ttft_p95_ms"] <= 200
    table = _splitvl(*common)
    assert table.stdout.startswith("answer: 1 encoder, ")
    bad = _splitvl("--profile", str(path), "--rate", "3", "--p95-ttft-ms", "9", "--sides", "x")
    assert bad.returncode == 2 and "--sides 'x': expected SIDE[:WEIGHT]" in bad.stderr
    missing = _splitvl(
        "--profile", str(tmp_path / "nope.json"), "--rate", "1", "--p95-ttft-ms", "9"
    )
    assert missing.returncode == 2 and "cannot read --profile" in missing.stderr
    unknown = _splitvl("--profile", str(path), "--rate", "1", "--p95-ttft-ms", "9", "--sides", "64")
    assert unknown.returncode == 2 and "no calibrated times for image sides [64]" in unknown.stderr


@pytest.mark.parametrize(
    ("cores", "jobs", "expected"),
    [(1, [10.0, 10.0], [20.0, 20.0]), (2, [10.0, 10.0], [10.0, 10.0]), (2, [10.0] * 3, [15.0] * 3)],
)
def test_host_shares_its_cores(cores: int, jobs: list[float], expected: list[float]) -> None:
    """Processor sharing: jobs started together on a host of ``cores`` each run at
    min(1, cores / jobs) of their speed; a later, shorter job finishes first."""
    import simpy

    from splitvl_tools.plan import _Host

    env = simpy.Environment()
    host = _Host(env, cores)
    finished: list[float] = []

    def job(ms: float) -> Any:
        yield host.work(ms)
        finished.append(env.now)

    for ms in jobs:
        env.process(job(ms))
    env.run()
    assert finished == pytest.approx(expected)
    # 10 ms alone on 1 core, then a 2 ms job at t=4: both at half speed until the short
    # one is done (t=8), the long one then alone: 10 - 4 - 2 = 4 ms more, t=12.
    env, order = simpy.Environment(), []
    host = _Host(env, 1)

    def later(ms: float, at: float, name: str) -> Any:
        yield env.timeout(at)
        yield host.work(ms)
        order.append((name, env.now))

    env.process(later(10.0, 0.0, "long"))
    env.process(later(2.0, 4.0, "short"))
    env.run()
    assert order == [("short", pytest.approx(8.0)), ("long", pytest.approx(12.0))]


def test_a_job_may_keep_several_cores_busy() -> None:
    """A decoder step that keeps 2 cores busy and a 1-core job on a 2-core host: weights
    sum to 3, each runs at 2/3 of its speed; the 4 ms job ends at 6 ms, the step's last
    6 ms then alone: 8 - 4 = 4 ms more, t=10."""
    import simpy

    from splitvl_tools.plan import _Host

    env, order = simpy.Environment(), []
    host = _Host(env, 2)

    def job(ms: float, weight: float, name: str) -> Any:
        yield host.work(ms, weight)
        order.append((name, env.now))

    env.process(job(8.0, 2.0, "step"))
    env.process(job(4.0, 1.0, "lookup"))
    env.run()
    assert order == [("lookup", pytest.approx(6.0)), ("step", pytest.approx(10.0))]


def test_a_trace_is_replayed_as_given() -> None:
    """A real run's arrivals replayed: at one 10 ms server, the second request (5 ms after
    the first) waits 5 ms, the third (100 ms later) none; req/s is the requests over first
    arrival -> last answer (3 in 110 ms)."""
    from splitvl_tools.plan import Arrival

    p = profile(lookup_ms={"miss": 10.0, "hit": 10.0})
    trace = [Arrival(0.0, 128, "unique", 0), Arrival(5.0, 128, "unique", 1)]
    trace.append(Arrival(100.0, 128, "exact", 0))
    pred = simulate(p, Workload(1.0, {128: 1.0}), trace=trace)
    assert pred.requests == 3
    assert (pred.ttft_p50_ms, pred.ttft_p95_ms) == (10.0, 15.0)
    assert pred.req_per_s == pytest.approx(3 / 0.115, rel=1e-3)
    assert pred.hit_rate == pytest.approx(1 / 3, abs=1e-3)  # the repeat hits (hit_of_repeats 1)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs is 0"),  # the step loop would never admit one
        ({"step_ms": float("nan")}, "step_ms: expected a time"),
        ({"step_ms": float("inf")}, "step_ms: expected a time"),
        ({"step_ms": -5}, "step_ms: expected a time"),
        ({"decoder_delay_ms": -3.0}, "decoder_delay_ms: expected a time"),
        ({"encode_delay_ms": []}, "encode_delay_ms: expected a time"),
        ({"client_delay_ms": {"miss": 1.0}}, "client_delay_ms: expected an object with the tiers"),
        ({"step_cores": 0}, "step_cores is 0"),
        ({"encoder_max_batch": True}, "encoder_max_batch is True"),
        ({"hit_of_repeats": 2.0}, "hit_of_repeats is 2.0"),
        ({"sides": []}, "'sides' must be an object"),
        ({"sides": {}}, "sides: no image side calibrated"),
        ({"sides": {"128": {"preprocess_ms": [1.0]}}}, "cannot read --profile"),
        ({"step_ms": "fast"}, "step_ms: expected a time"),
    ],
)
def test_a_profile_the_simulation_cannot_run_is_refused(
    tmp_path: Path, change: dict[str, Any], named: str
) -> None:
    """Found by an adversarial pass: max_num_seqs 0 hung the simulation, NaN step times
    printed NaN as JSON, an empty list of observed times or a missing tier raised a
    traceback. Every such profile is refused at load, naming the field (exit 2)."""
    data = json.loads(profile(step_ms=5.0).to_json())
    data.update(change)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    done = _splitvl("--profile", str(path), "--rate", "5", "--p95-ttft-ms", "500")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    assert named in done.stderr


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--sides", "128:nan", "sides and weights must be finite"),
        ("--sides", "128:1e400", "sides and weights must be finite"),
        ("--rate", "1e-300", "expected a finite rate >= 0.001"),
        ("--rate", "inf", "expected a finite rate >= 0.001"),
    ],
)
def test_flags_out_of_range_are_refused(tmp_path: Path, flag: str, value: str, named: str) -> None:
    path = tmp_path / "profile.json"
    path.write_text(profile(step_ms=5.0).to_json())
    args = {"--rate": "5", "--sides": "128", "--p95-ttft-ms": "500", flag: value}
    done = _splitvl("--profile", str(path), *(x for kv in args.items() for x in kv))
    assert done.returncode == 2 and named in done.stderr, done.stderr


def _decoder_bound(rate: float, seed: int = 3) -> tuple[Profile, Workload, list[Any]]:
    """One sequence at a time, 40 ms a request (8 tokens of 5 ms): a profile, a workload
    at ``rate`` and 300 Poisson arrivals of it, each a new image."""
    import random

    from splitvl_tools.plan import Arrival

    p = replace(profile(step_ms=5.0, lookup_ms={"miss": 1.0, "hit": 1.0}), max_num_seqs=1)
    rng = random.Random(seed)
    trace = [
        Arrival(0.0 if i == 0 else rng.expovariate(rate) * 1000, 128, "unique", i)
        for i in range(300)
    ]
    return p, Workload(rate, {128: 1.0}, 0.5, 8), trace


#: A smaller search than the command's (up to 3 of each, 800 simulated requests each).
SMALL: dict[str, Any] = {"max_replicas": 3, "requests": 800}


def test_validate_checks_the_recommended_counts_on_the_runs_arrivals() -> None:
    """At 60 requests/s of 40 ms each (2.4 decoders busy), a 200 ms p95 needs 3 decoders:
    replayed on the run's arrivals, 3 meet it and 2 fall behind. Against the measurement:
    the configuration that ran agrees when its measured p95 lands on the side of the SLO
    the planner predicts, and the check says so when it does not."""
    p, work, trace = _decoder_bound(60.0)
    check = plan_measure.check_replicas(
        p, work, trace, p95_ttft_ms=200.0, ran=Replicas(decoder=3), ran_p95_ms=150.0, **SMALL
    )
    assert check["recommended"] == {"encoder": 1, "decoder": 3, "cache": 1}
    three, two = check["replay"]
    assert (three["decoder"], three["meets"]) == (3, True) and three["ttft_p95_ms"] <= 200
    assert (two["decoder"], two["meets"]) == (2, False)
    assert two["req_per_s"] < 0.97 * 60  # 2 x 25/s served: the queue grows
    assert check["minimal"] is True
    assert (check["planner_says_ran_meets"], check["ran_meets"], check["agrees"]) == (
        True,
        True,
        True,
    )
    assert check["ran_replay"] == three and check["search_matches_replay"] is True
    # Measured 250 ms on 3 decoders: the planner said it would meet 200 ms; it did not.
    missed = plan_measure.check_replicas(
        p, work, trace, p95_ttft_ms=200.0, ran=Replicas(decoder=3), ran_p95_ms=250.0, **SMALL
    )
    assert (missed["ran_meets"], missed["agrees"]) == (False, False)
    # Two decoders ran and missed: the planner agrees that two do not meet it.
    two_ran = plan_measure.check_replicas(
        p, work, trace, p95_ttft_ms=200.0, ran=Replicas(decoder=2), ran_p95_ms=900.0, **SMALL
    )
    assert (two_ran["planner_says_ran_meets"], two_ran["agrees"]) == (False, True)
    # A target below one request's own time: no answer, nothing replayed.
    none = plan_measure.check_replicas(
        p, work, trace, p95_ttft_ms=3.0, ran=Replicas(), ran_p95_ms=45.0, **SMALL
    )
    assert (none["recommended"], none["replay"], none["minimal"]) == (None, [], None)


def test_the_validation_report_says_req_per_s_matches_by_construction() -> None:
    """The req/s ratio replays the run's own arrivals: the table's header and the note
    under it say it is 1.00 by construction; each run's replica check is one line."""
    from splitvl_tools.plan_cli import _validation_table

    figures = {"ttft_p50_ms": 50.0, "ttft_p95_ms": 80.0, "req_per_s": 3.0}
    counts = {"encoder": 1, "decoder": 1, "cache": 1}
    result = {
        "decoders": 1,
        "req_per_s_note": plan_measure.REQ_PER_S_NOTE,
        "runs": [
            {
                "utilisation": 0.35,
                "rate": 3.0,
                "predicted": figures,
                "measured": figures,
                "ratio": {k: 1.0 for k in figures},
                "replicas": {
                    "p95_ttft_ms": 90.0,
                    "recommended": counts,
                    "replay": [{**counts, "ttft_p95_ms": 80.0, "req_per_s": 3.0, "meets": True}],
                    "minimal": True,
                    "ran": counts,
                    "planner_says_ran_meets": True,
                    "ran_meets": False,
                    "agrees": False,
                    "ran_replay": {**counts, "ttft_p95_ms": 80.0, "req_per_s": 3.0, "meets": True},
                    "search_matches_replay": True,
                },
            }
        ],
    }
    table = _validation_table(result).splitlines()
    assert table[1].endswith("| req/s pred / meas (1.00 by construction) |")
    assert "1.00 by construction" in plan_measure.REQ_PER_S_NOTE
    assert plan_measure.REQ_PER_S_NOTE in table
    assert table[-1] == (
        "  utilisation 0.35: SLO 90 ms: recommends 1e/1d/1c; on the run's arrivals "
        "1e/1d/1c p95 80 ms meets (minimal); ran 1e/1d/1c: planner says meets, measured "
        "misses (DISAGREES); replayed p95 80 ms, 3 req/s (matches the search)"
    )
