"""``splitvl cache-bench``: the similarity tier's lookup latency, memory and recall by size.

For each size N (default 10k and 100k; add 1000000 explicitly: about 14 GB of RSS
and 15-20 minutes on a 2-core machine) it fills the cache service's own index kinds
(``cache_service.index``: ``flat`` = exact ``IndexFlatIP``, ``hnsw`` = HNSW on a random
projection with exact re-scoring, both with the service's default settings) with N
descriptors of the real dimension (``CacheSettings().descriptor_dim``, i.e.
``vlcommon.imaging.DESCRIPTOR_DIM``), then times single-query searches (one query per
call, as a Lookup makes them) and applies the store's decision rule (the first of
``search_k`` candidates with cosine >= threshold).

Data: N real image descriptors cannot be had offline, so descriptors are drawn from a
low-rank model of image thumbnails (a power-law spectrum over 256 random directions plus
5% isotropic noise, mean-free and L2-normalised): like real thumbnails, distinct entries
are correlated (cosines up to ~0.6-0.7) rather than orthogonal, which is harder for an
approximate index than i.i.d. vectors. Queries: half are near-duplicates of stored entries
(cosine 0.86-0.99 to their source), half are fresh draws (mostly misses).

Recall: of the queries the exact index answers with a hit at the default threshold, the
share the approximate index answers with the same entry (also measured again after 20%
of the entries became tombstones, as LRU churn leaves them). Memory per entry: growth of the
process's RSS while the index was filled, divided by N (index only; the embeddings
themselves are counted by the byte budget).

Usage: ``splitvl cache-bench [--sizes 10000,100000] [--queries 1000] [--json]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitvl.argtypes import positive_int

RANK = 256
NOISE = 0.05
CHUNK = 50_000
FLAT_TIMED_QUERIES = {10_000: 500, 100_000: 200}  # flat is slow at scale: fewer timed calls


@dataclass(frozen=True)
class BenchConfig:
    """Defaults come from the cache service's settings, so the bench measures what runs."""

    dim: int
    threshold: float
    search_k: int
    index_threshold: int
    params: Any  # cache_service.index.IndexParams


def default_config() -> BenchConfig:
    from cache_service.settings import CacheSettings

    overrides: dict[str, Any] = {}  # defaults and CACHE_* environment variables
    s = CacheSettings(**overrides)
    return BenchConfig(
        dim=s.descriptor_dim,
        threshold=s.threshold,
        search_k=s.search_k,
        index_threshold=s.index_threshold,
        params=s.index_params(),
    )


class DescriptorModel:
    """Low-rank, correlated, L2-normalised descriptors (see the module docstring)."""

    def __init__(self, dim: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        basis = rng.standard_normal((RANK, dim)).astype(np.float32) / np.sqrt(dim)
        scale = (1.0 + np.arange(RANK, dtype=np.float32)) ** -0.6
        self.basis = basis * scale[:, None]
        self.dim = dim

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        z = rng.standard_normal((n, RANK), dtype=np.float32)
        x = z @ self.basis
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        x += rng.standard_normal((n, self.dim), dtype=np.float32) * (NOISE / np.sqrt(self.dim))
        x -= x.mean(axis=1, keepdims=True)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        return x


def near_duplicates(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Unit vectors with cosine uniform in [0.86, 0.99] to the rows of ``x``."""
    cos = rng.uniform(0.86, 0.99, size=(len(x), 1)).astype(np.float32)
    g = rng.standard_normal(x.shape, dtype=np.float32)
    g -= (g * x).sum(axis=1, keepdims=True) * x
    g /= np.linalg.norm(g, axis=1, keepdims=True)
    q = cos * x + np.sqrt(1 - cos**2) * g
    return (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)


def _rss() -> int:
    import psutil

    gc.collect()
    return int(psutil.Process().memory_info().rss)


def _decide(scores: np.ndarray, ids: np.ndarray, threshold: float) -> int:
    """The store's rule (all grids equal here): best candidate at or above the threshold."""
    from cache_service.store import SCORE_TOLERANCE

    for s, i in zip(scores, ids, strict=True):
        if float(np.clip(s, -1, 1)) >= threshold - SCORE_TOLERANCE:
            return int(i)
    return -1


def _timed(
    index: Any, queries: np.ndarray, k: int, threshold: float
) -> tuple[list[int], tuple[list[float], list[float]]]:
    """Answers, and per-query (wall ms, this thread's CPU ms)."""
    answers, wall, cpu = [], [], []
    for q in queries:
        c0 = time.thread_time()
        t0 = time.perf_counter()
        scores, ids = index.search(q, k)
        answers.append(_decide(scores, ids, threshold))
        wall.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.thread_time() - c0) * 1000)
    return answers, (wall, cpu)


def _pct(times: tuple[list[float], list[float]]) -> dict[str, float]:
    """Wall-clock p50/p99, and the same over CPU time (what remains without preemption
    by other processes on a shared machine)."""
    wall, cpu = times
    return {
        "p50_ms": round(float(np.percentile(wall, 50)), 4),
        "p99_ms": round(float(np.percentile(wall, 99)), 4),
        "cpu_p50_ms": round(float(np.percentile(cpu, 50)), 4),
        "cpu_p99_ms": round(float(np.percentile(cpu, 99)), 4),
    }


