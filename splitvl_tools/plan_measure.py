"""What ``splitvl plan`` measures on real services: the calibration that makes a
:class:`~splitvl_tools.plan.Profile`, and the open-loop runs its predictions are
checked against (``splitvl plan --validate``).

Calibration, on a running cluster (one of each service, fresh caches):

1. per image side, ``WARMUP_REQUESTS`` calls not measured, then ``CALIBRATE_REQUESTS``
   one at a time (half designed repeats): each answer's stage timings
   (``GenerateResponse.timings``) by tier, kept call by call (the simulation draws from
   them), the client's TTFT beyond the stages, and the encoder's batch duration at
   batch 1 (its ``splitvl_encoder_batch_duration_seconds``);
2. ``BURST_REQUESTS`` new images at ``BURST_CONCURRENCY`` streams, one output token each:
   the encoder's mean batch size and duration there give the per-image batch cost;
3. text-only streams one at a time and ``BURST_CONCURRENCY`` at a time: the decode
   step's cost at one and at several running sequences (the client's inter-token
   latency), and the CPU that relaying each token costs the gateway, the decoder's front
   process and the client (their CPU time per token), which the simulation charges to
   the host's cores when the services share one.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from splitvl_tools.plan import (
    BURST_CONCURRENCY,
    BURST_REQUESTS,
    CALIBRATE_REQUESTS,
    Arrival,
    Profile,
    Replicas,
    SideTimes,
    Time,
    Workload,
)

ENC_DURATION = "splitvl_encoder_batch_duration_seconds"
ENC_IMAGES = "splitvl_encoder_batch_images"
#: PIDs by service (:func:`processes`), or None for services this host does not run.
Processes = Mapping[str, Sequence[int]] | None
#: Simulations of each validation run's own arrivals (their service times drawn anew).
PREDICTION_SEEDS = 5
#: Calls of each side before its measured ones (not recorded).
WARMUP_REQUESTS = 24
#: What the validation's req/s ratio is: the simulation replays the run's own arrival
#: times, and below saturation both finish about when the arrivals stop.
REQ_PER_S_NOTE = (
    "req/s: the simulation replays the run's own arrivals, so below saturation its ratio is "
    "1.00 by construction; it would fall only for a queue that grows (the run falling behind)"
)


@dataclass
class Observed:
    """One call as the client saw it (s) and the gateway's stage timings (ms)."""

    ok: bool
    tier: str = ""
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)


async def observe(stub: Any, request: Any, deadline_s: float = 120.0) -> Observed:
    """One streamed Generate: tier of its image (``miss`` when encoded, else ``hit``),
    TTFT, the gaps between token chunks, and the last message's stage timings."""
    import grpc

    from splitvl.client import TIER_NAMES

    out = Observed(ok=True)
    t0 = last = time.perf_counter()
    try:
        async for chunk in stub.Generate(request, timeout=deadline_s):
            now = time.perf_counter()
            if chunk.images:
                name = TIER_NAMES.get(chunk.images[0].tier, "?")
                out.tier = "hit" if name in ("exact", "similar") else "miss"
            if chunk.token_ids:
                if out.ttft_s is None:
                    out.ttft_s = now - t0
                else:
                    out.itl_s.extend([(now - last) / len(chunk.token_ids)] * len(chunk.token_ids))
                last = now
            if chunk.HasField("timings"):
                t = chunk.timings
                out.stages = {
                    name: getattr(t, f"{name}_ms")
                    for name in ("preprocess", "lookup", "encode", "ttft", "decode", "total")
                }
    except grpc.aio.AioRpcError:
        out.ok = False
    out.e2e_s = time.perf_counter() - t0
    return out


