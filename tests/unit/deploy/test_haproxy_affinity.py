"""deploy/haproxy/haproxy.cfg, as shipped, in front of three real grpcio servers.

Debian's haproxy (2.6) runs the file unchanged; only its environment variables differ
(decoder addresses, free loopback ports, a short health check period). The servers answer
with their own name: ``Who`` (unary) and ``Hold`` (server streaming: the name, then the
stream stays open until the client cancels it), so a test sees where each call went and
can hold calls in flight. Shown here:

* each of 12 affinity keys always reaches the same server, over repeats, over new
  connections and through a second HAProxy started from the same list; the keys spread over
  all three servers;
* one hot key at 30 calls in flight spreads past its home server (bounded loads,
  ``hash-balance-factor 125``), and returns home once the load is gone;
* a stopped server's keys move to the others and no other key moves; they come back when
  it returns; a server that reports NOT_SERVING on grpc.health.v1 is drained the same way
  (the gRPC health check, not a TCP connect);
* a call without the header (text only) still succeeds;
* decoders named by DNS (the Kubernetes way, a stub DNS server here) fill the
  server-template slots: keys stick and spread, and a record that leaves and returns moves
  only its own keys;
* a decoder killed mid-stream ends its call at once (HAProxy 2.6 cuts the stream without
  trailers: grpcio reports UNKNOWN), and the next call with that key goes elsewhere.

Skipped, with the reason, only where haproxy is not installed (``make system-deps`` installs
it; CI has it).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import io
import math
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any, Protocol

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
HAPROXY = shutil.which("haproxy") or (
    "/usr/sbin/haproxy" if os.access("/usr/sbin/haproxy", os.X_OK) else None
)
pytestmark = pytest.mark.skipif(
    HAPROXY is None,
    reason="haproxy is not installed (Debian package `haproxy`; `make system-deps` installs it)",
)

SERVICE = "splitvl.test.Echo"
HEADER = "x-splitvl-affinity"
# The config's server names for SPLITVL_DECODER_1..3.
NAMES = ("decoder1", "decoder2", "decoder3")
KEYS = [hashlib.sha256(f"image-{i}".encode()).hexdigest() for i in range(12)]
BALANCE_FACTOR = 1.25  # hash-balance-factor 125
CHECK_INTER = "100ms"  # fall 3, rise 2 (the shipped values): a state change within ~0.5 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Backend:
    """One grpcio server that answers with its name, plus grpc.health.v1."""

    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.health = health.HealthServicer()
        self.server: grpc.Server | None = None

    def start(self) -> None:
        name = self.name.encode()

        def who(request: bytes, context: grpc.ServicerContext) -> bytes:
            return name

        def hold(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            yield name
            while context.is_active():  # until the client cancels (or the server stops)
                time.sleep(0.02)

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    SERVICE,
                    {
                        "Who": grpc.unary_unary_rpc_method_handler(who),
                        "Hold": grpc.unary_stream_rpc_method_handler(hold),
                    },
                ),
            )
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.port = server.add_insecure_port(f"{self.host}:{self.port}")  # the same port again
        assert self.port
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        server.start()
        self.server = server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=0).wait(10)
            self.server = None


class HasPort(Protocol):
    port: int


class Proxy:
    """haproxy -f deploy/haproxy/haproxy.cfg in the foreground, stopped at the end."""

    def __init__(
        self,
        backends: Sequence[HasPort],
        workdir: Path,
        dns: dict[str, str] | None = None,
        servers: Sequence[str] = NAMES,
    ) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.servers = tuple(servers)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITVL_")}
        env.update(
            SPLITVL_HAPROXY_BIND=f"127.0.0.1:{self.port}",
            SPLITVL_HAPROXY_METRICS_BIND=f"127.0.0.1:{self.metrics_port}",
            SPLITVL_HAPROXY_CHECK_INTER=CHECK_INTER,
        )
        if dns is not None:  # decoders from DNS (server-template) instead of a list
            env.update(dns)
        for i, backend in enumerate(backends, start=1):
            env[f"SPLITVL_DECODER_{i}"] = f"127.0.0.1:{backend.port}"
        self.log = workdir / f"haproxy-{self.port}.log"
        assert HAPROXY is not None
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [HAPROXY, "-db", "-f", str(CONFIG)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        try:
            self.wait_for({name: "UP" for name in self.servers[: len(backends) or None]})
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.channel.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        assert self.process.poll() is not None

    def stats(self) -> list[dict[str, str]]:
        url = f"http://127.0.0.1:{self.metrics_port}/stats;csv"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode().lstrip("# ")
        return [row for row in csv.DictReader(io.StringIO(text)) if row["pxname"] == "decoders"]

    def status(self) -> dict[str, str]:
        """Each server's state as HAProxy's stats report it (UP, DOWN, UP 1/2 ...)."""
        return {r["svname"]: r["status"] for r in self.stats() if r["svname"] in self.servers}

    def wait_for(self, wanted: dict[str, str], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        seen: dict[str, str] = {}
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"haproxy exited: {self.log.read_text()}")
            with contextlib.suppress(OSError):
                seen = self.status()
                if all(seen.get(name) == state for name, state in wanted.items()):
                    return
            time.sleep(0.05)
        raise AssertionError(f"servers {seen}, wanted {wanted}; log: {self.log.read_text()}")

    def who(self, key: str | None, channel: grpc.Channel | None = None) -> str:
        call = (channel or self.channel).unary_unary(f"/{SERVICE}/Who")
        metadata = ((HEADER, key),) if key is not None else None
        return bytes(call(b"", metadata=metadata, timeout=10)).decode()

    def mapping(self, keys: list[str] = KEYS) -> dict[str, str]:
        return {key: self.who(key) for key in keys}

    def hold(self, key: str) -> tuple[str, Any]:
        """Open a Hold stream; returns the server that took it and the call (cancel it)."""
        call = self.channel.unary_stream(f"/{SERVICE}/Hold")(
            b"", metadata=((HEADER, key),), timeout=60
        )
        return bytes(next(call)).decode(), call


@pytest.fixture
def backends() -> Iterator[list[Backend]]:
    started = [Backend(name) for name in NAMES]
    try:
        for backend in started:
            backend.start()
        yield started
    finally:
        for backend in started:
            backend.stop()


@pytest.fixture
def proxy(backends: list[Backend], tmp_path: Path) -> Iterator[Proxy]:
    proxy = Proxy(backends, tmp_path)
    try:
        yield proxy
    finally:
        proxy.close()


# ----------------------------------------------------------------------------- the file


def test_the_shipped_config_routes_by_the_affinity_header_over_h2() -> None:
    text = CONFIG.read_text()
    lines = [line.split("#")[0].strip() for line in text.splitlines()]
    for directive in (
        "balance hdr(x-splitvl-affinity)",
        "hash-type consistent",
        "hash-balance-factor 125",
        'bind "${SPLITVL_HAPROXY_BIND}" proto h2',
        "timeout server 15m",
    ):
        assert directive in lines, directive
    (defaults,) = [line for line in lines if line.startswith("default-server ")]
    assert " proto h2 " in f"{defaults} " and " check " in f"{defaults} "


@pytest.mark.parametrize(
    ("env", "ok"),
    [
        ({"SPLITVL_DECODER_1": "10.0.0.1:50054", "SPLITVL_DECODER_2": "10.0.0.2:50054"}, True),
        ({"SPLITVL_DECODER_DNS": "splitvl-decoder.splitvl.svc.cluster.local:50054"}, True),
        ({}, False),
    ],
    ids=["address-list", "dns-server-template", "no-decoders"],
)
def test_both_ways_of_naming_decoders_parse(env: dict[str, str], ok: bool) -> None:
    assert HAPROXY is not None
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPLITVL_")}
    check = subprocess.run(
        [HAPROXY, "-c", "-f", str(CONFIG)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (check.returncode == 0) == ok, check.stdout + check.stderr
    if not ok:
        assert "no decoders: set SPLITVL_DECODER_1" in check.stdout + check.stderr


# ----------------------------------------------------------------------------- routing


def test_each_key_keeps_its_server_and_keys_spread_over_all(
    proxy: Proxy, backends: list[Backend], tmp_path: Path
) -> None:
    first = proxy.mapping()
    for _ in range(4):
        assert proxy.mapping() == first
    # A new connection, and a second HAProxy from the same list, route each key the same way.
    with grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
        assert {key: proxy.who(key, channel) for key in KEYS} == first
    second = Proxy(backends, tmp_path)
    try:
        assert second.mapping() == first
    finally:
        second.close()
    spread = Counter(first.values())
    print(f"keys per server: {dict(sorted(spread.items()))}")
    assert set(spread) == set(NAMES), spread
    # Under the bounded load at rest: no server holds more than half of 12 keys.
    assert max(spread.values()) <= 6, spread


def test_a_hot_key_spills_past_its_home_under_load(proxy: Proxy) -> None:
    key = KEYS[0]
    home = proxy.who(key)
    calls = []
    try:
        where = Counter()
        for _ in range(30):  # 30 calls in flight at once, all with the same key
            server, call = proxy.hold(key)
            where[server] += 1
            calls.append(call)
        in_flight = {r["svname"]: int(r["scur"]) for r in proxy.stats() if r["svname"] in NAMES}
        print(f"hot key {key[:12]} (home {home}), 30 in flight: {dict(sorted(where.items()))}")
        assert in_flight == {name: where[name] for name in NAMES}, in_flight
        # The home server takes the most, but no more than 1.25 x the mean (+1: HAProxy
        # counts the call being placed), and the rest spill to the next servers on the ring.
        assert where[home] == max(where.values()), where
        assert where[home] <= math.ceil(BALANCE_FACTOR * 30 / len(NAMES)) + 1, where
        assert where[home] > 30 / len(NAMES), where
        assert len(where) >= 2, where
    finally:
        for call in calls:
            call.cancel()
    # Once the load is gone, the key goes home again.
    deadline = time.monotonic() + 10
    while any(int(r["scur"]) for r in proxy.stats() if r["svname"] in NAMES):
        assert time.monotonic() < deadline, proxy.stats()
        time.sleep(0.05)
    assert [proxy.who(key) for _ in range(5)] == [home] * 5


def test_a_burst_of_one_hot_key_is_bounded_too(proxy: Proxy) -> None:
    """30 calls opened at once from 30 threads: the bound holds without sequencing."""
    key = KEYS[1]
    home = proxy.who(key)
    with futures.ThreadPoolExecutor(max_workers=30) as pool:
        opened = list(pool.map(lambda _: proxy.hold(key), range(30)))
    try:
        where = Counter(server for server, _ in opened)
        print(f"hot key burst (home {home}): {dict(sorted(where.items()))}")
        assert where[home] <= math.ceil(BALANCE_FACTOR * 30 / len(NAMES)) + 1, where
        assert len(where) >= 2, where
    finally:
        for _, call in opened:
            call.cancel()


def test_a_stopped_server_moves_only_its_own_keys(proxy: Proxy, backends: list[Backend]) -> None:
    before = proxy.mapping()
    victim = Counter(before.values()).most_common(1)[0][0]
    backend = backends[NAMES.index(victim)]
    backend.stop()
    # Calls made while HAProxy has not yet seen it go: retried on the next server.
    rounds = failed = 0
    t0 = time.monotonic()
    while proxy.status().get(victim) != "DOWN" and time.monotonic() - t0 < 15:
        rounds += 1
        try:
            proxy.mapping()
        except grpc.RpcError:
            failed += 1
    proxy.wait_for({victim: "DOWN"})
    print(f"stopped {victim}: {failed} of {rounds} rounds of 12 calls failed before DOWN")
    assert failed == 0
    after = proxy.mapping()
    for key, server in before.items():
        if server == victim:
            assert after[key] != victim, key
        else:
            assert after[key] == server, key  # the rest do not move
    moved = Counter(after[k] for k, s in before.items() if s == victim)
    print(f"{victim}'s {sum(moved.values())} keys went to {dict(sorted(moved.items()))}")
    # It returns on the same address: its keys come back.
    backend.start()
    proxy.wait_for({victim: "UP"})
    assert proxy.mapping() == before


CHILD = """
import sys, time
sys.path.insert(0, sys.argv[2])
from tests.unit.deploy.test_haproxy_affinity import Backend
backend = Backend(sys.argv[1])
backend.start()
print(backend.port, flush=True)
time.sleep(3600)
"""


@dataclasses.dataclass
class ChildBackend:
    """A Backend in its own process, so that it can die by SIGKILL."""

    process: subprocess.Popen[str]
    port: int


def test_a_decoder_killed_mid_stream_ends_the_call_at_once(tmp_path: Path) -> None:
    children = []
    try:
        for name in NAMES:
            process = subprocess.Popen(
                [sys.executable, "-c", CHILD, name, str(ROOT)],
                stdout=subprocess.PIPE,
                text=True,
            )
            children.append(ChildBackend(process, 0))
            assert process.stdout is not None
            children[-1].port = int(process.stdout.readline())
        proxy = Proxy(children, tmp_path)
        try:
            server, call = proxy.hold(KEYS[0])
            t0 = time.monotonic()
            children[NAMES.index(server)].process.kill()
            with pytest.raises(grpc.RpcError) as error:
                list(call)
            elapsed = time.monotonic() - t0
            code = error.value.code()
            details = error.value.details()
            print(f"killed {server} mid-stream: {code.name} {details!r} after {elapsed:.3f} s")
            # HAProxy 2.6 ends the client's stream without trailers: grpcio reports UNKNOWN.
            assert code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE), code
            assert elapsed < 5
            # A new call with the same key is retried past the dead server at once.
            assert proxy.who(KEYS[0]) != server
        finally:
            proxy.close()
    finally:
        for child in children:
            child.process.kill()
            child.process.wait(10)


def test_a_not_serving_server_is_drained_by_the_grpc_health_check(
    proxy: Proxy, backends: list[Backend]
) -> None:
    before = proxy.mapping()
    victim = NAMES[0]
    backend = backends[0]
    backend.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    proxy.wait_for({victim: "DOWN"})
    assert "health status is not SERVING" in proxy.log.read_text()
    after = proxy.mapping()
    assert victim not in after.values()
    assert all(after[k] == s for k, s in before.items() if s != victim)
    backend.health.set("", health_pb2.HealthCheckResponse.SERVING)
    proxy.wait_for({victim: "UP"})
    assert proxy.mapping() == before


class Dns:
    """A tiny authoritative DNS server on UDP loopback: A records for one name, changeable."""

    def __init__(self, name: str, addresses: list[str]) -> None:
        self.name = name.rstrip(".").lower()
        self.addresses = list(addresses)
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.bind(("127.0.0.1", 0))
        self.socket.settimeout(0.2)
        self.port = int(self.socket.getsockname()[1])
        self.queries = 0
        self.running = True
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while self.running:
            try:
                query, peer = self.socket.recvfrom(4096)
            except TimeoutError:
                continue
            with contextlib.suppress(Exception):  # a malformed query gets no answer
                self.socket.sendto(self.answer(query), peer)

    def answer(self, query: bytes) -> bytes:
        ident, _, qdcount = struct.unpack(">HHH", query[:6])
        assert qdcount == 1
        labels, at = [], 12
        while query[at]:
            labels.append(query[at + 1 : at + 1 + query[at]].decode().lower())
            at += 1 + query[at]
        qtype, _ = struct.unpack(">HH", query[at + 1 : at + 5])
        question = query[12 : at + 5]
        self.queries += 1
        if ".".join(labels) != self.name:
            return struct.pack(">HHHHHH", ident, 0x8583, 1, 0, 0, 0) + question  # NXDOMAIN
        records = [
            struct.pack(">HHHIH", 0xC00C, 1, 1, 1, 4) + socket.inet_aton(address)
            for address in (self.addresses if qtype == 1 else [])  # A only; AAAA: none
        ]
        header = struct.pack(">HHHHHH", ident, 0x8580, 1, len(records), 0, 0)
        return header + question + b"".join(records)

    def close(self) -> None:
        self.running = False
        self.thread.join(5)
        self.socket.close()


def test_decoders_from_dns_fill_server_template_slots(tmp_path: Path) -> None:
    """The Kubernetes way: SPLITVL_DECODER_DNS names a headless Service; its A records fill
    the server-template slots. Keys stick and spread, a record that leaves the answer takes
    only its keys with it, and one that comes back gets them back."""
    addresses = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    port = free_port()
    backends = [Backend(f"dns-{a}", a, port) for a in addresses]
    dns = Dns("decoders.splitvl.test", addresses)
    proxy = None
    try:
        for backend in backends:
            backend.start()
        proxy = Proxy(
            [],
            tmp_path,
            dns={
                "SPLITVL_DECODER_DNS": f"decoders.splitvl.test:{port}",
                "SPLITVL_DECODER_SLOTS": "4",  # one slot more than decoders
                "SPLITVL_HAPROXY_NAMESERVER": f"127.0.0.1:{dns.port}",
            },
            servers=NAMES,
        )
        before = proxy.mapping()
        assert [before == proxy.mapping() for _ in range(3)] == [True] * 3
        spread = Counter(before.values())
        print(f"DNS slots, keys per server: {dict(sorted(spread.items()))}")
        assert set(spread) == {b.name for b in backends}, spread
        # 127.0.0.2 leaves the answer (its pod is gone or not ready).
        dns.addresses = ["127.0.0.1", "127.0.0.3"]
        deadline = time.monotonic() + 20
        while "dns-127.0.0.2" in proxy.mapping().values():
            assert time.monotonic() < deadline, proxy.status()
            time.sleep(0.2)
        after = proxy.mapping()
        for key, server in before.items():
            if server != "dns-127.0.0.2":
                assert after[key] == server, key  # the rest do not move
        # It comes back: the freed slot takes it, and its keys return.
        dns.addresses = addresses
        deadline = time.monotonic() + 20
        while proxy.mapping() != before:
            assert time.monotonic() < deadline, (proxy.status(), proxy.mapping())
            time.sleep(0.2)
        assert dns.queries > 0
    finally:
        if proxy is not None:
            proxy.close()
        dns.close()
        for backend in backends:
            backend.stop()


def test_a_call_without_the_header_still_succeeds(proxy: Proxy) -> None:
    servers = [proxy.who(None) for _ in range(9)]
    print(f"no header, 9 calls: {dict(sorted(Counter(servers).items()))}")
    assert set(servers) <= set(NAMES)
    assert len(set(servers)) >= 2  # round robin, not all on one server


def test_a_soft_stop_lets_calls_in_flight_finish(proxy: Proxy) -> None:
    """SIGUSR1 (the Kubernetes preStop hook): no new connections, the open call goes on, and
    HAProxy exits once it ends."""
    _, call = proxy.hold(KEYS[0])
    proxy.process.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    assert proxy.process.poll() is None  # still serving the open call
    with grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as fresh:
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(fresh).result(timeout=1)
    assert call.is_active()
    call.cancel()
    assert proxy.process.wait(10) == 0


def test_prometheus_metrics_are_served(proxy: Proxy) -> None:
    with urllib.request.urlopen(
        f"http://127.0.0.1:{proxy.metrics_port}/metrics", timeout=5
    ) as response:
        text = response.read().decode()
    assert 'haproxy_server_status{proxy="decoders",server="decoder1"' in text


def test_haproxy_is_gone_once_closed(backends: list[Backend], tmp_path: Path) -> None:
    proxy = Proxy(backends, tmp_path)
    pid = proxy.process.pid
    proxy.close()
    assert proxy.process.returncode is not None  # exited and reaped
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
