"""The cluster a tool starts for itself: free ports, a temporary log folder kept only when
the run failed (or was the user's ``--log-dir``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitvl.home import default_model
from splitvl.launcher import Cluster, Ports
from splitvl.replicas import plan_store


@dataclass
class OwnCluster:
    """What :func:`own_cluster` yields: the running cluster and a pass/fail flag.

    Attributes:
        cluster: The four services, SERVING.
        ok: Set True once the run passed; the temporary logs are removed only then.
    """

    cluster: Cluster
    ok: bool = False


@contextlib.contextmanager
def own_cluster(
    *,
    model: str | None,
    log_dir: str | None,
    prefix: str,
    log: Callable[[str], None],
    env: dict[str, str] | None = None,
    replicas: Mapping[str, int] | None = None,
    store: str | None = None,
) -> Iterator[OwnCluster]:
    """Start the four services on free loopback ports; stop them on exit.

    Args:
        model: Checkpoint (None: the tiny one, built on first use).
        log_dir: The user's log folder (kept), or None for a temporary one named
            ``<prefix>*`` that is removed after a run that set ``ok``.
        prefix: The temporary folder's name prefix, e.g. ``splitvl-load-``.
        log: Progress lines (the services starting, where the logs were kept).
        env: Extra environment for the services.
        replicas: Instances per service, as ``splitvl up --replicas`` takes them
            (``{"decoder": 2, "cache": 2}``); None: one of each.
        store: The caches' store as ``splitvl up --store`` takes it: ``memory``, ``redis``
            (a local redis-server in the log folder, started first and stopped last) or a
            URL; None: the environment's ``CACHE_STORE``, else memory.

    Raises:
        ServiceStartError: a service did not start (its log is kept).
        LaunchConfigError: 2+ caches without a shared store (:func:`splitvl.replicas.check_store`).
    """
    folder = Path(log_dir or tempfile.mkdtemp(prefix=prefix))
    ports = Ports.free(replicas)
    cache_store, server = plan_store(
        store,
        {**os.environ, **(env or {})},
        replicas or {},
        folder / "redis",
        avoid=[p for p, _, _ in ports.bindings()],
    )
    run = OwnCluster(
        Cluster(
            model=model or default_model(),
            ports=ports,
            log_dir=folder,
            env=env or {},
            progress=log,
            cache_store=cache_store,
            store_server=server,
        )
    )
    shown = f", {len(ports.grpc)} instances" if replicas else ""
    log(f"starting the four services{shown} (logs in {folder}) ...")
    try:
        with run.cluster:
            yield run
    finally:
        keep_or_remove_logs(folder, own=log_dir is None, ok=run.ok, log=log)


def keep_or_remove_logs(log_dir: Path, *, own: bool, ok: bool, log: Callable[[str], None]) -> None:
    """Remove a temporary log folder after a run that passed; otherwise say where it is.

    Args:
        log_dir: The services' log folder.
        own: It is a temporary folder this run made (not the user's ``--log-dir``).
        ok: The run passed.
        log: Called with one line naming the folder when it is kept.
    """
    if own and ok:
        shutil.rmtree(log_dir, ignore_errors=True)
    else:
        log(f"service logs kept in {log_dir}")


def bench_model() -> Path:
    """The bench checkpoint (the real 2B model's ViT-to-LLM cost ratio), built once."""
    from splitvl.home import splitvl_home
    from splitvl.tiny_model import SEED, make_tiny_model

    path = splitvl_home() / f"bench-qwen3-vl-seed{SEED}"
    if not (path / "SPLITVL_TINY_MODEL").exists():
        print(f"building the bench checkpoint in {path} ...", file=sys.stderr)
        make_tiny_model(path, bench=True)
    return path


def machine() -> dict[str, Any]:
    """What a benchmark's JSON records of the host: cores, platform, Python, torch, CUDA."""
    import platform

    import torch

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }
