"""The services' names and the ports a cluster binds: free-port choice below the host's
ephemeral range, the :class:`Ports` layout, and the check that every port is free
before anything starts (:func:`check_ports`).

The layout (``splitvl up`` prints it, docs/usage.md states it): the gateway on the base
port, the encoder, cache and decoder on the next three; with ``--replicas``, replica r
(1-based) of a service listens :data:`PORT_STRIDE` x (r - 1) above replica 1, so replica 2
of the decoder is base + 13, replica 3 base + 23. Gateway replicas all take calls on the
base port (``SO_REUSEPORT``: the kernel spreads connections over them) and the HTTP port,
and each also listens on a port of its own, :data:`GATEWAY_INSTANCE_OFFSET` +
:data:`PORT_STRIDE` x (r - 1) above the base (base + 4, base + 14, ...), for its health
probe. Metrics ports follow the same layout from the metrics base port. A service run
once is named as before (``decoder``, its log ``decoder.log``); a replicated one's
instances are ``decoder-1``, ``decoder-2``, ...
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shlex
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from splitvl.errors import LaunchConfigError, PortInUseError

SERVICES = ("gateway", "encoder", "cache", "decoder")
PACKAGES = {
    "gateway": "gateway",
    "encoder": "encoder_service",
    "cache": "cache_service",
    "decoder": "decoder_service",
}
#: The services behind the gateway that ``--replicas`` may run more than once.
REPLICATED = ("encoder", "cache", "decoder")
#: Where a gateway replica's own port lies in its row of the layout (offsets 0-3 are the
#: four services').
GATEWAY_INSTANCE_OFFSET = 4
#: Ports between one replica of a service and the next: room for the four services'
#: offsets (0-3), and round numbers a reader can add in their head.
PORT_STRIDE = 10


def instance_name(service: str, replica: int, count: int) -> str:
    """``decoder`` when the service runs once, ``decoder-2`` for replica 2 of several."""
    return service if count == 1 else f"{service}-{replica}"


def service_of(instance: str) -> str:
    """The service an instance belongs to: ``decoder-2`` -> ``decoder``."""
    return instance.split("-", 1)[0]


# Linux's default ip_local_port_range; macOS and Windows use 49152-65535 (IANA's range).
_DEFAULT_EPHEMERAL = (32768, 60999)
# Chosen ports come from here: above the registered well-known services, below every
# common ephemeral range.
_CHOSEN_LOW = 20000


def ephemeral_range() -> tuple[int, int]:
    """The host's ephemeral port range ``(low, high)``, inclusive: the ports the kernel
    gives to outgoing connections (``/proc/sys/net/ipv4/ip_local_port_range``; Linux's
    default where it cannot be read)."""
    try:
        low, high = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def free_ports(n: int, *, consecutive: bool = False) -> list[int]:
    """``n`` distinct free loopback ports, all held open while chosen (one ``free_port``
    after another could hand out the same port twice); ``consecutive``: ``n`` ports in a
    row, as ``--base-port`` binds them.

    The ports lie below the host's ephemeral range. A port the OS picks (``bind(0)``) is
    in that range, so any outgoing connection on the host may take it as its local port
    between the choice and the service's bind, or hold it after a service stopped; that
    is what made a CI run's ``check_ports`` fail with no listener in sight.

    Raises:
        RuntimeError: no such ports were found in 1,000 tries.
    """
    low = _CHOSEN_LOW
    high = min(ephemeral_range()[0], 49152) - n  # last first port whose run fits below
    if high <= low:  # an unusual range that starts low: take what the OS gives
        low, high = 1024, 65535 - n
    rng = random.SystemRandom()
    for _ in range(1000):
        wanted = (
            list(range(start := rng.randint(low, high), start + n))
            if consecutive
            else sorted(set(rng.randint(low, high) for _ in range(n)))
        )
        if len(wanted) != n:
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in wanted:
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return wanted
    raise RuntimeError(f"no {n} free loopback ports found between {low} and {high + n}")


def free_port() -> int:
    """One free loopback port below the ephemeral range (see :func:`free_ports`)."""
    return free_ports(1)[0]


def free_base(span: int = 30) -> int:
    """A ``--base-port`` for a whole instance: ``span`` consecutive free ports from it,
    enough for ``Ports.from_base(base, base + 10, base + 20)`` and its HTTP port."""
    return free_ports(span, consecutive=True)[0]


@dataclass
class Ports:
    """gRPC and Prometheus ports of the four services, and the gateway's HTTP port
    (OpenAI-compatible front; 0 = off)."""

    grpc: dict[str, int]
    metrics: dict[str, int]
    http: int = 0
    #: The gRPC port the gateway replicas share (0: the gateway runs once, on its own
    #: ``grpc["gateway"]``).
    public: int = 0

    @classmethod
    def from_base(
        cls,
        base: int,
        metrics_base: int,
        http: int = 0,
        replicas: Mapping[str, int] | None = None,
    ) -> Ports:
        """The layout from a base port (module docstring); ``metrics_base`` 0 = no metrics.

        Args:
            replicas: Instances per service (``{"decoder": 2}``); absent services run once.

        Raises:
            LaunchConfigError: a replica's port would pass 65535.
        """
        grpc: dict[str, int] = {}
        metrics: dict[str, int] = {}
        gateways = (replicas or {}).get("gateway", 1)
        for i, service in enumerate(SERVICES):
            count = (replicas or {}).get(service, 1)
            for r in range(1, count + 1):
                name = instance_name(service, r, count)
                offset = i + PORT_STRIDE * (r - 1)
                shared = service == "gateway" and gateways > 1
                grpc[name] = base + offset + (GATEWAY_INSTANCE_OFFSET if shared else 0)
                metrics[name] = metrics_base + offset if metrics_base else 0
                top = max(grpc[name], metrics[name])
                if top > 65535:
                    raise LaunchConfigError(
                        f"{name} would listen on port {top}, past 65535: lower --base-port "
                        "or --metrics-base-port, or run fewer replicas"
                    )
        return cls(grpc=grpc, metrics=metrics, http=http, public=base if gateways > 1 else 0)

    @classmethod
    def free(cls, replicas: Mapping[str, int] | None = None) -> Ports:
        """Free ports for every instance (``replicas`` as in :meth:`from_base`)."""
        names = list(cls.from_base(1, 0, replicas=replicas).grpc)
        ports = free_ports(2 * len(names) + 2)
        return cls(
            grpc=dict(zip(names, ports[: len(names)], strict=True)),
            metrics=dict(zip(names, ports[len(names) : 2 * len(names)], strict=True)),
            http=ports[-2],
            public=ports[-1] if (replicas or {}).get("gateway", 1) > 1 else 0,
        )

    def gateway_address(self) -> str:
        """``127.0.0.1:PORT`` where clients reach the gateway: the port its replicas share,
        or the one gateway's."""
        return f"127.0.0.1:{self.public or self.grpc['gateway']}"

    def address(self, name: str) -> str:
        """``127.0.0.1:PORT`` of one instance (``decoder`` or ``decoder-2``); ``gateway``
        with gateway replicas: the port they share (:meth:`gateway_address`)."""
        if name == "gateway" and self.public:
            return self.gateway_address()
        return f"127.0.0.1:{self.grpc[name]}"

    def instances(self, service: str) -> list[str]:
        """The instances of one service, in replica order."""
        return [name for name in self.grpc if service_of(name) == service]

    def target(self, service: str) -> str:
        """The gRPC target that reaches every instance of ``service``: ``127.0.0.1:P`` for
        one, grpc's address-list form ``ipv4:127.0.0.1:P1,127.0.0.1:P2`` for several
        (the channel's round_robin policy, or the gateway's own decoder routing, picks)."""
        names = self.instances(service)
        if len(names) == 1:
            return self.address(names[0])
        return "ipv4:" + ",".join(self.address(name) for name in names)

    def bindings(self) -> list[tuple[int, str, str]]:
        """Every port the cluster binds: ``(port, what, the flag that moves it)``."""
        out = [(p, f"{n} gRPC", "--base-port") for n, p in self.grpc.items()]
        if self.public:
            out.insert(0, (self.public, "the gateways' shared gRPC", "--base-port"))
        out += [(p, f"{n} metrics", "--metrics-base-port") for n, p in self.metrics.items() if p]
        if self.http:
            out.append((self.http, "gateway OpenAI-compatible HTTP", "--http-port"))
        return out


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        # grpc and prometheus bind with SO_REUSEADDR: a port left in TIME_WAIT by a stopped
        # instance is free for them, so it must count as free here too.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            if err.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def port_owner(port: int) -> str:
    """Who holds ``port``, as far as this user may see: ``"another splitvl (pid N:
    python -m gateway)"``, ``"pid N (cmd)"``, ``"a connection, not a listener (...)"``
    when only a connection uses it as its local port, or ``""`` when it cannot be told."""
    import psutil

    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return ""
    mine = [c for c in conns if c.laddr and c.laddr.port == port]
    for conn in mine:
        if conn.status == psutil.CONN_LISTEN:
            if conn.pid is None:
                return ""
            try:
                cmdline = psutil.Process(conn.pid).cmdline()
            except psutil.Error:
                return f"pid {conn.pid}"
            words = [os.path.basename(w) if i == 0 else w for i, w in enumerate(cmdline)]
            shown = shlex.join(words[:3])
            ours = any(w in PACKAGES.values() or w.startswith("splitvl") for w in cmdline[1:4])
            return f"{'another splitvl ' if ours else ''}(pid {conn.pid}: {shown})"
    if mine:
        # No listener: the local end of a connection. The kernel hands the ephemeral range
        # to outgoing connections, so a port in it can be taken by any client on the host.
        low, high = ephemeral_range()
        hint = (
            f"; this host gives ports {low}-{high} to outgoing connections, "
            f"a port below {low} avoids that"
            if low <= port <= high
            else ""
        )
        return f"a connection, not a listener ({mine[0].status}{hint})"
    return ""


def check_ports(ports: Ports) -> None:
    """Refuse to start when any port the cluster would bind is taken.

    Raises:
        PortInUseError: one line naming the port, its role, who holds it where that can
            be told, and the flag that moves it.
    """
    seen: dict[int, str] = {}
    for port, what, flag in ports.bindings():
        if port in seen:
            raise PortInUseError(
                port, f"port {port} is given to both {seen[port]} and {what}; move one with {flag}"
            )
        seen[port] = what
        if not _port_free(port):
            owner = port_owner(port)
            held = f" by {owner}" if owner else ""
            off = " (0 turns it off)" if flag in ("--metrics-base-port", "--http-port") else ""
            raise PortInUseError(
                port,
                f"port {port} ({what}) is already in use{held}; stop that or move this "
                f"instance with {flag}{off}",
            )
