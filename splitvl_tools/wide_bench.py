"""``splitvl bench`` scenario ``wide``: TTFT at Qwen3-VL-2B's embedding width, one at a time.

The ``--like wide`` checkpoint (``splitvl.tiny_model.WIDE_OVERRIDES``: out_hidden 2,048 with
3 deepstack levels, 8,192 bf16 values per image token, a 4-block ViT and a 2-layer language
model) makes moving embeddings the larger part of a request: one 1,024x1,024 image is 1,024
tokens, 16 MiB of embeddings. Both systems run at once on the same checkpoint, in its dtype
(bf16): vLLM alone (``AsyncLLM`` in this process, its own ViT on the raw image) and
splitvl's four services (``splitvl up``'s cluster, cache on). They alternate run by run
within each pair (pair ``i`` starts with vLLM alone when ``i`` is even), so drift of this
shared machine falls on both; each pair's images are fresh (misses for both). After each
pair, the same engine is fed the embeddings splitvl computed (read back from the cache,
outside the timing): its TTFT is the decoder's share with no ViT and no transfer.

Reported: per pair, splitvl's mean TTFT minus vLLM alone's (ms); ``ttft_delta_ms_wide_conc1``
is the median of those over the pairs. splitvl's stage timings (the gateway's
``StageTimings``: preprocess, lookup, encode, put, the decoder's TTFT) say where its time goes.

Usage::

    splitvl bench --wide-only [--wide-pairs 5] [--json]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

SIDE = 1024  # pixels: 64x64 patches -> 1,024 merged tokens
# vLLM's CPU worker and torch keep their OpenMP threads spinning a little after a parallel
# region; a pause between requests keeps one system's tail off the other's request.
SETTLE_S = 0.3
STAGES = ("preprocess_ms", "lookup_ms", "encode_ms", "put_ms", "ttft_ms", "total_ms")


def wide_model() -> Path:
    """The ``--like wide`` checkpoint, built once under ``$SPLITVL_HOME`` (about 30 s)."""
    from splitvl.home import splitvl_home
    from splitvl.tiny_model import SEED, make_tiny_model

    path = splitvl_home() / f"wide-qwen3-vl-seed{SEED}"
    if not (path / "SPLITVL_TINY_MODEL").exists():
        print(f"building the wide checkpoint in {path} ...", file=sys.stderr)
        make_tiny_model(path, like="wide")
    return path


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


async def _split_request(
    stub: Any, image: bytes, prompt: str, max_tokens: int, policy: str = "similar"
) -> dict[str, Any]:
    """One streamed request through the gateway: client TTFT (ms), tier, stage timings."""
    from qwenvl.common.v1 import generation_pb2

    from splitvl.client import TIER_NAMES, build_request

    request = build_request(
        [image],
        prompt,
        max_tokens=max_tokens,
        ignore_eos=True,
        cache_policy={
            "similar": generation_pb2.CACHE_POLICY_SIMILAR,
            "off": generation_pb2.CACHE_POLICY_OFF,
        }[policy],
    )
    t0 = time.perf_counter()
    ttft = None
    out: dict[str, Any] = {}
    async for chunk in stub.Generate(request, timeout=600):
        if chunk.images:
            out["tier"] = TIER_NAMES.get(chunk.images[0].tier, "?")
            out["key"] = chunk.images[0].key
        if chunk.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        if chunk.HasField("timings"):
            out["stages"] = {name: getattr(chunk.timings, name) for name in STAGES}
    out["ttft_ms"] = 1000 * (ttft if ttft is not None else time.perf_counter() - t0)
    return out


async def _cached_embeddings(cache_address: str, key: str) -> Any:
    """The embeddings splitvl stored for ``key`` (torch, as the decoder got them), or None
    when the cache does not hold them within 5 s."""
    import grpc
    from qwenvl.cache.v1 import cache_service_pb2 as cpb
    from qwenvl.cache.v1 import cache_service_pb2_grpc as cpb_grpc
    from qwenvl.common.v1 import generation_pb2, tensor_pb2

    from vlcommon import tensors

    side = SIDE // 16
    options = [("grpc.max_receive_message_length", 256 << 20)]
    for _ in range(50):  # the put runs after the stream: wait for it
        async with grpc.aio.insecure_channel(cache_address, options=options) as channel:
            found = await cpb_grpc.CacheServiceStub(channel).Lookup(
                cpb.LookupRequest(
                    queries=[
                        cpb.LookupQuery(key=key, grid=tensor_pb2.GridTHW(t=1, h=side, w=side))
                    ],
                    policy=generation_pb2.CACHE_POLICY_EXACT_ONLY,
                    include_embeddings=True,
                ),
                timeout=60,
            )
        if found.results[0].tier == generation_pb2.CACHE_TIER_EXACT:
            return tensors.to_torch(found.results[0].embedding.embeddings).clone()
        await asyncio.sleep(0.1)
    return None  # the put failed (the gateway logs why): no reference for this image


def run_wide(
    pairs: int,
    per_run: int,
    max_tokens: int,
    seed: int,
    log_dir: Path,
    log: Any,
    vllm_alone: Any,
    cache_policy: str = "similar",
) -> dict[str, Any]:
    """The ``wide`` scenario; returns its table (JSON-able) with ``ttft_delta_ms``.

    Args:
        pairs: Pairs of runs (one per system, alternating who goes first), >= 5 for the
            issue's median.
        per_run: Requests per run (one at a time).
        max_tokens: Output tokens per request (greedy, eos ignored).
        seed: Seed of the images (``ImageFactory``).
        log_dir: The services' logs.
        log: Progress lines (stderr).
        vllm_alone: ``splitvl_tools.bench.VllmAlone`` (passed in: bench imports this module).
        cache_policy: splitvl's cache policy, ``similar`` or ``off`` (no lookup, no put:
            the decoder leg without the put beside it; no embeds reference either).
    """
    import torch
    from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

    from splitvl.launcher import Cluster, Ports
    from splitvl_tools.workload import ImageFactory, Request, png

    model = str(wide_model())
    factory = ImageFactory(side=SIDE, seed=seed)
    prompt = "Describe this image."
    log(f"wide: model {model}, {pairs} pairs x {per_run} requests, {SIDE}x{SIDE} images")
    cluster = Cluster(
        model=model,
        ports=Ports.free(),
        log_dir=log_dir,
        decoder_args=["--limit-mm-per-prompt", '{"image": 1, "video": 0}'],
        # The gateway's 1 s cache deadline lost 16 MiB puts here at load average 17
        # (DEADLINE_EXCEEDED in its log): the put runs after the stream, off the TTFT, so
        # a longer one changes no measured figure and keeps the embeds reference possible.
        env={"VLLM_CPU_KVCACHE_SPACE": "2", "GATEWAY_CACHE_TIMEOUT_S": "10"},
        progress=log,
    )
    rows: list[dict[str, Any]] = []

    async def main(engine: Any) -> None:
        async with cluster.gateway_channel() as channel:
            stub = pb_grpc.GatewayServiceStub(channel)

            async def vllm_raw(image: bytes) -> float:
                sample = await engine.raw(Request([image], prompt, ["unique"]))
                return 1000 * sample.ttft

            async def vllm_embeds(image: bytes, embeds: Any) -> float:
                grid = torch.tensor([[1, SIDE // 16, SIDE // 16]], dtype=torch.long)
                req = Request([image], prompt, ["unique"])
                sample = await engine.embeds(req, embeds, grid, [uuid.uuid4().hex])
                return 1000 * sample.ttft

            # Warm-up, unmeasured: both systems' first request pays one-off costs.
            warm = png(factory.make())
            await vllm_raw(warm)
            await _split_request(stub, warm, prompt, max_tokens, cache_policy)
            for i in range(pairs):
                images = [png(factory.make()) for _ in range(per_run)]
                order = ("vllm", "split") if i % 2 == 0 else ("split", "vllm")
                row: dict[str, Any] = {"pair": i, "first": order[0], "vllm": [], "split": []}
                for system in order:
                    for image in images:
                        await asyncio.sleep(SETTLE_S)
                        if system == "vllm":
                            row["vllm"].append(await vllm_raw(image))
                        else:
                            row["split"].append(
                                await _split_request(stub, image, prompt, max_tokens, cache_policy)
                            )
                row["vllm_embeds"] = []
                for image, done in zip(images, row["split"], strict=True):
                    if cache_policy == "off":
                        break  # nothing was put: no embeddings to read back
                    embeds = await _cached_embeddings(cluster.ports.address("cache"), done["key"])
                    if embeds is None:
                        log(f"  wide pair {i}: the cache put failed; no embeds reference")
                        continue
                    await asyncio.sleep(SETTLE_S)
                    row["vllm_embeds"].append(await vllm_embeds(image, embeds))
                vllm_mean = statistics.fmean(row["vllm"])
                split_mean = statistics.fmean(s["ttft_ms"] for s in row["split"])
                row["delta_ms"] = split_mean - vllm_mean
                rows.append(row)
                log(
                    f"  wide pair {i} ({order[0]} first): splitvl {split_mean:.0f} ms, "
                    f"vLLM alone {vllm_mean:.0f} ms, delta {row['delta_ms']:+.0f} ms"
                )

    with cluster:
        engine = vllm_alone(model, max_tokens, 1, block_size=32, dtype="auto")
        try:
            asyncio.run(main(engine))
        finally:
            engine.shutdown()
    return summarise_wide(rows) | {"cache_policy": cache_policy}


def summarise_wide(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over pairs of the per-pair means; the delta is per pair, then the median."""

    def per_pair(values: list[list[float]]) -> float:
        return median([statistics.fmean(v) for v in values])

    splits = [r["split"] for r in rows]
    stages = {
        name: per_pair([[s["stages"][name] for s in run if "stages" in s] for run in splits])
        for name in STAGES
    }
    tiers = sorted({s.get("tier", "?") for run in splits for s in run})
    return {
        "pairs": len(rows),
        "ttft_delta_ms": median([r["delta_ms"] for r in rows]),
        "ttft_delta_ms_min": min((r["delta_ms"] for r in rows), default=float("nan")),
        "ttft_delta_ms_max": max((r["delta_ms"] for r in rows), default=float("nan")),
        "vllm_ttft_ms": per_pair([r["vllm"] for r in rows]),
        "split_ttft_ms": per_pair([[s["ttft_ms"] for s in run] for run in splits]),
        "vllm_embeds_ttft_ms": per_pair([r["vllm_embeds"] for r in rows if r["vllm_embeds"]]),
        "split_stages_ms": stages,
        "split_tiers": tiers,
        "embedding_bytes_per_image": SIDE // 32 * (SIDE // 32) * 8192 * 2,
        "rows": rows,
    }


