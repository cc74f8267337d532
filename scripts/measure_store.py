"""Measure what the cache's shared store costs per entry (docs/scaling.md, "Store").

Usage::

    .venv/bin/python scripts/measure_store.py               # starts a loopback redis-server
    .venv/bin/python scripts/measure_store.py --runs 20 --json
    .venv/bin/python scripts/measure_store.py --mooncake    # also Mooncake Store (TCP)

One 16 MiB entry (Qwen3-VL-2B, one 1,024-token image: 1,024 x 8,192 bf16 bytes, main +
deepstack), medians of ``--runs`` runs, every kind interleaved in each run, and the ratios
that issue 42 bounds, taken run by run (median, min, max): ``store_put`` / ``redis_set``
and ``store_hit_read`` / ``redis_get`` (at most 1.3 each):

* ``redis_set`` / ``redis_get``: redis-py (hiredis) SET and GET of the raw bytes;
* ``store_put``: ``RedisStore.put`` of a new key (the header read, AES-256-GCM sealing,
  the write script, the log);
* ``store_hit_read``: an exact hit on a replica without a local copy (the header, then
  header and embeddings in one ``HMGET``, opened, local copy kept);
* ``store_hit_local``: the same hit again (the header only: the local copy answers);
* ``store_miss``: a key that is not there (one round trip);
* ``memory_hit``: the in-process store's exact hit, for reference;
* ``mooncake_put`` / ``mooncake_get`` (with ``--mooncake``): the
  ``mooncake-transfer-engine-non-cuda`` wheel's ``MooncakeDistributedStore`` over its TCP
  transport against a ``mooncake_master`` on loopback.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import redis

from cache_service.settings import CacheSettings
from cache_service.store import EmbeddingStore
from cache_service.store_conn import StoreAccess, parse_store_url
from cache_service.store_redis import RedisStore
from vlcommon import malloc

ROWS, WIDTH = 1024, 8192  # tokens x (out_hidden 2,048 x (1 + 3 deepstack)) bf16: 16 MiB
BF16 = 4  # DataType.DATA_TYPE_BF16
GRID = (1, 64, 64)  # 1,024 tokens after the 2x2 merge
DIM = 3072
PASSWORD = "measure-store"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(root: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    server = shutil.which("redis-server") or "/usr/bin/redis-server"
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", PASSWORD,
         "--dir", str(root), "--save", "", "--appendonly", "no",
         "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(port=port, password=PASSWORD)
    for _ in range(500):
        try:
            client.ping()
            break
        except redis.RedisError:
            time.sleep(0.01)
    return proc, f"redis://:{PASSWORD}@127.0.0.1:{port}/0"


def start_mooncake() -> tuple[list[subprocess.Popen[bytes]], Any]:
    """A ``mooncake_master`` (with its HTTP metadata server) and a ``mooncake_client`` that
    holds the store's memory (a 1 GB segment), both on loopback, and this process's client
    with no segment of its own: a put or get crosses to the holder over the TCP transport,
    as a Redis call crosses to redis-server (FACTS.md: "Scale-out parts")."""
    import mooncake  # type: ignore[import-not-found]
    from mooncake.store import MooncakeDistributedStore  # type: ignore[import-not-found]

    bindir = Path(mooncake.__file__).parent
    rpc, meta, holder = free_port(), free_port(), free_port()
    metadata = f"http://127.0.0.1:{meta}/metadata"
    procs = [
        subprocess.Popen(
            [
                str(bindir / "mooncake_master"),
                f"--rpc_port={rpc}",
                "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={meta}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),  # fmt: skip
    ]
    time.sleep(1.5)
    procs.append(
        subprocess.Popen(
            [
                str(bindir / "mooncake_client"),
                "--host=127.0.0.1",
                f"--port={holder}",
                "--global_segment_size=1GB",
                "--local_buffer_size=64MB",
                "--protocol=tcp",
                f"--master_server_address=127.0.0.1:{rpc}",
                f"--metadata_server={metadata}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
    )
    time.sleep(2.0)
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", metadata, 0, 128 << 20, "tcp", "", f"127.0.0.1:{rpc}")
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
    return procs, store


class Timer:
    """Milliseconds per named operation."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    def __call__(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.times.setdefault(name, []).append((time.perf_counter() - t0) * 1000)
        return out

    def summary(self) -> dict[str, Any]:
        ratios = {}
        for name, over in (("store_put", "redis_set"), ("store_hit_read", "redis_get")):
            per_run = [a / b for a, b in zip(self.times[name], self.times[over], strict=True)]
            ratios[f"{name}/{over}"] = {
                "median": round(statistics.median(per_run), 3),
                "min": round(min(per_run), 3),
                "max": round(max(per_run), 3),
            }
        return {
            "ratios": ratios,
            "median_ms": {k: round(statistics.median(v), 3) for k, v in self.times.items()},
            "p90_ms": {
                k: round(sorted(v)[int(0.9 * (len(v) - 1))], 3) for k, v in self.times.items()
            },
        }


