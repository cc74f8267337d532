"""``splitvl bench``: splitvl against vLLM alone, side by side, on the same workloads.

Systems, each measured on identical requests (same images, prompts, max_tokens, greedy,
eos ignored). Closed-loop scenarios run one system at a time, so an idle vLLM worker never
steals the other's core; the one-at-a-time scenarios run in alternating pairs with both
systems up (below):

* ``vllm``        vLLM alone: ``AsyncLLM`` on the raw images (its own ViT in the engine),
                  images decoded from their bytes inside each timed request;
* ``vllm_embeds`` the same engine fed precomputed embeddings: the bound at 100% cache hits;
* ``split_nocache`` splitvl's four services, cache policy OFF (every image is encoded);
* ``split_cache``   splitvl with the cache on (exact and similarity tiers);
* ``encoder``     the vision engine alone: batch size 1 against dynamic batching.

Scenarios: ``repeat0`` and ``repeat50`` (closed loop at ``--concurrency``),
``repeat0_conc1`` and ``repeat50_conc1`` (one at a time), ``repeat100`` (every image a
repeat of a warmed-up set). Every closed-loop figure is the median over ``--reps``
repetitions, each on a fresh workload, with min-max. The ``_conc1`` scenarios are measured
so that drift of this shared machine cancels: vLLM alone and splitvl (cache on) are both up
and alternate run by run over ``--conc1-pairs`` pairs (pair ``i`` starts with vLLM alone
when ``i`` is even), each pair on fresh images, with a pause between runs longer than
vLLM's idle busy-poll (``SETTLE_S``); their ratios are the median over pairs of each
pair's ratio. Ratios are splitvl over vLLM alone. Scenario ``wide``
(``splitvl_tools/wide_bench.py``; ``--wide-only`` runs it alone, ``--skip-wide`` leaves it
out): 1,024-token images at Qwen3-VL-2B's embedding width, one at a time, both systems up
at once and alternating run by run; ``ratios.ttft_delta_ms_wide_conc1`` is splitvl's mean
TTFT minus vLLM alone's, median over pairs.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from splitvl.argtypes import non_negative_int, positive_float, positive_int
from splitvl_tools.cluster import machine
from splitvl_tools.workload import ImageFactory, Request, make_workload

SCENARIOS = ("repeat0", "repeat50", "repeat0_conc1", "repeat50_conc1", "repeat100")
CONC1 = tuple(s for s in SCENARIOS if s.endswith("conc1"))
CLOSED = tuple(s for s in SCENARIOS if s not in CONC1)
# Seconds between two systems' runs in a conc1 pair: a vLLM worker busy-polls its message
# queue for 1 s after its last read (vLLM's shm_broadcast ``busy_loop_s``) before it
# sleeps, and would take the other system's core meanwhile.
SETTLE_S = 1.5


@dataclass
class Sample:
    """One request's timings: seconds, and what served its images."""

    ttft: float
    e2e: float
    itl: list[float]
    tokens: int
    tiers: list[str] = field(default_factory=list)


@dataclass
class Run:
    """One (system, scenario, repetition)."""

    samples: list[Sample]
    elapsed: float
    peak_rss: dict[str, int]
    cpu_s: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        ttft = [s.ttft for s in self.samples]
        e2e = [s.e2e for s in self.samples]
        itl = [x for s in self.samples for x in s.itl] or [0.0]
        tiers = [t for s in self.samples for t in s.tiers]
        hits = sum(t in ("exact", "similar") for t in tiers)
        return {
            "requests_per_s": len(self.samples) / self.elapsed,
            "output_tokens_per_s": sum(s.tokens for s in self.samples) / self.elapsed,
            "ttft_mean_ms": 1000 * statistics.fmean(ttft),
            "ttft_p50_ms": 1000 * pct(ttft, 50),
            "ttft_p99_ms": 1000 * pct(ttft, 99),
            "itl_p50_ms": 1000 * pct(itl, 50),
            "itl_p99_ms": 1000 * pct(itl, 99),
            "e2e_p50_ms": 1000 * pct(e2e, 50),
            "e2e_p99_ms": 1000 * pct(e2e, 99),
            "cache_hit_rate": hits / len(tiers) if tiers else float("nan"),
            "peak_rss_mib": sum(self.peak_rss.values()) / 2**20,
        }


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


class RssSampler:
    """Samples the resident memory of process trees every 0.2 s; keeps each tree's peak.

    Also counts CPU seconds (user + system) over the block per process: ``cpu_s`` maps
    ``tree`` (the process itself) and ``tree/<child name>`` (e.g. ``decoder/VLLM::Worker``,
    ``decoder/VLLM::EngineCore``, summed over children of one name) to seconds, to show
    which process, and so which core, a run was bound by.
    """

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.peak: dict[str, int] = dict.fromkeys(pids, 0)
        self.cpu_s: dict[str, float] = {}
        self._cpu0: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        import psutil

        while not self._stop.is_set():
            for name, pid in self.pids.items():
                try:
                    proc = psutil.Process(pid)
                    rss = proc.memory_info().rss + sum(
                        c.memory_info().rss for c in proc.children(recursive=True)
                    )
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                self.peak[name] = max(self.peak[name], rss)
            self._stop.wait(0.2)

    def _cpu(self) -> dict[str, float]:
        import psutil

        out: dict[str, float] = {}
        for name, pid in self.pids.items():
            try:
                proc = psutil.Process(pid)
                procs = [(name, proc)] + [
                    (f"{name}/{c.name()}", c) for c in proc.children(recursive=True)
                ]
                for label, p in procs:
                    t = p.cpu_times()
                    out[label] = out.get(label, 0.0) + t.user + t.system
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    def __enter__(self) -> RssSampler:
        self._cpu0 = self._cpu()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        end = self._cpu()
        self.cpu_s = {k: round(v - self._cpu0.get(k, 0.0), 2) for k, v in end.items()}


