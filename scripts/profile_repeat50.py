"""Where a repeat50 run's time goes at concurrency 32 (issue 18; ``--concurrency`` for
another): one server, vLLM's benchmark client, and per run the CPU of every process, the
busy share of every core, the services' counters (cache tiers, ViT calls, encodes shared
in flight, vLLM's prefix-cache tokens) and, with ``--py-spy``, the share of vLLM's worker
samples in the language model, in the ViT and waiting.

Every run sends the same mix (one seed for which request repeats which) of new images, so
runs compare. ``--place dec0`` pins the whole decoder (its gRPC process, vLLM's engine
core and worker) to core 0 on odd runs, ``--place ec0`` vLLM's engine core alone,
``--place enc-nice5`` runs every thread of the
encoder at nice 5 on odd runs (0 on even ones), ``--place enc-nice10`` at 10 on odd runs
(on even ones at 5, ``splitvl up``'s default since then), to A/B the placement within one
process. ``--pre-encode``
sends each distinct image of odd runs to splitvl once before the run (``openai_bench.
pre_encode``: another system message, so vLLM's prefix cache misses): those runs pay no
ViT, every image prefill still, and say how far the language model alone carries the mix.

    python scripts/profile_repeat50.py --system splitvl --runs 6 --place dec0
    python scripts/profile_repeat50.py --system vllm --runs 2 --py-spy

``--env KEY=VALUE`` (repeatable) sets an environment variable of the four services.

Needs py-spy (``pip install py-spy``) for ``--py-spy``; not a dependency of the project.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from splitvl.launcher import Cluster, Ports, free_port
from splitvl_tools import openai_bench as ob
from splitvl_tools.cluster import bench_model
from splitvl_tools.workload import ImageFactory

COUNTERS = (
    "splitvl_gateway_cache_lookups",
    "splitvl_encoder_images",
    "splitvl_encoder_deduplicated_images",
    "splitvl_encoder_batch_duration_seconds",
    "splitvl_encoder_queue_wait_seconds",
    "splitvl_decoder_engine_prefix_cache_queried_tokens",
    "splitvl_decoder_engine_prefix_cache_hit_tokens",
)


def counters(ports: Ports | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, port in (ports.metrics if ports else {}).items():
        with contextlib.suppress(httpx.HTTPError):
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            for family in text_string_to_metric_families(text):
                if family.name in COUNTERS:
                    for s in family.samples:
                        if s.name.endswith(("_total", "_sum")):
                            label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                            out[f"{name}:{s.name}{{{label}}}"] = s.value
    return out


def tree(roots: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for root in roots:
        with contextlib.suppress(psutil.Error):
            out += [root, *root.children(recursive=True)]
    return out


def cpu_seconds(procs: list[psutil.Process]) -> dict[str, float]:
    out = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            out[f"{p.pid} {p.name()[:22]}"] = t.user + t.system
    return out


def place(cluster: Cluster, on_core0: bool, only: str = "") -> None:
    """The decoder's whole process tree (except vLLM's worker, bound by vLLM; with
    ``only``, the processes whose name has it) on core 0, or back on every core."""
    cores = {0} if on_core0 else set(range(psutil.cpu_count()))
    for p in tree([psutil.Process(cluster.procs["decoder"].pid)]):
        if "Worker" in p.name() or only not in p.name():
            continue
        for t in p.threads():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(t.id, cores)


def renice(cluster: Cluster, service: str, nice: int) -> None:
    """Every thread of ``service``'s process tree at ``nice`` (Linux: per thread)."""
    for p in tree([psutil.Process(cluster.procs[service].pid)]):
        for t in p.threads():
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, t.id, nice)


