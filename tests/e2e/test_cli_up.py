"""``splitvl up`` as a user runs it: four services SERVING, then SIGINT stops all four."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from splitvl.launcher import SERVICES, free_base, health_status

pytestmark = pytest.mark.e2e


def test_up_serves_then_stops_cleanly_on_sigint(tiny_model, tmp_path) -> None:
    base = free_base()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "splitvl.cli",
            "up",
            "--model",
            str(tiny_model),
            "--base-port",
            str(base),
            "--metrics-base-port",
            "0",
            "--http-port",
            str(base + 20),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "is SERVING" in line:
                break
        assert any("is SERVING" in ln for ln in lines), "".join(lines)
        for i, name in enumerate(SERVICES):
            assert health_status(f"127.0.0.1:{base + i}") == "SERVING", name
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "stopped: {'gateway': 0, 'decoder': 0, 'encoder': 0, 'cache': 0}" in out, out
    assert elapsed < 60
    for i in range(4):
        assert health_status(f"127.0.0.1:{base + i}") == "UNREACHABLE"
