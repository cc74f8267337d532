"""Supervision of a running cluster: a service instance (each replica on its own) or the
local store server that exits is restarted on its ports with backoff; too many exits of
one stop everything (``splitvl up``)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from splitvl.redis_server import RedisServer

#: The name supervision gives the local store server (``splitvl up --store redis``).
STORE = "redis"


class Cluster(Protocol):
    """What supervision needs of :class:`splitvl.launcher.Cluster` (named here, not
    imported: the launcher imports this module)."""

    procs: dict[str, subprocess.Popen[bytes]]
    store_server: RedisServer | None

    def instances(self, *services: str) -> list[str]: ...

    def log_path(self, name: str) -> Path: ...

    def reap(self, name: str) -> None: ...

    def respawn(self, name: str) -> None: ...

    def serving(self, name: str, timeout_s: float = 1.0) -> bool: ...


@dataclass
class Supervisor:
    """Restarts a service of a running :class:`Cluster` that exits unexpectedly.

    A service instance that exits is restarted on its ports after a backoff that doubles
    from ``backoff_s`` up to ``max_backoff_s`` (its leftover process group, such as vLLM's
    engine core, is killed first); the others, other replicas of its service included,
    are left running. The local store server (:data:`STORE`) is restarted the same way,
    on its port with its password, empty (it keeps nothing on disk). When one instance
    has exited ``max_failures`` times within ``window_s`` seconds, :meth:`poll` reports
    it and the caller stops the cluster. Call :meth:`poll` about once a second.

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
        store = [STORE] if self.cluster.store_server is not None else []
        for name in [*self.cluster.instances(), *store]:
            if name in self._due:
                if now >= self._due[name]:
                    del self._due[name]
                    self._respawn(name)
                continue
            code = self._exit_code(name)
            if code is None:
                if name in self._restarted_at and self._serving(name):
                    took = now - self._restarted_at.pop(name)
                    self.say(f"splitvl: {name} is SERVING again ({took:.1f} s after its restart)")
                continue
            self._restarted_at.pop(name, None)
            times = [t for t in self.failures.get(name, []) if now - t <= self.window_s]
            times.append(now)
            self.failures[name] = times
            log = self._log_path(name)
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
            self._reap(name)
            self._due[name] = now + delay
        return None

    def _exit_code(self, name: str) -> int | None:
        """Its exit code once it has exited; None while it runs or was never started."""
        if name == STORE:
            return self._store().poll()
        proc = self.cluster.procs.get(name)
        return None if proc is None else proc.poll()

    def _store(self) -> RedisServer:
        assert self.cluster.store_server is not None
        return self.cluster.store_server

    def _log_path(self, name: str) -> Path:
        return self._store().log_path if name == STORE else self.cluster.log_path(name)

    def _reap(self, name: str) -> None:
        if name == STORE:
            self._store().stop()
        else:
            self.cluster.reap(name)

    def _respawn(self, name: str) -> None:
        """Start it again. The store server waits for its PING (a fraction of a second);
        one that cannot start again raises ServiceStartError, which ends ``up``."""
        self.restarts[name] = self.restarts.get(name, 0) + 1
        if name == STORE:
            self._store().start()
        else:
            self.cluster.respawn(name)
        self._restarted_at[name] = time.monotonic()

    def _serving(self, name: str) -> bool:
        if name == STORE:
            return self._store().ping(timeout_s=0.5)
        return self.cluster.serving(name, timeout_s=0.5)
