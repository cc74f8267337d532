"""One request at a time, two checkouts of splitvl side by side: which is faster on a miss?

Starts ``splitvl up`` from each tree (its own stubs: ``<tree>/protos`` first on the path)
on the same checkpoint, then sends fresh images (every request a miss for both) one at a
time, alternating A, B, B, A, ... so drift of a shared host cancels. Prints the medians of
TTFT as the client sees it and of the gateway's stage timings, with min-max, and B / A.

    python scripts/compare_trees.py OLD_TREE NEW_TREE --model DIR [--requests 12]
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image


def start(tree: Path, model: str, base: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": f"{tree / 'protos'}:{tree}", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "splitvl.cli", "up", "--model", model, "--base-port", str(base),
         "--metrics-base-port", "0", "--http-port", "0", "--log-dir", str(log)],
        cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip


def wait_serving(address: str, timeout: float = 600) -> None:
    from splitvl.launcher import health_status

    deadline = time.monotonic() + timeout
    while health_status(address) != "SERVING":
        if time.monotonic() > deadline:
            raise SystemExit(f"{address} did not come up")
        time.sleep(1)


def image(seed: int, side: int) -> bytes:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    img = Image.fromarray(base).resize((side, side), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def one(address: str, data: bytes, max_tokens: int) -> dict[str, float]:
    import grpc
    from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

    from splitvl.client import build_request

    request = build_request([data], "Describe this image.", max_tokens=max_tokens, ignore_eos=True)
    with grpc.insecure_channel(address) as channel:
        t0 = time.perf_counter()
        ttft = None
        timings = None
        for chunk in pb_grpc.GatewayServiceStub(channel).Generate(request, timeout=120):
            if ttft is None and chunk.token_ids:
                ttft = (time.perf_counter() - t0) * 1000
            if chunk.HasField("timings"):
                timings = chunk.timings
    assert ttft is not None and timings is not None
    return {
        "ttft_client": ttft,
        "preprocess": timings.preprocess_ms,
        "lookup": timings.lookup_ms,
        "encode": timings.encode_ms,
        "decoder_ttft": timings.ttft_ms,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--side", type=int, default=448)
    p.add_argument("--max-tokens", type=int, default=2)
    args = p.parse_args()
    logs = Path("/tmp/compare-trees")
    logs.mkdir(exist_ok=True)
    bases = {"A": 23100, "B": 23200}
    procs = {
        "A": start(args.old.resolve(), args.model, bases["A"], logs / "a"),
        "B": start(args.new.resolve(), args.model, bases["B"], logs / "b"),
    }
    try:
        for name in "AB":  # the gateway, encoder, cache and decoder of each (base + 0..3)
            for offset in range(4):
                wait_serving(f"127.0.0.1:{bases[name] + offset}")
        results: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
        for k in range(args.requests + 2):  # two warm-up pairs
            order = "AB" if k % 2 == 0 else "BA"
            for name in order:
                seed = 10_000 * (1 if name == "A" else 2) + k
                r = one(f"127.0.0.1:{bases[name]}", image(seed, args.side), args.max_tokens)
                if k >= 2:
                    results[name].append(r)
                time.sleep(0.3)
        print(f"A = {args.old}, B = {args.new}; {args.requests} misses each, alternating")
        print("| ms | A median [min-max] | B median [min-max] | B - A |")
        print("|---|---|---|---|")
        for key in results["A"][0]:
            a = [r[key] for r in results["A"]]
            b = [r[key] for r in results["B"]]
            ma, mb = statistics.median(a), statistics.median(b)
            print(f"| {key} | {ma:.1f} [{min(a):.1f}-{max(a):.1f}] | "
                  f"{mb:.1f} [{min(b):.1f}-{max(b):.1f}] | {mb - ma:+.1f} |")  # fmt: skip
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGINT)
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
