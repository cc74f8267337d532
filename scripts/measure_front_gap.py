"""Where a one-at-a-time request's time goes: the OpenAI front against the gRPC path.

One cluster on the bench checkpoint; requests alternate between the gRPC ``Generate`` and
the HTTP front (streaming, as vLLM's benchmark client sends them), each with a fresh
448x448 JPEG of i.i.d. random pixels (what vLLM's ``random-mm`` dataset sends: always a
miss), 32 tokens, eos ignored, greedy. Prints the client's TTFT and total per path, and the
gateway's stage timings (from the response / the ``splitvl`` extension), medians with
min..max over the pairs.

    .venv/bin/python scripts/measure_front_gap.py --pairs 10
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image


def noise_jpeg(rng: np.random.Generator, side: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def via_http(base: str, model: str, jpeg: bytes, max_tokens: int) -> dict[str, Any]:
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    body = {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "Describe the image."},
                ],
            }
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    ext: dict[str, Any] = {}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if ttft is None and data.get("choices") and data["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if "splitvl" in data:
                ext = data["splitvl"]
    total = time.perf_counter() - t0
    stages = ext.get("timings", {})
    return {"ttft_ms": 1e3 * (ttft or total), "total_ms": 1e3 * total, "stages": stages}


def via_grpc(address: str, jpeg: bytes, max_tokens: int) -> dict[str, Any]:
    import grpc
    from google.protobuf.json_format import MessageToDict
    from qwenvl.gateway.v1 import gateway_service_pb2_grpc

    from splitvl.client import build_request

    request = build_request([jpeg], "Describe the image.", max_tokens=max_tokens, ignore_eos=True)
    with grpc.insecure_channel(address) as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        t0 = time.perf_counter()
        ttft = None
        stages: dict[str, Any] = {}
        for item in stub.Generate(request, timeout=120):
            if ttft is None and (item.text or item.token_ids):
                ttft = time.perf_counter() - t0
            if item.HasField("timings"):
                stages = MessageToDict(item.timings, preserving_proto_field_name=True)
        total = time.perf_counter() - t0
    return {"ttft_ms": 1e3 * (ttft or total), "total_ms": 1e3 * total, "stages": stages}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--side", type=int, default=448)
    args = ap.parse_args()

    import tempfile

    from splitvl.launcher import Cluster, Ports
    from splitvl_tools.cluster import bench_model

    model = str(bench_model())
    rng = np.random.default_rng(0)
    cluster = Cluster(
        model=model,
        ports=Ports.free(),
        log_dir=Path(tempfile.mkdtemp(prefix="splitvl-front-gap-")),
        decoder_args=["--limit-mm-per-prompt", json.dumps({"image": 1, "video": 0})],
        env={"VLLM_CPU_KVCACHE_SPACE": "2"},
        progress=lambda s: print(s, file=sys.stderr),
    )
    rows: dict[str, list[dict[str, Any]]] = {"grpc": [], "http": []}
    with cluster:
        base = f"http://127.0.0.1:{cluster.ports.http}"
        address = cluster.ports.address("gateway")
        for _ in range(2):  # warm both paths
            via_grpc(address, noise_jpeg(rng, args.side), 2)
            via_http(base, model, noise_jpeg(rng, args.side), 2)
        for i in range(args.pairs):
            order = ("grpc", "http") if i % 2 == 0 else ("http", "grpc")
            for path in order:
                jpeg = noise_jpeg(rng, args.side)
                if path == "grpc":
                    rows[path].append(via_grpc(address, jpeg, args.max_tokens))
                else:
                    rows[path].append(via_http(base, model, jpeg, args.max_tokens))
                time.sleep(0.3)

    def fmt(values: list[float]) -> str:
        return f"{statistics.median(values):7.1f} ({min(values):.1f}..{max(values):.1f})"

    stage_names = sorted({k for r in rows["grpc"] + rows["http"] for k in r["stages"]})
    print(f"| figure, ms (median, min..max over {args.pairs}) | gRPC | HTTP front |")
    print("|---|---|---|")
    for name in ["ttft_ms", "total_ms"]:
        print(
            f"| {name} | {fmt([r[name] for r in rows['grpc']])} | "
            f"{fmt([r[name] for r in rows['http']])} |"
        )
    for name in stage_names:
        g = [float(r["stages"].get(name, 0)) for r in rows["grpc"]]
        h = [float(r["stages"].get(name, 0)) for r in rows["http"]]
        print(f"| stage {name} | {fmt(g)} | {fmt(h)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