def worker_shares(raw: Path) -> dict[str, float]:
    """Share of the worker's main-thread samples (py-spy raw format) per activity."""
    shares: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        leaf = stack.split(";")[-1]
        if leaf.startswith(("Condition.wait", "Connection._recv")):
            continue  # vLLM's idle helper threads
        low = stack.lower()
        if "embed_multimodal" in stack or "visual" in low or "vision" in low:
            shares["ViT"] += int(n)
        elif "forward" in stack:
            shares["language model"] += int(n)
        else:
            shares["waiting or other"] += int(n)
    total = sum(shares.values()) or 1
    return {k: round(v / total, 3) for k, v in shares.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", choices=("splitvl", "vllm"), default="splitvl")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument(
        "--place", choices=("up", "dec0", "ec0", "enc-nice5", "enc-nice10"), default="up"
    )
    ap.add_argument("--py-spy", action="store_true", help="profile vLLM's worker, last run")
    ap.add_argument(
        "--pre-encode", action="store_true", help="splitvl: odd runs have every embedding cached"
    )
    ap.add_argument(
        "--env", action="append", default=[], help="KEY=VALUE for the four services (splitvl)"
    )
    args = ap.parse_args()
    model = str(bench_model())
    work = Path(tempfile.mkdtemp(prefix="profile-repeat50-"))
    seeds, files = ob.run_inputs(work, 0, [32], 0, 448, 0, ["repeat50"])
    factory = ImageFactory(side=448, seed=99)
    runs = [
        ob.write_repeat_dataset(work, f"mix-r{r}-c32", args.requests, factory, 777)
        for r in range(args.runs)
    ]
    log = (work / "client.log").open("w")
    with contextlib.ExitStack() as stack:
        cluster: Cluster | None = None
        if args.system == "splitvl":
            ports = Ports.free()
            cluster = Cluster(
                model=model,
                ports=ports,
                log_dir=work / "logs",
                decoder_args=["--limit-mm-per-prompt", json.dumps({"image": 1, "video": 0})],
                env={"VLLM_CPU_KVCACHE_SPACE": "2", **dict(e.split("=", 1) for e in args.env)},
                progress=lambda line: print(line, file=sys.stderr),
            )
            stack.enter_context(cluster)
            base = f"http://127.0.0.1:{ports.http}"
            roots = [psutil.Process(p.pid) for p in cluster.procs.values()]
        else:
            ports = None
            base = stack.enter_context(ob.vllm_serve(model, free_port(), work / "vllm.log", 32))
            roots = [
                p
                for p in psutil.process_iter(["cmdline"])
                if "vllm.entrypoints.openai.api_server" in " ".join(p.info["cmdline"] or [])
            ]
        warm = files["repeat50"][ob.WARM_UP]
        ob.run_client(
            ob.client_args(base, model, "repeat50", warm, 1, 2, 4, 448, work / "w.json", 1), log
        )
        for r, path in enumerate(runs):
            if cluster is not None and args.place in ("dec0", "ec0"):
                place(cluster, r % 2 == 1, "EngineCore" if args.place == "ec0" else "")
            if cluster is not None and args.place == "enc-nice5":
                renice(cluster, "encoder", 5 if r % 2 else 0)
            if cluster is not None and args.place == "enc-nice10":
                renice(cluster, "encoder", 10 if r % 2 else 5)
            pre_encoded = cluster is not None and args.pre_encode and r % 2 == 1
            if pre_encoded:
                ob.pre_encode(base, model, path)
            procs = tree(roots)
            c0, k0, p0, w0 = (
                cpu_seconds(procs),
                counters(ports),
                psutil.cpu_times(True),
                time.time(),
            )
            spy = None
            if args.py_spy and r == args.runs - 1:
                worker = [p for p in procs if "Worker" in p.name()][0]
                spy = subprocess.Popen(
                    [shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")]
                    + ["record", "-p", str(worker.pid), "-d", "25", "--idle"]
                    + ["--format", "raw", "-o", str(work / "worker.txt"), "--nonblocking"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            argv = ob.client_args(
                base,
                model,
                "repeat50",
                path,
                args.concurrency,
                args.requests,
                32,
                448,
                work / f"{r}.json",
                r,
            )
            result = ob.run_client(argv, log)
            wall = time.time() - w0
            c1, k1, p1 = cpu_seconds(procs), counters(ports), psutil.cpu_times(True)
            median_ttft = result["median_ttft_ms"]
            report: dict[str, Any] = {
                "run": r,
                "placement": args.place if args.place != "up" and r % 2 else "up",
                "pre_encoded": pre_encoded,
                "req_s": round(result["request_throughput"], 3),
                "median_ttft_ms": round(median_ttft),
                "failed": result.get("failed", 0),
                "busy_per_core": [
                    round(1 - (b.idle - a.idle) / wall, 2) for a, b in zip(p0, p1, strict=True)
                ],
                "cores_per_process": {
                    k: round((c1[k] - c0[k]) / wall, 2) for k in c1 if k in c0 and c1[k] > c0[k]
                },
                "counters": {
                    k: round(v - k0.get(k, 0), 3) for k, v in k1.items() if v != k0.get(k)
                },
            }
            if spy is not None:
                spy.wait()
                report["worker_samples"] = worker_shares(work / "worker.txt")
            print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
