"""``splitvl soak``: many requests in a row, each with a different image; memory per service.

Case C11 (../shared/cases/README.md): after a warm-up, the resident memory (RSS) of every
service must stay flat while distinct images keep arriving. The soak starts its own four
services (the launcher knows their process ids), sends ``requests`` Generate calls one
after another (``concurrency`` at a time, 1 by default), each with a new image from the
workload generator (pairwise cosine similarity < 0.75, so every image is a cache miss:
decoded, resized, encoded, stored, decoded by vLLM), and samples the RSS of each
service's process tree (the decoder's includes vLLM's engine-core process) after the
warm-up and at the end, and every ``sample_every`` requests in between.

The cache's byte budget is set small (``--cache-mib``, 4 MiB by default) so that it is
full, and evicting, before the warm-up ends: what is measured afterwards is the steady
state of a bounded cache, not the cache filling its budget (which would be growth by
design, bounded by ``CACHE_CAPACITY_BYTES``).

Usage::

    splitvl soak                            # 1,000 requests, warm-up 200, 128 px images
    splitvl soak --requests 300 --warmup 100 --json
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

from splitvl.argtypes import non_negative_int, positive_float, positive_int

MAX_GROWTH = 0.05


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (0 if it is gone)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


@dataclass
class SoakReport:
    """RSS samples (bytes) per service, keyed by the number of requests done."""

    requests: int
    warmup: int
    status_counts: dict[str, int]
    samples: dict[int, dict[str, int]]
    elapsed_s: float
    error_examples: dict[str, str] = field(default_factory=dict)

    def growth(self) -> dict[str, float]:
        """Relative RSS growth of each service from the end of warm-up to the end."""
        start, end = self.samples[self.warmup], self.samples[self.requests]
        return {name: (end[name] - start[name]) / start[name] for name in sorted(start)}

    def as_dict(self) -> dict[str, Any]:
        start, end = self.samples[self.warmup], self.samples[self.requests]
        growth = self.growth()
        return {
            "requests": self.requests,
            "warmup": self.warmup,
            "ok": self.status_counts.get("OK", 0),
            "status_counts": self.status_counts,
            "error_examples": self.error_examples,
            "elapsed_s": round(self.elapsed_s, 1),
            "max_growth": MAX_GROWTH,
            "services": {
                name: {
                    "rss_after_warmup_mib": round(start[name] / 2**20, 1),
                    "rss_end_mib": round(end[name] / 2**20, 1),
                    "growth": round(growth[name], 4),
                    "ok": growth[name] < MAX_GROWTH,
                }
                for name in sorted(start)
            },
            "rss_mib_by_requests": {
                str(n): {k: round(v / 2**20, 1) for k, v in s.items()}
                for n, s in sorted(self.samples.items())
            },
            "passed": all(g < MAX_GROWTH for g in growth.values())
            and self.status_counts.get("OK", 0) == self.requests,
        }


async def run_soak(
    address: str,
    pids: dict[str, int],
    requests: list[Any],
    *,
    warmup: int,
    concurrency: int = 1,
    sample_every: int = 100,
    deadline_s: float = 120.0,
    progress: Any = None,
    security: Any = None,
) -> SoakReport:
    """Send ``requests`` in order (``concurrency`` at a time) and sample each tree's RSS.

    Samples are taken between batches, with nothing in flight, after a short pause so
    per-request buffers that are about to be freed are not counted.

    Args:
        address: The gateway, ``host:port``.
        pids: Root process id of each service (``Cluster.pids()``).
        requests: GenerateRequests, sent in order.
        warmup: Requests before the first sample (the growth baseline).
        concurrency: Calls in flight at once.
        sample_every: Requests between intermediate samples.
        deadline_s: Deadline of each call, seconds.
        progress: Called with a line at each sample.
        security: A ``vlcommon.tls.ClientSecurity``; default: the ``SPLITVL_TLS_*`` /
            ``SPLITVL_AUTH_TOKEN`` environment.

    Raises:
        ValueError: ``warmup`` is not inside ``1..len(requests) - 1``.
    """
    from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

    from vlcommon.settings import channel_options
    from vlcommon.tls import ClientSecurity, aio_channel

    if not 0 < warmup < len(requests):
        raise ValueError(f"warmup must be in 1..{len(requests) - 1}, got {warmup}")
    marks = {warmup, len(requests), *range(warmup, len(requests), sample_every)}
    samples: dict[int, dict[str, int]] = {}
    codes: Counter[str] = Counter()
    examples: dict[str, str] = {}

    async def call(stub: Any, request: Any) -> None:
        try:
            async for _ in stub.Generate(request, timeout=deadline_s):
                pass
            codes["OK"] += 1
        except grpc.aio.AioRpcError as err:
            codes[err.code().name] += 1
            examples.setdefault(err.code().name, (err.details() or "")[:300])

    t0 = time.perf_counter()
    security = security or ClientSecurity.from_env()
    async with aio_channel(address, security, options=channel_options()) as channel:
        stub = pb_grpc.GatewayServiceStub(channel)
        done = 0
        while done < len(requests):
            step = min(concurrency, len(requests) - done)
            # Never step over a sampling mark.
            upcoming = [m for m in marks if m > done]
            step = min(step, min(upcoming) - done) if upcoming else step
            await asyncio.gather(*(call(stub, r) for r in requests[done : done + step]))
            done += step
            if done in marks:
                await asyncio.sleep(1.0)
                samples[done] = {name: tree_rss(pid) for name, pid in pids.items()}
                if progress is not None:
                    mib = {k: round(v / 2**20) for k, v in samples[done].items()}
                    progress(f"  {done} requests, {time.perf_counter() - t0:.0f} s: RSS MiB {mib}")
    return SoakReport(
        requests=len(requests),
        warmup=warmup,
        status_counts=dict(codes),
        samples=samples,
        elapsed_s=time.perf_counter() - t0,
        error_examples=examples,
    )


def build_requests(n: int, *, side: int, max_tokens: int, seed: int) -> list[Any]:
    """``n`` requests, each with its own image (no designed repeats)."""
    from splitvl_tools.load import build_requests as build

    return build(n, side=side, repeat_fraction=0.0, max_tokens=max_tokens, seed=seed)


def soak_env(cache_mib: float) -> dict[str, str]:
    """Service environment of a soak: the cache's byte budget small enough to fill."""
    return {"CACHE_CAPACITY_BYTES": str(int(cache_mib * 2**20))}


