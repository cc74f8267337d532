"""Start, watch, restart and stop the four services as child processes on loopback.

Each service instance (one per service, or several replicas of the encoder, cache and
decoder: :mod:`splitvl.replicas`) runs as ``python -m <package>`` in its own process group
(so a terminal's Ctrl-C reaches only the launcher, which then stops them in order: gateway
first, so no new work arrives, then decoders, encoders and caches, then a local store
server if it started one). Each is waited on through its grpc.health.v1 ``Check``; logs
go to one file per instance.

Before anything starts, every port the cluster will bind is checked (:func:`check_ports`)
and the log folder is locked (:class:`LogDirLock`), so a second launcher never reports
another instance's services or overwrites its logs. Each child gets
``SPLITVL_LAUNCHER_PID``: its parent-death watchdog (:mod:`vlcommon.lifeline`) ends the
service and its vLLM processes when the launcher dies, however it dies.
:class:`Supervisor` restarts a service that exits unexpectedly, with backoff.

The port layout and its checks are in :mod:`splitvl.ports`, supervision in
:mod:`splitvl.supervisor`, the launch errors in :mod:`splitvl.errors`, the services'
checkpoint-derived arguments in :mod:`splitvl.engine_args` (all re-exported here).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# Re-exported (``X as X``): the tests and the tools import these from here; they live in
# engine_args, errors, ports and supervisor so that this module holds the cluster itself.
from splitvl.engine_args import DECODER_DEFAULT_ARGS as DECODER_DEFAULT_ARGS
from splitvl.engine_args import SERVED_DTYPES as SERVED_DTYPES
from splitvl.engine_args import checkpoint_dtype as checkpoint_dtype
from splitvl.engine_args import decoder_default_args as decoder_default_args
from splitvl.engine_args import split_args as split_args
from splitvl.errors import LaunchConfigError as LaunchConfigError
from splitvl.errors import PortInUseError as PortInUseError
from splitvl.errors import ServiceStartError as ServiceStartError
from splitvl.errors import StartInterrupted as StartInterrupted
from splitvl.ports import PACKAGES as PACKAGES
from splitvl.ports import SERVICES as SERVICES
from splitvl.ports import Ports as Ports
from splitvl.ports import check_ports as check_ports
from splitvl.ports import ephemeral_range as ephemeral_range
from splitvl.ports import free_base as free_base
from splitvl.ports import free_port as free_port
from splitvl.ports import free_ports as free_ports
from splitvl.ports import port_owner as port_owner
from splitvl.ports import service_of
from splitvl.redis_server import RedisServer
from splitvl.replicas import replica_env, store_secret_env
from splitvl.supervisor import Supervisor as Supervisor
from vlcommon.cpus import available_cpus, format_cpu_list, split_cpus
from vlcommon.lifeline import LAUNCHER_PID_ENV
from vlcommon.settings import channel_options
from vlcommon.tls import ClientSecurity, aio_channel, sync_channel

DEFAULT_BASE_PORT = 50051
DEFAULT_METRICS_BASE_PORT = 9401
#: The gateway's OpenAI-compatible HTTP front (``vllm serve``'s default port).
DEFAULT_HTTP_PORT = 8000


class StopFlag:
    """A stop request that a signal handler may set.

    ``threading.Event.set`` takes the event's lock, and a handler runs in the main thread
    between any two bytecodes, also while that thread is inside ``Event.wait`` or
    ``Event.set`` holding the same lock: a second SIGINT/SIGTERM then deadlocked ``splitvl
    up`` (seen 2026-12-01: it ignored every further signal with its services up). Here
    ``set`` only assigns an attribute and ``wait`` polls it, so neither takes a lock.
    """

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float, step: float = 0.05) -> bool:
        """Sleep until set or ``timeout`` seconds passed (in ``step`` s slices); whether set."""
        deadline = time.monotonic() + timeout
        while not self._set and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(step, left))
        return self._set


class LogDirLock:
    """An exclusive ``flock`` on ``<log_dir>/.lock`` for as long as a cluster runs there,
    so a second instance never truncates a running one's logs. The lock dies with the
    process that holds it (a SIGKILLed launcher leaves no stale lock).

    Raises:
        LaunchConfigError: (from :meth:`acquire`) another live process holds it.
    """

    def __init__(self, log_dir: Path) -> None:
        self.path = log_dir / ".lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise LaunchConfigError(
                f"--log-dir {self.path.parent}: {err.strerror or err}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise LaunchConfigError(
                f"log folder {self.path.parent} is in use by another splitvl (pid {holder}); "
                "give this instance its own with --log-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


@dataclass
class Cluster:
    """The four running services, with their replicas where ``ports`` lays out several.

    Each instance (``decoder``, or ``decoder-1``, ``decoder-2``, ... when replicated; see
    :mod:`splitvl.ports`) is started, health-checked, supervised and stopped on its own.

    Args:
        model: Checkpoint directory or hub id.
        ports: Ports to use (:meth:`Ports.from_base` with ``replicas`` for several).
        log_dir: Where each instance's log goes (``<name>.log``).
        env: Extra environment for the children (e.g. OTEL_* settings).
        decoder_args: Extra vLLM engine arguments for the decoder, after
            ``DECODER_DEFAULT_ARGS`` (``--dtype`` there is the checkpoint's own,
            :func:`decoder_default_args`) and ``SPLITVL_DECODER_ARGS`` (so they override
            both). The encoder runs the vision tower in the checkpoint's dtype too.
        cache_store: ``CACHE_STORE`` for every cache instance (None: the environment's,
            else the cache's default, memory).
        store_server: A local redis-server started before the services and stopped after
            them; its URL is the caches' ``CACHE_STORE``.
        start_timeout_s: How long :meth:`wait_ready` waits for every instance by default,
            seconds (a cold first start on a loaded 2-core host imports vLLM for minutes).
        reasoning_parser: The gateway's ``--reasoning-parser`` (``qwen3``: the OpenAI front
            returns the model's reasoning apart, as ``vllm serve --reasoning-parser qwen3``);
            empty: the gateway's environment decides (``GATEWAY_REASONING_PARSER``, off).
    """

    model: str
    ports: Ports
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    decoder_args: list[str] = field(default_factory=list)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    progress: Callable[[str], None] | None = None
    cache_store: str | None = None
    store_server: RedisServer | None = None
    start_timeout_s: float = 900.0
    reasoning_parser: str = ""
    _lock: LogDirLock | None = field(default=None, repr=False)

    def _command(self, name: str) -> list[str]:
        port, metrics = str(self.ports.grpc[name]), str(self.ports.metrics[name])
        service = service_of(name)
        base = [
            sys.executable,
            "-m",
            PACKAGES[service],
            "--host",
            "127.0.0.1",
            "--port",
            port,
            "--metrics-port",
            metrics,
        ]
        if service == "gateway":
            if self.ports.public:  # replicas: all on the shared port, each on its own too
                shared = ["--port", str(self.ports.public), "--instance-port", port]
                base[base.index("--port") : base.index("--port") + 2] = shared
                base += ["--reuse-port", "true"]
            return [
                *base,
                "--model",
                self.model,
                "--encoder-address",
                self.ports.target("encoder"),
                "--cache-address",
                self.ports.target("cache"),
                "--decoder-address",
                self.ports.target("decoder"),
                "--http-port",
                str(self.ports.http),
                *(("--reasoning-parser", self.reasoning_parser) if self.reasoning_parser else ()),
            ]
        if service == "encoder":
            # An operator's ENCODER_DTYPE wins over the checkpoint's dtype.
            dtype = None if self._env().get("ENCODER_DTYPE") else checkpoint_dtype(self.model)
            return [*base, "--model", self.model, *(("--dtype", dtype) if dtype else ())]
        if service == "decoder":
            return [
                *base,
                "--model",
                self.model,
                *decoder_default_args(self.model),
                *split_args(self._env().get("SPLITVL_DECODER_ARGS", ""), "SPLITVL_DECODER_ARGS"),
                *self.decoder_args,
            ]
        return base

    def instances(self, *services: str) -> list[str]:
        """Instance names of ``services`` in that order (all, in layout order, if none)."""
        return [n for s in services or SERVICES for n in self.ports.instances(s)]

    def start(self) -> None:
        """Start the store server if any, then every instance (decoders first: their
        engines take longest to come up).

        Raises:
            PortInUseError: a port it would bind is taken (nothing started, no log touched).
            LaunchConfigError: the log folder is another running instance's, the
                decoder arguments do not parse, or redis-server is not installed.
            ServiceStartError: the store server did not start (everything stopped).
        """
        check_ports(self.ports)
        lock = LogDirLock(self.log_dir)
        lock.acquire()
        self._lock = lock
        try:
            if self.store_server is not None:
                self.store_server.start()
            env = self._env()
            for name in self.instances("decoder", "encoder", "cache", "gateway"):
                self._spawn(name, env)
        except BaseException:
            self.stop()
            raise

    def _env(self) -> dict[str, str]:
        env = {**os.environ, "OTEL_SERVICE_NAME": "", **self.env}
        # All four share this host: the decoder reads embeddings from the encoder and the
        # cache through /dev/shm (an operator's GATEWAY_EMBEDDING_TRANSPORT wins).
        env.setdefault("GATEWAY_EMBEDDING_TRANSPORT", "shm")
        # A local checkpoint (the tiny or bench one) needs no hub, and offline mode keeps
        # transformers/vLLM from asking it; a hub id must be downloaded, so the user's
        # own HF_HUB_OFFLINE (unset: online) decides.
        if Path(self.model).is_dir():
            env.setdefault("HF_HUB_OFFLINE", "1")
        return env

    def _spawn(self, name: str, env: dict[str, str], append: bool = False) -> None:
        service = service_of(name)
        store = self.store_server.url if self.store_server is not None else self.cache_store
        child_env = {
            **env,
            "OTEL_SERVICE_NAME": f"splitvl-{service}",
            # Its share of the cores, the caches' CACHE_STORE (splitvl/replicas.py).
            **replica_env(name, self.ports, cpu_placement(env), store, env),
            **service_env(service, env),  # SPLITVL_TLS_* / SPLITVL_INTERNAL_TOKEN per service
            # A shared store's entries are sealed under a secret: one made here unless the
            # environment gives one (splitvl/replicas.py, store_secret_env).
            **(store_secret_env(store, env, self.log_dir) if service == "cache" else {}),
            # The child's watchdog ends its process group when this process is gone.
            LAUNCHER_PID_ENV: str(os.getpid()),
        }
        # Before the log is opened: a LaunchConfigError (the decoder's, spawned first) then
        # leaves nothing started and no file behind.
        command = self._command(name)
        # A restarted service's log is appended to the crashed one's.
        try:
            log = self.log_path(name).open("ab" if append else "wb")
        except OSError as err:
            raise LaunchConfigError(
                f"--log-dir {self.log_dir}: {self.log_path(name).name}: {err.strerror or err}"
            ) from None
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
        self,
        timeout_s: float | None = None,
        progress: Callable[[str], None] | None = None,
        stop: StopFlag | threading.Event | None = None,
    ) -> None:
        """Block until every instance's health says SERVING.

        Args:
            timeout_s: Give up after this many seconds (None: ``start_timeout_s``).
            progress: Called with a line when a service becomes SERVING and every 15 s while
                waiting (the decoder's vLLM engine takes tens of seconds on a CPU).
            stop: Set (Ctrl-C) to give up waiting at once: raises :class:`StartInterrupted`.

        Raises:
            ServiceStartError: a service exited or did not become SERVING in time (the
                message carries its log tail, ``summary`` one line).
        """
        if timeout_s is None:
            timeout_s = self.start_timeout_s
        start = time.monotonic()
        deadline = start + timeout_s
        next_note = start + 15
        pending = set(self.instances())
        while pending:
            if stop is not None and stop.is_set():
                raise StartInterrupted(f"interrupted while {', '.join(sorted(pending))} started")
            for name in sorted(pending):
                proc = self.procs[name]
                if proc.poll() is not None:
                    what = f"exited with code {proc.returncode} while starting"
                    tail = self.log_tail(name)
                    if proc.returncode == 2 and tail.strip():
                        # argparse's exit status: its last line is the usage error itself.
                        what += f" ({tail.strip().splitlines()[-1].strip()})"
                    raise ServiceStartError(name, self.log_path(name), what, tail)
                if self.serving(name):
                    pending.discard(name)
                    if progress is not None:
                        progress(f"  {name} SERVING after {time.monotonic() - start:.1f} s")
            if pending and time.monotonic() > deadline:
                name = [*(n for n in self.instances("decoder") if n in pending), *sorted(pending)][
                    0
                ]
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

    def terminate(self, name: str, grace_s: float = 60.0) -> int | None:
        """Stop one instance as an orchestrator does (SIGTERM: it drains, then exits);
        SIGKILL its group past ``grace_s``. The others are left alone.

        Returns:
            The exit code of the instance's root process (0 after a clean drain).
        """
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # vLLM's engine core and worker with it
        return proc.wait()

    def reap(self, name: str) -> None:
        """SIGKILL what is left of an exited service's process group (vLLM's engine core
        and worker outlive a decoder that exits on an engine death)."""
        proc = self.procs.get(name)
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()

    def respawn(self, name: str) -> None:
        """Start one service again on its ports, appending to its log; does not wait."""
        self.reap(name)
        self._spawn(name, self._env(), append=True)

    def restart(self, name: str, timeout_s: float = 300.0) -> None:
        """Start one service again on the same ports and wait until it is SERVING.

        The other services are left alone: their channels to it reconnect on their own.

        Raises:
            RuntimeError: it exited or did not become SERVING within ``timeout_s``.
        """
        self.respawn(name)
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

    def serving(self, name: str, timeout_s: float = 1.0) -> bool:
        """Whether one service's health says SERVING now."""
        address = self.ports.address(name)
        return health_status(address, timeout_s=timeout_s, security=self.security()) == "SERVING"

    def security(self) -> ClientSecurity:
        """How the launcher itself reaches the services (TLS roots, client certificate)."""
        return ClientSecurity.from_env(self._env())

    def gateway_channel(self) -> grpc.aio.Channel:
        """A ``grpc.aio`` channel to this cluster's gateway, with its TLS and token
        settings (:meth:`security`) and the shared channel options (message limits,
        keepalive); for the benchmarks' clients. Use it as ``async with``."""
        return aio_channel(self.ports.gateway_address(), self.security(), options=channel_options())

    def log_path(self, name: str) -> Path:
        """The log file of one service."""
        return self.log_dir / f"{name}.log"

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.log_path(name)
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 20.0) -> dict[str, int | None]:
        """SIGTERM the gateways and wait for them, then the other instances all at once
        (each drains on its own: vLLM's shutdown alone takes seconds, so one after the
        other added them up), SIGKILL of each group past the grace; then the store server,
        after the caches that use it (its code as ``redis``). A gateway's drain waits for
        its calls' answers, so the backends are idle when they stop (a decoder that
        gateways of other hosts call is not: run such a host's backends under their own
        orchestrator, which drains them one by one)."""
        codes: dict[str, int | None] = {}
        for wave in (self.instances("gateway"), self.instances("decoder", "encoder", "cache")):
            procs = {n: self.procs[n] for n in wave if n in self.procs}
            for proc in procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for name, proc in procs.items():
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
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
        if self.store_server is not None and (code := self.store_server.stop()) is not None:
            codes["redis"] = code
        if self._lock is not None:
            self._lock.release()
            self._lock = None
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


