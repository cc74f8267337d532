"""glibc's allocator kept from unmapping large blocks (the cache's 16 MiB entries).

glibc serves an allocation above its mmap threshold (128 KiB, raised dynamically up to
32 MiB) with a fresh ``mmap`` and returns it with ``munmap`` when freed, so every 16 MiB
payload a cache replica reads from its store, decrypts or copies is page-faulted in anew
(4,096 faults). Measured with ``scripts/measure_store.py`` on this 2-core host: a store
hit that reads 16 MiB took 1.79-1.93x a raw redis-py ``GET`` of them, 1.19x with the
threshold raised (docs/benchmarks.md, "Cache store"). Raising the threshold (and the trim
threshold with it) keeps freed blocks in the heap for the next one, as ``MALLOC_MMAP_
THRESHOLD_`` would from the environment; the cost is up to the trim threshold of freed
memory kept mapped. ``mallopt`` is glibc's (``man 3 mallopt``); elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt's parameter numbers (glibc malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def keep_large_blocks(max_bytes: int) -> bool:
    """Serve allocations up to ``max_bytes`` from the heap and keep up to twice that of
    freed memory mapped (0: leave glibc's defaults). Returns whether glibc took it."""
    if max_bytes <= 0:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(M_MMAP_THRESHOLD, max_bytes)) and bool(
        mallopt(M_TRIM_THRESHOLD, 2 * max_bytes)
    )
    log.info("malloc: blocks up to %d bytes from the heap (mallopt %s)", max_bytes, ok)
    return ok