async def run_calls(
    address: str,
    requests: Sequence[Any],
    *,
    concurrency: int | None = None,
    gaps_s: Sequence[float] | None = None,
    channels: int = 4,
) -> tuple[list[Observed], float]:
    """Every request once: ``concurrency`` at a time (closed loop), or open loop, request
    k sent ``gaps_s[k]`` seconds after request k-1 (:func:`poisson_gaps`; no cap, so
    queueing shows in TTFT).

    Returns:
        The calls in order, and the seconds from the first send to the last answer.
    """
    from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

    from vlcommon.settings import channel_options
    from vlcommon.tls import ClientSecurity, aio_channel

    security = ClientSecurity.from_env()
    chans = [aio_channel(address, security, options=channel_options()) for _ in range(channels)]
    stubs = [pb_grpc.GatewayServiceStub(ch) for ch in chans]
    try:
        t0 = time.perf_counter()
        if gaps_s is None:
            gate = asyncio.Semaphore(concurrency or 1)

            async def bounded(i: int, req: Any) -> Observed:
                async with gate:
                    return await observe(stubs[i % len(stubs)], req)

            calls = list(await asyncio.gather(*(bounded(i, r) for i, r in enumerate(requests))))
        else:
            tasks = []
            for i, (req, gap) in enumerate(zip(requests, gaps_s, strict=True)):
                await asyncio.sleep(gap)
                tasks.append(asyncio.ensure_future(observe(stubs[i % len(stubs)], req)))
            calls = list(await asyncio.gather(*tasks))
        return calls, time.perf_counter() - t0
    finally:
        for ch in chans:
            await ch.close()


def poisson_gaps(n: int, rate: float, seed: int) -> list[float]:
    """``n`` exponential inter-arrival times (s) of Poisson arrivals at ``rate``/s; the
    first is 0 (the run starts with a request)."""
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(rate) for _ in range(n - 1)]


def _median(values: Sequence[float], default: float = 0.0) -> float:
    return float(statistics.median(values)) if values else default


def _histogram(ports: Sequence[int], name: str) -> tuple[float, float]:
    """(sum, count) of a histogram over the given metrics ports."""
    from splitvl_tools.scale_bench import metric

    return (
        sum(metric(p, f"{name}_sum") for p in ports),
        sum(metric(p, f"{name}_count") for p in ports),
    )


def _delta_mean(before: tuple[float, float], after: tuple[float, float]) -> float:
    count = after[1] - before[1]
    return (after[0] - before[0]) / count if count > 0 else 0.0


def _by_tier(calls: Sequence[Observed], value: Callable[[Observed], float]) -> dict[str, Time]:
    """The observed values of ``value`` per tier (sorted, ms, 0.1 ms steps, none below 0);
    a tier with no call takes the other's."""
    seen = {
        t: sorted(round(max(0.0, value(c)), 1) for c in calls if c.ok and c.tier == t)
        for t in ("miss", "hit")
    }
    miss = seen["miss"] or seen["hit"] or [0.0]
    return {"miss": miss, "hit": seen["hit"] or miss}


