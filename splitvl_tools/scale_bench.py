"""``splitvl bench --scale``: two decoders routed by image affinity vs round robin, and two
cache replicas on Redis vs one in memory. One JSON, one run.

**Decoder routing.** One cluster: two decoders (each its own core where the host has
them, :func:`splitvl.replicas.decoder_cores`), two caches on a local redis-server, one
encoder. The gateway is restarted between runs with ``GATEWAY_DECODER_ROUTING``
``affinity`` (its own consistent hashing with bounded loads, gateway/pipeline/route.py) or
``proxy`` (one channel over both decoders' ``ipv4:`` list: grpc's round robin, what a
plain Service gives). The two alternate run by run (A B B A ...), so drift of this shared
host falls on both; each run has its own fresh images, half of them repeats of its own
earlier ones (exact copies and JPEG near-copies, :mod:`splitvl_tools.workload`), sent
closed-loop at ``--concurrency``. Per run: req/s, TTFT p50/p95 (client side, first token),
each decoder's vLLM prefix-cache hit rate over the run (its
``splitvl_decoder_engine_prefix_cache_{hit,queried}_tokens_total``) and the cache tiers.

**Cache replicas.** The same cluster's two caches on Redis, then a cluster of one cache in
memory (the default), each under ``splitvl load``'s workload of the scale-out issue (a pool
of 60 requests, half repeats, cycled at 8 concurrent for 20 s): the share of repeated
images served as exact hits (a call whose image bytes an earlier call sent), and the
gateway's lookup stage per call (``StageTimings.lookup_ms``), whose difference is what a
store lookup adds.

Usage::

    splitvl bench --scale [--scale-reps 3] [--requests 96] [--json] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitvl.launcher import Cluster

ROUTINGS = ("affinity", "proxy")
#: The cache comparison's workload (the scale-out issue's ``splitvl load`` line).
CACHE_POOL, CACHE_CONCURRENCY, CACHE_DURATION_S = 60, 8, 20.0
PREFIX_HITS = "splitvl_decoder_engine_prefix_cache_hit_tokens_total"
PREFIX_QUERIED = "splitvl_decoder_engine_prefix_cache_queried_tokens_total"
ROUTES = "splitvl_gateway_decoder_routes_total"  # {how=home|spilled|least_loaded|failover}


@dataclass
class Call:
    """One streamed Generate: client TTFT and end-to-end (s), tier, the gateway's lookup
    stage (ms), and the digest of its image bytes."""

    ok: bool
    ttft_s: float | None = None
    e2e_s: float = 0.0
    tier: str = ""
    lookup_ms: float = 0.0
    digest: str = ""
    repeat: bool = False


@dataclass
class Run:
    """One measured run."""

    what: str
    calls: list[Call] = field(default_factory=list)
    elapsed_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        ok = [c for c in self.calls if c.ok]
        ttft = [1000 * c.ttft_s for c in ok if c.ttft_s is not None]
        repeats = [c for c in ok if c.repeat]
        tiers = Counter(c.tier for c in ok)
        lookup = [c.lookup_ms for c in ok]
        return {
            "what": self.what,
            "calls": len(self.calls),
            "ok": len(ok),
            "req_per_s": round(len(ok) / self.elapsed_s, 3) if self.elapsed_s else 0.0,
            "ttft_p50_ms": _pct(ttft, 50),
            "ttft_p95_ms": _pct(ttft, 95),
            "tiers": dict(tiers),
            "hit_rate": round((tiers["exact"] + tiers["similar"]) / len(ok), 3) if ok else None,
            "repeats": len(repeats),
            "exact_hit_rate_of_repeats": (
                round(sum(c.tier == "exact" for c in repeats) / len(repeats), 3)
                if repeats
                else None
            ),
            "lookup_ms_p50": _pct(lookup, 50),
            "lookup_ms_p95": _pct(lookup, 95),
            **self.extra,
        }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))], 1)


def digest(request: Any) -> str:
    """The identity of a gateway GenerateRequest's first image (BLAKE2b of its bytes, 16 hex
    digits): repeats of one image share it. "" without an image part."""
    for message in request.messages:
        for part in message.parts:
            if part.HasField("image"):
                return hashlib.blake2b(part.image.data, digest_size=8).hexdigest()
    return ""


async def one(stub: Any, request: Any, deadline_s: float) -> Call:
    """One streamed Generate through the gateway."""
    import grpc

    from splitvl.client import TIER_NAMES

    call = Call(ok=True, digest=digest(request))
    t0 = time.perf_counter()
    try:
        async for chunk in stub.Generate(request, timeout=deadline_s):
            if chunk.images:
                call.tier = TIER_NAMES.get(chunk.images[0].tier, "?")
            if chunk.token_ids and call.ttft_s is None:
                call.ttft_s = time.perf_counter() - t0
            if chunk.HasField("timings"):
                call.lookup_ms = chunk.timings.lookup_ms
    except grpc.aio.AioRpcError:
        call.ok = False
    call.e2e_s = time.perf_counter() - t0
    return call


async def closed_loop(
    address: str,
    requests: list[Any],
    *,
    concurrency: int,
    duration_s: float | None = None,
    deadline_s: float = 120.0,
) -> tuple[list[Call], float]:
    """``requests`` through the gateway, ``concurrency`` at a time: each once in order, or,
    with ``duration_s``, cycled until that many seconds have passed. A call is a repeat
    when an earlier call sent the same image bytes."""
    from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

    from vlcommon.settings import channel_options
    from vlcommon.tls import ClientSecurity, aio_channel

    security = ClientSecurity.from_env()
    channels = [aio_channel(address, security, options=channel_options()) for _ in range(4)]
    stubs = [pb_grpc.GatewayServiceStub(ch) for ch in channels]
    calls: list[Call] = []
    seen: set[str] = set()
    turn = 0
    t0 = time.perf_counter()

    async def worker(w: int) -> None:
        nonlocal turn
        while True:
            if duration_s is None and turn >= len(requests):
                return
            if duration_s is not None and time.perf_counter() - t0 >= duration_s:
                return
            request = requests[turn % len(requests)]
            turn += 1
            key = digest(request)
            repeat = key in seen
            seen.add(key)
            call = await one(stubs[w % len(stubs)], request, deadline_s)
            call.repeat = repeat
            calls.append(call)

    try:
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    finally:
        for ch in channels:
            await ch.close()
    return calls, time.perf_counter() - t0


def samples(port: int, name: str) -> list[Any]:
    """The Prometheus samples called ``name`` that a service exports now."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


