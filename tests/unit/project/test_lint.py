"""ruff (lint and format) and mypy stay clean on the project's own code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = [
    "vlcommon",
    "encoder_service",
    "cache_service",
    "decoder_service",
    "gateway",
    "splitvl",
    "splitvl_tools",
    "scripts",
]


def test_ruff_clean() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_ruff_format_clean() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_mypy_clean() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "mypy", *PACKAGES], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
