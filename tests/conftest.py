"""Shared fixtures: the tiny checkpoint, the four services as subprocesses, an OTLP receiver."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from PIL import Image

# The shared input cases (not in this repository): ../shared/cases beside it, as CI lays
# it out, or wherever SPLITVL_CASES_DIR points.
CASES = Path(
    os.environ.get("SPLITVL_CASES_DIR") or Path(__file__).resolve().parents[2] / "shared" / "cases"
)
LONG_STREAM_TOKENS = 30000
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def case_file(name: str) -> Path:
    path = CASES / name
    if not path.exists():
        pytest.fail(
            f"case file {path} is missing: ../shared/cases must sit beside the repository, "
            "or SPLITVL_CASES_DIR name the folder"
        )
    return path


def photo(name: str) -> bytes:
    import skimage

    return (Path(skimage.__file__).parent / "data" / name).read_bytes()


def rgb(name: str) -> Image.Image:
    return Image.open(io.BytesIO(photo(name))).convert("RGB")


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@contextlib.asynccontextmanager
async def in_process_server(
    add_to_server: Any,
    servicer: Any,
    service_full_name: str,
    settings: Any = None,
    on_port: Any = None,
) -> AsyncIterator[grpc.aio.Channel]:
    """Serve ``servicer`` on 127.0.0.1:0 through the real bootstrap; yield a channel to it.

    ``settings``: a ServerSettings (port 0) to serve with instead of the defaults, which
    are the service's but for no grace: the test's calls are over (or meant to be cut)
    when it stops the server, and the drain's notice to health watchers (0.5 s) was most
    of many unit tests' time. A test of the drain passes its own settings.
    ``on_port``: called with the bound port before the channel opens.
    """
    from vlcommon.server import serve
    from vlcommon.settings import ServerSettings

    stop = asyncio.Event()
    started = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(
        serve(
            service_name="test",
            service_full_names=[service_full_name],
            settings=settings or ServerSettings(port=0, grace_s=0.0),
            stop_event=stop,
            on_started=started.set_result,
            register=lambda s: add_to_server(servicer, s),
        )
    )
    port = await started
    if on_port is not None:
        on_port(port)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        stop.set()
        await task


# Fixtures that start services as subprocesses: a test using one is an e2e test, whatever
# its module says, so `make test-fast` (-m "not e2e") never starts a service.
SERVICE_FIXTURES = {
    "cluster",
    "faulty_cluster",
    "soak_cluster",
    "drain_cluster",
    "slow_encoder_gateway",
    "qwen_budget_cluster",
    "up",
    "wide_cluster",
    "grpc_gateway",
    "replicated",
}
# Modules whose tests start services without one of those fixtures.
SERVICE_MODULES = {"test_c12_exporter", "test_multihost"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & SERVICE_FIXTURES or item.module.__name__.rsplit(".", 1)[-1] in (  # type: ignore[attr-defined]
            SERVICE_MODULES
        ):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(autouse=True)
def _unfreeze_gc() -> Iterator[None]:
    """serve() freezes the heap once its service is up (``gc_freeze``); in-process tests
    run it in this process, so every test hands the frozen objects back to the collector."""
    yield
    import gc

    gc.unfreeze()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint, built once per session with the fixed seed."""
    from splitvl.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with the Thinking chat template (``make-tiny-model --like
    thinking``), built once per session."""
    from splitvl.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("thinking") / "model", like="thinking")


class OtlpReceiver:
    """An in-process OTLP/gRPC trace receiver (opentelemetry-proto's TraceService),
    listening on ``host`` (another network namespace reaches it on a bridge address)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        receiver = self
        self.spans: list[dict[str, object]] = []
        self.lock = threading.Lock()

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # type: ignore[no-untyped-def]
                with receiver.lock:
                    for rs in request.resource_spans:
                        attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            for span in ss.spans:
                                receiver.spans.append(
                                    {
                                        "service": attrs.get("service.name", ""),
                                        "name": span.name,
                                        "trace_id": span.trace_id.hex(),
                                        "span_id": span.span_id.hex(),
                                        "parent": span.parent_span_id.hex(),
                                        "attributes": {a.key: a.value for a in span.attributes},
                                        "start_ns": span.start_time_unix_nano,
                                        "end_ns": span.end_time_unix_nano,
                                        "links": [
                                            (link.trace_id.hex(), link.span_id.hex())
                                            for link in span.links
                                        ],
                                        "events": [(e.name, e.time_unix_nano) for e in span.events],
                                        "event_attributes": [
                                            (e.name, {a.key: a.value for a in e.attributes})
                                            for e in span.events
                                        ],
                                    }
                                )
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.host = host
        self.port = self.server.add_insecure_port(f"{host}:0")
        self.server.start()

    def snapshot(self) -> list[dict[str, object]]:
        with self.lock:
            return list(self.spans)

    def env(self) -> dict[str, str]:
        """What a service needs to export its spans here, within 0.2 s of ending them."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{self.host}:{self.port}",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }

    def stop(self) -> None:
        self.server.stop(0)


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def cluster(
    tiny_model: Path, otlp_receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[object]:
    """The four services on free loopback ports, exporting spans to the receiver."""
    from splitvl.launcher import Cluster, Ports

    c = Cluster(
        model=str(tiny_model),
        ports=Ports.free(),
        log_dir=tmp_path_factory.mktemp("logs"),
        env={
            **otlp_receiver.env(),
            # Room for a stream long enough that a cancel always lands mid-generation (the
            # tiny model decodes thousands of tokens in seconds): see the C09 test.
            "GATEWAY_MAX_TOKENS_LIMIT": str(LONG_STREAM_TOKENS),
            "DECODER_MAX_TOKENS_LIMIT": str(LONG_STREAM_TOKENS),
        },
        decoder_args=["--max-model-len", "32768", "--max-num-batched-tokens", "2048"],
    )
    with c:
        yield c


@contextlib.contextmanager
def extra_service(
    cluster: Any, name: str, env: dict[str, str], log_dir: Path, **addresses: str
) -> Iterator[Any]:
    """One more ``name`` service (gateway or cache) beside the session cluster, on free
    ports, with ``env`` added; a gateway's ``encoder``/``cache``/``decoder`` addresses
    default to the cluster's. Yields ``ports`` that answer like a cluster's for this
    service (``address(name)``, ``metrics[name]``)."""
    import dataclasses
    import subprocess
    import time

    from splitvl.launcher import free_ports, health_status

    grpc_port, metrics_port = free_ports(2)
    command = cluster._command(name)
    for flag, value in (("--port", grpc_port), ("--metrics-port", metrics_port)):
        command[command.index(flag) + 1] = str(value)
    if "--http-port" in command:
        http = command.index("--http-port")
        del command[http : http + 2]  # no OpenAI front on this one
    for hop, address in addresses.items():
        command[command.index(f"--{hop}-address") + 1] = address
    log = (log_dir / f"{name}.log").open("wb")
    proc = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**cluster._env(), **env, "OTEL_SERVICE_NAME": f"extra-{name}"},
    )
    ports = dataclasses.replace(
        cluster.ports,
        grpc={**cluster.ports.grpc, name: grpc_port},
        metrics={**cluster.ports.metrics, name: metrics_port},
        http=0,
    )
    try:
        deadline = time.monotonic() + 180
        while health_status(ports.address(name)) != "SERVING":
            assert proc.poll() is None, f"the extra {name} exited: see {log.name}"
            assert time.monotonic() < deadline, f"the extra {name} did not start in 180 s"
            time.sleep(0.5)
        yield ports
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="session")
def grpc_gateway(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A second gateway over the session cluster's encoder, cache and decoder, with
    ``GATEWAY_EMBEDDING_TRANSPORT=grpc`` (the cluster's own, like ``splitvl up``, uses shm):
    the same requests then hand embeddings over by the other transport. Its ``ports``
    answer like a cluster's (``address("gateway")``, ``metrics["gateway"]``)."""
    import types

    env = {"GATEWAY_EMBEDDING_TRANSPORT": "grpc"}
    with extra_service(cluster, "gateway", env, tmp_path_factory.mktemp("grpc-gw")) as ports:
        yield types.SimpleNamespace(ports=ports)


# Where the time goes, by file (tests/suite_times.py): printed at the end of every run.
_FILE_TIMES = None


def pytest_configure(config: pytest.Config) -> None:
    global _FILE_TIMES
    from tests.suite_times import FileTimes

    _FILE_TIMES = FileTimes()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _FILE_TIMES is not None:
        _FILE_TIMES.add(report.nodeid, report.when, report.duration, report.keywords)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if _FILE_TIMES is None or not _FILE_TIMES.seconds:
        return
    for line in _FILE_TIMES.summary():
        terminalreporter.write_line(line)
    # Only whole files' times are kept: a -k, -m or --lf run, or an interrupted one,
    # would replace a file's time with a part of it.
    opt = config.option
    partial = opt.keyword or opt.markexpr or getattr(opt, "lf", False)
    if not partial and exitstatus != pytest.ExitCode.INTERRUPTED:
        _FILE_TIMES.write()
