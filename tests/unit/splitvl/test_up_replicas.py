"""``splitvl up --replicas ... --store redis``: the port layout, what the gateway and the
caches are given, the refusal of unshared caches, and the local redis-server's life, on
real processes and a real redis-server (Debian's ``redis-server``, installed by
``make install``). tests/e2e/test_up_replicas.py runs ``up`` itself with two decoders
and two caches and reads each replica's own metrics: both decoders and both caches
answered calls, and a repeat that reached the cache which had not put its image was an
exact hit read from the shared redis-server.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import psutil
import pytest
import redis

from splitvl.cli import main
from splitvl.errors import LaunchConfigError, ServiceStartError
from splitvl.launcher import (
    Cluster,
    Ports,
    Supervisor,
    free_base,
    free_port,
)
from splitvl.private_file import write_private
from splitvl.redis_server import RedisServer
from splitvl.replicas import (
    STORE_SECRET_VARS,
    decoder_cores,
    layout_lines,
    parse_replicas,
    plan_store,
    replica_env,
    store_secret_env,
)

REPLICAS = {"decoder": 2, "cache": 2, "encoder": 2}


def test_replicas_take_ports_ten_apart_from_their_first_and_services_run_once_keep_theirs() -> None:
    ports = Ports.from_base(50051, 9401, 8000, REPLICAS)
    assert ports.grpc == {
        "gateway": 50051,
        "encoder-1": 50052,
        "encoder-2": 50062,
        "cache-1": 50053,
        "cache-2": 50063,
        "decoder-1": 50054,
        "decoder-2": 50064,
    }
    assert ports.metrics == {
        "gateway": 9401,
        "encoder-1": 9402,
        "encoder-2": 9412,
        "cache-1": 9403,
        "cache-2": 9413,
        "decoder-1": 9404,
        "decoder-2": 9414,
    }
    assert ports.http == 8000
    # Without --replicas: the four names and ports of before.
    assert (
        Ports.from_base(50051, 0, 0, {}).grpc
        == Ports.from_base(50051, 0).grpc
        == {
            "gateway": 50051,
            "encoder": 50052,
            "cache": 50053,
            "decoder": 50054,
        }
    )
    assert Ports.from_base(50051, 0, 0, {"decoder": 3}).grpc["decoder-3"] == 50074
    assert set(Ports.from_base(50051, 0, 0, {"decoder": 3}).metrics.values()) == {0}
    with pytest.raises(LaunchConfigError, match="decoder-3 would listen on port 65543, past"):
        Ports.from_base(65520, 0, 0, {"decoder": 3})


def test_the_gateway_gets_each_replicated_service_as_an_ipv4_address_list() -> None:
    cluster = Cluster(
        model="/nonexistent",
        ports=Ports.from_base(50051, 0, 0, {"decoder": 2, "cache": 2}),
        log_dir=Path("/nonexistent"),
    )
    command = cluster._command("gateway")
    flags = dict(zip(command[3::2], command[4::2], strict=False))
    assert flags["--encoder-address"] == "127.0.0.1:50052"
    assert flags["--cache-address"] == "ipv4:127.0.0.1:50053,127.0.0.1:50063"
    assert flags["--decoder-address"] == "ipv4:127.0.0.1:50054,127.0.0.1:50064"
    decoder2 = cluster._command("decoder-2")
    assert decoder2[1:3] == ["-m", "decoder_service"]
    assert decoder2[decoder2.index("--port") + 1] == "50064"


def test_gateway_replicas_share_the_base_and_http_ports_each_with_a_port_of_its_own() -> None:
    ports = Ports.from_base(50051, 9401, 8000, {"gateway": 2, "decoder": 2})
    assert ports.public == 50051 and ports.gateway_address() == "127.0.0.1:50051"
    assert {n: p for n, p in ports.grpc.items() if n.startswith("gateway")} == {
        "gateway-1": 50055,
        "gateway-2": 50065,
    }
    assert ports.metrics["gateway-1"] == 9401 and ports.metrics["gateway-2"] == 9411
    # The shared port is checked once, before the instances' own.
    assert ports.bindings()[:3] == [
        (50051, "the gateways' shared gRPC", "--base-port"),
        (50055, "gateway-1 gRPC", "--base-port"),
        (50065, "gateway-2 gRPC", "--base-port"),
    ]
    cluster = Cluster(model="/nonexistent", ports=ports, log_dir=Path("/nonexistent"))
    for name, own in (("gateway-1", "50055"), ("gateway-2", "50065")):
        command = cluster._command(name)
        flags = dict(zip(command[3::2], command[4::2], strict=False))
        assert flags["--port"] == "50051" and flags["--instance-port"] == own, command
        assert flags["--reuse-port"] == "true" and flags["--http-port"] == "8000", command
    # One gateway: its own port is the public one, bound without sharing.
    one = Ports.from_base(50051, 9401, 8000, {"decoder": 2})
    assert one.public == 0 and one.gateway_address() == "127.0.0.1:50051"
    command = Cluster(model="/x", ports=one, log_dir=Path("/x"))._command("gateway")
    assert "--instance-port" not in command and "--reuse-port" not in command
    free = Ports.free({"gateway": 2})
    assert free.public and free.public not in (*free.grpc.values(), *free.metrics.values())
    lines = layout_lines(ports, Path("/logs"))
    assert lines[2:4] == [
        "  gateway  all      50051  -        (shared, SO_REUSEPORT)",
        "  gateway  1        50055  9401     gateway-1.log",
    ]


def test_a_second_server_on_a_port_in_use_fails_unless_both_share_it() -> None:
    """grpc binds with SO_REUSEPORT by default, so a second server on a taken port would
    silently split its calls with the first; here only ``reuse_port`` shares a port."""
    import asyncio

    import grpc

    from vlcommon.errors import ConfigError
    from vlcommon.server import _bind
    from vlcommon.settings import ServerSettings, server_options

    async def bind_twice(share: bool) -> list[int | str]:
        settings = ServerSettings(reuse_port=share)
        out: list[int | str] = []
        servers = [grpc.aio.server(options=server_options(settings)) for _ in range(2)]
        try:
            port = _bind(servers[0], "127.0.0.1", 0, None)
            out.append(port)
            await servers[0].start()
            try:
                out.append(_bind(servers[1], "127.0.0.1", port, None))
            except ConfigError as err:
                out.append(str(err).split(":")[0] + ":" + str(err).split(":")[1])
        finally:
            for server in servers:
                await server.stop(0)
        return out

    shared = asyncio.run(bind_twice(True))
    assert shared[0] == shared[1]
    apart = asyncio.run(bind_twice(False))
    assert apart[1] == f"cannot listen on 127.0.0.1:{apart[0]}"


def test_a_shared_port_takes_calls_only_once_its_process_is_serving() -> None:
    """A gateway replica that is still starting must not join the shared port's group:
    the kernel would hand it new connections, and they would stay with it. Its own port
    answers its health probe (NOT_SERVING) meanwhile; the shared one refuses connections
    until it is SERVING, then both serve."""
    import asyncio

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from vlcommon.server import serve
    from vlcommon.settings import ServerSettings

    shared, own = free_port(), free_port()

    async def status(port: int) -> str:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                answer = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=2
                )
            except grpc.aio.AioRpcError as err:
                return err.code().name
            return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)

    async def main() -> list[tuple[str, str]]:
        loaded, stop = asyncio.Event(), asyncio.Event()
        settings = ServerSettings(port=shared, instance_port=own, reuse_port=True)
        task = asyncio.ensure_future(
            serve(
                service_name="test",
                service_full_names=[],
                settings=settings,
                register=lambda server: None,
                startup=loaded.wait,
                stop_event=stop,
            )
        )
        seen = []
        await asyncio.sleep(1.0)
        seen.append((await status(own), await status(shared)))
        loaded.set()
        for _ in range(50):
            if (await status(shared)) == "SERVING":
                break
            await asyncio.sleep(0.1)
        seen.append((await status(own), await status(shared)))
        stop.set()
        await task
        return seen

    assert asyncio.run(main()) == [("NOT_SERVING", "UNAVAILABLE"), ("SERVING", "SERVING")]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("vit=2", "'vit' is not a service that takes replicas (gateway, encoder, cache, decoder)"),
        ("decoder=2,decoder=3", "decoder is given twice"),
        ("decoder=0", "decoder=0: at least 1"),
        ("decoder=two", "decoder=two: not an integer"),
        ("decoder", "'decoder' is not SERVICE=COUNT"),
    ],
)
def test_replicas_flag_errors_name_what_is_wrong(text: str, error: str) -> None:
    assert parse_replicas(" decoder=2 , cache=2,encoder=1,gateway=3 ") == {
        "decoder": 2,
        "cache": 2,
        "encoder": 1,
        "gateway": 3,
    }
    with pytest.raises(argparse.ArgumentTypeError) as err:
        parse_replicas(text)
    assert str(err.value) == error


def test_two_caches_without_a_shared_store_are_refused_saying_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    why = (
        "--replicas cache=2 needs a shared store: with --store memory (the default) each "
        "cache replica keeps its own entries, so a repeat that reaches another replica "
        "misses and is encoded again; add --store redis (a local redis-server) or "
        "--store redis://HOST:PORT/DB"
    )
    for store in (None, "memory"):
        with pytest.raises(LaunchConfigError) as err:
            plan_store(store, {}, {"cache": 2}, tmp_path)
        assert str(err.value) == why
    # Through the command: exit status 2, one line, nothing started (no log folder).
    argv = ["up", "--replicas", "cache=2", "--base-port", str(free_base())]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--log-dir", str(tmp_path / "logs")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"splitvl up: error: {why}\n"
    assert not (tmp_path / "logs").exists()
    # A URL, here or in $CACHE_STORE, is shared: accepted, nothing to start.
    url = "redis://:pw@10.0.0.5:6379/0"
    assert plan_store(url, {}, {"cache": 2}, tmp_path) == (url, None)
    assert plan_store(None, {"CACHE_STORE": url}, {"cache": 2}, tmp_path) == (None, None)
    assert plan_store(None, {}, {"decoder": 2}, tmp_path) == (None, None)


def test_each_decoder_replica_gets_its_own_cores_where_the_host_has_them() -> None:
    assert decoder_cores([0], [0, 1], 2) == [[0], [1]]  # 2 cores: one each
    assert decoder_cores([0, 1, 2], [0, 1, 2, 3], 3) == [[0], [1], [2]]
    assert decoder_cores([0, 1, 2, 3, 4], range(8), 2) == [[0, 1, 2], [3, 4]]
    assert decoder_cores([0], [0, 1], 3) == [[0], [1], [0]]
    ports = Ports.from_base(50051, 0, 0, {"decoder": 2, "cache": 2})
    placement = {
        "decoder": {"VLLM_CPU_OMP_THREADS_BIND": "0"},
        "encoder": {"ENCODER_CPUS": "1", "ENCODER_NICE": "5"},
    }
    assert replica_env("decoder-2", ports, placement, None) == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert replica_env("encoder", ports, placement, "x") == placement["encoder"]
    assert replica_env("cache-2", ports, placement, "redis://:p@h:1/0") == {
        "CACHE_STORE": "redis://:p@h:1/0"
    }
    assert replica_env("cache-1", ports, {}, None) == {}
    # The gateway's TLS name for address lists (see the TLS test below); a user's wins.
    assert replica_env("gateway", ports, {}, None) == {
        "GATEWAY_CLIENT_TLS_SERVER_NAME": "127.0.0.1"
    }
    assert replica_env("gateway", ports, {}, None, {"SPLITVL_TLS_SERVER_NAME": "svc"}) == {}
    assert replica_env("gateway", Ports.from_base(50051, 0), {}, None) == {}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_a_shared_store_gets_a_generated_secret_file_unless_one_is_given(tmp_path: Path) -> None:
    url = "redis://:p@h:1/0"
    env = store_secret_env(url, {}, tmp_path)
    path = tmp_path / "store-secret"
    assert env == {"CACHE_STORE_SECRET_FILE": str(path)}
    secret = path.read_text().strip()
    assert len(secret) == 43 and path.stat().st_mode & 0o777 == 0o600  # 256 bits
    assert store_secret_env(None, {"CACHE_STORE": url}, tmp_path) == env
    assert path.read_text().strip() == secret  # kept: a restart reads the old entries
    for given in STORE_SECRET_VARS:
        assert store_secret_env(url, {given: "x"}, tmp_path) == {}, given
    # "false" or blank gives no secret: the file is still handed out.
    for value in ("false", "0", "  "):
        assert store_secret_env(url, {"CACHE_STORE_ALLOW_NO_SECRET": value}, tmp_path) == env
        assert store_secret_env(url, {"CACHE_STORE_SECRET": "  "}, tmp_path) == env
    # A FIFO or a folder at its name is refused at once, never waited on.
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "store-secret", 0o600)
    with pytest.raises(LaunchConfigError, match="regular file"):
        store_secret_env(url, {}, fifo)
    from cache_service.settings import CacheSettings
    from vlcommon.errors import ConfigError

    with pytest.raises(ConfigError, match="not a file"):
        CacheSettings(store_secret_file=str(fifo / "store-secret")).secret()
    (tmp_path / "folder" / "store-secret").mkdir(parents=True)
    with pytest.raises(LaunchConfigError, match="regular file"):
        store_secret_env(url, {}, tmp_path / "folder")
    assert store_secret_env("memory", {}, tmp_path / "m") == {}
    assert store_secret_env(None, {}, tmp_path / "m") == {}
    assert not (tmp_path / "m").exists()
    # A file others can read, or a symlink planted at its name, is refused, not used.
    other = tmp_path / "other"
    other.mkdir()
    (other / "store-secret").write_text("readable\n")
    (other / "store-secret").chmod(0o644)
    with pytest.raises(LaunchConfigError, match="chmod 600"):
        store_secret_env(url, {}, other)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "store-secret").symlink_to(other / "store-secret")
    with pytest.raises(LaunchConfigError, match="symlink"):
        store_secret_env(url, {}, linked)
    # Written files replace a symlink at their name instead of writing through it.
    (linked / "url").symlink_to(other / "target")
    write_private(linked / "url", "secret")
    assert not (other / "target").exists() and not (linked / "url").is_symlink()
    assert (linked / "url").stat().st_mode & 0o777 == 0o600


def assert_needs_password(port: int) -> None:
    """The server on ``port`` refuses PING without its password, and a wrong one."""
    with pytest.raises(redis.AuthenticationError, match="authenticated|Authentication required"):
        redis.Redis(port=port).ping()
    with pytest.raises(redis.AuthenticationError, match="invalid username-password"):
        redis.Redis(port=port, password="wrong").ping()


def test_the_local_redis_server_needs_its_password_and_leaves_nothing_when_stopped(
    tmp_path: Path,
) -> None:
    server = RedisServer.create(tmp_path / "redis", maxmemory="64mb", avoid=[50051])
    server.start()
    assert server.proc is not None
    pid = server.proc.pid
    try:
        assert server.client().ping() is True
        assert_needs_password(server.port)
        config = server.client(timeout_s=2).config_get("*")
        assert {k: config[k] for k in ("maxmemory", "maxmemory-policy", "bind", "save")} == {
            "maxmemory": str(64 * 2**20),
            "maxmemory-policy": "allkeys-lru",
            "bind": "127.0.0.1",
            "save": "",
        }
        assert config["appendonly"] == "no"
        # The password is in 0600 files, never on the command line (ps shows those).
        assert server.password not in " ".join(psutil.Process(pid).cmdline())
        for name in ("redis.conf", "url"):
            assert (tmp_path / "redis" / name).stat().st_mode & 0o777 == 0o600
        assert (tmp_path / "redis" / "url").read_text() == (
            f"redis://:{server.password}@127.0.0.1:{server.port}/0\n"
        )
        assert len(server.password) >= 40 and server.port != 50051
    finally:
        code = server.stop()
    assert code == 0  # SIGTERM: redis's own clean shutdown
    assert not _alive(pid) and _refused(server.port)
    assert "ready to accept connections" in (tmp_path / "redis" / "redis.log").read_text().lower()
    assert server.stop() is None  # idempotent


def test_the_redis_server_ends_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    """``up`` killed -9 runs no ``finally``: the server's parent-death signal ends it."""
    code = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from splitvl.redis_server import RedisServer
        server = RedisServer.create(Path({str(tmp_path / "redis")!r}))
        server.start()
        print(server.proc.pid, server.port, flush=True)
        time.sleep(60)
        """
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert launcher.stdout is not None
    pid, port = (int(x) for x in launcher.stdout.readline().split())
    assert _alive(pid)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid) and _refused(port)


class _EchoCluster(Cluster):
    """Each instance runs a stand-in that writes its real command line and the store it
    was given to its log, then sleeps (the decoder's instances exit 3 when asked to)."""

    failing: str = ""

    def _command(self, name: str) -> list[str]:
        code = (
            "import json, os, sys, time; "
            "e = os.environ; print(json.dumps({'argv': sys.argv[1:], 'store': e.get('CACHE_STORE'),"
            " 'client': {k: v for k, v in e.items() if k.startswith('GATEWAY_CLIENT_')}}),"
            " flush=True); "
            f"sys.exit(3) if {name == self.failing} else time.sleep(120)"
        )
        return [sys.executable, "-c", code, *super()._command(name)]


def _echo(cluster: Cluster, name: str) -> dict[str, object]:
    deadline = time.monotonic() + 20
    while not cluster.log_path(name).read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    return json.loads(cluster.log_path(name).read_text().splitlines()[0])


def _echo_cluster(
    tmp_path: Path, failing: str = "", env: dict[str, str] | None = None
) -> _EchoCluster:
    ports = Ports.free(REPLICAS)
    cache_store, server = plan_store(
        "redis",
        {},
        REPLICAS,
        tmp_path / "logs" / "redis",
        avoid=[p for p, _, _ in ports.bindings()],
    )
    cluster = _EchoCluster(
        model=str(tmp_path),
        ports=ports,
        log_dir=tmp_path / "logs",
        env=env or {},
        store_server=server,
    )
    cluster.failing = failing
    assert cache_store is None and server is not None
    return cluster


def test_every_replica_starts_with_its_ports_its_log_and_the_store_then_all_stop(
    tmp_path: Path,
) -> None:
    cluster = _echo_cluster(tmp_path)
    cluster.start()
    server = cluster.store_server
    assert server is not None and server.proc is not None
    redis_pid = server.proc.pid
    try:
        assert sorted(p.name for p in (tmp_path / "logs").glob("*.log")) == [
            "cache-1.log",
            "cache-2.log",
            "decoder-1.log",
            "decoder-2.log",
            "encoder-1.log",
            "encoder-2.log",
            "gateway.log",
        ]
        for name in cluster.instances():
            echo = _echo(cluster, name)
            argv = echo["argv"]
            assert isinstance(argv, list)
            assert argv[argv.index("--port") + 1] == str(cluster.ports.grpc[name])
            assert argv[argv.index("--metrics-port") + 1] == str(cluster.ports.metrics[name])
            assert echo["store"] == (server.url if name.startswith("cache") else None), name
        gateway = _echo(cluster, "gateway")["argv"]
        assert isinstance(gateway, list)
        caches = ",".join(cluster.ports.address(n) for n in ("cache-1", "cache-2"))
        assert gateway[gateway.index("--cache-address") + 1] == f"ipv4:{caches}"
        assert server.ping()
    finally:
        codes = cluster.stop()
    assert list(codes) == [
        "gateway",
        "decoder-1",
        "decoder-2",
        "encoder-1",
        "encoder-2",
        "cache-1",
        "cache-2",
        "redis",
    ]
    assert codes["redis"] == 0 and not _alive(redis_pid)


def test_a_replica_that_fails_to_start_stops_the_redis_server_too(tmp_path: Path) -> None:
    cluster = _echo_cluster(tmp_path, failing="decoder-2")
    with pytest.raises(ServiceStartError) as err:
        with cluster:
            pass
    assert err.value.summary.startswith("decoder-2 exited with code 3 while starting; see")
    assert cluster.store_server is not None and cluster.store_server.proc is None
    assert cluster.procs == {}
    log = (tmp_path / "logs" / "redis" / "redis.log").read_text()
    assert "ready to exit" in log.lower()  # stopped, not left behind


def test_supervision_restarts_a_dead_redis_server_on_its_port_with_its_password(
    tmp_path: Path,
) -> None:
    cluster = _echo_cluster(tmp_path)
    lines: list[str] = []
    cluster.start()
    try:
        server = cluster.store_server
        assert server is not None and server.proc is not None
        server.proc.kill()
        supervisor = Supervisor(cluster, say=lines.append, backoff_s=0.05)
        deadline = time.monotonic() + 20
        while not any("redis is SERVING again" in ln for ln in lines):
            assert time.monotonic() < deadline, lines
            assert supervisor.poll() is None
            time.sleep(0.05)
        assert supervisor.restarts == {"redis": 1}
        assert lines[0].startswith("splitvl: redis exited with code -9; restarting it in 0 s")
        assert server.ping()
    finally:
        cluster.stop()


def test_the_gateway_reaches_tls_replicas_through_their_address_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With SPLITVL_TLS_*, grpc checks an address list's certificate against the list
    itself, which no certificate names; the launcher gives the gateway the name one
    address would be checked against. Two real TLS servers on the cache replicas' ports,
    reached with the gateway's own settings as the launcher set them."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from gateway.settings import GatewaySettings
    from tests.unit.vlcommon.test_security import make_pki
    from vlcommon.tls import ClientSecurity, sync_channel

    pki = make_pki(tmp_path / "pki")
    env = {
        "SPLITVL_TLS_CA_FILE": str(pki.ca),
        "SPLITVL_TLS_CERT_FILE": str(pki.client_cert),
        "SPLITVL_TLS_KEY_FILE": str(pki.client_key),
    }
    cluster = _echo_cluster(tmp_path, env=env)
    cluster.start()
    try:
        client = _echo(cluster, "gateway")["client"]
    finally:
        cluster.stop()
    assert isinstance(client, dict)
    assert client["GATEWAY_CLIENT_TLS_SERVER_NAME"] == "127.0.0.1"
    creds = grpc.ssl_server_credentials(
        [(pki.server_key.read_bytes(), pki.server_cert.read_bytes())]
    )
    servers = []
    for name in ("cache-1", "cache-2"):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        server.add_secure_port(cluster.ports.address(name), creds)
        server.start()
        servers.append(server)
    try:
        for key in [k for k in os.environ if k.startswith("GATEWAY_")]:
            monkeypatch.delenv(key)
        results = {}
        for with_name in (True, False):
            for key, value in client.items():
                if with_name or key != "GATEWAY_CLIENT_TLS_SERVER_NAME":
                    monkeypatch.setenv(key, value)
                else:
                    monkeypatch.delenv(key, raising=False)
            security = ClientSecurity.from_settings(GatewaySettings())
            with sync_channel(cluster.ports.target("cache"), security) as channel:
                try:
                    stub = health_pb2_grpc.HealthStub(channel)
                    for _ in range(4):  # round robin: both replicas
                        stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    results[with_name] = "OK"
                except grpc.RpcError as err:
                    results[with_name] = err.code().name  # type: ignore[attr-defined]
    finally:
        for server in servers:
            server.stop(0)
    assert results == {True: "OK", False: "UNAVAILABLE"}  # the name is what makes it work


def test_the_layout_names_every_replica_its_ports_its_log_and_the_store(tmp_path: Path) -> None:
    ports = Ports.from_base(50051, 9401, 8000, {"decoder": 2, "cache": 2})
    server = RedisServer(tmp_path / "redis", 23456, "secret")
    lines = layout_lines(ports, tmp_path, None, server)
    assert lines == [
        f"layout (all on 127.0.0.1; logs in {tmp_path}):",
        "  service  replica  gRPC   metrics  log",
        "  gateway  1        50051  9401     gateway.log",
        "  encoder  1        50052  9402     encoder.log",
        "  cache    1        50053  9403     cache-1.log",
        "  cache    2        50063  9413     cache-2.log",
        "  decoder  1        50054  9404     decoder-1.log",
        "  decoder  2        50064  9414     decoder-2.log",
        "  redis    1        23456  -        redis/redis.log",
        "  gateway OpenAI-compatible HTTP: http://127.0.0.1:8000/v1",
        "  cache store: redis://:***@127.0.0.1:23456/0 (redis-server started here; its URL "
        f"with the password: {tmp_path / 'redis' / 'url'})",
    ]
    assert "secret" not in "\n".join(lines)
    url = layout_lines(ports, tmp_path, "redis://user:pw@10.0.0.5:6379/0")[-1]
    assert url == "  cache store: redis://user:***@10.0.0.5:6379/0"


# ---------------------------------------------------------------------------------------
# End to end: one `splitvl up --replicas decoder=2,cache=2,encoder=2 --store redis` (about
# 2 min on 2 cores: two vLLM engines start side by side), and a second gateway beside it.
