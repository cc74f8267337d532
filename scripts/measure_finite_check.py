"""The embeddings' finiteness check, before and after ``tensors.all_finite`` (issue 14).

Every reader of an image's embeddings checks them for NaN and inf once: the decoder on
every request (``decoder_service.validation.check_image``), the cache on every put.
The check was ``torch.isfinite`` over the decoded tensor (the decoder) or ``np.isfinite``
over ``to_numpy``'s float32 copy (the cache); ``tensors.all_finite`` reads the payload's
exponent bits where it lies. Both run here on the same payloads, alternating trial by
trial, with torch on one thread as the services run it (``limit_torch_threads``):

    python scripts/measure_finite_check.py --trials 21

Prints one row per payload: median ms with min-max for each, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from qwenvl.common.v1 import tensor_pb2

from vlcommon import tensors

PAYLOADS = {
    # name: (tokens, width, dtype): one image's embeddings, main + deepstack concatenated
    "Qwen3-VL-2B, 1,024 tokens, bf16 (16 MiB)": (1024, 8192, torch.bfloat16),
    "bench checkpoint, 196 tokens, fp32 (1.5 MiB)": (196, 2048, torch.float32),
    "tiny checkpoint, 64 tokens, fp32 (96 KiB)": (64, 384, torch.float32),
}


def torch_check(msg: tensor_pb2.Tensor, data: bytearray) -> bool:
    """The decoder's check before: decode, then torch.isfinite."""
    return bool(torch.isfinite(tensors.to_torch(msg, data)).all())


def numpy_check(msg: tensor_pb2.Tensor, data: bytearray) -> bool:
    """The cache's check before: to_numpy (float32 for bf16), then np.isfinite."""
    return bool(np.isfinite(tensors.to_numpy(msg, data)).all())


def bits_check(msg: tensor_pb2.Tensor, data: bytearray) -> bool:
    """Now: ``tensors.all_finite`` on the payload."""
    return tensors.all_finite(msg, data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(1)
    checks = {"torch.isfinite": torch_check, "np.isfinite": numpy_check, "all_finite": bits_check}
    print("| payload | " + " | ".join(f"{n} ms" for n in checks) + " | torch / all_finite |")
    print("|---|" + "---|" * (len(checks) + 1))
    for name, (rows, width, dtype) in PAYLOADS.items():
        t = torch.randn(rows, width, generator=torch.Generator().manual_seed(0)).to(dtype)
        msg = tensors.from_torch(t)
        data = bytearray(msg.data)
        msg.ClearField("data")
        times: dict[str, list[float]] = {n: [] for n in checks}
        for _ in range(args.trials):
            for check_name, check in checks.items():
                t0 = time.perf_counter()
                assert check(msg, data)
                times[check_name].append(1000 * (time.perf_counter() - t0))
        cells = [f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]" for v in times.values()]
        ratio = statistics.median(times["torch.isfinite"]) / statistics.median(times["all_finite"])
        print(f"| {name} | " + " | ".join(cells) + f" | {ratio:.1f}x |")


if __name__ == "__main__":
    main()
