"""``splitvl bench --front-cpu``: CPU of the processes around the engine, per request and
per streamed token, splitvl against ``vllm serve``'s API server in the same run.

On a GPU the ViT and the decode steps leave the host's cores to the Python processes
around the engine, and those set how many requests one host can take. This measures
them, from each process's own CPU time (``/proc/<pid>/task/<tid>/stat``, user + system,
read before and after each run), on the same workload through three fronts:

* ``vllm_serve``: ``vllm.entrypoints.openai.api_server`` (the OpenAI server that ``vllm
  serve`` runs), streaming chat completions: its API-server process decodes, resizes and
  normalises each image, renders the prompt and detokenises. Front = that process;
  engine = its ``VLLM::*`` children (EngineCore, Worker).
* ``splitvl_grpc``: the gateway's gRPC ``Generate``. Front = gateway + cache + encoder
  (less its ViT threads, named ``splitvl-vit``: the engine of a miss) + decoder (less its
  ``VLLM::*`` children).
* ``splitvl_openai``: the gateway's OpenAI front, the same request as ``vllm_serve``'s.

Scenarios (each request streamed, greedy, ``ignore_eos``, ``--max-tokens`` out):

* ``miss``: a new 448x448 PNG per request (the cache misses; the ViT runs);
* ``hit``: the same images again (an exact hit in splitvl's cache; vLLM's own
  multimodal processor cache for ``vllm serve``);
* ``text``: no image;
* ``tokens``: no image, ``--front-cpu-long`` tokens out; a process's CPU per streamed token
  is ``(cpu(tokens) - cpu(text)) / (long - max_tokens)`` per request, what each hop costs
  a token.

Every run is ``--requests`` requests at ``--concurrency``; the systems take turns within a
round (who goes first rotates), ``--rounds`` rounds, medians with min-max over rounds.
Both servers stay up: an idle front costs next to nothing, and the engines' CPU is not
what is compared.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SYSTEMS = ("vllm_serve", "splitvl_grpc", "splitvl_openai")
SCENARIOS = ("miss", "hit", "text", "tokens")
#: Threads of the encoder that run the ViT (``encoder_service/batcher.py`` names its
#: executor thread so; torch's OpenMP threads started from it inherit the name).
ENGINE_THREAD_PREFIX = "splitvl-vit"
#: Child processes that are vLLM's engine (EngineCore, Worker), not its front.
ENGINE_PROCESS_PREFIX = "VLLM::"
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(stat_path: str) -> tuple[str, float]:
    """``(comm, user + system seconds)`` from a ``/proc/.../stat`` file.

    Raises:
        OSError: the process or thread is gone.
    """
    stat = Path(stat_path).read_text()
    # comm is in parentheses and may hold spaces: the fields after its closing one.
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    return comm, (int(fields[11]) + int(fields[12])) / _TICK


def _engine_threads(pid: int) -> float:
    """CPU seconds of the live threads of ``pid`` named ``splitvl-vit*``."""
    total = 0.0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            comm, seconds = _cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
        if comm.startswith(ENGINE_THREAD_PREFIX):
            total += seconds
    return total


def cpu_by_process(roots: dict[str, int]) -> dict[tuple[str, int, str], float]:
    """CPU seconds so far of every process of each tree, split into front and engine.

    Args:
        roots: ``{name: pid}`` of the trees' root processes.

    Returns:
        ``{(name, pid, "front" | "engine"): seconds}``: a child process named ``VLLM::*``
        and a live thread named ``splitvl-vit*`` are engine, the rest front. A process's
        own total (``/proc/<pid>/stat``) includes its threads that have ended, which count
        as front: the split can only overstate the front.
    """
    import psutil

    out: dict[tuple[str, int, str], float] = {}
    for name, pid in roots.items():
        try:
            root = psutil.Process(pid)
            procs = [root.pid, *(c.pid for c in root.children(recursive=True))]
        except psutil.Error:
            continue
        for p in procs:
            try:
                comm, seconds = _cpu_seconds(f"/proc/{p}/stat")
            except OSError:
                continue
            engine = seconds if comm.startswith(ENGINE_PROCESS_PREFIX) else _engine_threads(p)
            out[(name, p, "engine")] = engine
            out[(name, p, "front")] = seconds - engine
    return out


def cpu_delta(
    before: dict[tuple[str, int, str], float], after: dict[tuple[str, int, str], float]
) -> tuple[dict[str, float], int]:
    """Per tree, front and engine CPU seconds between two :func:`cpu_by_process` reads
    (``{"<name>": front, "<name>/engine": engine}``), and how many processes ended in
    between (their CPU of the run is unknown and left out; a process born in between
    counts whole)."""
    out: dict[str, float] = {}
    for (name, _pid, part), seconds in after.items():
        key = f"{name}/engine" if part == "engine" else name
        out[key] = out.get(key, 0.0) + seconds - before.get((name, _pid, part), 0.0)
    gone = {(n, p) for n, p, _ in before} - {(n, p) for n, p, _ in after}
    return out, len(gone)


def cpu_by_part(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each tree: ``{"<name>": front, "<name>/engine": engine}``
    (:func:`cpu_by_process`, summed per tree)."""
    return cpu_delta({}, cpu_by_process(roots))[0]


