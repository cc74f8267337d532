"""Graceful drain on SIGTERM, and the gateway's limit on concurrent streams, on a cluster
of this module's own (the session cluster is left alone: these tests stop services).

Drain: SIGTERM -> health NOT_SERVING -> new RPCs refused -> in-flight streams finish with
all their tokens -> the process exits 0 as soon as they are done (well inside its grace
period, which it used to wait out in full).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from qwenvl.decoder.v1 import decoder_service_pb2, decoder_service_pb2_grpc
from qwenvl.gateway.v1 import gateway_service_pb2_grpc

from splitvl.client import build_request
from splitvl.launcher import Cluster, Ports, health_status
from tests.conftest import photo
from vlcommon.errors import error_info, retry_info

GRACE_S = 120.0
STREAM_TOKENS = 4000  # seconds of decoding on a CPU: SIGTERM lands mid-stream


async def test_drain_ends_when_streams_end_not_at_the_grace_period() -> None:
    """In process, through the real bootstrap (cache service): with a health ``Watch``
    open (as a load balancer keeps one), stopping turns it NOT_SERVING first and returns
    at once instead of waiting out the grace period (``server.stop(grace)`` alone waited
    the whole 60 s here)."""

    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from qwenvl.cache.v1 import cache_service_pb2_grpc

    from cache_service.__main__ import build_servicer
    from cache_service.settings import CacheSettings
    from tests.unit.vlcommon.test_security import CACHE
    from vlcommon.server import serve

    grace = 60.0
    settings = CacheSettings(port=0, grace_s=grace)
    servicer = build_servicer(settings)
    stop = asyncio.Event()
    started = asyncio.get_running_loop().create_future()
    server = asyncio.ensure_future(
        serve(
            service_name="cache",
            service_full_names=[CACHE],
            settings=settings,
            register=lambda s: cache_service_pb2_grpc.add_CacheServiceServicer_to_server(
                servicer, s
            ),
            stop_event=stop,
            on_started=started.set_result,
        )
    )
    port = await started
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        t0 = time.monotonic()
        stop.set()
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        await asyncio.wait_for(server, grace)
        elapsed = time.monotonic() - t0
    assert elapsed < grace / 4, elapsed


async def test_drain_waits_for_an_rpc_whose_handler_started_after_the_count_was_idle() -> None:
    """An RPC the server accepted just before ``stop()`` is counted only once its handler
    starts. Drain used to cancel it after the Watch notice (its caller got a bare
    CANCELLED: ``splitvl faults``, a rolling restart); it now waits for it too."""
    from grpc_health.v1 import health

    from vlcommon.admission import AdmissionInterceptor
    from vlcommon.server import WATCH_NOTICE_S, drain

    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    server.add_insecure_port("127.0.0.1:0")
    await server.start()
    admission = AdmissionInterceptor(max_in_flight=8, retry_after_ms=100)
    late_s = 0.8  # the handler ends this long after it starts

    async def late_handler() -> None:
        await asyncio.sleep(WATCH_NOTICE_S / 2)  # the count was idle: drain is settling
        admission.try_acquire()
        await asyncio.sleep(late_s)
        admission.release()

    t0 = time.monotonic()
    late = asyncio.ensure_future(late_handler())
    await asyncio.wait_for(drain(server, servicer, admission, grace_s=30.0), 30)
    elapsed = time.monotonic() - t0
    assert late.done()  # the server stopped only once the late handler had finished
    assert WATCH_NOTICE_S / 2 + late_s <= elapsed < 5, elapsed


async def test_serving_begins_with_the_startup_heap_frozen() -> None:
    """Once its engine is up, a service freezes the heap it started with (``gc_freeze``,
    on by default), so a full garbage collection, which stalls every stream, walks only
    what serving allocated (210 ms per collection in the gateway before, 1 ms after);
    ``gc_freeze=False`` leaves it alone."""
    import gc

    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from qwenvl.cache.v1 import cache_service_pb2_grpc

    from cache_service.__main__ import build_servicer
    from cache_service.settings import CacheSettings
    from tests.conftest import in_process_server
    from tests.unit.vlcommon.test_security import CACHE

    async def frozen_when_serving(settings: CacheSettings) -> tuple[int, int]:
        gc.unfreeze()
        assert gc.get_freeze_count() == 0
        async with in_process_server(
            cache_service_pb2_grpc.add_CacheServiceServicer_to_server,
            build_servicer(settings),
            CACHE,
            settings,
        ) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(100):
                status = (await health.Check(health_pb2.HealthCheckRequest())).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.05)
            assert status == health_pb2.HealthCheckResponse.SERVING
            return gc.get_freeze_count(), len(gc.get_objects(generation=2))

    frozen, oldest = await frozen_when_serving(CacheSettings(port=0))
    # This process has imported torch, grpc and the services: far more than serving adds.
    assert frozen > 50_000, frozen
    assert oldest < frozen / 10, (oldest, frozen)
    frozen, oldest = await frozen_when_serving(CacheSettings(port=0, gc_freeze=False))
    assert frozen == 0
    assert oldest > 50_000, oldest


@pytest.fixture(scope="module")
def drain_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(
        model=str(tiny_model),
        ports=Ports.free(),
        log_dir=tmp_path_factory.mktemp("drain-logs"),
        env={
            "GATEWAY_MAX_CONCURRENT_RPCS": "1",
            "GATEWAY_RETRY_AFTER_MS": "500",
            "GATEWAY_GRACE_S": str(GRACE_S),
            "DECODER_GRACE_S": str(GRACE_S),
            "GATEWAY_MAX_TOKENS_LIMIT": str(STREAM_TOKENS),
            "DECODER_MAX_TOKENS_LIMIT": str(STREAM_TOKENS),
        },
        decoder_args=["--max-model-len", "32768", "--max-num-batched-tokens", "2048"],
    )
    with cluster:
        yield cluster


def _stream(cluster: Cluster, max_tokens: int):  # type: ignore[no-untyped-def]
    channel = grpc.insecure_channel(cluster.ports.address("gateway"))
    stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
    request = build_request(
        [photo("chelsea.png")], "Describe.", max_tokens=max_tokens, ignore_eos=True
    )
    return channel, stub.Generate(request, timeout=300)


@pytest.mark.e2e
def test_gateway_refuses_a_stream_over_its_limit_with_a_retry_hint(drain_cluster: Cluster) -> None:
    channel, first = _stream(drain_cluster, 3000)
    with channel:
        head = next(first)  # the stream holds the gateway's only slot from here
        assert len(head.token_ids) >= 1
        _, second = _stream(drain_cluster, 4)
        with pytest.raises(grpc.RpcError) as err:
            list(second)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        info = error_info(err.value)
        assert info is not None and info.reason == "TOO_MANY_REQUESTS"
        assert info.metadata["limit"] == "1"
        retry = retry_info(err.value)
        assert isinstance(retry, error_details_pb2.RetryInfo)
        assert retry.retry_delay.ToMilliseconds() == 500
        # The admitted stream still finishes with every token.
        tokens = len(head.token_ids) + sum(len(c.token_ids) for c in first)
        assert tokens == 3000
    # And the slot is free again.
    channel, third = _stream(drain_cluster, 4)
    with channel:
        assert sum(len(c.token_ids) for c in third) == 4


@pytest.mark.e2e
def test_sigterm_drains_the_gateway_stream_then_exits(drain_cluster: Cluster) -> None:
    gateway = drain_cluster.procs["gateway"]
    channel, stream = _stream(drain_cluster, STREAM_TOKENS)
    with channel:
        chunks = [next(stream)]
        before = sum(len(c.token_ids) for c in chunks)
        assert before < STREAM_TOKENS
        t_signal = time.monotonic()
        gateway.send_signal(signal.SIGTERM)
        # Health first: NOT_SERVING (or no longer reachable once the listener closed).
        deadline = time.monotonic() + 30
        while health_status(drain_cluster.ports.address("gateway")) == "SERVING":
            assert time.monotonic() < deadline, "the gateway still says SERVING after SIGTERM"
            time.sleep(0.1)
        # A new call is refused while the old stream goes on.
        new_channel, new_call = _stream(drain_cluster, 4)
        with new_channel, pytest.raises(grpc.RpcError) as refused:
            list(new_call)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        for chunk in stream:
            chunks.append(chunk)
        t_done = time.monotonic()
    tokens = sum(len(c.token_ids) for c in chunks)
    assert tokens == STREAM_TOKENS  # every token of the in-flight stream arrived
    assert chunks[-1].usage.completion_tokens == STREAM_TOKENS
    assert len(chunks) > 2  # the stream really was still running when SIGTERM landed
    code = gateway.wait(timeout=GRACE_S)
    t_exit = time.monotonic()
    assert code == 0
    # It exits once its streams are done, not at the end of its 120 s grace period.
    assert t_exit - t_done < 30, (t_exit - t_done, t_done - t_signal)


@pytest.mark.e2e
def test_sigterm_drains_the_decoder_stream_then_exits(drain_cluster: Cluster) -> None:
    decoder = drain_cluster.procs["decoder"]
    request = decoder_service_pb2.GenerateRequest(request_id="drain")
    request.messages.add(role="user").parts.add(text="Count.")
    request.sampling.max_tokens = STREAM_TOKENS
    request.sampling.ignore_eos = True
    with grpc.insecure_channel(drain_cluster.ports.address("decoder")) as channel:
        stub = decoder_service_pb2_grpc.DecoderServiceStub(channel)
        stream = stub.Generate(request, timeout=300)
        chunks = [next(stream)]
        decoder.send_signal(signal.SIGTERM)
        for chunk in stream:
            chunks.append(chunk)
        t_done = time.monotonic()
    assert sum(len(c.token_ids) for c in chunks) == STREAM_TOKENS
    assert len(chunks) > 2
    code = decoder.wait(timeout=GRACE_S)
    assert code == 0
    assert time.monotonic() - t_done < 45
