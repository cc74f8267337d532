"""The shared server interceptors through the real bootstrap (``vlcommon.server.serve`` on
127.0.0.1:0): a service still loading answers UNAVAILABLE naming itself at once, and a
handler's ServiceError becomes its status, in unary and streaming handlers alike."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.test_metrics import bytes_service
from vlcommon.errors import error_info, invalid_argument
from vlcommon.server import serve
from vlcommon.settings import ServerSettings


async def test_a_service_still_starting_refuses_calls_with_unavailable_then_serves() -> None:
    loaded = asyncio.Event()
    calls: list[bytes] = []

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        calls.append(request)
        return request

    async def tokens(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        yield request

    stop = asyncio.Event()
    started = asyncio.get_running_loop().create_future()
    add = bytes_service("t.v1.SlowService", {"Echo": echo}, {"Tokens": tokens})
    task = asyncio.ensure_future(
        serve(
            service_name="decoder",
            service_full_names=["t.v1.SlowService"],
            settings=ServerSettings(port=0, gc_freeze=False),
            register=lambda server: add(None, server),
            startup=loaded.wait,  # the engine "loads" until the test says so
            stop_event=stop,
            on_started=started.set_result,
        )
    )
    port = await started
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for call in (
                channel.unary_unary("/t.v1.SlowService/Echo")(b"x", timeout=5),
                _first(channel.unary_stream("/t.v1.SlowService/Tokens")(b"x", timeout=5)),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert err.value.details() == (
                    "decoder is starting (its engine is loading); retry shortly"
                )
                info = error_info(err.value)
                assert info is not None and info.reason == "SERVICE_STARTING"
                assert info.metadata["service"] == "decoder"
            assert calls == []  # the handler never ran
            health = health_pb2_grpc.HealthStub(channel)
            status = (await health.Check(health_pb2.HealthCheckRequest())).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            loaded.set()
            for _ in range(100):
                status = (await health.Check(health_pb2.HealthCheckRequest())).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.05)
            assert await channel.unary_unary("/t.v1.SlowService/Echo")(b"y", timeout=5) == b"y"
            assert calls == [b"y"]
    finally:
        stop.set()
        await task


async def _first(call):  # type: ignore[no-untyped-def]
    async for item in call:
        return item


async def test_a_service_error_raised_in_a_stream_after_a_message_is_its_status() -> None:
    """No try/except in the handler: the error interceptor maps it, after the first message."""
    from tests.conftest import in_process_server

    async def tokens(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        yield b"first"
        raise invalid_argument("TOO_LONG", "prompt is too long; the limit is 8", field="prompt")

    add = bytes_service("t.v1.StreamService", {}, {"Tokens": tokens})
    async with in_process_server(add, None, "t.v1.StreamService") as channel:
        call = channel.unary_stream("/t.v1.StreamService/Tokens")(b"x", timeout=5)
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for item in call:
                got.append(item)
    assert got == [b"first"]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "prompt is too long; the limit is 8"
    info = error_info(err.value)
    assert info is not None and info.reason == "TOO_LONG" and info.metadata["field"] == "prompt"
