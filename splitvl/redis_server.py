"""A local ``redis-server`` for ``splitvl up --store redis``: the cache replicas' shared store.

Usage::

    server = RedisServer.create(log_dir / "redis", maxmemory="1gb", avoid={50051, ...})
    server.start()              # waits until AUTH + PING answer PONG
    env["CACHE_STORE"] = server.url   # redis://:PASSWORD@127.0.0.1:PORT/0
    ...
    server.stop()               # SIGTERM, then SIGKILL past the grace; idempotent

The server listens on 127.0.0.1 only, on a free port below the host's ephemeral range
(:func:`splitvl.ports.free_ports`), with a random password (``requirepass``), a
``maxmemory`` budget evicted by ``allkeys-lru`` (the store is a cache: an evicted entry is
a miss, re-encoded), and no persistence (``save ""``, ``appendonly no``): a restart starts
empty, as the in-memory cache does. Its config, working directory and log live in the run
directory. The password travels in the config file (mode 0600) and the URL file beside
it, never on a command line, which every user on the host can read through ``ps``.

The server runs in its own process group (a terminal's Ctrl-C reaches only the launcher,
which stops it after the caches) under ``setpriv --pdeathsig TERM`` where util-linux's
``setpriv`` is installed, so it ends with the launcher even when that is SIGKILLed (the
services watch the launcher for the same reason: :mod:`vlcommon.lifeline`).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from splitvl.errors import LaunchConfigError, ServiceStartError
from splitvl.ports import free_ports
from splitvl.private_file import write_private

#: ``maxmemory`` of the local server unless ``--redis-maxmemory`` says otherwise.
DEFAULT_MAXMEMORY = "1gb"
# redis.conf's memory units (bytes, k/kb, m/mb, g/gb; case-insensitive).
_MEMORY = re.compile(r"^[1-9][0-9]*(b|k|kb|m|mb|g|gb)?$", re.IGNORECASE)
# Where Debian's redis-server package puts the binary, if PATH lacks it.
_BINARY_DIRS = ("/usr/bin", "/usr/sbin", "/usr/local/bin")


def memory_size(text: str) -> str:
    """A ``maxmemory`` value in redis.conf's units (``512mb``, ``1gb``, ``1073741824``).

    Raises:
        ValueError: anything else (argparse names the flag).
    """
    if not _MEMORY.match(text.strip()):
        raise ValueError(f"{text!r} is not a size such as 512mb or 1gb")
    return text.strip().lower()


def redis_binary() -> str:
    """The ``redis-server`` executable.

    Raises:
        LaunchConfigError: it is not installed, naming the package and the alternative.
    """
    found = shutil.which("redis-server")
    if found:
        return found
    for folder in _BINARY_DIRS:
        path = Path(folder) / "redis-server"
        if os.access(path, os.X_OK):
            return str(path)
    raise LaunchConfigError(
        "--store redis starts a local redis-server, and none is installed: "
        "apt-get install redis-server, or give --store redis://HOST:PORT/DB"
    )


@dataclass
class RedisServer:
    """One local ``redis-server`` process: config, start, readiness, stop.

    Args:
        run_dir: Its folder: ``redis.conf``, ``url`` (both 0600), ``redis.log``, ``data/``.
        port: Its loopback port.
        password: Its ``requirepass``; URL-safe, so :attr:`url` needs no escaping.
        maxmemory: Its memory budget in redis.conf's units.
    """

    run_dir: Path
    port: int
    password: str
    maxmemory: str = DEFAULT_MAXMEMORY
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @classmethod
    def create(
        cls, run_dir: Path, *, maxmemory: str = DEFAULT_MAXMEMORY, avoid: Iterable[int] = ()
    ) -> RedisServer:
        """A server (not started) on a free loopback port that is not in ``avoid`` (the
        cluster's own ports) and a new random password (256 bits)."""
        taken = set(avoid)
        port = next(p for p in free_ports(len(taken) + 1) if p not in taken)
        return cls(run_dir, port, secrets.token_urlsafe(32), memory_size(maxmemory))

    @property
    def url(self) -> str:
        """``redis://:PASSWORD@127.0.0.1:PORT/0``: what the caches get as ``CACHE_STORE``."""
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def shown_url(self) -> str:
        """:attr:`url` with the password masked, for printing."""
        return f"redis://:***@127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "redis.log"

    @property
    def url_path(self) -> Path:
        """A file holding :attr:`url` (0600), for ``redis-cli -u "$(cat ...)"``."""
        return self.run_dir / "url"

    def config(self) -> str:
        """redis.conf's text (one directive a line)."""
        return "\n".join(
            [
                "bind 127.0.0.1",
                "protected-mode yes",
                f"port {self.port}",
                f'requirepass "{self.password}"',
                f"maxmemory {self.maxmemory}",
                "maxmemory-policy allkeys-lru",
                # A cache, not a database: no snapshot, no append-only file.
                'save ""',
                "appendonly no",
                f'dir "{self.run_dir / "data"}"',
                'logfile ""',  # stdout, which start() sends to redis.log
                "daemonize no",
                "",
            ]
        )

    def start(self, timeout_s: float = 15.0) -> None:
        """Start the server (appending to its log) and wait until it answers PING.

        Raises:
            LaunchConfigError: no ``redis-server`` is installed, or the folder is unusable.
            ServiceStartError: it exited, or did not answer within ``timeout_s``
                (stopped first; the message carries its log's tail).
        """
        binary = redis_binary()
        try:
            (self.run_dir / "data").mkdir(parents=True, exist_ok=True)
            write_private(self.run_dir / "redis.conf", self.config())
            write_private(self.url_path, self.url + "\n")
            log = self.log_path.open("ab")
        except OSError as err:
            raise LaunchConfigError(f"--log-dir {self.run_dir}: {err.strerror or err}") from None
        setpriv = shutil.which("setpriv")
        wrap = [setpriv, "--pdeathsig", "TERM", "--"] if setpriv else []
        with log:
            self.proc = subprocess.Popen(
                [*wrap, binary, str(self.run_dir / "redis.conf")],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                process_group=0,
            )
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ping():
            assert self.proc is not None
            code = self.proc.poll()
            if code is not None or time.monotonic() > deadline:
                what = (
                    f"exited with code {code} while starting"
                    if code is not None
                    else f"did not answer PING within {timeout_s:.0f} s"
                )
                self.stop()
                raise ServiceStartError("redis-server", self.log_path, what, self.log_tail())
            time.sleep(0.05)

    def client(self, timeout_s: float = 2.0) -> redis.Redis:
        """A redis-py client of this server with its password (no retries)."""
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            password=self.password,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )

    def ping(self, timeout_s: float = 1.0) -> bool:
        """Whether PING, with the password, answers PONG."""
        client = self.client(timeout_s)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def poll(self) -> int | None:
        """Its exit code, or None while it runs (or was never started)."""
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def kill(self) -> int | None:
        """SIGKILL the server (a crash, for fault drills); :meth:`start` brings it back on
        its port with its password, empty (it saves nothing)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        proc.kill()
        return proc.wait()

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM (redis shuts down without saving: no save points), SIGKILL past the
        grace; returns its exit code (None when it was not started)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
        return proc.wait()
