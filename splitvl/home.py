"""Where splitvl keeps its files (``$SPLITVL_HOME``), the default checkpoint, and the
cluster that ``splitvl up``/``demo`` flags describe."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from splitvl.launcher import Cluster, Ports, check_ports, split_args
from splitvl.replicas import plan_store


def splitvl_home() -> Path:
    """``$SPLITVL_HOME`` (default ``~/.cache/splitvl``): checkpoints and logs."""
    return Path(os.environ.get("SPLITVL_HOME", Path.home() / ".cache" / "splitvl"))


def default_model() -> str:
    """The tiny checkpoint, built on first use (deterministic, about 10 s)."""
    from splitvl.tiny_model import SEED, make_tiny_model

    path = splitvl_home() / f"tiny-qwen3-vl-seed{SEED}"
    if not (path / "SPLITVL_TINY_MODEL").exists():
        print(f"building the tiny Qwen3-VL checkpoint in {path} ...", file=sys.stderr)
        tmp = Path(tempfile.mkdtemp(dir=path.parent if path.parent.exists() else None))
        make_tiny_model(tmp)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            tmp.rename(path)
    return str(path)


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    """The cluster ``splitvl up``/``demo`` flags describe (not started), with ``up``'s
    ``--replicas`` and ``--store`` (splitvl/replicas.py).

    Raises:
        PortInUseError: a port it would bind is taken (checked before the default
            checkpoint is built).
        LaunchConfigError: replicas past port 65535, several caches without a shared
            store, or ``--store redis`` without redis-server.
    """
    replicas = getattr(args, "replicas", None) or {}
    ports = Ports.from_base(args.base_port, args.metrics_base_port, args.http_port, replicas)
    # One log folder per base port by default, so instances on other ports keep theirs.
    log_dir = Path(args.log_dir or splitvl_home() / "logs" / str(args.base_port))
    cache_store, server = plan_store(
        getattr(args, "store", None),
        os.environ,
        replicas,
        log_dir / "redis",
        maxmemory=getattr(args, "redis_maxmemory", None),
        avoid=[port for port, _, _ in ports.bindings()],
    )
    check_ports(ports)  # before building a checkpoint: a second `up` refuses at once
    model = args.model or default_model()
    return Cluster(
        model=model,
        ports=ports,
        log_dir=log_dir,
        decoder_args=[a for arg in args.decoder_arg for a in split_args(arg, "--decoder-arg")],
        cache_store=cache_store,
        store_server=server,
        start_timeout_s=args.start_timeout,
        reasoning_parser=getattr(args, "reasoning_parser", None) or "",
    )