def front_of(system: str, cpu: dict[str, float]) -> float:
    """The front's CPU seconds of a system, from :func:`cpu_by_part` of its trees."""
    return sum(v for k, v in cpu.items() if not k.endswith("/engine"))


# -- the workload -----------------------------------------------------------------------
def data_url(image_png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image_png).decode()


def make_images(n: int, side: int, seed: int) -> list[bytes]:
    from splitvl_tools.workload import ImageFactory, png

    factory = ImageFactory(side=side, seed=seed)
    return [png(factory.make()) for _ in range(n)]


async def openai_call(
    client: Any, base: str, model: str, image: bytes | None, prompt: str, max_tokens: int
) -> int:
    """One streamed chat completion; returns the content chunks received."""
    content: list[dict[str, Any]] = []
    if image is not None:
        content.append({"type": "image_url", "image_url": {"url": data_url(image)}})
    content.append({"type": "text", "text": prompt})
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    chunks = 0
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{base}: HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
    return chunks


async def grpc_call(stub: Any, image: bytes | None, prompt: str, max_tokens: int) -> int:
    from qwenvl.common.v1 import generation_pb2

    from splitvl.client import build_request

    request = build_request(
        [image] if image is not None else [],
        prompt,
        max_tokens=max_tokens,
        ignore_eos=True,
        cache_policy=generation_pb2.CACHE_POLICY_SIMILAR,
    )
    tokens = 0
    async for chunk in stub.Generate(request, timeout=600):
        tokens += len(chunk.token_ids)
    return tokens


async def run_requests(calls: list[Any], concurrency: int) -> float:
    semaphore = asyncio.Semaphore(concurrency)

    async def one(call: Any) -> None:
        async with semaphore:
            await call()

    t0 = time.perf_counter()
    await asyncio.gather(*(one(c) for c in calls))
    return time.perf_counter() - t0


# -- the servers ------------------------------------------------------------------------
@contextlib.contextmanager
def servers(model: str, work: Path, block: int, say: Any) -> Iterator[dict[str, Any]]:
    from splitvl.launcher import Cluster, Ports, free_port
    from splitvl_tools.openai_bench import vllm_serve

    port = free_port()
    say("starting vllm serve ...")
    with contextlib.ExitStack() as stack:
        base = stack.enter_context(vllm_serve(model, port, work / "vllm.log", block))
        vllm_pid = _listener_pid(port)
        say("starting splitvl ...")
        cluster = Cluster(
            model=model,
            ports=Ports.free(),
            log_dir=work / "splitvl-logs",
            decoder_args=[
                "--limit-mm-per-prompt",
                json.dumps({"image": 1, "video": 0}),
                "--block-size",
                str(block),
            ],
            env={"VLLM_CPU_KVCACHE_SPACE": "2"},
            progress=say,
        )
        stack.enter_context(cluster)
        yield {
            "vllm_base": base,
            "vllm_roots": {"api_server": vllm_pid},
            "cluster": cluster,
            "split_roots": {n: p.pid for n, p in cluster.procs.items()},
            "split_base": f"http://127.0.0.1:{cluster.ports.http}",
        }