def bench_size(
    n: int,
    cfg: BenchConfig,
    n_queries: int,
    seed: int = 0,
    log: Any = None,
    sweep: list[tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """Build both index kinds over ``n`` descriptors and measure them (see module docstring)."""
    import faiss

    from cache_service.index import VectorIndex

    say = log or (lambda _msg: None)
    model = DescriptorModel(cfg.dim, seed)
    rng = np.random.default_rng(seed + n)
    targets = np.sort(rng.choice(n, size=n_queries // 2, replace=False))
    sources = np.empty((len(targets), cfg.dim), dtype=np.float32)

    base = _rss()
    approx: Any = None
    t0 = time.perf_counter()
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        x = model.draw(stop - start, np.random.default_rng([seed, start]))
        if approx is None:
            approx = VectorIndex("hnsw", cfg.dim, cfg.params)
            approx.reserve(n)  # no std::vector doubling: 1M peaks at ~1x its vectors
        sel = (targets >= start) & (targets < stop)
        sources[sel] = x[targets[sel] - start]
        approx.add(np.arange(start, stop, dtype=np.int64), x)
        del x
        say(f"  {n}: {stop} added ({time.perf_counter() - t0:.0f} s)")
    build_s = time.perf_counter() - t0
    approx_bytes = (_rss() - base) / n

    queries = np.concatenate(
        [near_duplicates(sources, rng), model.draw(n_queries - len(targets), rng)]
    )
    # Exact answers from the full vectors the approximate index re-scores with (the same
    # IndexFlatIP computation as the flat kind, without a second copy of N vectors).
    refine: Any = faiss.downcast_index(approx.index.index)
    flat_all = refine.refine_index
    say(f"  {n}: exact answers for {len(queries)} queries")
    scores, ids = flat_all.search(queries, cfg.search_k)
    exact = [_decide(s, i, cfg.threshold) for s, i in zip(scores, ids, strict=True)]

    # One OpenMP thread per search, as the service runs them (cache_service.__main__): a
    # single query gains nothing from a parallel region, and on a shared CPU its spin-waits
    # dominated the tail (p99 128 ms vs 0.2 ms p50 at 5k with 2 threads).
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    approx_answers, approx_times = _timed(approx, queries, cfg.search_k, cfg.threshold)
    hits = [i for i, e in enumerate(exact) if e >= 0]

    def recall(answers: list[int]) -> float | None:
        """Share of the exact index's hits the approximate one answers the same way."""
        return round(sum(answers[i] == exact[i] for i in hits) / len(hits), 4) if hits else None

    extra = sum(1 for i, a in enumerate(approx_answers) if a >= 0 and a != exact[i])
    # Other (ef_search, k_factor) settings on the same graph: recall against latency.
    swept: dict[str, Any] = {}
    for ef, kf in sweep or []:
        approx.tune_search(ef, kf)
        tuned, tuned_times = _timed(approx, queries, cfg.search_k, cfg.threshold)
        swept[f"ef{ef}_k{kf}"] = {**_pct(tuned_times), "recall": recall(tuned)}
        say(f"  {n}: ef_search {ef}, k_factor {kf}: {swept[f'ef{ef}_k{kf}']}")
    approx.tune_search(cfg.params.ef_search_for(approx.ntotal), cfg.params.k_factor)

    class _Flat:  # times single-query exact searches on the shared full vectors
        def __init__(self, index: Any) -> None:
            self.index = index

        def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
            s, i = self.index.search(q.reshape(1, -1), k)
            return s[0], i[0]

    n_flat = FLAT_TIMED_QUERIES.get(n, 50)
    _, flat_times = _timed(_Flat(flat_all), queries[:n_flat], cfg.search_k, cfg.threshold)

    # Steady LRU churn leaves up to CACHE_REBUILD_FRACTION of an HNSW index as tombstones:
    # tombstone 20% of the entries (none that is an exact answer, so those stay right) and
    # time the same queries again.
    answers = {e for e in exact if e >= 0}
    pool = np.setdiff1d(np.arange(n), np.fromiter(answers, np.int64, len(answers)))
    for index_id in rng.choice(pool, size=n // 5, replace=False):
        approx.remove(int(index_id))
    tomb_answers, tomb_times = _timed(approx, queries, cfg.search_k, cfg.threshold)
    faiss.omp_set_num_threads(threads)
    flat_bytes = float(cfg.dim * 4 + 16)  # IndexFlatIP row + IndexIDMap2's id and reverse map
    approximate = {
        **_pct(approx_times),
        "bytes_per_entry": round(approx_bytes),
        "build_s": round(build_s, 1),
        "timed_queries": len(queries),
    }
    flat = {**_pct(flat_times), "bytes_per_entry": round(flat_bytes), "timed_queries": n_flat}
    serving = approximate if n >= cfg.index_threshold else flat
    result = {
        **{k: serving[k] for k in ("p50_ms", "p99_ms", "cpu_p50_ms", "cpu_p99_ms")},
        "bytes_per_entry": serving["bytes_per_entry"],
        "index": "hnsw" if n >= cfg.index_threshold else "flat",
        "ef_search": cfg.params.ef_search_for(n) if n >= cfg.index_threshold else None,
        "recall": recall(approx_answers),
        "exact_hits": len(hits),
        "approx_hits_differing": extra,
        "flat": flat,
        "approximate": approximate,
        "approximate_20pct_tombstones": {
            **_pct(tomb_times),
            "recall": recall(tomb_answers),
        },
    }
    if swept:
        result["sweep"] = swept
    del approx, flat_all, refine
    gc.collect()
    return result


def run(
    sizes: list[int],
    n_queries: int = 1000,
    log: Any = None,
    sweep: list[tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """Benchmark every size; the ``--json`` document."""
    import os

    import faiss

    cfg = default_config()
    out: dict[str, Any] = {
        "dim": cfg.dim,
        "threshold": cfg.threshold,
        "index_threshold": cfg.index_threshold,
        "hnsw": {
            "projected_dim": cfg.params.projected_dim,
            "M": cfg.params.hnsw_m,
            "ef_construction": cfg.params.ef_construction,
            "ef_search": cfg.params.ef_search,
            "ef_reference_entries": cfg.params.ef_reference_entries,
            "k_factor": cfg.params.k_factor,
            "search_k": cfg.search_k,
        },
        "faiss": faiss.__version__,
        "omp_threads": faiss.omp_get_max_threads(),
        "cpus": os.cpu_count(),
        "load_average_1m_at_start": round(os.getloadavg()[0], 2),
        "sizes": {},
    }
    for n in sizes:
        if log:
            log(f"size {n} ...")
        out["sizes"][str(n)] = bench_size(n, cfg, n_queries, log=log, sweep=sweep)
    return out


def table(result: dict[str, Any]) -> str:
    lines = [
        f"descriptor dim {result['dim']}, threshold {result['threshold']}, "
        f"HNSW {result['hnsw']}, faiss {result['faiss']}, {result['cpus']} CPUs, "
        f"load average {result['load_average_1m_at_start']} at start",
        "latency per single-query search, wall ms p50/p99 (CPU ms p50/p99)",
        f"{'entries':>9} {'flat':>30} {'approximate':>30} "
        f"{'flat B/entry':>12} {'approx B/entry':>14} {'recall':>7} {'build s':>8}   "
        "approximate with 20% tombstones",
    ]
    for n, r in result["sizes"].items():
        f, a = r["flat"], r["approximate"]

        def cell(x: dict[str, Any]) -> str:
            return (
                f"{x['p50_ms']:.3f}/{x['p99_ms']:.3f} ({x['cpu_p50_ms']:.3f}/{x['cpu_p99_ms']:.3f})"
            )

        recall = r["recall"] if r["recall"] is not None else "-"
        t = r["approximate_20pct_tombstones"]
        lines.append(
            f"{int(n):>9} {cell(f):>30} {cell(a):>30} {f['bytes_per_entry']:>12} "
            f"{a['bytes_per_entry']:>14} {recall:>7} {a['build_s']:>8}   "
            f"{cell(t)} recall {t['recall']}"
        )
        for name, x in r.get("sweep", {}).items():
            lines.append(f"{'':>9} {name:>30} {cell(x):>30} {'':>12} {'':>14} {x['recall']:>7}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    sizes, sweep = args.sizes, args.sweep
    if args.queries < 2:
        raise SystemExit("splitvl cache-bench: --queries must be at least 2")
    if min(sizes) < args.queries // 2:
        raise SystemExit(
            f"splitvl cache-bench: every size must hold the {args.queries // 2} entries the "
            f"near-duplicate queries copy (--queries {args.queries}); got {min(sizes)}"
        )
    result = run(
        sizes, args.queries, log=lambda m: print(m, file=sys.stderr, flush=True), sweep=sweep
    )
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


def _sizes(text: str) -> list[int]:
    """``--sizes`` value: comma-separated positive entry counts."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of positive entry counts")
    return [positive_int(x) for x in items]


def _sweep_pairs(text: str) -> list[tuple[int, int]]:
    """``--sweep`` value: comma-separated ``EF_SEARCH:K_FACTOR`` pairs of positive integers."""
    pairs = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) != 2:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not EF_SEARCH:K_FACTOR (two positive integers, e.g. 128:16)"
            )
        pairs.append((positive_int(parts[0]), positive_int(parts[1])))
    return pairs


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "cache-bench", help="similarity index lookup latency, memory and recall by size"
    )
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=[10_000, 100_000],
        help="comma-separated entry counts (default 10000,100000; 1000000 needs ~17 GB "
        "of memory and ~7 min)",
    )
    p.add_argument(
        "--queries", type=positive_int, default=1000, help="half near-duplicates, half new"
    )
    p.add_argument(
        "--sweep",
        type=_sweep_pairs,
        default=[],
        help="extra EF_SEARCH:K_FACTOR settings timed on the same HNSW graph, e.g. 128:8,128:16",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)