def metric(port: int, sample: str) -> float:
    """One Prometheus sample of a service, summed over its labels."""
    return sum(s.value for s in samples(port, sample))


def routes(port: int) -> dict[str, float]:
    """The gateway's decoder routes so far by ``how`` (home, spilled, least_loaded,
    failover); with ``GATEWAY_DECODER_ROUTING=proxy`` every call is ``home`` (one endpoint)."""
    out: dict[str, float] = {}
    for sample in samples(port, ROUTES):
        how = sample.labels.get("how", "")
        out[how] = out.get(how, 0.0) + sample.value
    return out


def prefix_counts(cluster: Cluster) -> dict[str, tuple[float, float]]:
    """Each decoder's (prefix-cache hit tokens, queried tokens) so far."""
    return {
        name: (
            metric(cluster.ports.metrics[name], PREFIX_HITS),
            metric(cluster.ports.metrics[name], PREFIX_QUERIED),
        )
        for name in cluster.instances("decoder")
    }


def use_routing(cluster: Cluster, routing: str) -> None:
    """Restart the gateway with ``GATEWAY_DECODER_ROUTING=routing`` (SERVING on return)."""
    cluster.env["GATEWAY_DECODER_ROUTING"] = routing
    cluster.terminate("gateway", grace_s=30)
    cluster.restart("gateway")