def calibrate(
    address: str,
    encoder_metrics: Sequence[int],
    *,
    sides: Sequence[int],
    max_tokens: int,
    seed: int,
    log: Callable[[str], None],
    processes: Processes = None,
    max_num_seqs: int = 128,
) -> Profile:
    """Measure a running cluster (module docstring) and return its :class:`Profile`.

    Args:
        address: The gateway.
        encoder_metrics: The encoders' Prometheus ports.
        sides: Image sides to calibrate, pixels (the first also takes the burst).
        max_tokens: Output tokens per calibration request.
        seed: Seed of the calibration images (use one the measured runs do not).
        processes: PIDs of the gateway and the decoders when they run on this host
            (:func:`processes`): the relay of tokens is then their CPU time per token;
            without them it is 0.
    """
    from encoder_service.settings import EncoderSettings

    enc = EncoderSettings()
    per_side = {
        side: _one_at_a_time(
            address, encoder_metrics, side, max_tokens, seed + side, log, processes
        )
        for side in sides
    }
    first = sides[0]
    batch_ms, batch_n = _encoder_burst(address, encoder_metrics, first, seed + 7, log)
    one_ms, encode_cores = per_side[first][1], per_side[first][2]
    # b0 + b1 n: batch 1 (one at a time) and the burst's mean batch; without batching in the
    # burst (n ~ 1) there is no slope to fit: every image costs its batch-1 time.
    b1 = (batch_ms - one_ms) / (batch_n - 1) if batch_n > 1.2 else one_ms
    b1 = min(max(b1, 0.0), one_ms)
    b0 = one_ms - b1
    all_calls = [c for calls, _, _ in per_side.values() for c in calls if c.ok]
    decode = _decode_runs(address, max_tokens, processes, log)
    itl_1 = decode["d0"] + decode["d1"]
    times: dict[int, SideTimes] = {}
    for side, (calls, enc_ms, _) in per_side.items():
        ok = [c for c in calls if c.ok]
        times[side] = SideTimes(
            preprocess_ms=_by_tier(ok, lambda c: c.stages.get("preprocess", 0.0)),
            lookup_ms=_by_tier(ok, lambda c: c.stages.get("lookup", 0.0)),
            encode_image_ms=round(max(0.0, enc_ms - b0), 3),
            # The decoder's first step is the prefill and a decode step (d0 + d1 at one).
            prefill_ms=_by_tier(ok, lambda c: c.stages.get("ttft", 0.0) - itl_1),
        )
    misses = [c for c in per_side[first][0] if c.ok and c.tier == "miss"]
    encode_delay = _by_tier(
        misses, lambda c: c.stages.get("encode", 0.0) - one_ms - enc.max_wait_ms
    )["miss"]
    client = _by_tier(
        all_calls,
        lambda c: (
            (c.ttft_s or 0.0) * 1000
            - sum(c.stages.get(k, 0.0) for k in ("preprocess", "lookup", "encode", "ttft"))
        ),
    )
    repeats = [c for calls, _, _ in per_side.values() for c in calls[1:] if c.ok]
    hits = sum(c.tier == "hit" for c in repeats)
    designed = round(0.5 * (CALIBRATE_REQUESTS - 1)) * len(sides)
    return Profile(
        sides=times,
        encode_batch_ms=round(b0, 3),
        encode_delay_ms=encode_delay,
        encoder_max_batch=enc.max_batch_images,
        encoder_max_wait_ms=enc.max_wait_ms,
        # The decoder's prefill step is fitted into prefill_ms; what it does before vLLM
        # schedules the request is not separable from the gateway's view: kept at 0.
        decoder_delay_ms=0.0,
        step_ms=round(decode["d0"], 3),
        step_per_seq_ms=round(decode["d1"], 3),
        client_delay_ms=client,
        hit_of_repeats=round(min(1.0, hits / designed), 3) if designed else 1.0,
        relay_ms_per_token=round(decode["relay"], 4),
        step_cores=round(decode["step_cores"], 3),
        encode_cores=round(encode_cores, 3),
        max_num_seqs=max_num_seqs,
        conditions={
            "burst_mean_batch_images": round(batch_n, 2),
            "burst_batch_ms": round(batch_ms, 2),
            "itl_one_ms": round(itl_1, 2),
            **{k: round(v, 3) for k, v in decode.items() if k not in ("d0", "d1", "relay")},
        },
    )


def _one_at_a_time(
    address: str,
    encoder_metrics: Sequence[int],
    side: int,
    max_tokens: int,
    seed: int,
    log: Callable[[str], None],
    processes: Processes = None,
) -> tuple[list[Observed], float, float]:
    """``CALIBRATE_REQUESTS`` calls of one side, one at a time (half designed repeats),
    the encoder's mean batch duration meanwhile (ms), and the cores its batches kept busy
    (its CPU time over their duration; 1 without the processes)."""
    from splitvl_tools.load import build_requests

    requests = build_requests(
        CALIBRATE_REQUESTS, side=side, repeat_fraction=0.5, max_tokens=max_tokens, seed=seed
    )
    # Not measured: a side's first calls are slower (the first ViT call of a shape, first
    # allocations), and each would be drawn as often as any other by the simulation.
    warm = build_requests(
        WARMUP_REQUESTS, side=side, repeat_fraction=0.0, max_tokens=2, seed=seed + 50_000
    )
    asyncio.run(run_calls(address, warm, concurrency=1))
    before = _histogram(encoder_metrics, ENC_DURATION)
    cpu0 = _service_cpu_ms(processes, "encoder", own=True)
    calls, _ = asyncio.run(run_calls(address, requests, concurrency=1))
    cpu_ms = _service_cpu_ms(processes, "encoder", own=True) - cpu0
    after = _histogram(encoder_metrics, ENC_DURATION)
    log(f"  side {side}, one at a time: {sum(c.ok for c in calls)}/{len(calls)} answered")
    busy_ms = (after[0] - before[0]) * 1000
    cores = max(1.0, cpu_ms / busy_ms) if processes and busy_ms > 0 else 1.0
    return calls, _delta_mean(before, after) * 1000, cores