def one_run(
    i: int,
    timed: Timer,
    stores: tuple[RedisStore, RedisStore, EmbeddingStore, redis.Redis],
    data: bytes,
    descriptor: np.ndarray,
    mooncake: Any,
) -> None:
    """Every kind once, in a fixed order (so each sees the same host state)."""
    writer, reader, memory, raw = stores
    key, shape = f"k{i}", (ROWS, WIDTH)
    timed("redis_set", raw.set, "raw", data)
    assert timed("redis_get", raw.get, "raw") == data
    timed("store_put", writer.put, key, descriptor, GRID, BF16, shape, data)
    hit = timed("store_hit_read", reader.lookup, key, None, GRID, similar=False)
    assert hit.entry is not None and hit.entry.data == data
    timed("store_hit_local", reader.lookup, key, None, GRID, similar=False)
    timed("store_miss", reader.lookup, "none", None, GRID, similar=False)
    timed("memory_hit", memory.lookup, "m", None, GRID, similar=False)
    if mooncake is not None:
        timed("mooncake_put", mooncake.put, f"mk{i}", data)
        assert bytes(timed("mooncake_get", mooncake.get, f"mk{i}")) == data
        mooncake.remove(f"mk{i}")
    reader.local.discard(key)  # the next run reads the store again


def measure(runs: int, use_mooncake: bool, heap_max_bytes: int) -> dict[str, Any]:
    # As the cache service does (CACHE_MALLOC_HEAP_MAX_BYTES; vlcommon/malloc.py).
    malloc.keep_large_blocks(heap_max_bytes)
    data = np.random.default_rng(0).integers(0, 2**16, (ROWS, WIDTH), np.uint16).tobytes()
    assert len(data) == 16 << 20
    descriptor = np.random.default_rng(1).standard_normal(DIM).astype(np.float32)
    root = Path(tempfile.mkdtemp(prefix="measure-store-"))
    proc, url = start_redis(root)
    children = [proc]
    try:
        access = StoreAccess(parse_store_url(url), timeout_s=5.0)  # type: ignore[arg-type]
        replicas = []
        for _ in range(2):
            store = RedisStore(
                access, secret="measure-store-secret", descriptor_dim=DIM, capacity_bytes=1 << 30
            )
            store.start(follow=False)
            replicas.append(store)
        memory = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=1 << 30)
        memory.put("m", descriptor, GRID, BF16, (ROWS, WIDTH), data)
        mooncake = None
        if use_mooncake:
            mooncake_procs, mooncake = start_mooncake()
            children += mooncake_procs
        timed = Timer()
        stores = (replicas[0], replicas[1], memory, redis.Redis.from_url(url))
        for i in range(runs):
            one_run(i, timed, stores, data, descriptor, mooncake)
        for store in replicas:
            store.close()
        return {"entry_bytes": len(data), "runs": runs, **timed.summary()}
    finally:
        for child in reversed(children):
            child.terminate()
            child.wait(10)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--mooncake", action="store_true", help="also Mooncake Store (TCP)")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument(
        "--heap-max-bytes",
        type=int,
        default=CacheSettings().malloc_heap_max_bytes,
        help="mallopt as the cache service (CACHE_MALLOC_HEAP_MAX_BYTES); 0: glibc's defaults",
    )
    args = parser.parse_args()
    result = measure(args.runs, args.mooncake, args.heap_max_bytes)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for name, ms in result["median_ms"].items():
        print(f"{name:18s} {ms:9.3f} ms (median)   {result['p90_ms'][name]:9.3f} ms (p90)")
    for name, r in result["ratios"].items():
        print(f"{name:26s} {r['median']:.3f} (median of runs; {r['min']:.3f}-{r['max']:.3f})")


if __name__ == "__main__":
    main()
