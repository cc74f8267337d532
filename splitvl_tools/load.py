"""``splitvl load``: many concurrent streaming Generate calls against the gateway.

A bounded grpc.aio client on loopback: ``concurrency`` workers, each sending one
streaming ``GatewayService/Generate`` after another until ``duration`` seconds have
passed, every call with a deadline. Images come from the workload generator
(:mod:`splitvl_tools.workload`): a fixed, pre-built list of requests whose images are unique
or designed repeats (exact copies and JPEG near-copies), cycled through; after the first
cycle every image has been seen before, which is what a real mix of new and popular
images looks like to the cache.

Usage::

    splitvl load                                  # own cluster on free ports, 200 x 120 s
    splitvl load --address 127.0.0.1:50051 --concurrency 50 --duration 30 --json

Reported: requests finished, OK count, every status by code (with one example message
each), ``hung`` (calls that had neither a result nor a status by deadline + slack: the
client's own asyncio timeout fired), throughput (requests/s, output tokens/s) and
latency percentiles (TTFT = first streamed token, end-to-end) in milliseconds.
The exit status is 1 when any call ended INTERNAL or UNKNOWN or hung.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from splitvl.argtypes import fraction, non_negative_float, positive_float, positive_int
from vlcommon.errors import error_info, retry_info

BAD_CODES = ("INTERNAL", "UNKNOWN")
HUNG = "HUNG"


@dataclass
class CallResult:
    """One call: its final status name (``HUNG`` when the client had to give up)."""

    code: str
    message: str = ""
    ttft_s: float | None = None
    e2e_s: float = 0.0
    tokens: int = 0
    tiers: list[str] = field(default_factory=list)
    retry_after_s: float | None = None  # the server's google.rpc.RetryInfo hint, if any
    reason: str = ""  # the status's google.rpc.ErrorInfo reason, if any


@dataclass
class LoadReport:
    """Everything one load run measured (times in seconds until :meth:`as_dict`)."""

    concurrency: int
    duration_s: float
    deadline_s: float
    results: list[CallResult]
    elapsed_s: float

    def as_dict(self) -> dict[str, Any]:
        counts = Counter(r.code for r in self.results)
        ok = [r for r in self.results if r.code == "OK"]
        examples: dict[str, str] = {}
        for r in self.results:
            if r.code != "OK" and r.code not in examples:
                examples[r.code] = r.message[:300]
        tiers = Counter(t for r in ok for t in r.tiers)
        return {
            "requests": len(self.results),
            "ok": len(ok),
            "status_counts": {code: counts[code] for code in sorted(counts) if code != HUNG},
            "hung": counts[HUNG],
            "internal_or_unknown": sum(counts[c] for c in BAD_CODES),
            "error_examples": examples,
            "concurrency": self.concurrency,
            "duration_s": self.duration_s,
            "deadline_s": self.deadline_s,
            "elapsed_s": round(self.elapsed_s, 3),
            "requests_per_s": round(len(ok) / self.elapsed_s, 3) if self.elapsed_s else 0.0,
            "tokens_per_s": (
                round(sum(r.tokens for r in ok) / self.elapsed_s, 3) if self.elapsed_s else 0.0
            ),
            "ttft_ms": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
            "e2e_ms": percentiles([r.e2e_s for r in ok]),
            "image_tiers": dict(tiers),
        }


def percentiles(values_s: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 (and mean, max) of seconds, in milliseconds; None when empty."""
    if not values_s:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "max": None}
    arr = np.asarray(values_s, dtype=np.float64) * 1000
    return {
        "p50": round(float(np.percentile(arr, 50)), 1),
        "p90": round(float(np.percentile(arr, 90)), 1),
        "p99": round(float(np.percentile(arr, 99)), 1),
        "mean": round(float(arr.mean()), 1),
        "max": round(float(arr.max()), 1),
    }


def build_requests(
    n: int,
    *,
    side: int,
    repeat_fraction: float,
    max_tokens: int,
    seed: int,
) -> list[Any]:
    """``n`` GatewayService GenerateRequests from the workload generator (one image each).

    Args:
        n: Requests to build (the load cycles through them).
        side: Image side, pixels (square RGB PNGs; repeats may be JPEG).
        repeat_fraction: Probability that an image repeats an earlier one.
        max_tokens: Tokens to generate per request (``ignore_eos``, greedy).
        seed: Seed of the images and of the repeat decisions.
    """
    from splitvl.client import build_request
    from splitvl_tools.workload import ImageFactory, make_workload

    work = make_workload(
        ImageFactory(side=side, seed=seed), requests=n, repeat_fraction=repeat_fraction, seed=seed
    )
    return [build_request(r.images, r.prompt, max_tokens=max_tokens, ignore_eos=True) for r in work]


