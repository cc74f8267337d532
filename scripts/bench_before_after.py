"""Before/after guard for a change to the request path: the same bench, alternating
between an earlier commit and the working tree, on one host.

Only ratios measured in one run compare on a shared host, so each side runs in turn
(after, before, after, before, ...) and the table gives each side's medians over its runs
with min-max. The earlier commit runs from a git worktree of its own (``--before``, made
once under ``$TMPDIR``) with its own generated gRPC stubs, through ``PYTHONPATH``; the
working tree runs as installed. Every run is a whole ``splitvl bench`` command (its own
cluster), by default the quick one without the wide and encoder scenarios:

    python scripts/bench_before_after.py --before de3ce6c --rounds 2
    python scripts/bench_before_after.py --before HEAD~3 --bench-args "--quick --skip-wide"

Prints, per side, splitvl's req/s at 32 (repeat0, repeat50, repeat100), the ratios the
bench computes against vLLM alone, and the after/before ratio of each median; writes
every run's JSON and log under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BENCH = "--quick --skip-wide --skip-encoder --conc1-pairs 1"


def worktree(rev: str) -> Path:
    """A worktree of ``rev`` with its gRPC stubs generated (made once, then reused)."""
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", rev], check=True, capture_output=True, text=True
    ).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"splitvl-before-{sha[:12]}"
    if not (path / ".git").exists():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(path), sha],
            check=True,
        )
    protos = path / "protos"
    sources = sorted(str(p.relative_to(protos)) for p in protos.glob("qwenvl/**/*.proto"))
    # The build's own generator (setup.py's compile_protos, grpcio-tools: the dev extra).
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{protos}", f"-I{include}", f"--python_out={protos}"]
    if protoc.main([*args, f"--grpc_python_out={protos}", *sources]) != 0:
        raise SystemExit(f"protoc failed on {protos}")
    return path


def run_bench(side: str, tree: Path | None, bench_args: str, out: Path, k: int) -> dict:
    env = dict(os.environ)
    cwd = ROOT
    if tree is not None:  # the earlier commit's packages and stubs first on the path
        env["PYTHONPATH"] = f"{tree}{os.pathsep}{tree / 'protos'}"
        cwd = tree
    folder = out / f"{k:02d}-{side}"
    argv = [sys.executable, "-m", "splitvl.cli", "bench", *shlex.split(bench_args)]
    argv += ["--json", "--out", str(folder)]
    print(f"run {k} ({side}): {shlex.join(argv[1:])}", file=sys.stderr, flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "bench.log").open("wb") as log:
        proc = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=log)
    if proc.returncode != 0:
        raise SystemExit(f"run {k} ({side}) failed: {folder / 'bench.log'}")
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])


def figures(result: dict) -> dict[str, float]:
    """splitvl's req/s per closed-loop scenario, and the bench's req/s ratios."""
    out = {}
    for scenario, row in result["systems"].get("split_cache", {}).items():
        if not scenario.endswith("conc1"):
            out[f"split_cache {scenario} req/s"] = row["requests_per_s"]["median"]
    for key, value in result["ratios"].items():
        if value is not None and key.startswith("rps_ratio"):
            out[key] = value
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the earlier commit (any git rev)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side")
    parser.add_argument("--bench-args", default=DEFAULT_BENCH, help="splitvl bench's flags")
    parser.add_argument("--out", default="before-after", help="folder for the runs")
    args = parser.parse_args()
    tree = worktree(args.before)
    out = Path(args.out)
    runs: dict[str, list[dict[str, float]]] = {"after": [], "before": []}
    k = 0
    for r in range(args.rounds):
        # Who goes first alternates round by round.
        for side in ("after", "before") if r % 2 == 0 else ("before", "after"):
            k += 1
            result = run_bench(side, tree if side == "before" else None, args.bench_args, out, k)
            runs[side].append(figures(result))
    keys = sorted({key for side in runs.values() for run in side for key in run})
    print(f"| figure | after (median [min-max]) | before ({args.before}) | after/before |")
    print("|---|---|---|---|")
    for key in keys:
        cells, medians = [], []
        for side in ("after", "before"):
            values = [run[key] for run in runs[side] if key in run]
            medians.append(statistics.median(values) if values else None)
            cells.append(
                f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"
                if values
                else "-"
            )
        a, b = medians
        ratio = f"{a / b:.3f}" if a is not None and b else "-"
        print(f"| {key} | {cells[0]} | {cells[1]} | {ratio} |")
    (out / "summary.json").write_text(json.dumps({"before": args.before, **runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