def routing_runs(
    cluster: Cluster,
    *,
    reps: int,
    requests: int,
    concurrency: int,
    max_tokens: int,
    side: int,
    seed: int,
    log: Any,
) -> list[Run]:
    """``reps`` runs of each routing, alternating A B B A ..., fresh images each run."""
    from splitvl_tools.load import build_requests

    order = [ROUTINGS[(i + i // 2) % 2] for i in range(2 * reps)]  # A B B A A B ...
    runs = []
    address = cluster.ports.address("gateway")
    for i, routing in enumerate(order):
        use_routing(cluster, routing)
        work = build_requests(
            requests, side=side, repeat_fraction=0.5, max_tokens=max_tokens, seed=seed + 101 * i
        )
        # One warm call (its own image): the new gateway's channels and thread pools.
        warm = build_requests(1, side=side, repeat_fraction=0.0, max_tokens=2, seed=seed + 9999 + i)
        asyncio.run(closed_loop(address, warm, concurrency=1))
        before = prefix_counts(cluster)
        routed = routes(cluster.ports.metrics["gateway"])
        calls, elapsed = asyncio.run(closed_loop(address, work, concurrency=concurrency))
        after = prefix_counts(cluster)
        routed = {
            how: n - routed.get(how, 0.0)
            for how, n in routes(cluster.ports.metrics["gateway"]).items()
        }
        prefix = {}
        for name in after:
            hits = after[name][0] - before[name][0]
            queried = after[name][1] - before[name][1]
            prefix[name] = {
                "hit_tokens": hits,
                "queried_tokens": queried,
                "hit_rate": round(hits / queried, 3) if queried else None,
            }
        run = Run(routing, calls, elapsed, {"prefix_cache": prefix, "routes": routed})
        s = run.summary()
        log(
            f"  {routing}: {s['req_per_s']} req/s, TTFT p50 {s['ttft_p50_ms']} p95 "
            f"{s['ttft_p95_ms']} ms, prefix hit rate "
            + ", ".join(f"{n} {p['hit_rate']}" for n, p in prefix.items())
            + (f"; routes {routed}" if routed else "")
        )
        runs.append(run)
    return runs


def cache_runs(cluster: Cluster, what: str, reps: int, seed: int, log: Any) -> list[Run]:
    """The cache comparison's workload on ``cluster``, ``reps`` times (own images each)."""
    from splitvl_tools.load import build_requests

    runs = []
    for i in range(reps):
        work = build_requests(
            CACHE_POOL, side=128, repeat_fraction=0.5, max_tokens=16, seed=seed + 7 + 31 * i
        )
        calls, elapsed = asyncio.run(
            closed_loop(
                cluster.ports.address("gateway"),
                work,
                concurrency=CACHE_CONCURRENCY,
                duration_s=CACHE_DURATION_S,
            )
        )
        run = Run(what, calls, elapsed)
        s = run.summary()
        log(
            f"  {what}: exact hits of repeats {s['exact_hit_rate_of_repeats']}, lookup p50 "
            f"{s['lookup_ms_p50']} ms"
        )
        runs.append(run)
    return runs


def medians(runs: list[Run], keys: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Per ``what``: the median, min and max of each key over its runs."""
    out: dict[str, dict[str, Any]] = {}
    for what in dict.fromkeys(r.what for r in runs):
        rows = [r.summary() for r in runs if r.what == what]
        out[what] = {}
        for k in keys:
            values = [row[k] for row in rows if row[k] is not None]
            out[what][k] = (
                {
                    "median": round(statistics.median(values), 3),
                    "min": min(values),
                    "max": max(values),
                }
                if values
                else None
            )
    return out


def prefix_median(runs: list[Run]) -> dict[str, dict[str, float | None]]:
    """Per routing and decoder: the median prefix-cache hit rate over the runs."""
    out: dict[str, dict[str, float | None]] = {}
    for what in dict.fromkeys(r.what for r in runs):
        by_decoder: dict[str, list[float]] = {}
        for r in runs:
            if r.what == what:
                for name, p in r.extra["prefix_cache"].items():
                    if p["hit_rate"] is not None:
                        by_decoder.setdefault(name, []).append(p["hit_rate"])
        out[what] = {n: round(statistics.median(v), 3) for n, v in by_decoder.items()}
    return out


def run(args: argparse.Namespace) -> int:
    from splitvl_tools.cluster import own_cluster

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    reps = args.scale_reps
    requests = args.requests or 96
    log("decoder routing and 2 caches on Redis: 2 decoders, 2 caches, a local redis-server")
    with own_cluster(
        model=args.model,
        log_dir=None,
        prefix="splitvl-scale-",
        log=log,
        replicas={"decoder": 2, "cache": 2},
        store="redis",
    ) as own:
        routing = routing_runs(
            own.cluster,
            reps=reps,
            requests=requests,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            side=args.image_side,
            seed=args.seed,
            log=log,
        )
        use_routing(own.cluster, "affinity")
        redis = cache_runs(own.cluster, "2 caches on redis", reps, args.seed, log)
        own.ok = True
    # The same two decoders as the store's runs: vLLM's CPU workers keep their cores busy
    # even when idle, so a one-decoder layout would compare the caches on a quieter host.
    log("1 cache in memory (2 decoders, as above)")
    with own_cluster(
        model=args.model,
        log_dir=None,
        prefix="splitvl-scale-",
        log=log,
        replicas={"decoder": 2},
    ) as own:
        memory = cache_runs(own.cluster, "1 cache in memory", reps, args.seed, log)
        own.ok = True
    keys = ("req_per_s", "ttft_p50_ms", "ttft_p95_ms", "hit_rate")
    cache_keys = ("exact_hit_rate_of_repeats", "hit_rate", "lookup_ms_p50", "lookup_ms_p95")
    result = {
        "command": " ".join(["splitvl", "bench", *sys.argv[2:]]),
        "plan": {
            "reps": reps,
            "requests": requests,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "image_side": args.image_side,
            "repeat_fraction": 0.5,
            "cache_workload": {
                "pool": CACHE_POOL,
                "concurrency": CACHE_CONCURRENCY,
                "duration_s": CACHE_DURATION_S,
            },
        },
        "routing": medians(routing, keys),
        "prefix_cache_hit_rate": prefix_median(routing),
        "cache": medians(redis + memory, cache_keys),
        "runs": [r.summary() for r in routing + redis + memory],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench-scale.json").write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result))
    else:
        print_scale(result, sys.stdout)
    return 0


def print_scale(result: dict[str, Any], out: Any) -> None:
    """The two headline tables, Markdown."""

    def m(cell: dict[str, Any] | None) -> str:
        return "-" if cell is None else f"{cell['median']} [{cell['min']}-{cell['max']}]"

    print(
        "| routing | req/s | TTFT p50 ms | TTFT p95 ms | prefix-cache hit rate per decoder "
        "| cache hit rate |",
        file=out,
    )
    print("|---|---|---|---|---|---|", file=out)
    for what, row in result["routing"].items():
        prefix = ", ".join(f"{n} {v}" for n, v in result["prefix_cache_hit_rate"][what].items())
        print(
            f"| {what} | {m(row['req_per_s'])} | {m(row['ttft_p50_ms'])} | "
            f"{m(row['ttft_p95_ms'])} | {prefix} | {m(row['hit_rate'])} |",
            file=out,
        )
    print("\n| caches | exact hits of repeats | lookup p50 ms | lookup p95 ms |", file=out)
    print("|---|---|---|---|", file=out)
    for what, row in result["cache"].items():
        print(
            f"| {what} | {m(row['exact_hit_rate_of_repeats'])} | {m(row['lookup_ms_p50'])} | "
            f"{m(row['lookup_ms_p95'])} |",
            file=out,
        )
