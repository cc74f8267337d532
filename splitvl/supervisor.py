"""Supervision of a running cluster: a service that exits is restarted on its ports with
backoff; too many exits of one stop everything (``splitvl up``)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from splitvl.ports import SERVICES


class Cluster(Protocol):
    """What supervision needs of :class:`splitvl.launcher.Cluster` (named here, not
    imported: the launcher imports this module)."""

    procs: dict[str, subprocess.Popen[bytes]]

    def log_path(self, name: str) -> Path: ...

    def reap(self, name: str) -> None: ...

    def respawn(self, name: str) -> None: ...

    def serving(self, name: str, timeout_s: float = 1.0) -> bool: ...


@dataclass
class Supervisor:
    """Restarts a service of a running :class:`Cluster` that exits unexpectedly.

    A service that exits is restarted on its ports after a backoff that doubles from
    ``backoff_s`` up to ``max_backoff_s`` (its leftover process group, such as vLLM's
    engine core, is killed first); the others are left running. When one service has
    exited ``max_failures`` times within ``window_s`` seconds, :meth:`poll` reports it
    and the caller stops the cluster. Call :meth:`poll` about once a second.

    Args:
        cluster: The started cluster.
        say: Where the one-line notices go (``splitvl up``: stderr).
        max_failures: Exits within ``window_s`` that end supervision.
        window_s: The window, seconds.
        backoff_s: First restart delay, seconds.
        max_backoff_s: Longest restart delay, seconds.
    """

    cluster: Cluster
    say: Callable[[str], None]
    max_failures: int = 5
    window_s: float = 300.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    failures: dict[str, list[float]] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    _due: dict[str, float] = field(default_factory=dict)
    _restarted_at: dict[str, float] = field(default_factory=dict)

    def poll(self) -> str | None:
        """Check every service once; returns a one-line reason to stop everything, or None."""
        now = time.monotonic()
        for name in SERVICES:
            if name in self._due:
                if now >= self._due[name]:
                    del self._due[name]
                    self._respawn(name)
                continue
            proc = self.cluster.procs.get(name)
            if proc is None:
                continue
            code = proc.poll()
            if code is None:
                if name in self._restarted_at and self._serving(name):
                    took = now - self._restarted_at.pop(name)
                    self.say(f"splitvl: {name} is SERVING again ({took:.1f} s after its restart)")
                continue
            self._restarted_at.pop(name, None)
            times = [t for t in self.failures.get(name, []) if now - t <= self.window_s]
            times.append(now)
            self.failures[name] = times
            log = self.cluster.log_path(name)
            if len(times) >= self.max_failures:
                return (
                    f"{name} exited with code {code}, {len(times)} times in "
                    f"{self.window_s:.0f} s; stopping all services; see its log: {log}"
                )
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** (len(times) - 1))
            self.say(
                f"splitvl: {name} exited with code {code}; restarting it in {delay:.0f} s "
                f"(exit {len(times)} of at most {self.max_failures - 1} in "
                f"{self.window_s:.0f} s); see its log: {log}"
            )
            self.cluster.reap(name)
            self._due[name] = now + delay
        return None

    def _respawn(self, name: str) -> None:
        self.restarts[name] = self.restarts.get(name, 0) + 1
        self.cluster.respawn(name)
        self._restarted_at[name] = time.monotonic()

    def _serving(self, name: str) -> bool:
        return self.cluster.serving(name, timeout_s=0.5)
