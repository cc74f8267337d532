"""``splitvl bench --front-cpu``'s accounting: which CPU is the front's and which the
engine's, on real processes and threads, and the per-request and per-token arithmetic."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from splitvl_tools.front_cpu import cpu_by_part, summarize

# A process tree shaped like a decoder with an encoder's ViT thread: the main thread burns
# 0.2 s of CPU, a thread named splitvl-vit 0.4 s (and a thread it starts, as torch's OpenMP
# pool is, 0.2 s), a thread that ends 0.1 s, and a child process named VLLM::Worker 0.3 s;
# then all that are left sleep.
TREE = textwrap.dedent(
    """
    import os, sys, threading, time
    from vlcommon.cpus import name_this_thread

    def burn(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    if sys.argv[1] == "worker":
        name_this_thread("VLLM::Worker")
        burn(0.3)
        print("ready", flush=True)
        time.sleep(60)
    import subprocess
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], "worker"],
                             stdout=subprocess.PIPE, text=True)

    def stay(seconds, done):
        burn(seconds)
        done.release()
        time.sleep(60)

    def vit(done):
        name_this_thread("splitvl-vit")
        threading.Thread(target=stay, args=(0.2, done), daemon=True).start()
        stay(0.4, done)

    start = time.thread_time()
    done = threading.Semaphore(0)
    threading.Thread(target=vit, args=(done,), daemon=True).start()
    ended = threading.Thread(target=burn, args=(0.1,))
    ended.start()
    ended.join()
    done.acquire()
    done.acquire()
    burn(0.2)
    child.stdout.readline()
    print("ready", time.thread_time() - start, flush=True)
    time.sleep(60)
    """
)


def test_vllm_children_and_vit_threads_count_as_engine_the_rest_as_front() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", TREE, "root", TREE], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[0] == "ready"
        main_thread = float(line[1])  # the burn and the thread joins, no imports
        time.sleep(0.2)  # the worker's exit of its burn loop is accounted
        cpu = cpu_by_part({"svc": proc.pid})
    finally:
        proc.kill()
        proc.wait()
    # Engine: the ViT thread, the thread it started and the VLLM:: child, 0.9 s in all.
    assert 0.85 <= cpu["svc/engine"] <= 1.1, cpu
    # Front: the main thread (its 0.2 s burn, and its imports before) and the thread that
    # ended (0.1 s), never the engine's.
    assert main_thread >= 0.2 and 0.3 <= cpu["svc"] < 0.85, cpu
    assert set(cpu) == {"svc", "svc/engine"}


def test_a_run_counts_each_process_from_its_own_first_read() -> None:
    """A process that ended during a run drops out (and is counted as gone) instead of
    taking its whole lifetime's CPU out of the tree's total; one born during it counts
    whole."""
    from splitvl_tools.front_cpu import cpu_delta

    before = {("svc", 1, "front"): 10.0, ("svc", 1, "engine"): 0.0, ("svc", 2, "engine"): 50.0}
    after = {("svc", 1, "front"): 10.5, ("svc", 1, "engine"): 0.0, ("svc", 3, "engine"): 0.25}
    assert cpu_delta(before, after) == ({"svc": 0.5, "svc/engine": 0.25}, 1)


def test_cpu_per_request_and_per_token_are_medians_over_rounds() -> None:
    def row(r: int, scenario: str, system: str, front: float, engine: float) -> dict:
        return {
            "round": r,
            "scenario": scenario,
            "system": system,
            "requests": 10,
            "elapsed_s": 1.0,
            "cpu_s": {system: front, f"{system}/engine": engine},
        }

    rows = []
    for r, k in enumerate((1.0, 2.0, 3.0)):
        for system, front in (("vllm_serve", 0.5), ("splitvl_grpc", 0.2)):
            rows += [
                row(r, "miss", system, front * k, 9.0),
                row(r, "text", system, front / 5, 1.0),
                # 10 requests x (256 - 16) tokens more than text: 2,400 tokens
                row(r, "tokens", system, front / 5 + 0.024 * k, 5.0),
            ]
    report = summarize(rows, 16, 256)
    miss = report["per_request_ms"]["splitvl_grpc"]["miss"]
    # 0.2, 0.4, 0.6 s over 10 requests: 20, 40, 60 ms per request; the engine apart.
    assert miss["front_ms"] == pytest.approx({"median": 40.0, "min": 20.0, "max": 60.0})
    assert miss["parts_ms"]["splitvl_grpc/engine"] == pytest.approx(900.0)
    # 0.024 s more per 2,400 tokens in round 0: 10 µs per token (20, 30 in the others).
    per_token = report["per_token_us"]["splitvl_grpc"]["splitvl_grpc"]
    assert per_token == pytest.approx({"median": 20.0, "min": 10.0, "max": 30.0})
    assert "splitvl_grpc/engine" not in report["per_token_us"]["splitvl_grpc"]
    assert report["ratios"]["front_cpu_splitvl_grpc_miss"] == pytest.approx(0.4)
    assert report["ratios"]["front_cpu_splitvl_grpc_text"] == pytest.approx(0.4)