async def closed_loop(
    requests: list[Request], concurrency: int, call: Any
) -> tuple[list[Sample], float]:
    """Run ``call(request)`` for every request, ``concurrency`` at a time."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(req: Request) -> Sample:
        async with semaphore:
            return await call(req)  # type: ignore[no-any-return]

    t0 = time.perf_counter()
    samples = await asyncio.gather(*(one(r) for r in requests))
    return list(samples), time.perf_counter() - t0


async def run_load(
    requests: list[Request], concurrency: int, call: Any, rate: float | None, seed: int = 0
) -> tuple[list[Sample], float]:
    """Closed loop at ``concurrency``, or, with ``rate`` (requests/s), open-loop Poisson
    arrivals: exponential inter-arrival times from a seeded generator, no cap, so queueing
    shows in TTFT."""
    if rate is None or concurrency <= 1:
        return await closed_loop(requests, concurrency, call)
    rng = random.Random(seed)
    t0 = time.perf_counter()
    tasks = []
    for req in requests:
        tasks.append(asyncio.ensure_future(call(req)))
        await asyncio.sleep(rng.expovariate(rate))
    samples = await asyncio.gather(*tasks)
    return list(samples), time.perf_counter() - t0


class Stream:
    """Accumulates TTFT and ITL from token deltas."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.last = self.t0
        self.itl: list[float] = []
        self.tokens = 0

    def tokens_arrived(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.itl.extend([(now - self.last) / n] * n)
        self.last = now
        self.tokens += n

    def sample(self, tiers: list[str] | None = None) -> Sample:
        end = time.perf_counter()
        return Sample(
            (self.first or end) - self.t0, end - self.t0, self.itl, self.tokens, tiers or []
        )


# -- vLLM alone ---------------------------------------------------------------------------
class VllmAlone:
    """vLLM's AsyncLLM in this process (its engine core in a child process)."""

    def __init__(
        self,
        model: str,
        max_tokens: int,
        images_per_request: int,
        block_size: int | None = None,
        dtype: str = "float32",
    ) -> None:
        from transformers import AutoProcessor
        from vllm import AsyncEngineArgs, SamplingParams
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        self.llm = AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                model=model,
                dtype=dtype,  # type: ignore[arg-type]  # "auto": the checkpoint's (wide: bf16)
                enforce_eager=True,
                max_model_len=4096,
                seed=0,
                enable_mm_embeds=True,
                limit_mm_per_prompt={"image": images_per_request, "video": 0},
                block_size=block_size,
            )
        )
        self.params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
        self.processor = AutoProcessor.from_pretrained(model)

    def prompt(self, req: Request) -> str:
        content = [{"type": "image"}] * len(req.images) + [{"type": "text", "text": req.prompt}]
        return str(
            self.processor.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
            )
        )

    async def raw(self, req: Request) -> Sample:
        from PIL import Image

        stream = Stream()
        images = [Image.open(io.BytesIO(b)).convert("RGB") for b in req.images]
        inputs: Any = {"prompt": self.prompt(req), "multi_modal_data": {"image": images}}
        async for out in self.llm.generate(inputs, self.params, request_id=uuid.uuid4().hex):
            stream.tokens_arrived(len(out.outputs[0].token_ids))
        return stream.sample()

    async def embeds(self, req: Request, embeds: Any, grid: Any, uuids: list[str]) -> Sample:
        stream = Stream()
        inputs: Any = {
            "prompt": self.prompt(req),
            "multi_modal_data": {"image": {"image_embeds": embeds, "image_grid_thw": grid}},
            "multi_modal_uuids": {"image": uuids},
        }
        async for out in self.llm.generate(inputs, self.params, request_id=uuid.uuid4().hex):
            stream.tokens_arrived(len(out.outputs[0].token_ids))
        return stream.sample()

    def shutdown(self) -> None:
        self.llm.shutdown()


# -- splitvl ------------------------------------------------------------------------------
async def split_call(stub: Any, req: Request, max_tokens: int, policy: int) -> Sample:
    from qwenvl.gateway.v1 import gateway_service_pb2 as pb

    from splitvl.client import TIER_NAMES, build_request

    request = build_request(
        req.images, req.prompt, max_tokens=max_tokens, ignore_eos=True, cache_policy=policy
    )
    stream = Stream()
    tiers: list[str] = []
    call = stub.Generate(request, timeout=600)
    async for chunk in call:
        assert isinstance(chunk, pb.GenerateResponse)
        if chunk.images:
            tiers = [TIER_NAMES.get(im.tier, "?") for im in chunk.images]
        stream.tokens_arrived(len(chunk.token_ids))
    return stream.sample(tiers)