def print_table(report: dict[str, Any], out: Any = sys.stdout) -> None:
    print(
        f"{report['requests']} requests ({report['ok']} OK, statuses {report['status_counts']}) "
        f"in {report['elapsed_s']} s; RSS of each process tree after {report['warmup']} "
        "(warm-up) and at the end\n",
        file=out,
    )
    print("| service | RSS after warm-up (MiB) | RSS at end (MiB) | growth | < 5% |", file=out)
    print("|---|---|---|---|---|", file=out)
    for name, s in report["services"].items():
        print(
            f"| {name} | {s['rss_after_warmup_mib']} | {s['rss_end_mib']} | "
            f"{100 * s['growth']:+.2f}% | {'yes' if s['ok'] else 'NO'} |",
            file=out,
        )
    print("\nRSS (MiB) by requests done:", file=out)
    for n, row in report["rss_mib_by_requests"].items():
        print(f"  {n:>6}: {row}", file=out)


def main(args: argparse.Namespace) -> int:
    from splitvl_tools.cluster import own_cluster

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    log(f"building {args.requests} requests, each with its own {args.image_side}px image ...")
    requests = build_requests(
        args.requests, side=args.image_side, max_tokens=args.max_tokens, seed=args.seed
    )
    rc = 1
    with own_cluster(
        model=args.model,
        log_dir=args.log_dir,
        prefix="splitvl-soak-",
        log=log,
        env=soak_env(args.cache_mib),
    ) as run:
        cluster = run.cluster
        report = asyncio.run(
            run_soak(
                cluster.ports.address("gateway"),
                cluster.pids(),
                requests,
                warmup=args.warmup,
                concurrency=args.concurrency,
                sample_every=args.sample_every,
                progress=log,
                security=cluster.security(),
            )
        ).as_dict()
        if args.json:
            print(json.dumps(report))
        else:
            print_table(report)
        rc = 0 if report["passed"] else 1
        run.ok = rc == 0
    return rc


def add_parser(sub: Any) -> None:
    p = sub.add_parser("soak", help="distinct images in a row; RSS growth of each service")
    p.add_argument("--model", help="checkpoint (default: tiny)")
    p.add_argument("--log-dir", help="service logs (default: a temp dir, removed after a pass)")
    p.add_argument("--requests", type=positive_int, default=1000)
    p.add_argument(
        "--warmup", type=non_negative_int, default=200, help="requests before the first sample"
    )
    p.add_argument("--sample-every", type=positive_int, default=100)
    p.add_argument("--concurrency", type=positive_int, default=1)
    p.add_argument("--max-tokens", type=positive_int, default=4)
    p.add_argument("--image-side", type=positive_int, default=128)
    p.add_argument("--cache-mib", type=positive_float, default=4.0, help="cache byte budget, MiB")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)
