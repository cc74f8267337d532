"""Inter-token latency at each hop: the client, the gateway and the decoder.

Starts ``splitvl up`` on MODEL, sends one image again and again (an exact hit after the
first), and prints the client's median ITL beside the means of the gateway's and the
decoder's ITL histograms over the same requests. With ``--placements`` it alternates,
after start, where the processes other than vLLM's worker and the encoder may run
(``free``: every core; ``front``: the gateway, the cache and the decoder's front process on
the last core; ``all``: every other process there), three rounds.

    python scripts/measure_itl_hops.py --model DIR [--tokens 32] [--requests 8] [--placements]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from compare_trees import image, wait_serving  # noqa: E402

BASE, METRICS_BASE = 23300, 23310
HISTOGRAMS = {
    "gateway": (METRICS_BASE, "splitvl_gateway_inter_token_latency_seconds"),
    "decoder": (METRICS_BASE + 3, "splitvl_decoder_inter_token_latency_seconds"),
}


def histogram(port: int, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram on a service's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_sum"):
            total = float(line.split()[-1])
        elif line.startswith(name + "_count"):
            count = float(line.split()[-1])
    return total, count


def run(stub, request, requests: int) -> str:  # type: ignore[no-untyped-def]
    before = {k: histogram(*v) for k, v in HISTOGRAMS.items()}
    itls: list[float] = []
    for _ in range(requests):
        last = None
        for chunk in stub.Generate(request, timeout=120):
            now = time.perf_counter()
            if chunk.token_ids:
                if last is not None:
                    itls.append((now - last) * 1000 / len(chunk.token_ids))
                last = now
        time.sleep(0.3)
    after = {k: histogram(*v) for k, v in HISTOGRAMS.items()}
    means = {
        k: 1000 * (after[k][0] - before[k][0]) / max(after[k][1] - before[k][1], 1)
        for k in HISTOGRAMS
    }
    return (
        f"client ITL median {statistics.median(itls):.2f} ms, mean {statistics.mean(itls):.2f} "
        f"(n={len(itls)}); "
        f"gateway mean {means['gateway']:.2f}; decoder mean {means['decoder']:.2f}"
    )


def place(tree, mode: str) -> None:  # type: ignore[no-untyped-def]
    import psutil

    last = [max(os.sched_getaffinity(0))]
    for proc in tree:
        try:
            cmd = " ".join(proc.cmdline())
            if proc.name() == "VLLM::Worker" or "encoder_service" in cmd:
                continue
            front = any(f"-m {m}" in cmd for m in ("decoder_service", "gateway", "cache_service"))
            if mode == "all" or (mode == "front" and front):
                proc.cpu_affinity(last)
            else:
                proc.cpu_affinity(sorted(os.sched_getaffinity(0)))
        except psutil.Error:
            pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--placements", action="store_true")
    args = p.parse_args()
    import grpc
    import psutil
    from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

    from splitvl.client import build_request

    proc = subprocess.Popen(
        [sys.executable, "-m", "splitvl.cli", "up", "--model", args.model,
         "--base-port", str(BASE), "--metrics-base-port", str(METRICS_BASE), "--http-port", "0",
         "--log-dir", "/tmp/measure-itl-hops"],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        for offset in range(4):
            wait_serving(f"127.0.0.1:{BASE + offset}")
        request = build_request(
            [image(1, 448)], "Describe this image.", max_tokens=args.tokens, ignore_eos=True
        )
        with grpc.insecure_channel(f"127.0.0.1:{BASE}") as channel:
            stub = pb_grpc.GatewayServiceStub(channel)
            for _ in range(2):  # the miss, then a warm hit
                list(stub.Generate(request, timeout=120))
            if not args.placements:
                print(run(stub, request, args.requests))
                return
            tree = psutil.Process(proc.pid).children(recursive=True)
            for mode in ["free", "front", "all"] * 3:
                place(tree, mode)
                print(f"{mode}: {run(stub, request, args.requests // 2 or 1)}", flush=True)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


if __name__ == "__main__":
    main()