def retry_delay_s(err: grpc.aio.AioRpcError) -> float | None:
    """The ``google.rpc.RetryInfo`` delay a failed call carries (seconds), or None."""
    info = retry_info(err)
    return None if info is None else float(info.retry_delay.ToTimedelta().total_seconds())


async def one_call(
    stub: Any, request: Any, deadline_s: float, slack_s: float, metadata: Any = None
) -> CallResult:
    """One streaming Generate with a gRPC deadline, and an asyncio bound of deadline + slack.

    A call that ends neither with a result nor with a status by then is ``HUNG``.
    """
    from splitvl.client import TIER_NAMES

    t0 = time.perf_counter()
    result = CallResult(code="OK")
    call = stub.Generate(request, timeout=deadline_s, metadata=metadata)

    async def drain() -> None:
        async for chunk in call:
            if chunk.token_ids and result.ttft_s is None:
                result.ttft_s = time.perf_counter() - t0
            if chunk.images:
                result.tiers = [TIER_NAMES.get(im.tier, "?") for im in chunk.images]
            result.tokens += len(chunk.token_ids)

    try:
        await asyncio.wait_for(drain(), timeout=deadline_s + slack_s)
    except grpc.aio.AioRpcError as err:
        result.code = err.code().name
        result.message = err.details() or ""
        result.retry_after_s = retry_delay_s(err)
        info = error_info(err)
        result.reason = info.reason if info is not None else ""
    except TimeoutError:
        call.cancel()
        result.code = HUNG
        result.message = f"no result or status {deadline_s + slack_s:.1f} s after the start"
    result.e2e_s = time.perf_counter() - t0
    return result


async def run_load(
    address: str,
    requests: list[Any],
    *,
    concurrency: int,
    duration_s: float,
    deadline_s: float,
    slack_s: float = 10.0,
    channels: int = 4,
    progress: Any = None,
    security: Any = None,
) -> LoadReport:
    """Closed-loop load: ``concurrency`` workers calling until ``duration_s`` has passed.

    Calls are spread round-robin over ``channels`` HTTP/2 connections (a single
    connection would serialise all frames through one socket and one event-loop callback
    chain on the server). A worker that got RESOURCE_EXHAUSTED waits the server's
    RetryInfo delay (1 s without one, at most 5 s) before its next call. A worker starts
    no new call after ``duration_s``; the calls in flight then finish (or end by their
    deadline), so the run lasts at most ``duration_s + deadline_s + slack_s + 5``.

    Args:
        address: The gateway, ``host:port``.
        requests: GenerateRequests, cycled through in order.
        concurrency: Workers, i.e. calls in flight.
        duration_s: Seconds during which new calls start.
        deadline_s: gRPC deadline of each call, seconds.
        slack_s: Past ``deadline_s + slack_s`` a call is cancelled and counted ``HUNG``.
        channels: HTTP/2 connections to spread the calls over.
        progress: Called with a status line every 15 s, if given.
        security: A ``vlcommon.tls.ClientSecurity`` (TLS roots, client certificate,
            bearer token); default: the ``SPLITVL_TLS_*`` / ``SPLITVL_AUTH_TOKEN`` environment.

    Returns:
        Every call's result and the elapsed wall time (until the last call ended).
    """
    from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

    from vlcommon.settings import channel_options
    from vlcommon.tls import ClientSecurity, aio_channel

    security = security or ClientSecurity.from_env()
    chans = [aio_channel(address, security, options=channel_options()) for _ in range(channels)]
    stubs = [pb_grpc.GatewayServiceStub(ch) for ch in chans]
    results: list[CallResult] = []
    next_request = 0
    t0 = time.perf_counter()
    stop_at = t0 + duration_s

    async def worker(w: int) -> None:
        nonlocal next_request
        while time.perf_counter() < stop_at:
            request = requests[next_request % len(requests)]
            next_request += 1
            result = await one_call(stubs[w % len(stubs)], request, deadline_s, slack_s)
            results.append(result)
            if result.code == "RESOURCE_EXHAUSTED":
                # Back off as a well-behaved client would: the server's RetryInfo hint
                # (a full service answers at once, so retrying at once would only spin).
                await asyncio.sleep(min(result.retry_after_s or 1.0, 5.0))
            elif result.code != "OK":
                await asyncio.sleep(0.1)  # e.g. a gateway that is down fails at once

    async def report_progress() -> None:
        while True:
            await asyncio.sleep(15)
            counts = Counter(r.code for r in results)
            progress(f"  {time.perf_counter() - t0:.0f} s: {len(results)} done {dict(counts)}")

    ticker = asyncio.ensure_future(report_progress()) if progress is not None else None
    try:
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    finally:
        if ticker is not None:
            ticker.cancel()
        for ch in chans:
            await ch.close()
    return LoadReport(concurrency, duration_s, deadline_s, results, time.perf_counter() - t0)


