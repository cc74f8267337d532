"""Start, watch and stop the four services as child processes on loopback.

Each service runs as ``python -m <package>`` in its own session (so a terminal's Ctrl-C
reaches only the launcher, which then stops the services in order: gateway first, so
no new work arrives, then decoder, encoder and cache). Each is waited on through its
grpc.health.v1 ``Check``; logs go to one file per service.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vlcommon.cpus import available_cpus, format_cpu_list, split_cpus
from vlcommon.security import ClientSecurity, service_env, sync_channel

SERVICES = ("gateway", "encoder", "cache", "decoder")
PACKAGES = {
    "gateway": "gateway",
    "encoder": "encoder_service",
    "cache": "cache_service",
    "decoder": "decoder_service",
}
DEFAULT_BASE_PORT = 50051
DEFAULT_METRICS_BASE_PORT = 9401
# The tiny checkpoint's engine settings; a real model overrides them with
# ``splitvl up --decoder-arg`` or ``SPLITVL_DECODER_ARGS`` (vLLM's argparse keeps the last
# value of a repeated flag, so appended arguments win).
DECODER_DEFAULT_ARGS = ("--dtype", "float32", "--max-model-len", "4096", "--seed", "0")


class ServiceStartError(RuntimeError):
    """A service exited or did not become SERVING; ``summary`` is one line for a user.

    Attributes:
        service: The service's name (``gateway``, ``encoder``, ``cache``, ``decoder``).
        log_path: Its log file.
        summary: One line naming the service, what happened and the log file.
    """

    def __init__(self, service: str, log_path: Path, what: str, tail: str) -> None:
        self.service = service
        self.log_path = log_path
        self.summary = f"{service} {what}; see its log: {log_path}"
        super().__init__(f"{service} {what}:\n{tail}")


class LaunchConfigError(ValueError):
    """The launch configuration itself is wrong (nothing was started); one line for a user."""


def split_args(text: str, source: str) -> list[str]:
    """Shell words of a decoder-argument string (``shlex.split``).

    Raises:
        LaunchConfigError: unbalanced quotes or a trailing escape, naming ``source``.
    """
    try:
        return shlex.split(text)
    except ValueError as err:
        raise LaunchConfigError(f"{source}: {err} in {text!r}") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Ports:
    """gRPC and Prometheus ports of the four services."""

    grpc: dict[str, int]
    metrics: dict[str, int]

    @classmethod
    def from_base(cls, base: int, metrics_base: int) -> Ports:
        return cls(
            grpc={name: base + i for i, name in enumerate(SERVICES)},
            metrics={
                name: (metrics_base + i if metrics_base else 0) for i, name in enumerate(SERVICES)
            },
        )

    @classmethod
    def free(cls) -> Ports:
        return cls(
            grpc={n: free_port() for n in SERVICES}, metrics={n: free_port() for n in SERVICES}
        )

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.grpc[name]}"


@dataclass
class Cluster:
    """The four running services.

    Args:
        model: Checkpoint directory or hub id.
        ports: Ports to use.
        log_dir: Where each service's log goes (``<name>.log``).
        env: Extra environment for the children (e.g. OTEL_* settings).
        decoder_args: Extra vLLM engine arguments for the decoder, after
            ``DECODER_DEFAULT_ARGS`` and ``SPLITVL_DECODER_ARGS`` (so they override both).
    """

    model: str
    ports: Ports
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    decoder_args: list[str] = field(default_factory=list)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    progress: Callable[[str], None] | None = None

    def _command(self, name: str) -> list[str]:
        port, metrics = str(self.ports.grpc[name]), str(self.ports.metrics[name])
        base = [
            sys.executable,
            "-m",
            PACKAGES[name],
            "--host",
            "127.0.0.1",
            "--port",
            port,
            "--metrics-port",
            metrics,
        ]
        if name == "gateway":
            return [
                *base,
                "--model",
                self.model,
                "--encoder-address",
                self.ports.address("encoder"),
                "--cache-address",
                self.ports.address("cache"),
                "--decoder-address",
                self.ports.address("decoder"),
            ]
        if name == "encoder":
            return [*base, "--model", self.model]
        if name == "decoder":
            return [
                *base,
                "--model",
                self.model,
                *DECODER_DEFAULT_ARGS,
                *split_args(self._env().get("SPLITVL_DECODER_ARGS", ""), "SPLITVL_DECODER_ARGS"),
                *self.decoder_args,
            ]
        return base

    def start(self) -> None:
        """Start all four (decoder first: its engine takes longest to come up)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = self._env()
        for name in ("decoder", "encoder", "cache", "gateway"):
            self._spawn(name, env)

    def _env(self) -> dict[str, str]:
        env = {**os.environ, "OTEL_SERVICE_NAME": "", **self.env}
        # A local checkpoint (the tiny or bench one) needs no hub, and offline mode keeps
        # transformers/vLLM from asking it; a hub id must be downloaded, so the user's
        # own HF_HUB_OFFLINE (unset: online) decides.
        if Path(self.model).is_dir():
            env.setdefault("HF_HUB_OFFLINE", "1")
        return env

    def _spawn(self, name: str, env: dict[str, str], append: bool = False) -> None:
        placement = cpu_placement(env)
        child_env = {
            **env,
            "OTEL_SERVICE_NAME": f"splitvl-{name}",
            **placement.get(name, {}),
            **service_env(name, env),  # SPLITVL_TLS_* / SPLITVL_INTERNAL_TOKEN per service
        }
        # Before the log is opened: a LaunchConfigError (the decoder's, spawned first) then
        # leaves nothing started and no file behind.
        command = self._command(name)
        # A restarted service's log is appended to the crashed one's.
        log = self.log_path(name).open("ab" if append else "wb")
        self.procs[name] = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,  # a background process group must not read the tty
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            # Its own process group (``kill``/``stop`` signal the group: vLLM's engine-core
            # and worker children go with the decoder), but not its own session: Linux gives
            # every session its own scheduler autogroup, and with one autogroup per service
            # the kernel here starved every other process for seconds at a time while vLLM
            # decoded (measured: a 0.1 s heartbeat stalled 5-51 s with per-service sessions,
            # never with one). A new process group also keeps a terminal's Ctrl-C to the
            # launcher, which stops the services in order.
            process_group=0,
        )
        log.close()

    def wait_ready(
        self, timeout_s: float = 600.0, progress: Callable[[str], None] | None = None
    ) -> None:
        """Block until every service's health says SERVING.

        Args:
            timeout_s: Give up after this many seconds.
            progress: Called with a line when a service becomes SERVING and every 15 s while
                waiting (the decoder's vLLM engine takes tens of seconds on a CPU).

        Raises:
            ServiceStartError: a service exited or did not become SERVING in time (the
                message carries its log tail, ``summary`` one line).
        """
        start = time.monotonic()
        deadline = start + timeout_s
        next_note = start + 15
        pending = set(SERVICES)
        while pending:
            for name in sorted(pending):
                proc = self.procs[name]
                if proc.poll() is not None:
                    what = f"exited with code {proc.returncode} while starting"
                    tail = self.log_tail(name)
                    if proc.returncode == 2 and tail.strip():
                        # argparse's exit status: its last line is the usage error itself.
                        what += f" ({tail.strip().splitlines()[-1].strip()})"
                    raise ServiceStartError(name, self.log_path(name), what, tail)
                if health_status(self.ports.address(name), security=self.security()) == "SERVING":
                    pending.discard(name)
                    if progress is not None:
                        progress(f"  {name} SERVING after {time.monotonic() - start:.1f} s")
            if pending and time.monotonic() > deadline:
                name = "decoder" if "decoder" in pending else sorted(pending)[0]
                tails = "\n".join(f"--- {n}\n{self.log_tail(n)}" for n in sorted(pending))
                raise ServiceStartError(
                    name,
                    self.log_path(name),
                    f"not SERVING after {timeout_s:.0f}s (pending: {', '.join(sorted(pending))})",
                    tails,
                )
            if pending and progress is not None and time.monotonic() > next_note:
                next_note += 15
                progress(
                    f"  still starting: {', '.join(sorted(pending))} "
                    f"({time.monotonic() - start:.0f} s)"
                )
            if pending:
                time.sleep(0.5)

    def pids(self) -> dict[str, int]:
        """Process id of each running service (the root of its process tree)."""
        return {name: proc.pid for name, proc in self.procs.items() if proc.poll() is None}

    def kill(self, name: str) -> int | None:
        """SIGKILL one service's whole process group at once (a crash, for fault tests).

        Returns:
            The exit code of the service's root process (``-9``).
        """
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return proc.wait()

    def restart(self, name: str, timeout_s: float = 300.0) -> None:
        """Start one service again on the same ports and wait until it is SERVING.

        The other services are left alone: their channels to it reconnect on their own.

        Raises:
            RuntimeError: it exited or did not become SERVING within ``timeout_s``.
        """
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            self.kill(name)
        self._spawn(name, self._env(), append=True)
        start = time.monotonic()
        while (
            status := health_status(self.ports.address(name), security=self.security())
        ) != "SERVING":
            if self.procs[name].poll() is not None:
                raise RuntimeError(
                    f"{name} exited with code {self.procs[name].returncode}:\n{self.log_tail(name)}"
                )
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(
                    f"{name} not SERVING after {timeout_s:.0f}s (health: {status}):\n"
                    f"{self.log_tail(name)}"
                )
            time.sleep(0.2)

    def security(self) -> ClientSecurity:
        """How the launcher itself reaches the services (TLS roots, client certificate)."""
        return ClientSecurity.from_env(self._env())

    def log_path(self, name: str) -> Path:
        """The log file of one service."""
        return self.log_dir / f"{name}.log"

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.log_path(name)
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 20.0) -> dict[str, int | None]:
        """SIGTERM each service (gateway first) and wait; SIGKILL its group past the grace."""
        codes: dict[str, int | None] = {}
        for name in ("gateway", "decoder", "encoder", "cache"):
            proc = self.procs.get(name)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            # vLLM's engine-core children live in the decoder's session: kill the group.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            codes[name] = proc.returncode
        self.procs.clear()
        return codes

    def __enter__(self) -> Cluster:
        self.start()
        try:
            self.wait_ready(progress=self.progress)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cpu_placement(env: dict[str, str]) -> dict[str, dict[str, str]]:
    """Environment that keeps the encoder off the cores vLLM's CPU worker is bound to.

    Only without a GPU, with at least two cores, and unless the user already chose
    (``VLLM_CPU_OMP_THREADS_BIND`` or ``ENCODER_CPUS`` set).
    """
    if shutil.which("nvidia-smi") is not None and env.get("CUDA_VISIBLE_DEVICES") != "":
        return {}
    if env.get("VLLM_CPU_OMP_THREADS_BIND") or env.get("ENCODER_CPUS"):
        return {}
    split = split_cpus(available_cpus())
    if split is None:
        return {}
    decoder, encoder = split
    return {
        "decoder": {"VLLM_CPU_OMP_THREADS_BIND": format_cpu_list(decoder)},
        "encoder": {"ENCODER_CPUS": format_cpu_list(encoder)},
    }


def health_status(
    address: str,
    service: str = "",
    timeout_s: float = 1.0,
    security: ClientSecurity | None = None,
) -> str:
    """grpc.health.v1 status name of ``service`` at ``address`` (``UNREACHABLE`` on error).

    ``security`` defaults to the ``SPLITVL_TLS_*`` environment (health needs no token).
    """
    with sync_channel(address, security or ClientSecurity.from_env()) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return "UNREACHABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