# The encoder's cores also run the gateway, the cache, the decoder's gRPC process and
# vLLM's engine core, whose turnaround between the worker's steps and whose token relay
# are on every request's critical path, while the ViT is throughput work. At niceness 5
# they preempt it: repeat50 at 32 concurrent through the OpenAI front, 8 alternating
# pairs on 2 cores (scripts/profile_repeat50.py --place enc-nice5, 2026-12-04): median
# TTFT 1,270 against 1,800 ms, 3.49 against 3.41 req/s; one at a time 0.633 against
# 0.624 req/s and the same ViT time (272 ms), docs/benchmarks.md.
ENCODER_NICE_ON_CPU = 5


def cpu_placement(env: dict[str, str]) -> dict[str, dict[str, str]]:
    """Environment that keeps the encoder off the cores vLLM's CPU worker is bound to,
    at niceness :data:`ENCODER_NICE_ON_CPU` (unless ``ENCODER_NICE`` is set).

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
        "encoder": {
            "ENCODER_CPUS": format_cpu_list(encoder),
            "ENCODER_NICE": env.get("ENCODER_NICE", str(ENCODER_NICE_ON_CPU)),
        },
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


SERVICE_ENV_PREFIXES = {
    "gateway": "GATEWAY",
    "encoder": "ENCODER",
    "cache": "CACHE",
    "decoder": "DECODER",
}


def service_env(name: str, env: dict[str, str]) -> dict[str, str]:
    """Per-service settings derived from the cluster-wide ``SPLITVL_*`` security variables
    (what ``splitvl up`` and the test clusters use; a service's own ``<PREFIX>_*`` variable,
    when set, wins).

    * ``SPLITVL_TLS_CERT_FILE`` / ``SPLITVL_TLS_KEY_FILE``: every service's server
      certificate, and its client certificate on the calls it makes;
    * ``SPLITVL_TLS_CA_FILE``: the CA the services' certificates chain to (clients verify
      servers with it);
    * ``SPLITVL_TLS_CLIENT_CA_FILE``: mTLS on the internal services (encoder, cache,
      decoder): only clients with a certificate from this CA get through the handshake;
    * ``SPLITVL_INTERNAL_TOKEN``: the shared secret every internal hop carries and the
      internal services require.

    Args:
        name: ``gateway``, ``encoder``, ``cache`` or ``decoder``.
        env: The launcher's environment.

    Returns:
        Variables to add to that service's environment.
    """
    prefix = SERVICE_ENV_PREFIXES[name]
    mapping = {
        "SPLITVL_TLS_CERT_FILE": ("TLS_CERT_FILE", "CLIENT_TLS_CERT_FILE"),
        "SPLITVL_TLS_KEY_FILE": ("TLS_KEY_FILE", "CLIENT_TLS_KEY_FILE"),
        "SPLITVL_TLS_CA_FILE": ("CLIENT_TLS_CA_FILE",),
        "SPLITVL_TLS_SERVER_NAME": ("CLIENT_TLS_SERVER_NAME",),
        "SPLITVL_INTERNAL_TOKEN": ("INTERNAL_TOKEN",),
    }
    if name != "gateway":  # the gateway's callers are users: mTLS there is opt-in
        mapping["SPLITVL_TLS_CLIENT_CA_FILE"] = ("TLS_CLIENT_CA_FILE",)
    out: dict[str, str] = {}
    for source, targets in mapping.items():
        value = env.get(source, "")
        if not value:
            continue
        for target in targets:
            key = f"{prefix}_{target}"
            if not env.get(key):
                out[key] = value
    return out