def _encoder_burst(
    address: str, encoder_metrics: Sequence[int], side: int, seed: int, log: Callable[[str], None]
) -> tuple[float, float]:
    """``BURST_REQUESTS`` new images at ``BURST_CONCURRENCY``, one output token each (so
    the decoder barely competes): the encoder's mean batch duration (ms) and size."""
    from splitvl_tools.load import build_requests

    burst = build_requests(BURST_REQUESTS, side=side, repeat_fraction=0.0, max_tokens=1, seed=seed)
    dur0, img0 = _histogram(encoder_metrics, ENC_DURATION), _histogram(encoder_metrics, ENC_IMAGES)
    calls, _ = asyncio.run(run_calls(address, burst, concurrency=BURST_CONCURRENCY))
    dur1, img1 = _histogram(encoder_metrics, ENC_DURATION), _histogram(encoder_metrics, ENC_IMAGES)
    log(f"  encoder burst: {sum(c.ok for c in calls)}/{len(calls)} answered")
    return _delta_mean(dur0, dur1) * 1000, _delta_mean(img0, img1)


def _cpu_ms(pid: int, *, children: bool) -> float:
    """CPU time (user + system, ms) of a process, or of all its descendants."""
    import psutil

    proc = psutil.Process(pid)
    procs = proc.children(recursive=True) if children else [proc]
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total * 1000


def _decode_runs(
    address: str, max_tokens: int, processes: Processes, log: Callable[[str], None]
) -> dict[str, float]:
    """Text-only streams (no encoder, no cache) one at a time and ``BURST_CONCURRENCY`` at
    a time: the decode step ``d0 + d1 x sequences`` from the client's inter-token latency
    at 1 and at B running sequences (B by Little's law: the calls' decode time over the
    run's), and, with the processes, the relay's CPU per token (the gateway, the
    decoder's front process and this client; 0 without them).

    vLLM's engine CPU time is no measure of the step's time: its processes use more CPU
    than the wall time of their steps (measured here: 9.3 ms of CPU per 5.3 ms step),
    which is what ``step_cores`` says (the cores a step keeps busy, one sequence alone).
    """
    from splitvl.client import build_request
    from splitvl_tools.workload import PROMPTS

    points = []
    for n, concurrency in ((6, 1), (BURST_REQUESTS, BURST_CONCURRENCY)):
        requests = [
            build_request([], PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, ignore_eos=True)
            for i in range(n)
        ]
        cpu0 = _relay_cpu_ms(processes)
        engine0 = _service_cpu_ms(processes, "decoder", own=False)
        calls, elapsed = asyncio.run(run_calls(address, requests, concurrency=concurrency))
        cpu1 = _relay_cpu_ms(processes)
        engine_ms = _service_cpu_ms(processes, "decoder", own=False) - engine0
        ok = [c for c in calls if c.ok]
        tokens = max(1, len(ok) * max_tokens)
        running = max(1.0, sum(c.stages.get("decode", 0.0) for c in ok) / (elapsed * 1000))
        itl = _median([x * 1000 for c in ok for x in c.itl_s])
        points.append((running, itl, (cpu1 - cpu0) / tokens, engine_ms / tokens))
        log(f"  text at {concurrency}: {len(ok)}/{n} answered, {running:.2f} running")
    (b_1, itl_1, _, engine_1), (b_n, itl_n, relay, _) = points
    d1 = max(0.0, (itl_n - itl_1) / (b_n - b_1)) if b_n > b_1 + 0.05 else 0.0
    return {
        "d0": max(0.0, itl_1 - d1 * b_1),
        "d1": d1,
        "relay": max(0.0, relay),
        # One sequence alone: the engine's CPU per token over the step's wall time.
        "step_cores": max(1.0, engine_1 / itl_1) if processes and itl_1 > 0 else 1.0,
        "text_running_one": b_1,
        "text_running_burst": b_n,
        "itl_text_one_ms": itl_1,
        "itl_text_burst_ms": itl_n,
    }