def _listener_pid(port: int) -> int:
    import psutil

    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            assert conn.pid is not None
            return conn.pid
    raise RuntimeError(f"no process listens on {port}")


# -- the run ----------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    import httpx

    from splitvl_tools.cluster import bench_model

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    model = str(args.model or bench_model())
    work = Path(tempfile.mkdtemp(prefix="splitvl-front-cpu-"))
    n, conc = args.requests or 32, args.front_cpu_concurrency
    short, long_ = args.max_tokens, args.front_cpu_long
    # Fresh images for every (round, system): the systems do not share caches, but the
    # two splitvl fronts do.
    images = {
        (r, s): make_images(n, args.image_side, args.seed + 100 * r + i)
        for r in range(args.rounds)
        for i, s in enumerate(SYSTEMS)
    }
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    with servers(model, work, args.block_size or 32, say) as srv:
        from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

        async def main() -> None:
            limits = httpx.Limits(max_connections=conc * 2)
            async with (
                httpx.AsyncClient(timeout=600, limits=limits) as http,
                srv["cluster"].gateway_channel() as channel,
            ):
                stub = pb_grpc.GatewayServiceStub(channel)

                def one(system: str, image: bytes | None, prompt: str, tokens: int) -> Any:
                    """The coroutine of one request through ``system``."""
                    if system == "splitvl_grpc":
                        return grpc_call(stub, image, prompt, tokens)
                    base = srv["vllm_base"] if system == "vllm_serve" else srv["split_base"]
                    return openai_call(http, base, model, image, prompt, tokens)

                def calls(system: str, scenario: str, r: int) -> list[Any]:
                    tokens = long_ if scenario == "tokens" else short
                    return [
                        functools.partial(
                            one,
                            system,
                            images[(r, system)][k] if scenario in ("miss", "hit") else None,
                            f"Describe this image. ({scenario} {r}.{k})",
                            tokens,
                        )
                        for k in range(n)
                    ]

                # First-use costs of every front, unmeasured.
                warm = make_images(2, args.image_side, args.seed + 99_999)
                for system in SYSTEMS:
                    for im in (*warm, *warm, None):
                        await one(system, im, "warm", short)
                step = 0
                for r in range(args.rounds):
                    for scenario in SCENARIOS:
                        order = SYSTEMS[step % 3 :] + SYSTEMS[: step % 3]
                        step += 1
                        for system in order:
                            roots = (
                                srv["vllm_roots"] if system == "vllm_serve" else srv["split_roots"]
                            )
                            await asyncio.sleep(1.5)  # vLLM's busy-poll after a run ends
                            before = cpu_by_process(roots)
                            elapsed = await run_requests(calls(system, scenario, r), conc)
                            cpu, gone = cpu_delta(before, cpu_by_process(roots))
                            rows.append(
                                {
                                    "round": r,
                                    "scenario": scenario,
                                    "system": system,
                                    "requests": n,
                                    "elapsed_s": elapsed,
                                    "cpu_s": cpu,
                                    "processes_gone": gone,
                                }
                            )
                            say(
                                f"  round {r} {scenario:6s} {system:14s} "
                                f"front {1000 * front_of(system, cpu) / n:7.1f} ms/req "
                                f"({n / elapsed:.2f} req/s)"
                            )

        asyncio.run(main())
    report = summarize(rows, short, long_)
    report["command"] = " ".join(["splitvl", "bench", *sys.argv[2:]])
    report["seconds"] = time.perf_counter() - t_start
    report["plan"] = {
        "requests": n,
        "concurrency": conc,
        "max_tokens": short,
        "long": long_,
        "rounds": args.rounds,
        "image_side": args.image_side,
    }
    from splitvl_tools.cluster import machine

    report["machine"] = machine()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "front-cpu.json").write_text(json.dumps({**report, "rows": rows}, indent=2))
    print_table(report, sys.stdout)
    return 0


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(rows: list[dict[str, Any]], short: int, long_: int) -> dict[str, Any]:
    """Per system and scenario: front CPU ms per request and each process's share
    (medians over rounds); per system: µs per streamed token of each front process.

    Ratios: splitvl's front (gRPC and OpenAI) over ``vllm serve``'s API server, per
    scenario, and per token per hop.
    """
    per_req: dict[str, dict[str, dict[str, Any]]] = {}
    by: dict[tuple[str, str, int], dict[str, float]] = {}
    for row in rows:
        n = row["requests"]
        cpu = {k: 1000 * v / n for k, v in row["cpu_s"].items()}  # ms per request
        by[(row["system"], row["scenario"], row["round"])] = cpu
    rounds = sorted({row["round"] for row in rows})
    for system in SYSTEMS:
        for scenario in SCENARIOS:
            runs = [by[(system, scenario, r)] for r in rounds if (system, scenario, r) in by]
            if not runs:
                continue
            parts = sorted({k for run in runs for k in run})
            per_req.setdefault(system, {})[scenario] = {
                "front_ms": _spread([front_of(system, run) for run in runs]),
                "parts_ms": {p: statistics.median(run.get(p, 0.0) for run in runs) for p in parts},
            }
    per_token: dict[str, dict[str, dict[str, float]]] = {}
    extra = long_ - short
    for system in SYSTEMS:
        pairs = [
            (by[(system, "tokens", r)], by[(system, "text", r)])
            for r in rounds
            if (system, "tokens", r) in by and (system, "text", r) in by
        ]
        if not pairs:
            continue
        parts = sorted({k for a, _ in pairs for k in a if not k.endswith("/engine")})
        per_token[system] = {
            p: _spread([1000 * (a.get(p, 0.0) - b.get(p, 0.0)) / extra for a, b in pairs])
            for p in parts
        }
    ratios: dict[str, float] = {}
    peer = per_req.get("vllm_serve", {})
    for system in ("splitvl_grpc", "splitvl_openai"):
        for scenario, row in per_req.get(system, {}).items():
            if scenario in peer:
                ratios[f"front_cpu_{system}_{scenario}"] = (
                    row["front_ms"]["median"] / peer[scenario]["front_ms"]["median"]
                )
    return {"per_request_ms": per_req, "per_token_us": per_token, "ratios": ratios}


def print_table(report: dict[str, Any], out: Any) -> None:
    print("| front CPU, ms per request | miss | exact hit | text | processes (miss) |", file=out)
    print("|---|---|---|---|---|", file=out)
    for system, scenarios in report["per_request_ms"].items():
        cells = []
        for scenario in ("miss", "hit", "text"):
            s = scenarios.get(scenario)
            if s is None:
                cells.append("-")
                continue
            f = s["front_ms"]
            cells.append(f"{f['median']:.1f} [{f['min']:.1f}-{f['max']:.1f}]")
        miss = scenarios.get("miss", {}).get("parts_ms", {})
        parts = ", ".join(f"{k} {v:.1f}" for k, v in miss.items())
        print(f"| {system} | {' | '.join(cells)} | {parts} |", file=out)
    print(file=out)
    print("| front CPU, µs per streamed token | process | median [min-max] |", file=out)
    print("|---|---|---|", file=out)
    for system, parts in report["per_token_us"].items():
        for part, s in parts.items():
            print(
                f"| {system} | {part} | {s['median']:.0f} [{s['min']:.0f}-{s['max']:.0f}] |",
                file=out,
            )
    print(file=out)
    for k, v in report["ratios"].items():
        print(f"{k}: {v:.3f}", file=out)