# -- the encoder alone ---------------------------------------------------------------------
def encoder_batching(
    model: str,
    side: int,
    images: int,
    concurrency: int,
    reps: int,
    threads: int,
) -> dict[str, Any]:
    """images/s of the vision engine at batch size 1 and with dynamic batching as the
    encoder service runs it (``EncoderSettings`` defaults and ``ENCODER_*`` variables)."""
    import torch

    from encoder_service.batcher import Batcher
    from encoder_service.engine import VisionEngine
    from encoder_service.settings import EncoderSettings, batch_patches_for
    from vlcommon.imaging import plan_resize

    torch.set_num_threads(threads)
    engine = VisionEngine.load(model, device="auto")
    factory = ImageFactory(side=side, seed=4242 + side)
    pre = []
    for _ in range(images):
        image = factory.make()
        plan = plan_resize(image.height, image.width, engine.spec, index=0)
        pre.append(engine.preprocess(np.asarray(image), plan))
    engine.encode(pre[:1])  # warm-up
    env_only: dict[str, Any] = {}  # defaults and ENCODER_* environment variables
    settings = EncoderSettings(**env_only)
    dynamic_opts = {
        "max_batch_images": settings.max_batch_images,
        "max_batch_patches": batch_patches_for(settings.max_batch_patches, engine.device.type),
        "max_wait_ms": settings.max_wait_ms,
    }
    single_opts = {"max_batch_images": 1, "max_batch_patches": 1 << 20, "max_wait_ms": 0.0}

    async def run(opts: dict[str, Any]) -> float:
        b = Batcher(engine.encode, **opts, max_queue=1024)
        b.start()
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with sem:
                await b.submit(f"img{i}", pre[i])

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(images)))
        elapsed = time.perf_counter() - t0
        await b.stop()
        return images / elapsed

    single, dynamic = [], []
    for _ in range(reps):
        single.append(asyncio.run(run(single_opts)))
        dynamic.append(asyncio.run(run(dynamic_opts)))
    t0 = time.perf_counter()
    for p in pre[:4]:
        engine.encode([p])
    per_image = (time.perf_counter() - t0) / 4
    return {
        "side": side,
        "patches_per_image": int(np.prod(pre[0].grid)),
        "dynamic_settings": dynamic_opts,
        "images_per_s_batch1": spread(single),
        "images_per_s_dynamic": spread(dynamic),
        "speedup": statistics.median(dynamic) / statistics.median(single),
        "vit_ms_per_image": 1000 * per_image,
    }


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# -- orchestration -------------------------------------------------------------------------
@dataclass
class Plan:
    concurrency: int
    requests: int
    requests_conc1: int
    max_tokens: int
    reps: int
    side: int
    images_per_request: int
    seed: int
    quick: bool = False
    rate: float | None = None
    block_size: int | None = None  # vLLM KV-cache block size, the same for both systems
    conc1_pairs: int = 5  # alternating pairs of one-at-a-time runs (CONC1)


