"""Hosts as Linux network namespaces on one bridge, for tests that cross a real network.

Usage (as root, with iproute2's ``ip`` and util-linux's ``unshare``)::

    with Network(["a", "b"]) as net:
        proc = net.popen("a", [sys.executable, "-m", "gateway", "--host", net["a"].address])
        before = net.link_bytes()
        ...
        moved = net.link_bytes() - before   # bytes per link and direction

Each host is a network namespace ``splitvl-<run>-<host>`` with loopback up and one veth
whose other end sits on a bridge ``svb<run>`` in the root namespace; the bridge has the
``.1`` address of a /28 block of 198.51.100.0/24 (TEST-NET-2, RFC 5737: never routed),
the hosts ``.11``, ``.12``, ... of the same block. A block no other run on this machine
uses is taken under a lock, so concurrent runs (CI jobs on one runner) neither share
names nor addresses. Processes start through
``ip netns exec NS unshare --mount sh -c 'mount -t tmpfs tmpfs /dev/shm && exec ...'``:
each "host" has its own empty /dev/shm, so no shared-memory segment crosses hosts.

Teardown (``close``, also on failure) kills every process in each namespace (the ones
started here by their process group, then whatever ``ip netns pids`` still lists) and
deletes the namespaces (which deletes their veths) and the bridge. A run killed before
its teardown leaves a record under ``/run/splitvl-netns``; the next :class:`Network` removes
what a dead run left (:func:`sweep_stale`).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

#: TEST-NET-2 (RFC 5737), cut into /28 blocks: one per concurrent run.
NET = ipaddress.ip_network("198.51.100.0/24")
BLOCK_PREFIX = 28
#: Host addresses in a block start at .11 (the bridge is .1).
FIRST_HOST = 11
STATE_DIR = Path("/run/splitvl-netns")
# ``sh`` mounts a private tmpfs on /dev/shm in the new mount namespace, then becomes the
# command ("$@"), so the pid Popen returns is the command's own (ip netns exec and unshare
# without --fork exec too): its parent is this process, which the services' lifeline
# watchdog (vlcommon.lifeline) checks.
_SHM_PRIVATE = 'mount -t tmpfs -o size=2g tmpfs /dev/shm && exec "$@"'


def missing() -> str | None:
    """Why network-namespace hosts cannot be made here; None when they can."""
    if os.geteuid() != 0:
        return "network namespaces, veths and tmpfs mounts need root (CI runs the tests as root)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("mount", "mount")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian package {package})"
    if not Path("/sys/class/net").is_dir():
        return "/sys/class/net is not mounted: link counters cannot be read"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


@dataclass(frozen=True)
class Host:
    """One namespace "host".

    Attributes:
        name: Its short name (``a``).
        netns: The network namespace (``splitvl-<run>-a``).
        address: Its IPv4 address on the bridge.
        veth: The root-namespace end of its link: rx there is what the host sent, tx what
            it received.
    """

    name: str
    netns: str
    address: str
    veth: str


@dataclass(frozen=True)
class LinkBytes:
    """Bytes on each host's link (Ethernet frames, as the veth counts them).

    ``sent[h]``: from host ``h`` onto the bridge; ``received[h]``: from the bridge to ``h``.
    Subtract two readings for what a span of time moved.
    """

    sent: dict[str, int]
    received: dict[str, int]

    def __sub__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(
            {h: n - other.sent[h] for h, n in self.sent.items()},
            {h: n - other.received[h] for h, n in self.received.items()},
        )


@dataclass
class Network:
    """A bridge and one namespace per host name (see the module docstring).

    Args:
        names: Host names, one lowercase letter or word each (``a``, ``b``, ...).
    """

    names: Sequence[str]
    run: str = field(default_factory=lambda: secrets.token_hex(3))
    hosts: dict[str, Host] = field(default_factory=dict)
    bridge: str = ""
    gateway_address: str = ""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _record: Path | None = None

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # -- setup and teardown -------------------------------------------------------------
    def open(self) -> Network:
        """Create the bridge and the hosts.

        Raises:
            RuntimeError: no free /28 block is left, or ``ip`` failed (its stderr).
        """
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        sweep_stale()
        self.bridge = f"svb{self.run}"
        with _locked(STATE_DIR / ".lock"):
            block = _free_block()
            self.gateway_address = str(block[1])
            self.hosts = {
                name: Host(
                    name=name,
                    netns=f"splitvl-{self.run}-{name}",
                    address=str(block[FIRST_HOST + i]),
                    veth=f"sv{self.run}{i}",
                )
                for i, name in enumerate(self.names)
            }
            self._record = STATE_DIR / self.run
            self._record.write_text(
                json.dumps(
                    {
                        "pid": os.getpid(),
                        "bridge": self.bridge,
                        "netns": [h.netns for h in self.hosts.values()],
                        "veths": [h.veth for h in self.hosts.values()],
                    }
                )
            )
            try:
                self._create(block)
            except BaseException:
                self.close()
                raise
        return self

    def _create(self, block: ipaddress.IPv4Network) -> None:
        prefix = f"/{block.prefixlen}"
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", self.gateway_address + prefix, "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host in self.hosts.values():
            inner = f"{host.veth}i"
            _ip("netns", "add", host.netns)
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", host.netns)
            _ip("link", "set", host.veth, "master", self.bridge, "up")
            _ip("-n", host.netns, "link", "set", inner, "name", "eth0")
            _ip("-n", host.netns, "addr", "add", host.address + prefix, "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            # A default route, so libraries that find "their" address by routing towards
            # an outside one (vLLM's get_ip) get eth0's rather than an error.
            _ip("-n", host.netns, "route", "add", "default", "via", self.gateway_address)

    def close(self) -> None:
        """Kill every process, delete the namespaces and the bridge (idempotent)."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self.procs.clear()
        hosts = self.hosts.values()
        _remove(self.bridge, [h.netns for h in hosts], [h.veth for h in hosts])
        if self._record is not None:
            self._record.unlink(missing_ok=True)
            self._record = None

    def __enter__(self) -> Network:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- processes ----------------------------------------------------------------------
    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``host``: in its network namespace, with a private /dev/shm."""
        ns = self.hosts[host].netns
        return ["ip", "netns", "exec", ns, "unshare", "--mount", "sh", "-c", _SHM_PRIVATE, "sh"] + [
            *argv
        ]

    def popen(
        self, host: str, argv: Sequence[str], *, log: IO[bytes], **kw: Any
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` in a process group of its own (vLLM's children go
        with it), output to ``log``; :meth:`close` kills it."""
        proc = subprocess.Popen(
            self.command(host, argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            process_group=0,
            **kw,
        )
        self.procs.append(proc)
        return proc

    # -- faults -------------------------------------------------------------------------
    @contextlib.contextmanager
    def partitioned(self, host: str) -> Iterator[None]:
        """Cut ``host`` off while the block runs (its link down at the bridge end: its
        packets are dropped, no reset is sent, as when a switch port or a zone fails), then
        bring the link back."""
        veth = self.hosts[host].veth
        _ip("link", "set", veth, "down")
        try:
            yield
        finally:
            _ip("link", "set", veth, "up")  # still the bridge's port: nothing else to redo

    # -- counters -----------------------------------------------------------------------
    def link_bytes(self) -> LinkBytes:
        """Each host's link counters now (the root-namespace end of its veth)."""

        def read(veth: str, counter: str) -> int:
            return int(Path(f"/sys/class/net/{veth}/statistics/{counter}").read_text())

        hosts = self.hosts.values()
        return LinkBytes(
            sent={h.name: read(h.veth, "rx_bytes") for h in hosts},
            received={h.name: read(h.veth, "tx_bytes") for h in hosts},
        )

    def tcp_bytes(self) -> dict[tuple[str, str], int]:
        """TCP payload bytes received so far on every open socket, summed per
        ``(from, to)`` pair of hosts (``root`` for this namespace's bridge address), from
        ``ss -ti``'s ``bytes_received``. Sockets within one host (loopback, or a host's
        own address) are left out. Subtract two readings: a socket closed in between
        drops out of the later one.
        """
        by_address = {h.address: h.name for h in self.hosts.values()}
        by_address[self.gateway_address] = "root"
        out: dict[tuple[str, str], int] = {}
        for here, ns in [("root", None), *((h.name, h.netns) for h in self.hosts.values())]:
            prefix = ["ip", "netns", "exec", ns] if ns else []
            text = _run(*prefix, "ss", "-tinHO", "state", "established").stdout
            for local, peer, received in _ss_sockets(text):
                if by_address.get(local) != here or peer not in by_address:
                    continue
                source = by_address[peer]
                if source != here:
                    out[(source, here)] = out.get((source, here), 0) + received
        return out


# With a state filter ss prints no State column: Recv-Q Send-Q Local:Port Peer:Port ...
_ADDRESS = r"\[?(?:::ffff:)?([0-9.]+)\]?:\d+"  # IPv4 (or IPv4-mapped IPv6) and a port
_SS_LINE = re.compile(rf"^\s*\d+\s+\d+\s+{_ADDRESS}\s+{_ADDRESS}\s")
_RECEIVED = re.compile(r"\bbytes_received:(\d+)")


def _ss_sockets(text: str) -> Iterator[tuple[str, str, int]]:
    """``(local address, peer address, bytes_received)`` of each line of ``ss -tinHO``."""
    for line in text.splitlines():
        m = _SS_LINE.match(line)
        if m is None:
            continue
        received = _RECEIVED.search(line)
        yield m.group(1), m.group(2), int(received.group(1)) if received else 0


def tcp_delta(
    after: dict[tuple[str, str], int], before: dict[tuple[str, str], int]
) -> dict[tuple[str, str], int]:
    """``after - before`` per pair, pairs that moved nothing left out."""
    out = {pair: n - before.get(pair, 0) for pair, n in after.items()}
    return {pair: n for pair, n in out.items() if n > 0}


def _ip(*argv: str) -> None:
    result = _run("ip", *argv, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(argv)}: {result.stderr.strip()}")


def _remove(bridge: str, namespaces: Sequence[str], veths: Sequence[str]) -> None:
    """Kill what runs in ``namespaces``, delete them, ``veths`` and ``bridge``; absent
    ones are fine. (A namespace's veth would go with it, but asynchronously: the kernel
    frees a namespace in a work queue; deleting the veth itself is done on return.)"""
    for ns in namespaces:
        pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pids and time.monotonic() < deadline:
            pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
            time.sleep(0.1)
        _run("ip", "netns", "del", ns, check=False)
    for veth in veths:
        _run("ip", "link", "del", veth, check=False)
    if bridge:
        _run("ip", "link", "del", bridge, check=False)


def _free_block() -> ipaddress.IPv4Network:
    """A /28 of :data:`NET` that no address in the root namespace is in (call under the
    lock, and create the bridge before releasing it)."""
    used = _run("ip", "-4", "-o", "addr", "show").stdout
    taken = {
        ipaddress.ip_interface(m.group(1)).ip
        for m in re.finditer(r"\binet (\S+)", used)
        if ipaddress.ip_interface(m.group(1)).ip in NET
    }
    for block in NET.subnets(new_prefix=BLOCK_PREFIX):
        if not any(ip in block for ip in taken):
            return block  # type: ignore[return-value]
    raise RuntimeError(f"every /{BLOCK_PREFIX} of {NET} is in use by other runs")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def sweep_stale() -> list[str]:
    """Remove the namespaces and bridges of runs whose process is dead (a run killed
    before its teardown); returns their run ids."""
    removed = []
    with _locked(STATE_DIR / ".lock"):
        for record in STATE_DIR.glob("[0-9a-f]*"):
            try:
                state = json.loads(record.read_text())
                if _alive(int(state["pid"])):
                    continue  # its own teardown will run
            except (OSError, ValueError, KeyError):
                continue
            _remove(state.get("bridge", ""), state.get("netns", []), state.get("veths", []))
            record.unlink(missing_ok=True)
            removed.append(record.name)
    return removed
