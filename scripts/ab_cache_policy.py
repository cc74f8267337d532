"""All-miss load through one ``splitvl up`` with the cache off and on, interleaved.

What does the cache cost when nothing repeats? One cluster on the bench checkpoint; per
pair, two closed-loop runs of new 448x448 images (``repeat0``, each run on images of its
own), one with ``CACHE_POLICY_OFF`` and one with ``CACHE_POLICY_SIMILAR``, the order
alternating pair by pair; per run req/s and each service's CPU seconds:

    python scripts/ab_cache_policy.py --pairs 4 --requests 64 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from qwenvl.common.v1 import generation_pb2
from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

from splitvl.launcher import Cluster, Ports
from splitvl_tools.bench import Plan, RssSampler, build_workloads, closed_loop, split_call
from splitvl_tools.cluster import bench_model

POLICIES = {"off": generation_pb2.CACHE_POLICY_OFF, "similar": generation_pb2.CACHE_POLICY_SIMILAR}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the bench one)")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    model = args.model or str(bench_model())
    plan = Plan(
        concurrency=args.concurrency, requests=args.requests, requests_conc1=1,
        max_tokens=args.max_tokens, reps=args.pairs, side=448, images_per_request=1, seed=11,
    )  # fmt: skip
    works = {
        name: build_workloads(plan, seed_offset=offset, scenarios=("repeat0",))["repeat0"]
        for name, offset in (("off", 0), ("similar", 77))
    }
    cluster = Cluster(
        model=model,
        ports=Ports.free(),
        log_dir=Path(tempfile.mkdtemp(prefix="ab-cache-")),
        decoder_args=["--limit-mm-per-prompt", '{"image": 1, "video": 0}'],
        env={"VLLM_CPU_KVCACHE_SPACE": "2"},
        progress=print,
    )
    rps: dict[str, list[float]] = {name: [] for name in POLICIES}

    async def run() -> None:
        async with cluster.gateway_channel() as channel:
            stub = pb_grpc.GatewayServiceStub(channel)
            warm = works["off"][0]["requests"][:4]
            await closed_loop(warm, 2, lambda r: split_call(stub, r, 2, POLICIES["off"]))
            pids = {n: p.pid for n, p in cluster.procs.items()}
            for pair in range(args.pairs):
                order = ("off", "similar") if pair % 2 == 0 else ("similar", "off")
                for name in order:
                    requests = works[name][pair]["requests"]

                    async def call(r, name=name):  # type: ignore[no-untyped-def]
                        return await split_call(stub, r, args.max_tokens, POLICIES[name])

                    with RssSampler(pids) as sampler:
                        samples, elapsed = await closed_loop(requests, args.concurrency, call)
                    rps[name].append(len(samples) / elapsed)
                    cpu = ", ".join(f"{k} {v:.2f}" for k, v in sampler.cpu_s.items() if v >= 0.05)
                    line = f"pair {pair} {name}: {rps[name][-1]:.2f} req/s; CPU s: {cpu}"
                    print(line, flush=True)
                    await asyncio.sleep(2)

    with cluster:
        asyncio.run(run())
    for name, values in rps.items():
        print(f"{name}: median {statistics.median(values):.2f} req/s over {len(values)} runs")
    print(f"similar / off: {statistics.median(rps['similar']) / statistics.median(rps['off']):.3f}")


if __name__ == "__main__":
    main()