def build_workloads(
    plan: Plan,
    seed_offset: int = 0,
    scenarios: tuple[str, ...] = CLOSED,
    reps: int | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Per scenario, per repetition: the measured requests, and a warm-up set where the
    scenario repeats images.

    Repeats refer to images served BEFORE the measured run (a warm-up set, sent unmeasured
    to every system alike, so vLLM's own caches get the same chance): at concurrency 32 a
    repeat of a request still in flight could not hit any cache, which is not what a
    server with popular images sees. So every repeat draws from the warm-up set, and a
    scenario's repeat fraction is exact (repeat50: half the images, half of those exact
    copies and half JPEG re-encodes).

    ``scenarios`` and ``reps`` (default ``plan.reps``) choose what is made: the closed-loop
    scenarios by default; the conc1 pairs ask for ``CONC1`` with one entry per pair.
    """
    from splitvl_tools.workload import png

    factory = ImageFactory(side=plan.side, seed=plan.seed + seed_offset)
    out: dict[str, list[dict[str, Any]]] = {s: [] for s in scenarios}
    kw: dict[str, Any] = {"images_per_request": plan.images_per_request}

    def warm_pool(n: int, seed: int) -> tuple[list[Any], list[Request]]:
        pool = [factory.make() for _ in range(n)]
        warm = [
            Request(
                [png(im)] * plan.images_per_request,
                f"Describe this image. (warm {k})",
                ["unique"] * plan.images_per_request,
            )
            for k, im in enumerate(pool)
        ]
        return pool, warm

    for rep in range(plan.reps if reps is None else reps):
        seed = plan.seed * 1000 + rep * 10 + seed_offset
        for scenario in scenarios:
            n = plan.requests_conc1 if scenario.endswith("conc1") else plan.requests
            fraction = {"repeat0": 0.0, "repeat50": 0.5, "repeat100": 1.0}[
                scenario.removesuffix("_conc1")
            ]
            work: dict[str, Any] = {}
            pool = None
            if fraction > 0:
                pool, work["warmup"] = warm_pool(max(4, n // 4), seed)
            work["requests"] = make_workload(
                factory,
                requests=n,
                repeat_fraction=fraction,
                seed=seed + len(out[scenario]),
                pool=pool,
                **kw,
            )
            out[scenario].append(work)
    return out


def concurrency_of(scenario: str, plan: Plan) -> int:
    return 1 if scenario.endswith("conc1") else plan.concurrency


class Embedder:
    """Precomputed embeddings of a request's images, as splitvl's encoder makes them
    (``VisionEngine`` on CPU, the shared resize plan), for vLLM alone fed embeddings."""

    def __init__(self, model: str) -> None:
        from encoder_service.engine import VisionEngine

        self.vision = VisionEngine.load(model, device="cpu")

    def __call__(self, req: Request) -> tuple[Any, Any, list[str]]:
        """``(embeds [tokens, width], image_grid_thw [n_images, 3] int64, keys)``."""
        import torch

        from vlcommon.imaging import decode_image, exact_key, plan_resize

        rows, grids, keys = [], [], []
        for data in req.images:
            image = decode_image(data, index=0, max_decoded_pixels=10**8)
            p = plan_resize(image.height, image.width, self.vision.spec, index=0)
            [e] = self.vision.encode([self.vision.preprocess(np.asarray(image), p)])
            rows.append(e)
            grids.append(p.grid)
            keys.append(exact_key(image, p, "bench"))
        return torch.cat(rows), torch.tensor(grids, dtype=torch.long), keys


def bench_vllm(
    model: str, plan: Plan, workloads: dict[str, list[dict[str, Any]]], log: Any
) -> dict[str, dict[str, list[Run]]]:
    """vLLM alone on raw images, and on precomputed embeddings for repeat100 (the closed-
    loop scenarios of ``workloads``; the conc1 ones run in :func:`bench_conc1_pairs`)."""
    from vlcommon.server import freeze_startup_heap

    results: dict[str, dict[str, list[Run]]] = {"vllm": {}, "vllm_embeds": {}}
    engine = VllmAlone(model, plan.max_tokens, plan.images_per_request, plan.block_size)
    embeds_for = Embedder(model)

    async def main() -> None:
        await closed_loop(workloads["repeat0"][0]["requests"][:2], 2, engine.raw)  # warm-up
        # As vLLM's API server does once up (and splitvl's services): the startup heap out
        # of garbage collection, so a full collection does not stall this front-end.
        freeze_startup_heap("bench (vLLM alone)")
        for scenario, works in workloads.items():
            for rep, work in enumerate(works):
                conc = concurrency_of(scenario, plan)
                if "warmup" in work:
                    await closed_loop(work["warmup"], conc, engine.raw)
                with RssSampler({"vllm": os.getpid()}) as rss:
                    samples, elapsed = await run_load(
                        work["requests"], conc, engine.raw, plan.rate, rep
                    )
                results["vllm"].setdefault(scenario, []).append(
                    Run(samples, elapsed, rss.peak, rss.cpu_s)
                )
                log(f"  vllm {scenario} rep {rep}: {len(samples) / elapsed:.2f} req/s")
                if scenario == "repeat100":
                    # The same requests on precomputed embeddings: the bound of a perfect
                    # cache.
                    pre = {id(r): embeds_for(r) for r in work["requests"]}

                    async def call(req: Request, pre: dict[int, Any] = pre) -> Sample:
                        return await engine.embeds(req, *pre[id(req)])

                    with RssSampler({"vllm": os.getpid()}) as rss:
                        samples, elapsed = await run_load(
                            work["requests"], conc, call, plan.rate, rep
                        )
                    results["vllm_embeds"].setdefault(scenario, []).append(
                        Run(samples, elapsed, rss.peak, rss.cpu_s)
                    )
                    log(f"  vllm_embeds {scenario} rep {rep}: {len(samples) / elapsed:.2f} req/s")

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    return results


def bench_split(
    model: str,
    plan: Plan,
    workloads: dict[str, list[dict[str, Any]]],
    nocache_workloads: dict[str, list[dict[str, Any]]],
    log_dir: Path,
    log: Any,
) -> tuple[dict[str, dict[str, list[Run]]], list[dict[str, Any]]]:
    """splitvl with the cache off and on (closed loop), then, with its services still up,
    the conc1 pairs against vLLM alone (:func:`bench_conc1_pairs`).

    Returns:
        The runs by system and scenario (``vllm`` and ``vllm_embeds`` conc1 runs among
        them), and the pairs' rows.
    """
    from qwenvl.common.v1 import generation_pb2
    from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

    from splitvl.launcher import Cluster, Ports
    from vlcommon.server import freeze_startup_heap

    results: dict[str, dict[str, list[Run]]] = {"split_nocache": {}, "split_cache": {}}
    cluster = Cluster(
        model=model,
        ports=Ports.free(),
        log_dir=log_dir,
        decoder_args=[
            "--limit-mm-per-prompt",
            json.dumps({"image": plan.images_per_request, "video": 0}),
            *(["--block-size", str(plan.block_size)] if plan.block_size else []),
        ],
        env={"VLLM_CPU_KVCACHE_SPACE": "2"},
        progress=log,
    )
    # One at a time, the cache off would be split_cache's repeat0_conc1 again (all misses).
    systems = {
        "split_nocache": (
            generation_pb2.CACHE_POLICY_OFF,
            ("repeat0",) if plan.quick else ("repeat0", "repeat50"),
        ),
        "split_cache": (generation_pb2.CACHE_POLICY_SIMILAR, CLOSED),
    }

    async def main() -> None:
        # The cluster's own TLS/token settings (SPLITVL_TLS_*, SPLITVL_AUTH_TOKEN).
        async with cluster.gateway_channel() as channel:
            stub = pb_grpc.GatewayServiceStub(channel)
            warm = workloads["repeat0"][0]["requests"][:2]
            await closed_loop(
                warm,
                2,
                lambda r: split_call(stub, r, plan.max_tokens, generation_pb2.CACHE_POLICY_OFF),
            )
            freeze_startup_heap("bench (splitvl client)")  # as for vLLM alone
            pids = {n: p.pid for n, p in cluster.procs.items()}
            # Systems alternate within each repetition, so drift over the run (warm-up,
            # cache growth) cannot favour either.
            for scenario in CLOSED:
                for rep in range(plan.reps):
                    for system, (policy, scenarios) in systems.items():
                        if scenario not in scenarios:
                            continue
                        # Cache off runs on its own (equally made) images: the same images
                        # would reach the decoder's vLLM prefix cache twice otherwise.
                        source = nocache_workloads if system == "split_nocache" else workloads
                        work = source[scenario][rep]
                        conc = concurrency_of(scenario, plan)

                        async def call(r: Request, policy: int = policy) -> Sample:
                            return await split_call(stub, r, plan.max_tokens, policy)

                        if "warmup" in work:
                            await closed_loop(work["warmup"], conc, call)
                        with RssSampler(pids) as rss:
                            samples, elapsed = await run_load(
                                work["requests"], conc, call, plan.rate, rep
                            )
                        results[system].setdefault(scenario, []).append(
                            Run(samples, elapsed, rss.peak, rss.cpu_s)
                        )
                        log(f"  {system} {scenario} rep {rep}: {len(samples) / elapsed:.2f} req/s")

    with cluster:
        asyncio.run(main())
        pair_runs, pairs = bench_conc1_pairs(model, plan, cluster, log)
    for system, scenarios in pair_runs.items():
        for scenario, reps in scenarios.items():
            results.setdefault(system, {})[scenario] = reps
    return results, pairs


def bench_conc1_pairs(
    model: str, plan: Plan, cluster: Any, log: Any
) -> tuple[dict[str, dict[str, list[Run]]], list[dict[str, Any]]]:
    """The one-at-a-time scenarios (``CONC1``) in alternating pairs, both systems up.

    vLLM alone (``VllmAlone``, this process) starts beside the running cluster. Each pair
    gets fresh images (``build_workloads`` with a seed offset of its own), and for each
    scenario both systems run the same requests, one after the other, ``SETTLE_S`` apart:
    pair ``i`` starts with vLLM alone when ``i`` is even. A scenario that repeats images
    sends its warm-up set to each system, unmeasured, right before that system's run.
    After each pair's ``repeat0_conc1``, the same engine is fed the embeddings of those
    requests (computed outside the timing): vLLM's TTFT with no ViT.

    Returns:
        Runs by system (``vllm``, ``split_cache``, ``vllm_embeds``) and scenario, one per
        pair; and one row per pair and scenario: ``{"pair", "scenario", "first",
        "rps_ratio", "ttft_ratio"}`` (splitvl over vLLM alone).
    """
    from qwenvl.common.v1 import generation_pb2
    from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

    works = build_workloads(plan, seed_offset=900, scenarios=CONC1, reps=plan.conc1_pairs)
    runs: dict[str, dict[str, list[Run]]] = {"vllm": {}, "split_cache": {}, "vllm_embeds": {}}
    rows: list[dict[str, Any]] = []
    log(f"conc1 pairs: vLLM alone beside the cluster, {plan.conc1_pairs} pairs ...")
    embeds_for = Embedder(model)  # before the engine: a failure here leaves none running
    engine = VllmAlone(model, plan.max_tokens, plan.images_per_request, plan.block_size)
    pids = {n: p.pid for n, p in cluster.procs.items()}

    async def main() -> None:
        async with cluster.gateway_channel() as channel:
            stub = pb_grpc.GatewayServiceStub(channel)

            async def split(r: Request) -> Sample:
                return await split_call(
                    stub, r, plan.max_tokens, generation_pb2.CACHE_POLICY_SIMILAR
                )

            calls = {"vllm": (engine.raw, {"vllm": os.getpid()}), "split_cache": (split, pids)}
            await closed_loop(works[CONC1[0]][0]["requests"][:1], 1, engine.raw)  # warm-up
            for i in range(plan.conc1_pairs):
                order = ("vllm", "split_cache") if i % 2 == 0 else ("split_cache", "vllm")
                for scenario in CONC1:
                    work = works[scenario][i]
                    done: dict[str, Run] = {}
                    for system in order:
                        call, watched = calls[system]
                        await asyncio.sleep(SETTLE_S)
                        if "warmup" in work:
                            await closed_loop(work["warmup"], 1, call)
                        with RssSampler(watched) as rss:
                            samples, elapsed = await closed_loop(work["requests"], 1, call)
                        done[system] = Run(samples, elapsed, rss.peak, rss.cpu_s)
                        runs[system].setdefault(scenario, []).append(done[system])
                    if scenario == "repeat0_conc1":
                        pre = {id(r): embeds_for(r) for r in work["requests"]}

                        async def fed(req: Request, pre: dict[int, Any] = pre) -> Sample:
                            return await engine.embeds(req, *pre[id(req)])

                        await asyncio.sleep(SETTLE_S)
                        samples, elapsed = await closed_loop(work["requests"], 1, fed)
                        runs["vllm_embeds"].setdefault(scenario, []).append(
                            Run(samples, elapsed, {})
                        )
                    split_s, vllm_s = done["split_cache"].summary(), done["vllm"].summary()
                    row = {
                        "pair": i,
                        "scenario": scenario,
                        "first": order[0],
                        "rps_ratio": split_s["requests_per_s"] / vllm_s["requests_per_s"],
                        "ttft_ratio": split_s["ttft_mean_ms"] / vllm_s["ttft_mean_ms"],
                    }
                    rows.append(row)
                    log(
                        f"  pair {i} {scenario} ({order[0]} first): splitvl "
                        f"{split_s['requests_per_s']:.2f} req/s, vLLM alone "
                        f"{vllm_s['requests_per_s']:.2f} req/s, ratio {row['rps_ratio']:.3f}"
                    )

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    return runs, rows


def pair_ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per conc1 scenario: the median over pairs of each pair's ratio, with min-max."""
    out: dict[str, Any] = {}
    for scenario in sorted({r["scenario"] for r in rows}):
        for key in ("rps_ratio", "ttft_ratio"):
            values = [r[key] for r in rows if r["scenario"] == scenario]
            out[f"{key.removesuffix('_ratio')}_ratio_{scenario}"] = spread(values) | {
                "pairs": len(values)
            }
    return out


def summarise(runs: dict[str, dict[str, list[Run]]]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for system, scenarios in runs.items():
        for scenario, reps in scenarios.items():
            per = [r.summary() for r in reps]
            out.setdefault(system, {})[scenario] = {
                k: spread([p[k] for p in per]) for k in per[0]
            } | {
                "peak_rss_mib_by_process": {k: v / 2**20 for k, v in reps[-1].peak_rss.items()},
                "cpu_s_by_process": {
                    k: statistics.median(r.cpu_s.get(k, 0.0) for r in reps) for k in reps[-1].cpu_s
                },
            }
    return out


def ratios(
    table: dict[str, dict[str, dict[str, Any]]],
    encoder: list[dict[str, Any]],
    vit_vllm_ms: float | None,
    pairs: dict[str, Any] | None = None,
) -> dict[str, float | None]:
    """splitvl over vLLM alone, from the medians of ``table``; the conc1 ones, where
    ``pairs`` (:func:`pair_ratios`) has them, are the median over pairs of each pair's
    ratio instead."""

    def m(system: str, scenario: str, key: str) -> float | None:
        try:
            return float(table[system][scenario][key]["median"])
        except KeyError:
            return None

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    enc448 = next((e for e in encoder if e["side"] == 448), encoder[0] if encoder else None)
    return {
        "rps_ratio_repeat0": ratio(
            m("split_cache", "repeat0", "requests_per_s"), m("vllm", "repeat0", "requests_per_s")
        ),
        "rps_ratio_repeat50": ratio(
            m("split_cache", "repeat50", "requests_per_s"), m("vllm", "repeat50", "requests_per_s")
        ),
        "ttft_ratio_repeat50": ratio(
            m("split_cache", "repeat50", "ttft_mean_ms"), m("vllm", "repeat50", "ttft_mean_ms")
        ),
        **{
            f"rps_ratio_{scenario}": (
                float(pairs[f"rps_ratio_{scenario}"]["median"])
                if pairs and f"rps_ratio_{scenario}" in pairs
                else ratio(
                    m("split_cache", scenario, "requests_per_s"),
                    m("vllm", scenario, "requests_per_s"),
                )
            )
            for scenario in CONC1
        },
        "ttft_ratio_repeat100_vs_embeds": ratio(
            m("split_cache", "repeat100", "ttft_mean_ms"),
            m("vllm_embeds", "repeat100", "ttft_mean_ms"),
        ),
        "rps_ratio_repeat100_vs_embeds": ratio(
            m("split_cache", "repeat100", "requests_per_s"),
            m("vllm_embeds", "repeat100", "requests_per_s"),
        ),
        "encoder_batching_speedup": enc448["speedup"] if enc448 else None,
        # > 1: splitvl's encoder is faster per image than vLLM's in-engine ViT.
        "vit_speed_ratio_vs_vllm": ratio(
            vit_vllm_ms, enc448["vit_ms_per_image"] if enc448 else None
        ),
    }


def print_table(table: dict[str, dict[str, dict[str, Any]]], out: Any) -> None:
    cols = [
        ("requests_per_s", "req/s", 2),
        ("output_tokens_per_s", "tok/s", 0),
        ("ttft_mean_ms", "TTFT mean", 0),
        ("ttft_p50_ms", "TTFT p50", 0),
        ("ttft_p99_ms", "TTFT p99", 0),
        ("itl_p50_ms", "ITL p50", 1),
        ("itl_p99_ms", "ITL p99", 1),
        ("e2e_p50_ms", "E2E p50", 0),
        ("e2e_p99_ms", "E2E p99", 0),
        ("cache_hit_rate", "hit", 2),
        ("peak_rss_mib", "RSS MiB", 0),
    ]
    head = f"| {'scenario':<15} | {'system':<13} | " + " | ".join(c[1] for c in cols) + " |"
    print(head, file=out)
    print("|" + "|".join("-" * len(x) for x in head.strip("|").split("|")) + "|", file=out)
    for scenario in SCENARIOS:
        for system in ("vllm", "vllm_embeds", "split_nocache", "split_cache"):
            row = table.get(system, {}).get(scenario)
            if row is None:
                continue
            cells = []
            for key, _, digits in cols:
                v = row[key]
                if v["median"] != v["median"]:  # NaN: not applicable (no cache)
                    cells.append("-")
                    continue
                cells.append(
                    f"{v['median']:.{digits}f} [{v['min']:.{digits}f}-{v['max']:.{digits}f}]"
                    if key in ("requests_per_s", "ttft_mean_ms")
                    else f"{v['median']:.{digits}f}"
                )
            print(f"| {scenario:<15} | {system:<13} | " + " | ".join(cells) + " |", file=out)
    print("\nCPU seconds by process during the measured run (median of repetitions):", file=out)
    for scenario in ("repeat0", "repeat50"):
        for system in ("vllm", "split_cache"):
            cpu = table.get(system, {}).get(scenario, {}).get("cpu_s_by_process")
            if cpu:
                parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items()) if v >= 0.05)
                print(f"  {scenario} {system}: {parts}", file=out)


