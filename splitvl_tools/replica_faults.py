"""``splitvl faults``: replicas killed, stores lost and every replica restarted, under load.

A cluster with two replicas of the encoder, the cache and the decoder (the caches sharing
a local redis-server), the gateway routing decoder calls by image affinity, and
``concurrency`` streaming Generate calls looping the whole time (half the images repeats;
half the workers with the cache off, so the encoders work in every step).
One step after another, each followed by a load window of ``window`` seconds:

==================  ==============================================================
step                what happens at its start
==================  ==============================================================
``baseline``        nothing
``cache_killed``    SIGKILL of cache-1 (its process group)
``cache_back``      cache-1 started again on its port, SERVING
``encoder_killed``  SIGKILL of encoder-1
``encoder_back``    encoder-1 started again
``decoder_killed``  SIGKILL of decoder-1 (vLLM's engine and worker with it)
``decoder_back``    decoder-1 started again
``store_killed``    SIGKILL of the redis-server
``store_back``      the redis-server started again (empty: it saves nothing)
``rolling``         each replica in turn stopped with SIGTERM (it drains), started
                    again and SERVING before the next (``rolling``: which ones,
                    by default all six)
==================  ==============================================================

What a client may see (:func:`verdicts`): every call answered. Answers in progress on a
killed or drained decoder move to the other one (request migration,
``splitvl_gateway_migrations_total``); the only failure allowed is an answer that could
not move (UNAVAILABLE, ErrorInfo reason ``DECODER_LOST_MID_STREAM``), ended while decoder-1
was dead, at most one per call then in flight. None hangs or ends after its deadline
(+ slack), nothing is INTERNAL or UNKNOWN. Beside the statuses the drill records what
proves the mechanism: the gateway's replays on the other decoder
(``splitvl_gateway_decoder_routes_total{how="failover"}``) and its migrations in the kill
and the rolling steps, decoder-1's answers once back
(its keys returned), the caches' store errors while the store was down
(``splitvl_cache_store_errors_total``), and a probe image stored and then found as an
exact hit after the store returned (caching resumed, no restart).

Usage::

    splitvl faults                      # 60 s windows, 16 concurrent, the tiny checkpoint
    splitvl faults --window 15 --rate 8 --json   # paced: 8 calls started per second

The test (tests/e2e/replicated/test_replica_faults.py) runs the same drill with 10 s windows,
paced to 8 calls/s, and rolls only the replicas the earlier steps did not restart (cache-2,
encoder-2, decoder-2): under a closed loop on CI's 2 cores a decoder takes about 2 minutes
to start again and an encoder about 1.5.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from splitvl.argtypes import positive_float, positive_int
from splitvl.launcher import Cluster
from splitvl_tools.load import BAD_CODES, HUNG, CallResult, build_requests, one_call
from splitvl_tools.plan import percentile
from vlcommon.refusals import Refusal

STEPS = (
    "baseline",
    "cache_killed",
    "cache_back",
    "encoder_killed",
    "encoder_back",
    "decoder_killed",
    "decoder_back",
    "store_killed",
    "store_back",
    "rolling",
)
#: What ``splitvl faults`` starts: two of each replicated service.
REPLICAS = {"encoder": 2, "cache": 2, "decoder": 2}
#: The only failure a client may see: an answer whose decoder died and that could not
#: move to the other (its ErrorInfo reason).
LOST_MID_STREAM = Refusal.DECODER_LOST_MID_STREAM


@dataclass
class Call:
    """One load call: the step it started in, the step it ended in, its result."""

    started: str
    ended: str
    result: CallResult


@dataclass
class Drill:
    """The drill over a running cluster (see the module docstring).

    Args:
        cluster: Two replicas of encoder, cache and decoder, caches on ``store_server``.
        window_s: Seconds of load after each step.
        concurrency: Calls in flight (workers, each calling in a loop).
        rate: Calls started per second over all workers, at most (None: each worker
            calls again as soon as its call ends, a closed loop that keeps every core
            busy). A paced load leaves the restarts CPU: the test uses it on 2 cores.
        deadline_s: Each call's gRPC deadline.
        slack_s: Past deadline + slack a call is ``HUNG``.
        log: Progress lines.
        rolling: The replicas the ``rolling`` step restarts, in order (None: every one).
    """

    cluster: Cluster
    window_s: float = 60.0
    concurrency: int = 16
    deadline_s: float = 60.0
    slack_s: float = 10.0
    log: Callable[[str], None] = print
    rolling: Sequence[str] | None = None
    rate: float | None = None
    step: str = "baseline"
    calls: list[Call] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    step_times: dict[str, float] = field(default_factory=dict)

    # -- metrics -----------------------------------------------------------------------

    def metric(self, name: str, sample: str, **labels: str) -> float:
        """One sample of instance ``name``'s Prometheus metrics, summed over the other
        labels (0 when absent or unreachable)."""
        from prometheus_client.parser import text_string_to_metric_families

        port = self.cluster.ports.metrics[name]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return 0.0
        return sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def failovers(self) -> float:
        return self.metric("gateway", "splitvl_gateway_decoder_routes_total", how="failover")

    def store_errors(self) -> float:
        return sum(
            self.metric(n, "splitvl_cache_store_errors_total")
            for n in self.cluster.instances("cache")
        )

    def migrations(self) -> float:
        return self.metric("gateway", "splitvl_gateway_migrations_total")

    def decoder_answers(self, name: str) -> float:
        return self.metric(name, "splitvl_decoder_requests_total", method="Generate", code="OK")

    # -- the steps ---------------------------------------------------------------------

    async def enter(
        self, step: str, action: Callable[[], object] | None = None, *, before: bool = False
    ) -> None:
        """Run ``action`` (off the event loop) and hold ``step``'s window after it.

        Args:
            before: ``step`` begins as the action starts (a kill: a call it cuts off ends
                in ``step``); otherwise once the action is done (a restart: until it is
                SERVING, the previous step's state holds).
        """
        t0 = time.monotonic()
        if before:
            self.step = step
        if action is not None:
            await asyncio.to_thread(action)
        self.step = step
        self.step_times[step] = round(time.monotonic() - t0, 1)
        self.log(f"  {step} ({self.step_times[step]:.0f} s to get there)")
        await asyncio.sleep(self.window_s)

    async def steps(self, stub: Any, probe: Any) -> None:
        c = self.cluster
        await self.enter("baseline")
        await self.enter("cache_killed", lambda: c.kill("cache-1"), before=True)
        await self.enter("cache_back", lambda: c.restart("cache-1"))
        await self.enter("encoder_killed", lambda: c.kill("encoder-1"), before=True)
        await self.enter("encoder_back", lambda: c.restart("encoder-1"))
        before, moved = self.failovers(), self.migrations()
        await self.enter("decoder_killed", lambda: c.kill("decoder-1"), before=True)
        self.facts["failovers_decoder_killed"] = self.failovers() - before
        self.facts["migrations_decoder_killed"] = self.migrations() - moved
        await self.enter("decoder_back", lambda: c.restart("decoder-1"))
        self.facts["decoder_1_answers_once_back"] = self.decoder_answers("decoder-1")
        server = c.store_server
        assert server is not None, "the drill needs the caches' redis-server"
        before = self.store_errors()
        await self.enter("store_killed", server.kill, before=True)
        self.facts["store_errors_store_killed"] = self.store_errors() - before
        await self.enter("store_back", server.start)
        self.facts["probe_after_store_back"] = await self.until_exact(stub, probe)
        moved = self.migrations()
        await self.enter("rolling", self.rolling_restart, before=True)
        self.facts["migrations_rolling"] = self.migrations() - moved

    def rolling_restart(self) -> None:
        """Each replica in turn: SIGTERM (it drains), start again, SERVING, then the next."""
        codes = {}
        names = self.cluster.instances("cache", "encoder", "decoder")
        for name in names if self.rolling is None else self.rolling:
            codes[name] = self.cluster.terminate(name)
            self.cluster.restart(name)
            self.log(f"    {name} restarted (drain exit code {codes[name]})")
        self.facts["rolling_exit_codes"] = codes

    async def until_exact(self, stub: Any, request: Any, timeout_s: float = 60.0) -> list[str]:
        """Ask ``request`` until its image is an exact hit (stored, then found); the tiers
        of the last answer."""
        end = time.monotonic() + timeout_s
        while True:
            r = await one_call(stub, request, self.deadline_s, self.slack_s)
            if r.code == "OK" and r.tiers == ["exact"] or time.monotonic() > end:
                return r.tiers if r.code == "OK" else [r.code]
            await asyncio.sleep(0.5)

    # -- the load ------------------------------------------------------------------------

    async def run(self, requests: list[Any], probe: Any) -> None:
        """The load and the steps. Odd workers send their requests with the cache off, so
        the encoders work in every step (the pool's images are all cached within seconds)."""
        from qwenvl.common.v1 import generation_pb2
        from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

        from vlcommon.settings import channel_options
        from vlcommon.tls import aio_channel

        security = self.cluster.security()
        address = self.cluster.ports.address("gateway")
        channels = [aio_channel(address, security, options=channel_options()) for _ in range(4)]
        stubs = [pb_grpc.GatewayServiceStub(ch) for ch in channels]
        stop = asyncio.Event()
        turn = 0
        uncached = []
        for r in requests:
            copy = type(r)()
            copy.CopyFrom(r)
            copy.cache_policy = generation_pb2.CACHE_POLICY_OFF
            uncached.append(copy)

        async def worker(w: int) -> None:
            nonlocal turn
            pool = uncached if w % 2 else requests
            # Paced: each worker starts a call every `period` seconds at most, the workers
            # spread over the first period (worker w starts at w / rate).
            period = self.concurrency / self.rate if self.rate else 0.0
            await asyncio.sleep(w / self.rate if self.rate else 0.0)
            while not stop.is_set():
                request = pool[turn % len(pool)]
                turn += 1
                started, t0 = self.step, time.monotonic()
                result = await one_call(stubs[w % 4], request, self.deadline_s, self.slack_s)
                self.calls.append(Call(started, self.step, result))
                if result.code != "OK":
                    await asyncio.sleep(0.2)  # a failing call ends fast: do not spin
                await asyncio.sleep(max(0.0, period - (time.monotonic() - t0)))

        workers = [asyncio.ensure_future(worker(w)) for w in range(self.concurrency)]
        try:
            await self.steps(stubs[0], probe)
        finally:
            stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
            for ch in channels:
                await ch.close()

    # -- the report ----------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """Statuses per step (by the step each call ended in), the worst end-to-end time,
        the facts gathered, and :func:`verdicts`."""
        by_step: dict[str, dict[str, int]] = {s: {} for s in STEPS}
        misses: dict[str, int] = dict.fromkeys(STEPS, 0)
        examples: dict[str, str] = {}
        for c in self.calls:
            codes = by_step[c.ended]
            codes[c.result.code] = codes.get(c.result.code, 0) + 1
            if c.result.code == "OK" and "miss" in c.result.tiers:
                misses[c.ended] += 1
            if c.result.code != "OK":
                examples.setdefault(c.result.code, c.result.message[:300])
        ok = [c for c in self.calls if c.result.code == "OK"]
        report = {
            "window_s": self.window_s,
            "concurrency": self.concurrency,
            "rate": self.rate,
            "deadline_s": self.deadline_s,
            "calls": len(self.calls),
            "ok": len(ok),
            "statuses_by_step": by_step,
            "encoded_by_step": misses,
            "error_examples": examples,
            "tiers": dict(Counter(t for c in ok for t in c.result.tiers)),
            "max_e2e_s": round(max((c.result.e2e_s for c in self.calls), default=0.0), 2),
            # TTFT p95 of the answered calls by the step they started in: the rolling
            # restart's against the baseline's says what a roll costs the callers.
            "ttft_p95_s_by_step": _ttft_p95_by_step(ok),
            "seconds_to_reach_step": self.step_times,
            **self.facts,
        }
        report["verdicts"] = verdicts(self.calls, report, self.deadline_s + self.slack_s)
        return report


def _ttft_p95_by_step(ok: list[Call]) -> dict[str, float]:
    """TTFT p95 (seconds) of answered calls by the step they started in (nearest rank)."""
    by_step: dict[str, list[float]] = {}
    for c in ok:
        if c.result.ttft_s is not None:
            by_step.setdefault(c.started, []).append(c.result.ttft_s)
    return {step: round(percentile(v, 95), 3) for step, v in by_step.items()}


def verdicts(calls: list[Call], report: dict[str, Any], bound_s: float) -> dict[str, bool]:
    """The drill's pass/fail checks, by name (all True: it passed)."""
    failed = [c for c in calls if c.result.code != "OK"]
    lost = [
        c
        for c in failed
        if c.result.code == "UNAVAILABLE"
        and c.result.reason == LOST_MID_STREAM
        and c.result.tokens > 0
        and c.ended == "decoder_killed"
    ]
    every_step = all(report["statuses_by_step"][s].get("OK", 0) > 0 for s in STEPS)
    encoded = all(n > 0 for n in report["encoded_by_step"].values())
    return {
        "no call hung, INTERNAL or UNKNOWN": not any(
            c.result.code in (HUNG, *BAD_CODES) for c in calls
        ),
        "every call ended within its deadline + slack": report["max_e2e_s"] <= bound_s,
        "only answers that could not move off the killed decoder failed, at most one "
        "per call in flight": len(lost) == len(failed) <= report["concurrency"],
        "every step answered calls": every_step,
        "every step encoded images (the encoders were in use)": encoded,
        "calls were replayed on the other decoder": report["failovers_decoder_killed"] > 0,
        "decoder-1 answered again once back": report["decoder_1_answers_once_back"] > 0,
        "the caches counted store errors while it was down": (
            report["store_errors_store_killed"] > 0
        ),
        "an image was cached again after the store returned": (
            report["probe_after_store_back"] == ["exact"]
        ),
        "every replica drained with exit code 0": all(
            code == 0 for code in report["rolling_exit_codes"].values()
        ),
    }


def run_drill(
    cluster: Cluster,
    *,
    window_s: float,
    concurrency: int,
    pool: int = 48,
    deadline_s: float = 60.0,
    log: Callable[[str], None] = print,
    rolling: Sequence[str] | None = None,
    rate: float | None = None,
) -> dict[str, Any]:
    """Run the drill on ``cluster`` (left running, every replica restarted); the report.

    ``rolling``: the replicas the last step restarts (None: all six); ``rate``: calls
    started per second at most (None: a closed loop); see :class:`Drill`.
    """
    from splitvl.client import build_request
    from splitvl_tools.workload import ImageFactory, png

    requests = build_requests(pool, side=96, repeat_fraction=0.5, max_tokens=8, seed=37)
    probe_image = png(ImageFactory(side=96, seed=997).make())
    probe = build_request([probe_image], "Describe this image.", max_tokens=4, ignore_eos=True)
    drill = Drill(cluster, window_s, concurrency, deadline_s, log=log, rolling=rolling, rate=rate)
    asyncio.run(drill.run(requests, probe))
    return drill.report()


def print_report(report: dict[str, Any], out: Any = sys.stdout) -> None:
    """Statuses per step and the verdicts, as Markdown."""
    print(
        "| step | statuses (by the step a call ended in) | TTFT p95, s (by the step a call "
        "started in) | s to reach |\n|---|---|---|---|",
        file=out,
    )
    for step in STEPS:
        codes = ", ".join(f"{k} {v}" for k, v in sorted(report["statuses_by_step"][step].items()))
        reach = report["seconds_to_reach_step"].get(step, "-")
        ttft = report.get("ttft_p95_s_by_step", {}).get(step, "-")
        print(f"| {step} | {codes or '-'} | {ttft} | {reach} |", file=out)
    moved = [f"{k} {report[k]:.0f}" for k in ("migrations_decoder_killed", "migrations_rolling")]
    print(f"\nanswers moved to the other decoder: {', '.join(moved)}", file=out)
    print(
        f"\ncalls {report['calls']}, OK {report['ok']}, max e2e {report['max_e2e_s']} s", file=out
    )
    for name, passed in report["verdicts"].items():
        print(f"- [{'x' if passed else ' '}] {name}", file=out)
    for code, message in report["error_examples"].items():
        print(f"\n{code} example: {message}", file=out)


def main(args: argparse.Namespace) -> int:
    from splitvl_tools.cluster import own_cluster

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with own_cluster(
        model=args.model,
        log_dir=args.log_dir,
        prefix="splitvl-faults-",
        log=log,
        replicas=REPLICAS,
        store="redis",
    ) as run:
        report = run_drill(
            run.cluster,
            window_s=args.window,
            concurrency=args.concurrency,
            deadline_s=args.deadline,
            log=log,
            rate=args.rate,
        )
        run.ok = all(report["verdicts"].values())
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0 if run.ok else 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "faults", help="kill and restart replicas and the store under load; what clients saw"
    )
    p.add_argument("--model", help="checkpoint (default: tiny)")
    p.add_argument("--log-dir", help="service logs (default: a temp dir, removed after a pass)")
    p.add_argument("--window", type=positive_float, default=60.0, help="seconds of load per step")
    p.add_argument("--concurrency", type=positive_int, default=16, help="calls in flight")
    p.add_argument(
        "--rate",
        type=positive_float,
        help="calls started per second at most (default: a closed loop, every core busy)",
    )
    p.add_argument("--deadline", type=positive_float, default=60.0, help="deadline of each call, s")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)
