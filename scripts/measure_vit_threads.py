"""The encoder's ViT on one thread against two, with and without a busy core beside it.

One at a time, vLLM's worker leaves its core idle while splitvl's encoder runs the ViT on
the other: what would a second ViT thread on the worker's core give? Per setting, the
same preprocessed 448x448 images (``VisionEngine``, the shared resize plan) through
``VisionEngine.encode`` one by one; the settings alternate image by image. ``--spinner``
adds a process on CPU 0 that calls ``sched_yield`` in a loop, as vLLM's idle worker does
for 1 s after its last step (``shm_broadcast`` ``busy_loop_s``):

    python scripts/measure_vit_threads.py --model ~/.cache/splitvl/bench-qwen3-vl-seed1234
    python scripts/measure_vit_threads.py --model ... --spinner

Prints ms per image, median [min-max], per thread count.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from encoder_service.engine import VisionEngine
from splitvl_tools.workload import ImageFactory
from vlcommon.imaging import plan_resize

SPINNER = "import os, time\nt = time.time()\nwhile time.time() - t < 600: os.sched_yield()\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint (the bench one)")
    parser.add_argument("--images", type=int, default=12)
    parser.add_argument("--spinner", action="store_true", help="a sched_yield loop on CPU 0")
    args = parser.parse_args()
    engine = VisionEngine.load(args.model, device="cpu")
    factory = ImageFactory(side=448, seed=5)
    pre = []
    for _ in range(args.images):
        image = factory.make()
        plan = plan_resize(image.height, image.width, engine.spec, index=0)
        pre.append(engine.preprocess(np.asarray(image), plan))
    spinner = None
    if args.spinner:
        spinner = subprocess.Popen(
            [sys.executable, "-c", SPINNER], preexec_fn=lambda: os.sched_setaffinity(0, {0})
        )
    try:
        times: dict[int, list[float]] = {1: [], 2: []}
        for threads in (1, 2):  # warm-up of each pool
            torch.set_num_threads(threads)
            engine.encode(pre[:1])
        for p in pre:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                t0 = time.perf_counter()
                engine.encode([p])
                times[threads].append(1000 * (time.perf_counter() - t0))
    finally:
        if spinner is not None:
            spinner.kill()
    for threads, values in times.items():
        print(
            f"{threads} thread(s): {statistics.median(values):.0f} ms per image "
            f"[{min(values):.0f}-{max(values):.0f}], {len(values)} images"
            + (", sched_yield spinner on CPU 0" if args.spinner else "")
        )


if __name__ == "__main__":
    main()
