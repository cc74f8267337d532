"""Service-to-service channels: calls are spread over every address a target resolves to."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from vlcommon.settings import ServerSettings, channel_options, server_options


class _Count(grpc.aio.ServerInterceptor):
    """Counts the Check calls a server gets, and the health Watch streams opened on it (the
    channel's client-side health checking opens one per connection)."""

    def __init__(self) -> None:
        self.calls = 0
        self.watches = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        if handler_call_details.method.endswith("/Check"):
            self.calls += 1
        elif handler_call_details.method.endswith("/Watch"):
            self.watches += 1
        return await continuation(handler_call_details)


async def _server() -> tuple[grpc.aio.Server, int, _Count]:
    count = _Count()
    server = grpc.aio.server(interceptors=[count], options=server_options(ServerSettings()))
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port, count


async def test_round_robin_spreads_calls_over_every_resolved_address() -> None:
    """A target naming two replicas (as a headless Service's DNS name does) gets calls on both;
    with gRPC's default pick_first every call would land on the first."""
    (s1, p1, c1), (s2, p2, c2) = await _server(), await _server()
    try:
        target = f"ipv4:127.0.0.1:{p1},127.0.0.1:{p2}"
        async with grpc.aio.insecure_channel(target, options=channel_options()) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await channel.channel_ready()
            for _ in range(20):
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert c1.calls + c2.calls == 20
        assert c1.calls >= 5 and c2.calls >= 5, (c1.calls, c2.calls)
        # healthCheckConfig: each replica's health is watched, so one loading or draining
        # (NOT_SERVING) gets no new calls.
        assert c1.watches >= 1 and c2.watches >= 1, (c1.watches, c2.watches)
    finally:
        await s1.stop(0)
        await s2.stop(0)


def test_server_options_bound_connection_age() -> None:
    opts = dict(server_options(ServerSettings(max_connection_age_s=30)))
    assert opts["grpc.max_connection_age_ms"] == 30_000
    assert opts["grpc.max_connection_age_grace_ms"] == 600_000
    assert "grpc.max_connection_age_ms" not in dict(
        server_options(ServerSettings(max_connection_age_s=0))
    )
