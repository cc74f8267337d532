"""Short-first against first come, first served: long (512 new tokens) and short (16)
requests mixed at 32 concurrent, each with its own image.

Priorities only matter while requests wait in vLLM's queue, i.e. when the engine's batch
is full. The decoder here runs ``--max-num-seqs 8`` (as a GPU deployment's batch or KV
budget binds; at its CPU default every one of 32 requests would run at once and no order
would matter) under ``--scheduling-policy priority`` (the decoder's default). The gateway
is restarted between runs with ``GATEWAY_PRIORITY_POLICY`` ``fcfs`` or ``short-first``,
alternating A B B A ...; every run has fresh images, a quarter of its requests long.

Reported per policy (medians over runs, with their range): short requests' TTFT p50/p95
and latency p95, long requests' TTFT p95 and latency p50 (their cost), req/s.

Usage::

    python scripts/measure_short_first.py [--model DIR] [--reps 2] [--requests 96] [--aging-s S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

SHORT, LONG = 16, 512
POLICIES = ("fcfs", "short-first")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def one(stub: Any, request: Any) -> tuple[float, float]:
    """(TTFT, latency) in ms."""
    t0 = time.perf_counter()
    ttft = None
    async for chunk in stub.Generate(request, timeout=900):
        if chunk.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
    return 1000 * (ttft or 0.0), 1000 * (time.perf_counter() - t0)


async def run(address: str, requests: list[tuple[str, Any]], concurrency: int) -> dict[str, Any]:
    import grpc
    from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

    from vlcommon.settings import channel_options

    channels = [grpc.aio.insecure_channel(address, options=channel_options()) for _ in range(4)]
    stubs = [pb_grpc.GatewayServiceStub(ch) for ch in channels]
    results: dict[str, list[tuple[float, float]]] = {"short": [], "long": []}
    turn = 0
    t0 = time.perf_counter()

    async def worker(w: int) -> None:
        nonlocal turn
        while turn < len(requests):
            kind, request = requests[turn]
            turn += 1
            results[kind].append(await one(stubs[w % 4], request))

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    elapsed = time.perf_counter() - t0
    for ch in channels:
        await ch.close()
    s, lg = results["short"], results["long"]
    return {
        "req_per_s": round((len(s) + len(lg)) / elapsed, 3),
        "short_ttft_p50_ms": round(pct([t for t, _ in s], 50), 1),
        "short_ttft_p95_ms": round(pct([t for t, _ in s], 95), 1),
        "short_latency_p95_ms": round(pct([e for _, e in s], 95), 1),
        "long_ttft_p95_ms": round(pct([t for t, _ in lg], 95), 1),
        "long_latency_p50_ms": round(pct([e for _, e in lg], 50), 1),
        "long_latency_p95_ms": round(pct([e for _, e in lg], 95), 1),
    }


def workload(n: int, seed: int, side: int) -> list[tuple[str, Any]]:
    from splitvl.client import build_request
    from splitvl_tools.workload import ImageFactory, png

    rng = random.Random(seed)
    factory = ImageFactory(side=side, seed=seed)
    out = []
    for _ in range(n):
        kind = "long" if rng.random() < 0.25 else "short"
        tokens = LONG if kind == "long" else SHORT
        request = build_request(
            [png(factory.make())], "Describe this image.", max_tokens=tokens, ignore_eos=True
        )
        out.append((kind, request))
    return out


def main() -> int:
    from splitvl.launcher import Cluster, Ports
    from splitvl_tools.cluster import bench_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint (default: the bench checkpoint)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--image-side", type=int, default=224)
    p.add_argument("--log-dir", default="/tmp/short-first-logs")
    p.add_argument(
        "--aging-s",
        type=float,
        help="GATEWAY_PRIORITY_AGING_S for both policies (default: the gateway's, 2 s)",
    )
    args = p.parse_args()
    model = args.model or str(bench_model())
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in POLICIES}
    env = {} if args.aging_s is None else {"GATEWAY_PRIORITY_AGING_S": str(args.aging_s)}
    with Cluster(
        model=model,
        ports=Ports.free(),
        log_dir=Path(args.log_dir),
        env=env,
        decoder_args=["--max-num-seqs", str(args.max_num_seqs)],
    ) as cluster:
        order = [POLICIES[(i + i // 2) % 2] for i in range(2 * args.reps)]  # A B B A ...
        for i, policy in enumerate(order):
            cluster.env["GATEWAY_PRIORITY_POLICY"] = policy
            cluster.terminate("gateway", grace_s=30)
            cluster.restart("gateway")
            requests = workload(args.requests, seed=500 + i, side=args.image_side)
            result = asyncio.run(run(cluster.ports.address("gateway"), requests, args.concurrency))
            print(f"{policy}: {result}", file=sys.stderr, flush=True)
            runs[policy].append(result)
    report: dict[str, Any] = {"command": " ".join(sys.argv), "model": model, "policies": {}}
    for policy, rows in runs.items():
        report["policies"][policy] = {
            k: {
                "median": round(statistics.median(r[k] for r in rows), 3),
                "range": [min(r[k] for r in rows), max(r[k] for r in rows)],
            }
            for k in rows[0]
        }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