def print_wide(table: dict[str, Any], out: Any) -> None:
    """The scenario's table: medians over pairs, ms."""
    s = table["split_stages_ms"]
    print(
        f"wide (1 at a time, {SIDE}x{SIDE} = 1,024 tokens, "
        f"{table['embedding_bytes_per_image'] / 2**20:.0f} MiB bf16 per image, "
        f"{table['pairs']} pairs)",
        file=out,
    )
    print("| system | TTFT mean ms (median over pairs) |", file=out)
    print("|---|---|", file=out)
    print(f"| vLLM alone (raw image, its ViT) | {table['vllm_ttft_ms']:.0f} |", file=out)
    policy = table.get("cache_policy", "similar")
    what = "miss: encoder, cache put" if policy == "similar" else "cache off: encoder"
    print(f"| splitvl ({what}) | {table['split_ttft_ms']:.0f} |", file=out)
    print(f"| vLLM fed the embeddings (no ViT) | {table['vllm_embeds_ttft_ms']:.0f} |", file=out)
    print(
        f"ttft_delta_ms_wide_conc1: {table['ttft_delta_ms']:+.1f} ms "
        f"(pairs {table['ttft_delta_ms_min']:+.0f} .. {table['ttft_delta_ms_max']:+.0f})",
        file=out,
    )
    print(
        "splitvl stages (gateway StageTimings, ms): "
        + ", ".join(f"{k.removesuffix('_ms')} {v:.0f}" for k, v in s.items()),
        file=out,
    )
