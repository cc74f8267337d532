"""Where the suite's time goes, by test file: measured in every run, listed in tests/suite.toml.

In the spirit of SGLang's ``run_suite.py`` (each file with its estimated seconds): every
run sums each file's setup, call and teardown time (a module's cluster start lands in its
first test's setup) and prints the files by time at the end, with the total; a run of
whole files (no ``-k``, ``-m``, ``--lf``, not interrupted) writes them to
``.pytest-times.json`` at the root. ``tests/suite.toml`` lists every test file with
the seconds of the last full ``make test`` on 2 cores; ``tests/unit/project/test_suite_file.py``
fails
when a test file is missing from it (a new file must say what it costs). Refresh it after
a full run::

    .venv/bin/python -m tests.suite_times --write   # reads .pytest-times.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "tests" / "suite.toml"
TIMES = ROOT / ".pytest-times.json"
#: issue 45: `make test` within 30 minutes on 2 cores.
BUDGET_S = 30 * 60


class FileTimes:
    """Seconds per test file (setup + call + teardown of its tests) and which ran e2e."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.tests: dict[str, int] = defaultdict(int)
        self.e2e: set[str] = set()

    def add(self, nodeid: str, when: str, duration: float, keywords: object) -> None:
        path = nodeid.split("::", 1)[0]
        self.seconds[path] += duration
        if when == "call":
            self.tests[path] += 1
        if "e2e" in keywords:  # type: ignore[operator]
            self.e2e.add(path)

    def summary(self, top: int = 30) -> list[str]:
        total = sum(self.seconds.values())
        lines = [f"where the time went, by file (total {total / 60:.1f} min):"]
        ranked = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        for path, seconds in ranked[:top]:
            kind = "e2e" if path in self.e2e else "unit"
            lines.append(f"{seconds:8.1f} s  {kind:4}  {self.tests[path]:4} tests  {path}")
        if len(ranked) > top:
            rest = sum(s for _, s in ranked[top:])
            lines.append(f"{rest:8.1f} s  the other {len(ranked) - top} files")
        return lines

    def write(self, path: Path = TIMES) -> None:
        """Write the times, this run's files over those already there (a run of some
        files updates theirs), atomically (a reader never sees half a file); a folder
        that cannot be written to only loses them, never fails the run."""
        out = {
            p: {"seconds": round(s, 1), "tests": self.tests[p], "e2e": p in self.e2e}
            for p, s in sorted(self.seconds.items())
        }
        try:
            if path.exists():
                out = dict(sorted({**json.loads(path.read_text()), **out}.items()))
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(out, indent=1) + "\n")
            os.replace(tmp, path)
        except (OSError, ValueError):
            pass


def read_suite(path: Path = SUITE) -> dict[str, dict[str, object]]:
    """tests/suite.toml: test file -> {seconds, kind}."""
    return tomllib.loads(path.read_text())["files"]  # type: ignore[no-any-return]


def render_suite(times: dict[str, dict[str, object]]) -> str:
    total = sum(float(t["seconds"]) for t in times.values())  # type: ignore[arg-type]
    lines = [
        "# Every test file with the seconds it took in the last full `make test` (2 cores),",
        "# setup (its cluster) included; kind e2e: starts services. Written by",
        "# `.venv/bin/python -m tests.suite_times --write` from .pytest-times.json;",
        "# tests/unit/project/test_suite_file.py fails when a test file is missing here.",
        f"# Total: {total:.0f} s ({total / 60:.1f} min); budget {BUDGET_S // 60} min.",
        "",
        "[files]",
    ]
    for path, t in sorted(times.items(), key=lambda kv: -float(kv[1]["seconds"])):  # type: ignore[arg-type]
        kind = "e2e" if t["e2e"] else "unit"
        lines.append(f'"{path}" = {{ seconds = {float(t["seconds"]):.1f}, kind = "{kind}" }}')  # type: ignore[arg-type]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite tests/suite.toml")
    args = parser.parse_args(argv)
    if not TIMES.exists():
        parser.error(f"{TIMES.name} is missing: run the suite first (make test)")
    times = json.loads(TIMES.read_text())
    if SUITE.exists():
        # A partial run updates the files it ran; files that no longer exist drop out.
        listed = {
            p: {"seconds": t["seconds"], "e2e": t["kind"] == "e2e"} for p, t in read_suite().items()
        }
        times = {**listed, **times}
    times = {p: t for p, t in times.items() if (ROOT / p).exists()}
    text = render_suite(times)
    if args.write:
        SUITE.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
