"""The cache is an optimisation: a gateway whose cache is down or hangs still serves.

An in-process gateway (the real ``GatewayServicer`` on a loopback server) talks to the
session cluster's real encoder and decoder, and to a cache that is either an address where
nothing listens or a real gRPC CacheService whose every call hangs. Each request must be
answered by encoding, with the same tokens as the cluster's own gateway with the cache
off, and the failure must be counted in ``splitvl_gateway_cache_failures_total{op}``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from prometheus_client import REGISTRY
from qwenvl.cache.v1 import cache_service_pb2 as cpb
from qwenvl.cache.v1 import cache_service_pb2_grpc as cpb_grpc
from qwenvl.common.v1 import generation_pb2
from qwenvl.decoder.v1 import decoder_service_pb2_grpc
from qwenvl.encoder.v1 import encoder_service_pb2_grpc
from qwenvl.gateway.v1 import gateway_service_pb2_grpc as gpb_grpc

from splitvl.client import build_request, consume, generate
from splitvl.launcher import free_port
from tests.conftest import in_process_server, photo

pytestmark = pytest.mark.e2e
CACHE_TIMEOUT_S = 0.5
HANG_S = 60.0
MAX_TOKENS = 8


class HangingCache(cpb_grpc.CacheServiceServicer):
    """A real CacheService that never answers in time (a stuck or overloaded cache)."""

    def __init__(self) -> None:
        self.calls = 0

    async def Lookup(self, request: cpb.LookupRequest, context: grpc.aio.ServicerContext):
        self.calls += 1
        await asyncio.sleep(HANG_S)
        return cpb.LookupResponse()

    async def Put(self, request: cpb.PutRequest, context: grpc.aio.ServicerContext):
        self.calls += 1
        await asyncio.sleep(HANG_S)
        return cpb.PutResponse()


@contextlib.asynccontextmanager
async def serve_on_free_port(servicer: HangingCache) -> AsyncIterator[int]:
    """``servicer`` behind the real server bootstrap on 127.0.0.1:0; yields the port."""
    from vlcommon.server import serve
    from vlcommon.settings import ServerSettings

    stop = asyncio.Event()
    started = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(
        serve(
            service_name="hanging-cache",
            service_full_names=["qwenvl.cache.v1.CacheService"],
            settings=ServerSettings(port=0, grace_s=1.0),
            stop_event=stop,
            on_started=started.set_result,
            register=lambda s: cpb_grpc.add_CacheServiceServicer_to_server(servicer, s),
        )
    )
    port = await started
    try:
        yield port
    finally:
        stop.set()
        await task


def failures(op: str) -> float:
    return REGISTRY.get_sample_value("splitvl_gateway_cache_failures_total", {"op": op}) or 0.0


@contextlib.asynccontextmanager
async def gateway_with_cache(cluster, tiny_model, cache_address: str) -> AsyncIterator[str]:
    """An in-process gateway using the cluster's encoder and decoder and ``cache_address``."""
    from gateway.__main__ import channel, forbidden_tokens
    from gateway.pipeline import Downstream, Pipeline
    from gateway.servicer import GatewayServicer
    from gateway.settings import GatewaySettings
    from vlcommon.model_info import load_vision_spec, model_revision

    settings = GatewaySettings(
        model=str(tiny_model), cache_address=cache_address, cache_timeout_s=CACHE_TIMEOUT_S
    )
    security = cluster.security()
    channels = [
        channel(cluster.ports.address("encoder"), security),
        channel(cluster.ports.address("decoder"), security),
        channel(cache_address, security),
    ]
    servicer = GatewayServicer(
        Pipeline(
            settings,
            load_vision_spec(tiny_model),
            model_revision(tiny_model),
            forbidden_tokens(tiny_model),
            Downstream(
                encoder=encoder_service_pb2_grpc.EncoderServiceStub(channels[0]),
                decoder=decoder_service_pb2_grpc.DecoderServiceStub(channels[1]),
                cache=cpb_grpc.CacheServiceStub(channels[2]),
            ),
        )
    )
    try:
        async with in_process_server(
            gpb_grpc.add_GatewayServiceServicer_to_server,
            servicer,
            "qwenvl.gateway.v1.GatewayService",
        ) as ch:
            yield ch  # type: ignore[misc]
    finally:
        for c in channels:
            await c.close()


async def ask(gateway_channel, image: bytes):
    request = build_request([image], "Describe this image.", max_tokens=MAX_TOKENS, ignore_eos=True)
    stub = gpb_grpc.GatewayServiceStub(gateway_channel)
    chunks = [c async for c in stub.Generate(request, timeout=120)]
    return consume(iter(chunks))


async def until(predicate, timeout_s: float = 20.0) -> bool:
    for _ in range(int(timeout_s / 0.1)):
        if predicate():
            return True
        await asyncio.sleep(0.1)
    return predicate()


@pytest.fixture(scope="module")
def reference(cluster):
    """Tokens for the image through the cluster's own gateway with the cache off."""
    request = build_request(
        [photo("coffee.png")],
        "Describe this image.",
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        cache_policy=generation_pb2.CACHE_POLICY_OFF,
    )
    return generate(cluster.ports.address("gateway"), request, timeout_s=120)


async def test_cache_address_where_nothing_listens_still_serves(
    cluster, tiny_model, reference
) -> None:
    dead = f"127.0.0.1:{free_port()}"
    lookups, puts = failures("lookup"), failures("put")
    async with gateway_with_cache(cluster, tiny_model, dead) as gw:
        result = await ask(gw, photo("coffee.png"))
        assert await until(lambda: failures("put") == puts + 1)
    assert result.token_ids == reference.token_ids and len(result.token_ids) == MAX_TOKENS
    assert [im["tier"] for im in result.images] == ["miss"]
    assert failures("lookup") == lookups + 1


async def test_hanging_cache_still_serves_within_its_deadline(
    cluster, tiny_model, reference
) -> None:
    hanging = HangingCache()
    lookups, puts = failures("lookup"), failures("put")
    async with serve_on_free_port(hanging) as port:
        async with gateway_with_cache(cluster, tiny_model, f"127.0.0.1:{port}") as gw:
            result = await asyncio.wait_for(ask(gw, photo("coffee.png")), timeout=HANG_S / 2)
            assert await until(lambda: failures("put") == puts + 1)
    assert hanging.calls == 2  # the lookup and the put both reached it, and both timed out
    assert result.token_ids == reference.token_ids
    assert [im["tier"] for im in result.images] == ["miss"]
    assert failures("lookup") == lookups + 1
    # The lookup gave up at the cache deadline, not at the hanging server's pace (generous
    # bound: the machine is shared and slow).
    assert result.timings["lookup_ms"] < CACHE_TIMEOUT_S * 1000 + 5000