def _relay_cpu_ms(processes: Processes) -> float:
    """CPU so far (ms) of the gateway, the decoders' front processes (not their
    children) and this one; 0 without the processes."""
    import os

    if not processes:
        return 0.0
    pids = (*processes["gateway"], *processes["decoder"], os.getpid())
    return sum(_cpu_ms(pid, children=False) for pid in pids)


def _service_cpu_ms(processes: Processes, service: str, *, own: bool) -> float:
    """CPU so far (ms) of a service's processes' descendants (vLLM's engine), and with
    ``own`` of the processes themselves too; 0 without the processes."""
    if not processes:
        return 0.0
    total = 0.0
    for pid in processes[service]:
        total += _cpu_ms(pid, children=True)
        if own:
            total += _cpu_ms(pid, children=False)
    return total


def measured(calls: Sequence[Observed], elapsed_s: float) -> dict[str, Any]:
    """TTFT p50/p95 (ms) and req/s (answered over first send -> last answer) of a run."""
    from splitvl_tools.plan import percentile

    ok = [c for c in calls if c.ok and c.ttft_s is not None]
    ttft = [c.ttft_s * 1000 for c in ok if c.ttft_s is not None]
    return {
        "ttft_p50_ms": round(percentile(ttft, 50), 1) if ttft else None,
        "ttft_p95_ms": round(percentile(ttft, 95), 1) if ttft else None,
        "req_per_s": round(len(ok) / elapsed_s, 3) if elapsed_s else 0.0,
        "hit_rate": round(sum(c.tier == "hit" for c in ok) / len(ok), 3) if ok else 0.0,
        "ttft_p50_ms_by_tier": {
            t: round(percentile([c.ttft_s * 1000 for c in ok if c.tier == t and c.ttft_s], 50), 1)
            for t in ("miss", "hit")
            if any(c.tier == t for c in ok)
        },
        "answered": len(ok),
        "failed": len(calls) - len(ok),
    }


def rate_at(profile: Profile, workload: Workload, replicas: Replicas, utilisation: float) -> float:
    """The arrival rate (requests/s) at which the busiest service's predicted utilisation
    is ``utilisation`` (bisection over short simulations)."""
    from splitvl_tools.plan import simulate

    low, high = 0.01, 1.0
    while (
        max(simulate(profile, _at(workload, high), replicas, requests=400).utilisation.values())
        < utilisation
    ):
        high *= 2
        if high > 1e4:
            break
    for _ in range(14):
        mid = (low + high) / 2
        busiest = max(
            simulate(profile, _at(workload, mid), replicas, requests=400).utilisation.values()
        )
        low, high = (mid, high) if busiest < utilisation else (low, mid)
    return round((low + high) / 2, 3)


def _at(workload: Workload, rate: float) -> Workload:
    return Workload(rate, workload.sides, workload.repeat_fraction, workload.max_tokens)