def print_table(report: dict[str, Any], out: Any = sys.stdout) -> None:
    """The report as a short Markdown table."""
    rows = [
        ("concurrency", report["concurrency"]),
        ("duration (s) / elapsed (s)", f"{report['duration_s']} / {report['elapsed_s']}"),
        ("deadline per call (s)", report["deadline_s"]),
        ("requests finished", report["requests"]),
        ("OK", report["ok"]),
        (
            "status counts",
            ", ".join(f"{k} {v}" for k, v in report["status_counts"].items()) or "-",
        ),
        ("hung", report["hung"]),
        ("INTERNAL + UNKNOWN", report["internal_or_unknown"]),
        ("throughput (req/s)", report["requests_per_s"]),
        ("output tokens/s", report["tokens_per_s"]),
    ]
    for name in ("ttft_ms", "e2e_ms"):
        p = report[name]
        rows.append(
            (f"{name[:-3].upper()} p50 / p90 / p99 (ms)", f"{p['p50']} / {p['p90']} / {p['p99']}")
        )
    rows.append(
        ("image tiers (OK calls)", ", ".join(f"{k} {v}" for k, v in report["image_tiers"].items()))
    )
    print("| metric | value |\n|---|---|", file=out)
    for k, v in rows:
        print(f"| {k} | {v} |", file=out)
    for code, message in report["error_examples"].items():
        print(f"\n{code} example: {message}", file=out)


def main(args: argparse.Namespace) -> int:
    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    log(f"building {args.pool} requests ({args.image_side}px images) ...")
    requests = build_requests(
        args.pool,
        side=args.image_side,
        repeat_fraction=args.repeat_fraction,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )

    def go(address: str, security: Any = None) -> dict[str, Any]:
        log(f"load: {args.concurrency} concurrent for {args.duration:.0f} s against {address}")
        report = asyncio.run(
            run_load(
                address,
                requests,
                concurrency=args.concurrency,
                duration_s=args.duration,
                deadline_s=args.deadline,
                slack_s=args.slack,
                progress=log,
                security=security,
            )
        )
        return report.as_dict()

    if args.address:
        result = go(args.address)
        return report_result(args, result)
    from splitvl_tools.cluster import own_cluster

    rc = 1
    with own_cluster(
        model=args.model, log_dir=args.log_dir, prefix="splitvl-load-", log=log
    ) as run:
        # The cluster's own TLS/token settings (SPLITVL_TLS_*, SPLITVL_AUTH_TOKEN).
        result = go(run.cluster.ports.address("gateway"), run.cluster.security())
        rc = report_result(args, result)
        run.ok = rc == 0
    return rc


def report_result(args: argparse.Namespace, result: dict[str, Any]) -> int:
    """Print the result (JSON or a table); 1 when a call was INTERNAL/UNKNOWN or hung."""
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 1 if result["internal_or_unknown"] or result["hung"] else 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("load", help="concurrent streaming Generate calls; statuses and latency")
    p.add_argument("--address", help="a running gateway (default: start a cluster on free ports)")
    p.add_argument("--model", help="checkpoint for the own cluster (default: tiny)")
    p.add_argument(
        "--log-dir",
        help="service logs of the own cluster (default: a temp dir, removed after a pass)",
    )
    p.add_argument("--concurrency", type=positive_int, default=200, help="calls in flight")
    p.add_argument(
        "--duration", type=positive_float, default=120.0, help="seconds to keep starting calls"
    )
    p.add_argument("--deadline", type=positive_float, default=60.0, help="deadline of each call, s")
    p.add_argument(
        "--slack", type=non_negative_float, default=10.0, help="past deadline + slack: hung"
    )
    p.add_argument("--max-tokens", type=positive_int, default=16)
    p.add_argument("--image-side", type=positive_int, default=128)
    p.add_argument(
        "--pool", type=positive_int, default=1200, help="distinct requests to cycle through"
    )
    p.add_argument("--repeat-fraction", type=fraction, default=0.5)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)