def plot_cdf(runs: dict[str, dict[str, list[Run]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, scenario in zip(axes, ("repeat0", "repeat50", "repeat100"), strict=True):
        for system in ("vllm", "vllm_embeds", "split_nocache", "split_cache"):
            reps = runs.get(system, {}).get(scenario)
            if not reps:
                continue
            lat = np.sort([1000 * s.e2e for r in reps for s in r.samples])
            ax.plot(lat, np.arange(1, len(lat) + 1) / len(lat), label=system)
        ax.set_title(f"end-to-end latency CDF, {scenario}")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args: argparse.Namespace) -> int:
    if args.openai:
        from splitvl_tools.openai_bench import run

        return run(args)
    if args.front_cpu:
        from splitvl_tools.front_cpu import run as run_front_cpu

        return run_front_cpu(args)
    if args.scale:
        from splitvl_tools.scale_bench import run as run_scale

        return run_scale(args)
    if args.video:
        from splitvl_tools.video_bench import run as run_video

        return run_video(args)
    if args.photos:
        # Its own process: splitvl_tools.photos builds on this module's parts, so importing
        # it here would make an import circle.
        import subprocess

        photos = [sys.executable, "-m", "splitvl_tools.photos", *sys.argv[2:]]
        return subprocess.call(photos)
    import torch

    from decoder_service.engine import default_block_size
    from splitvl.home import splitvl_home
    from splitvl_tools.cluster import bench_model
    from vlcommon.cpus import available_cpus, split_cpus

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    # vLLM logs to stdout by default; the in-process engine (and its engine-core process,
    # which inherits the environment) would put its log lines before --json's document.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if args.wide_only:
        return wide_main(args, log)
    model = args.model or str(bench_model())
    plan = Plan(
        concurrency=args.concurrency,
        requests=args.requests or (32 if args.quick else 64),
        requests_conc1=args.requests_conc1 or (6 if args.quick else 16),
        max_tokens=args.max_tokens,
        reps=args.reps,
        side=args.image_side,
        images_per_request=args.images_per_request,
        seed=args.seed,
        quick=args.quick,
        rate=args.rate,
        block_size=args.block_size or default_block_size(not torch.cuda.is_available()),
        conc1_pairs=args.conc1_pairs,
    )
    log(f"model {model}; plan {plan}")
    t_start = time.perf_counter()
    log("building workloads ...")
    workloads = build_workloads(plan)

    split = split_cpus(available_cpus())
    threads = len(split[1]) if split else (os.cpu_count() or 1)
    encoder = []
    for side in (448, 224) if not args.skip_encoder else ():
        log(f"encoder alone, {side}x{side}: batch 1 vs dynamic ...")
        encoder.append(
            encoder_batching(
                model,
                side,
                images=12 if args.quick else 32,
                concurrency=16,
                reps=plan.reps,
                threads=threads,
            )
        )
    log("vLLM alone ...")
    runs = bench_vllm(model, plan, workloads, log)
    log("splitvl ...")
    nocache = build_workloads(plan, seed_offset=500)
    split_runs, pair_rows = bench_split(
        model, plan, workloads, nocache, splitvl_home() / "bench-logs", log
    )
    for system, scenarios in split_runs.items():
        runs.setdefault(system, {}).update(scenarios)
    table = summarise(runs)
    pairs = pair_ratios(pair_rows)
    wide = None if args.skip_wide else run_wide_scenario(args, log)

    # vLLM's in-engine ViT (with its image preprocessing) per image: mean TTFT on the raw
    # images minus mean TTFT on precomputed embeddings of the same requests, one at a time.
    vit_vllm = None
    try:
        raw = table["vllm"]["repeat0_conc1"]["ttft_mean_ms"]["median"]
        emb = table["vllm_embeds"]["repeat0_conc1"]["ttft_mean_ms"]["median"]
        vit_vllm = (raw - emb) / plan.images_per_request
    except KeyError:
        pass

    result: dict[str, Any] = {
        "command": " ".join(["splitvl", "bench", *sys.argv[2:]]),
        "plan": plan.__dict__,
        "model": model,
        "machine": machine(),
        "systems": table,
        "encoder": encoder,
        "vllm_vit_ms_per_image": vit_vllm,
        "ratios": ratios(table, encoder, vit_vllm, pairs),
        "conc1_pairs": {"ratios": pairs, "rows": pair_rows},
        "wide": wide,
        "seconds": time.perf_counter() - t_start,
    }
    if wide is not None:
        result["ratios"]["ttft_delta_ms_wide_conc1"] = wide["ttft_delta_ms"]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_cdf(runs, out_dir / "latency_cdf.png")
    (out_dir / "bench.json").write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result))
    else:
        print_table(table, sys.stdout)
        print()
        for e in encoder:
            print(
                f"encoder {e['side']}x{e['side']}: batch 1 "
                f"{e['images_per_s_batch1']['median']:.2f} img/s, dynamic "
                f"{e['images_per_s_dynamic']['median']:.2f} img/s "
                f"(x{e['speedup']:.2f}); ViT {e['vit_ms_per_image']:.0f} ms/image"
            )
        if wide is not None:
            from splitvl_tools.wide_bench import print_wide

            print_wide(wide, sys.stdout)
        for k, v in result["ratios"].items():
            print(f"{k}: {'n/a' if v is None else f'{v:.3f}'}")
        for k, v in pairs.items():
            print(
                f"{k}: median {v['median']:.3f} over {v['pairs']} alternating pairs "
                f"[{v['min']:.3f}-{v['max']:.3f}]"
            )
        print(
            f"plot: {out_dir / 'latency_cdf.png'}; raw: {out_dir / 'bench.json'}; "
            f"{result['seconds']:.0f} s"
        )
    return 0