def validate(
    *,
    model: str | None,
    utilisations: Sequence[float],
    side: int,
    max_tokens: int,
    repeat_fraction: float,
    duration_s: float,
    decoders: int,
    seed: int,
    log: Callable[[str], None],
    p95_ttft_ms: float | None = None,
) -> dict[str, Any]:
    """On a fresh cluster, for each target utilisation: calibrate, run the real workload
    open loop, and simulate that run's own arrivals: predicted against measured TTFT
    p50/p95 and req/s (the last 1.00 by construction: :data:`REQ_PER_S_NOTE`); then the
    planner's replica counts for that run's rate (:func:`check_replicas`).

    Args:
        model: Checkpoint (None: the tiny one).
        utilisations: Loads, as the busiest service's predicted utilisation (0..1).
        side: Image side, pixels.
        max_tokens: Output tokens per request.
        repeat_fraction: Fraction of repeated images.
        duration_s: Seconds of arrivals per load.
        decoders: Decoder replicas (2: the gateway routes by image affinity).
        seed: Seed of the images and arrivals.
        p95_ttft_ms: The SLO the replica counts are checked for, ms; None: twice the
            TTFT p50 the profile predicts with no queueing (a latency SLO that lets
            queueing double the idle time).
    """
    import os

    from splitvl.client import build_request
    from splitvl_tools.cluster import own_cluster
    from splitvl_tools.plan import simulate
    from splitvl_tools.workload import ImageFactory, make_workload

    rows = []
    # Every service on this host, sharing its cores.
    replicas = Replicas(decoder=decoders, host_cores=len(os.sched_getaffinity(0)))
    with own_cluster(
        model=model,
        log_dir=None,
        prefix="splitvl-plan-",
        log=log,
        replicas={"decoder": decoders} if decoders > 1 else None,
    ) as own:
        cluster = own.cluster
        address = cluster.ports.address("gateway")
        encoders = [cluster.ports.metrics[n] for n in cluster.instances("encoder")]
        workload = Workload(1.0, {side: 1.0}, repeat_fraction, max_tokens)
        profiles = []
        for k, target in enumerate(utilisations):
            # Calibrated again right before each run: this shared host's speed drifts by
            # tens of percent within minutes (docs/planner.md), and a profile measured
            # before an earlier run no longer describes the machine of a later one.
            log("calibrating ...")
            profile = calibrate(
                address,
                encoders,
                sides=[side],
                max_tokens=max_tokens,
                seed=seed + 1000 * (k + 1),
                log=log,
                processes=processes(cluster),
            )
            profiles.append(asdict(profile))
            rate = rate_at(profile, workload, replicas, target)
            n = max(60, round(rate * duration_s))
            work = make_workload(
                ImageFactory(side=side, seed=seed + k),
                requests=n,
                repeat_fraction=repeat_fraction,
                seed=seed + k,
            )
            requests = [
                build_request(r.images, r.prompt, max_tokens=max_tokens, ignore_eos=True)
                for r in work
            ]
            gaps = poisson_gaps(n, rate, seed + k)
            log(f"utilisation {target:.2f}: {rate:g} requests/s, {n} requests, open loop ...")
            calls, elapsed = asyncio.run(run_calls(address, requests, gaps_s=gaps))
            real = measured(calls, elapsed)
            # The same arrivals and repeats, simulated with PREDICTION_SEEDS draws of the
            # service times: the median of each figure.
            trace = [
                Arrival(gap * 1000, side, r.kinds[0], r.sources[0])
                for gap, r in zip(gaps, work, strict=True)
            ]
            predicted = _median_prediction(
                [
                    simulate(profile, _at(workload, rate), replicas, seed=s, trace=trace)
                    for s in range(PREDICTION_SEEDS)
                ]
            )
            slo = p95_ttft_ms or 2 * idle_ttft_ms(profile, workload, replicas)
            counts = check_replicas(
                profile,
                _at(workload, rate),
                trace,
                p95_ttft_ms=slo,
                ran=replicas,
                ran_p95_ms=real["ttft_p95_ms"],
            )
            rows.append(
                {
                    "utilisation": target,
                    "rate": rate,
                    "requests": n,
                    "predicted": predicted,
                    "measured": real,
                    "ratio": {
                        key: round(predicted[key] / real[key], 3) if real[key] else None
                        for key in ("ttft_p50_ms", "ttft_p95_ms", "req_per_s")
                    },
                    "replicas": counts,
                }
            )
            log(f"  predicted {predicted}")
            log(f"  measured  {real}")
            log(f"  replicas  {counts}")
        own.ok = True
    return {
        "profiles": profiles,
        "decoders": decoders,
        "runs": rows,
        "req_per_s_note": REQ_PER_S_NOTE,
    }


def idle_ttft_ms(profile: Profile, workload: Workload, replicas: Replicas) -> float:
    """The TTFT p50 the profile predicts with no queueing (arrivals a minute apart), ms."""
    from splitvl_tools.plan import simulate

    return simulate(profile, _at(workload, 1 / 60), replicas, requests=200).ttft_p50_ms


