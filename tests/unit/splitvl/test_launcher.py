"""The launcher's guards, without the services: busy ports, a log folder in use, the
parent-death watchdog and supervision, each on real sockets and real processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from splitvl.launcher import (
    SERVICES,
    Cluster,
    LaunchConfigError,
    LogDirLock,
    PortInUseError,
    Ports,
    Supervisor,
    check_ports,
    ephemeral_range,
    free_base,
    free_port,
)


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_a_busy_grpc_port_is_named_with_its_holder_and_the_flag_that_moves_it() -> None:
    with _listener() as held:
        port = held.getsockname()[1]
        ports = Ports.free()
        ports.grpc["cache"] = port
        with pytest.raises(PortInUseError) as err:
            check_ports(ports)
    message = str(err.value)
    assert err.value.port == port
    assert f"port {port} (cache gRPC) is already in use" in message
    assert f"pid {os.getpid()}" in message  # this test process holds it
    assert "another splitvl" not in message  # pytest is not a splitvl service
    assert message.endswith("move this instance with --base-port")


def test_a_busy_metrics_port_names_the_metrics_flag() -> None:
    with _listener() as held:
        ports = Ports.free()
        ports.metrics["decoder"] = held.getsockname()[1]
        with pytest.raises(PortInUseError, match=r"decoder metrics.*--metrics-base-port \(0 turns"):
            check_ports(ports)


def test_a_port_held_by_a_connection_is_named_so_with_the_range_that_causes_it() -> None:
    """CI once refused a port after every process of a killed ``up`` was gone: no
    listener, but an outgoing connection had the port as its local end (the kernel gives
    the ephemeral range to clients). The message says so, not a bare "in use"."""
    with _listener() as server, socket.socket() as client:
        client.bind(("127.0.0.1", 0))  # the kernel's pick: from the ephemeral range
        client.connect(server.getsockname())
        port = client.getsockname()[1]
        ports = Ports.free()
        ports.grpc["decoder"] = port
        with pytest.raises(PortInUseError) as err:
            check_ports(ports)
    low, high = ephemeral_range()
    assert low <= port <= high
    message = str(err.value)
    assert f"port {port} (decoder gRPC) is already in use by a connection, not a" in message
    assert f"this host gives ports {low}-{high} to outgoing connections" in message
    assert f"pid {os.getpid()}" not in message  # a connection is not a holder to stop


def test_chosen_ports_lie_below_the_ephemeral_range() -> None:
    low = ephemeral_range()[0]
    for _ in range(20):
        ports = Ports.free()
        assert max([*ports.grpc.values(), *ports.metrics.values(), ports.http]) < low
        base = free_base()
        assert base + 30 <= low
        check_ports(Ports.from_base(base, base + 10, base + 20))


def test_free_ports_pass_and_a_port_given_twice_is_refused() -> None:
    ports = Ports.free()
    check_ports(ports)  # nothing listens there
    ports.metrics["gateway"] = ports.grpc["encoder"]
    with pytest.raises(PortInUseError, match="given to both encoder gRPC and gateway metrics"):
        check_ports(ports)


def test_a_port_a_splitvl_service_holds_is_named_as_another_splitvl(tmp_path: Path) -> None:
    """The holder's command line says which service it is (``python -m cache_service``)."""
    port = free_port()
    script = tmp_path / "cache_service.py"
    script.write_text(
        "import socket, sys, time\n"
        f"s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen()\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    # Run as `python -m cache_service`, as the launcher starts it.
    proc = subprocess.Popen(
        [sys.executable, "-m", "cache_service"], cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        ports = Ports.free()
        ports.grpc["gateway"] = port
        with pytest.raises(PortInUseError) as err:
            check_ports(ports)
    finally:
        proc.kill()
        proc.wait()
    assert f"by another splitvl (pid {proc.pid}: python -m cache_service)" in str(err.value)


def test_a_log_folder_in_use_is_refused_naming_its_holder(tmp_path: Path) -> None:
    first = LogDirLock(tmp_path)
    first.acquire()
    try:
        with pytest.raises(LaunchConfigError) as err:
            LogDirLock(tmp_path).acquire()
        assert f"in use by another splitvl (pid {os.getpid()})" in str(err.value)
        assert "--log-dir" in str(err.value)
    finally:
        first.release()
    again = LogDirLock(tmp_path)
    again.acquire()  # released: free again
    again.release()


def _descendants_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_a_service_and_its_children_end_when_the_launcher_is_sigkilled(tmp_path: Path) -> None:
    """launcher (SIGKILLed) -> service with the watchdog -> a grandchild (vLLM's engine core
    stands for it), all in the service's process group: both end within seconds."""
    service = textwrap.dedent(
        """
        import subprocess, sys, time
        from vlcommon.lifeline import start_watchdog
        assert start_watchdog(poll_s=0.1, grace_s=0.5) is not None
        # SIGTERM is ignored here, as by a service stuck in its drain: the group kill ends it.
        import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print(child.pid, flush=True)
        time.sleep(120)
        """
    )
    launcher = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        env = {{**os.environ, "SPLITVL_LAUNCHER_PID": str(os.getpid())}}
        p = subprocess.Popen([sys.executable, "-c", {service!r}], env=env,
                             process_group=0, stdout=subprocess.PIPE, text=True)
        print(p.pid, p.stdout.readline().strip(), flush=True)
        time.sleep(120)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", launcher],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and _descendants_alive(pids) == pids
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while _descendants_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _descendants_alive(pids) == []


def test_the_watchdog_stays_off_without_the_launcher_variable_and_in_grandchildren() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; from vlcommon.lifeline import start_watchdog as w\n"
            "print(w() is None)\n"
            "os.environ['SPLITVL_LAUNCHER_PID'] = '1'; print(w() is None)\n"
            "os.environ['SPLITVL_LAUNCHER_PID'] = str(os.getpid()); print(w() is None,"
            " 'SPLITVL_LAUNCHER_PID' in os.environ)\n",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    # Unset, pid 1, and a pid that is not the parent: no watchdog; the variable is consumed.
    assert out.stdout.split() == ["True", "True", "True", "False"]


class _ScriptedCluster(Cluster):
    """A Cluster whose 'services' are small scripts: the decoder exits with code 3 at once,
    the others run until stopped."""

    def _command(self, name: str) -> list[str]:
        code = "import sys; sys.exit(3)" if name == "decoder" else "import time; time.sleep(120)"
        return [sys.executable, "-c", code]


def test_supervision_restarts_the_service_that_exits_and_leaves_the_others(tmp_path: Path) -> None:
    cluster = _ScriptedCluster(model=str(tmp_path), ports=Ports.free(), log_dir=tmp_path / "logs")
    lines: list[str] = []
    cluster.start()
    try:
        others = {n: cluster.procs[n].pid for n in SERVICES if n != "decoder"}
        supervisor = Supervisor(
            cluster, say=lines.append, max_failures=4, window_s=60, backoff_s=0.05
        )
        reason = None
        deadline = time.monotonic() + 30
        while reason is None and time.monotonic() < deadline:
            reason = supervisor.poll()
            time.sleep(0.02)
        # Three restarts, then the fourth exit within the window stops supervision.
        assert supervisor.restarts == {"decoder": 3}
        assert {n: cluster.procs[n].pid for n in others} == others
        assert all(cluster.procs[n].poll() is None for n in others)
    finally:
        cluster.stop()
    log = cluster.log_path("decoder")
    assert reason == (
        f"decoder exited with code 3, 4 times in 60 s; stopping all services; see its log: {log}"
    )
    assert lines[0] == (
        "splitvl: decoder exited with code 3; restarting it in 0 s (exit 1 of at most 3 in "
        f"60 s); see its log: {log}"
    )
    assert len(lines) == 3 and "exit 3 of at most 3" in lines[2]
    # Backoff doubles: 0.05, 0.1, 0.2 s.
    assert "restarting it in 0 s" in lines[2]  # rounded for the line; the delay is 0.2 s


def test_a_launcher_start_with_a_busy_port_leaves_no_log_behind(tmp_path: Path) -> None:
    with _listener() as held:
        ports = Ports.free()
        ports.grpc["gateway"] = held.getsockname()[1]
        cluster = _ScriptedCluster(model=str(tmp_path), ports=ports, log_dir=tmp_path / "logs")
        with pytest.raises(PortInUseError):
            cluster.start()
    assert not (tmp_path / "logs").exists()
    assert cluster.procs == {}


def test_free_ports_are_distinct_every_time() -> None:
    """One free_port() after another once handed the encoder and decoder the same metrics
    port (a bench run then refused to start)."""
    for _ in range(50):
        ports = Ports.free()
        taken = [*ports.grpc.values(), *ports.metrics.values(), ports.http]
        assert len(set(taken)) == len(taken) == 9
        check_ports(ports)


@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_an_unusable_log_folder_is_one_line_not_a_traceback(tmp_path: Path, kind: str) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    folder = afile if kind == "a file" else afile / "sub"
    with pytest.raises(LaunchConfigError) as err:
        LogDirLock(folder).acquire()
    assert str(err.value).startswith(f"--log-dir {folder}: ")


def test_a_stop_signal_while_starting_ends_the_wait_at_once(tmp_path: Path) -> None:
    import threading

    from splitvl.launcher import StartInterrupted

    cluster = _ScriptedCluster(model=str(tmp_path), ports=Ports.free(), log_dir=tmp_path / "l")
    stop = threading.Event()
    stop.set()
    t0 = time.monotonic()
    try:
        cluster.procs = {}  # nothing started: the wait checks the stop first
        with pytest.raises(StartInterrupted):
            cluster.wait_ready(timeout_s=60, stop=stop)
    finally:
        cluster.stop()
    assert time.monotonic() - t0 < 1


_SIGNAL_STORM_CHILD = """
import signal, sys, threading, time
from splitvl.launcher import StopFlag
stop = threading.Event() if sys.argv[1] == "event" else StopFlag()
signal.signal(signal.SIGUSR1, lambda *_: stop.set())
print("ready", flush=True)
end = time.monotonic() + 2
while time.monotonic() < end:
    stop.wait(0.0005)
print("done", flush=True)
"""


def test_stop_flag_survives_signals_that_land_inside_wait(tmp_path: Path) -> None:
    """`splitvl up` once hung on Ctrl-C: its handler called threading.Event.set, which
    takes the lock that the main thread held inside Event.wait when the signal landed
    (py-spy: handlers nested in Condition.__enter__). StopFlag takes no lock. A child
    waits in a tight loop while SIGUSR1 arrives every 0.2 ms: with StopFlag it ends
    cleanly. With an Event (the old code; ``child.py event``) the same storm ended the child
    with nested handlers in ``Condition.__enter__`` and a RecursionError, 5 runs of 5."""
    script = tmp_path / "child.py"
    script.write_text(_SIGNAL_STORM_CHILD)
    child = subprocess.Popen(
        [sys.executable, str(script), "flag"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    end = time.monotonic() + 1.5
    while time.monotonic() < end and child.poll() is None:
        os.kill(child.pid, signal.SIGUSR1)
        time.sleep(0.0002)
    try:
        out, _ = child.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        child.kill()
        out = "(hung)"
    assert child.returncode == 0 and out.strip() == "done"