def run_wide_scenario(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    """The ``wide`` scenario (splitvl_tools/wide_bench.py) with this command's flags."""
    from splitvl.home import splitvl_home
    from splitvl_tools.wide_bench import run_wide

    return run_wide(
        pairs=args.wide_pairs,
        per_run=args.wide_requests,
        max_tokens=args.wide_max_tokens,
        seed=args.seed,
        log_dir=splitvl_home() / "bench-logs-wide",
        log=log,
        vllm_alone=VllmAlone,
        cache_policy=args.wide_cache_policy,
    )


def wide_main(args: argparse.Namespace, log: Any) -> int:
    """``splitvl bench --wide-only``: the ``wide`` scenario alone."""
    from splitvl_tools.wide_bench import print_wide

    t_start = time.perf_counter()
    wide = run_wide_scenario(args, log)
    result = {
        "command": " ".join(["splitvl", "bench", *sys.argv[2:]]),
        "machine": machine(),
        "wide": wide,
        "ratios": {"ttft_delta_ms_wide_conc1": wide["ttft_delta_ms"]},
        "seconds": time.perf_counter() - t_start,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench-wide.json").write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result))
    else:
        print_wide(wide, sys.stdout)
        print(f"raw: {out_dir / 'bench-wide.json'}; {result['seconds']:.0f} s")
    return 0


def block_size(text: str) -> int:
    """``--block-size``: a KV-cache block size both engines of the run can use.

    On CPU that is vLLM's CPU attention's (``decoder_service.engine.cpu_block_size_error``);
    any other size used to fail in vLLM alone's engine core after the workload was built.
    """
    value = positive_int(text)
    import torch

    if not torch.cuda.is_available():
        from decoder_service.engine import cpu_block_size_error

        problem = cpu_block_size_error(value)
        if problem:
            raise argparse.ArgumentTypeError(problem.removeprefix("--block-size "))
    return value


def add_parser(sub: Any) -> None:
    from splitvl.cli import DefaultsHelpFormatter  # here: splitvl.cli imports this module

    p = sub.add_parser(
        "bench",
        help="splitvl against vLLM alone on the same workloads",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--model", help="checkpoint (default: the bench checkpoint, built once)")
    p.add_argument("--quick", action="store_true", help="smaller workloads (< 10 min here)")
    p.add_argument(
        "--concurrency", type=positive_int, default=32, help="closed-loop requests in flight"
    )
    p.add_argument(
        "--rate",
        type=positive_float,
        default=None,
        help="open-loop Poisson arrivals at this many requests/s instead of a closed loop",
    )
    p.add_argument(
        "--requests",
        type=non_negative_int,
        default=0,
        help="requests per closed-loop run; 0 = the scenario's own (64, --quick 32; photos "
        "32 / 8; video 16 / 8; openai 4x the concurrency, at least 16)",
    )
    p.add_argument(
        "--requests-conc1",
        type=non_negative_int,
        default=0,
        help="requests per one-at-a-time run; 0 = the scenario's own (16, --quick 6; photos 8 / 4)",
    )
    p.add_argument(
        "--conc1-pairs",
        type=positive_int,
        default=5,
        help="pairs of one-at-a-time runs, vLLM alone and splitvl both up, who goes first "
        "alternating pair by pair; the conc1 ratios are the median over pairs",
    )
    p.add_argument("--max-tokens", type=positive_int, default=32, help="output tokens per request")
    p.add_argument(
        "--reps",
        type=positive_int,
        default=3,
        help="repetitions of each closed-loop run (medians over them; conc1: --conc1-pairs)",
    )
    p.add_argument(
        "--image-side", type=positive_int, default=448, help="square images of this many pixels"
    )
    p.add_argument("--images-per-request", type=positive_int, default=1, help="images per prompt")
    p.add_argument("--seed", type=int, default=7, help="seed of the generated images")
    p.add_argument(
        "--block-size",
        type=block_size,
        default=None,
        help="vLLM KV-cache block size for both systems (default: the decoder's: 32 on CPU,"
        " vLLM's own on GPU; on CPU a positive multiple of 32)",
    )
    p.add_argument(
        "--skip-encoder",
        action="store_true",
        help="leave out the encoder-alone runs (batch 1 vs dynamic batching)",
    )
    p.add_argument(
        "--skip-wide", action="store_true", help="leave out the wide scenario (wide_bench.py)"
    )
    # One scenario instead of the default run: at most one of these (they used to be picked
    # silently in the order openai, video, photos).
    instead = p.add_mutually_exclusive_group()
    instead.add_argument(
        "--wide-only",
        action="store_true",
        help="run only the wide scenario: 1,024-token images at Qwen3-VL-2B's embedding width",
    )
    p.add_argument(
        "--wide-pairs",
        type=positive_int,
        default=5,
        help="wide: pairs of runs (splitvl, vLLM alone; alternating who goes first)",
    )
    p.add_argument("--wide-requests", type=positive_int, default=2, help="wide: requests per run")
    p.add_argument(
        "--wide-cache-policy",
        choices=("similar", "off"),
        default="similar",
        help="wide: splitvl's cache policy: similar (a lookup, then each miss put in the cache "
        "while the decoder runs) or off (neither)",
    )
    p.add_argument(
        "--wide-max-tokens", type=positive_int, default=4, help="wide: output tokens per request"
    )
    p.add_argument("--out", default="bench-out", help="directory for the JSON results")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    instead.add_argument(
        "--openai",
        action="store_true",
        help="instead: vLLM's benchmark client against `vllm serve` and splitvl's "
        "OpenAI-compatible front (splitvl_tools/openai_bench.py)",
    )
    instead.add_argument(
        "--photos",
        action="store_true",
        help="instead: the photos scenario (12 MP phone JPEGs, PNG screenshots, half "
        "byte-identical repeats, max_pixels 1280*32*32; splitvl_tools/photos.py)",
    )
    p.add_argument(
        "--openai-concurrency", default="1,8,32", help="with --openai: concurrencies to run"
    )
    p.add_argument(
        "--openai-datasets",
        default="distinct,repeat50,reencoded50",
        help="with --openai: datasets to run, of distinct, repeat50, reencoded50, "
        "repeat100 (the all-hits probe that bounds repeat50's ratio) and preencoded50 "
        "(splitvl only: repeat50 with every embedding cached ahead, the ViT-free bound)",
    )
    instead.add_argument(
        "--video",
        action="store_true",
        help="instead: the video scenario, 10-second clips at 2 fps, half repeats "
        "(splitvl_tools/video_bench.py)",
    )
    p.add_argument(
        "--video-concurrency", type=positive_int, default=8, help="with --video: streams at once"
    )
    instead.add_argument(
        "--scale",
        action="store_true",
        help="instead: 2 decoders routed by image affinity vs round robin, and 2 caches on "
        "Redis vs 1 in memory (splitvl_tools/scale_bench.py; the tiny checkpoint by default)",
    )
    p.add_argument(
        "--scale-reps",
        type=positive_int,
        default=3,
        help="with --scale: runs of each routing (alternating) and of each cache set-up",
    )
    instead.add_argument(
        "--front-cpu",
        action="store_true",
        help="instead: CPU ms per request (miss, exact hit, text) and µs per streamed token "
        "of the processes around the engine, splitvl's gRPC and OpenAI fronts against `vllm "
        "serve`'s API server (splitvl_tools/front_cpu.py; --requests, default 32)",
    )
    p.add_argument(
        "--front-cpu-concurrency",
        type=positive_int,
        default=8,
        help="with --front-cpu: requests in flight",
    )
    p.add_argument(
        "--front-cpu-long",
        type=positive_int,
        default=256,
        help="with --front-cpu: output tokens of the per-token runs (against --max-tokens)",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=2,
        help="with --openai or --front-cpu: vllm/splitvl alternations",
    )
    p.set_defaults(func=main)
