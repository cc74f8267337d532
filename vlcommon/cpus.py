"""CPU placement on machines without a GPU.

vLLM's CPU worker pins its OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``) and keeps those
cores busy even when idle (FACTS.md: an encoder sharing core 0 slowed decoding by ~25%).
So ``splitvl up`` gives the decoder's worker the first cores and the encoder the last
quarter (at least one), and each process keeps to its own.
"""

from __future__ import annotations

import os


def parse_cpu_list(text: str) -> list[int]:
    """Parse ``"0,2-4"`` into ``[0, 2, 3, 4]``.

    Raises:
        ValueError: malformed text.
    """
    cpus: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-", 1))
            if hi < lo:
                raise ValueError(f"bad CPU range {part!r}")
            cpus.extend(range(lo, hi + 1))
        else:
            cpus.append(int(part))
    return sorted(set(cpus))


def format_cpu_list(cpus: list[int]) -> str:
    """The inverse of parse_cpu_list, with ranges: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    cpus = sorted(set(cpus))
    start = prev = None
    for c in [*cpus, None]:
        if start is None:
            start = prev = c
        elif c is not None and prev is not None and c == prev + 1:
            prev = c
        else:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = prev = c
    return ",".join(out)


def split_cpus(available: list[int]) -> tuple[list[int], list[int]] | None:
    """(decoder cores, encoder cores), or None when there are fewer than two cores."""
    cpus = sorted(available)
    if len(cpus) < 2:
        return None
    n_encoder = max(1, len(cpus) // 4)
    return cpus[:-n_encoder], cpus[-n_encoder:]


def available_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def name_this_thread(name: str) -> None:
    """Set the calling thread's OS name (Linux ``prctl(PR_SET_NAME)``, 15 bytes at most;
    elsewhere nothing): ``top -H``, py-spy and ``/proc/<pid>/task/<tid>/comm`` show it, and
    threads the thread starts inherit it (torch's OpenMP pool started from the encoder's
    ViT thread is named ``splitvl-vit`` too, which is how ``splitvl bench --front-cpu``
    tells the ViT's CPU from the encoder front's). Python 3.11 names no OS thread itself.
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the process's own libc, no ldconfig
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # pragma: no cover - no libc: keep the default name
        pass