def check_replicas(
    profile: Profile,
    workload: Workload,
    trace: Sequence[Arrival],
    *,
    p95_ttft_ms: float,
    ran: Replicas,
    ran_p95_ms: float | None,
    max_replicas: int = 4,
    requests: int = 2000,
) -> dict[str, Any]:
    """The replica counts the planner recommends for ``workload`` (its search,
    :func:`splitvl_tools.plan.plan`, on Poisson draws at the rate, on ``ran``'s host),
    checked two ways:

    - on the run's own arrivals (``trace`` replayed, :data:`PREDICTION_SEEDS` draws of the
      service times, medians): the recommended counts meet the SLO (p95 TTFT within
      ``p95_ttft_ms``, req/s within 3% of the trace's arrival rate) and one fewer of any
      service with more than one does not; so the answer neither falls short of nor
      exceeds what those arrivals need;
    - against the measurement: the one configuration that ran (``ran``) meets the SLO in
      the planner's search exactly when its measured p95 did (``agrees``). One host runs
      one configuration, so the counts the planner did not pick are not measured.

    Returns:
        ``recommended`` (replicas, or None when no configuration up to ``max_replicas``
        meets the SLO), ``replay`` (p95 ms, req/s and meets, by configuration: the
        recommended one and each one fewer), ``minimal`` (the recommended counts meet
        in the replay and every one fewer does not), ``planner_says_ran_meets``,
        ``ran_meets``, ``agrees``, and ``ran_replay`` with ``search_matches_replay``
        (the configuration that ran, replayed, against the search's verdict on it).
    """
    from splitvl_tools.plan import answer, plan, simulate

    candidates = plan(
        profile,
        workload,
        p95_ttft_ms=p95_ttft_ms,
        max_replicas=max_replicas,
        requests=requests,
        host_cores=ran.host_cores,
    )
    span_s = sum(a.after_ms for a in trace[1:]) / 1000
    arrival_rate = (len(trace) - 1) / span_s if span_s > 0 else workload.rate

    def counts(r: Replicas) -> dict[str, int]:
        return {"encoder": r.encoder, "decoder": r.decoder, "cache": r.cache}

    def replay(r: Replicas) -> dict[str, Any]:
        runs = [
            simulate(profile, workload, r, seed=s, trace=trace) for s in range(PREDICTION_SEEDS)
        ]
        p95 = statistics.median(p.ttft_p95_ms for p in runs)
        rps = statistics.median(p.req_per_s for p in runs)
        meets = p95 <= p95_ttft_ms and rps >= 0.97 * arrival_rate
        return {
            **counts(r),
            "ttft_p95_ms": round(p95, 1),
            "req_per_s": round(rps, 3),
            "meets": meets,
        }

    ran_candidate = next((c for c in candidates if counts(c.replicas) == counts(ran)), None)
    says = ran_candidate.meets if ran_candidate else None
    met = None if ran_p95_ms is None else ran_p95_ms <= p95_ttft_ms
    ran_replay = replay(ran)
    out: dict[str, Any] = {
        "p95_ttft_ms": round(p95_ttft_ms, 1),
        "recommended": None,
        "replay": [],
        "minimal": None,
        "ran": counts(ran),
        "planner_says_ran_meets": says,
        "ran_meets": met,
        "agrees": None if says is None or met is None else says == met,
        # The model on the run's own arrivals: where it differs from the search's verdict
        # (Poisson draws), the search decided by its own arrival sample.
        "ran_replay": ran_replay,
        "search_matches_replay": None if says is None else says == ran_replay["meets"],
    }
    best = answer(candidates)
    if best is None:
        return out
    r = best.replicas
    out["recommended"] = counts(r)
    out["replay"].append(replay(r))
    for service in ("encoder", "decoder", "cache"):
        if getattr(r, service) > 1:
            out["replay"].append(replay(replace(r, **{service: getattr(r, service) - 1})))
    verdicts = [row["meets"] for row in out["replay"]]
    out["minimal"] = verdicts[0] and not any(verdicts[1:])
    return out


def _median_prediction(predictions: Sequence[Any]) -> dict[str, Any]:
    """Each figure's median over several simulations of one trace."""
    out: dict[str, Any] = {}
    for key, value in asdict(predictions[0]).items():
        if isinstance(value, dict):
            seen = [asdict(p)[key] for p in predictions]
            out[key] = {k: round(statistics.median(d[k] for d in seen if k in d), 3) for k in value}
        else:
            out[key] = round(statistics.median(asdict(p)[key] for p in predictions), 3)
    return out


def processes(cluster: Any) -> dict[str, list[int]]:
    """PIDs of a local cluster's services by name (``gateway``, ``decoder``: their front
    processes, whose children run vLLM's engine, ``encoder``)."""
    return {
        service: [cluster.procs[n].pid for n in cluster.instances(service)]
        for service in ("gateway", "decoder", "encoder")
    }
