"""grpc's own retry policy on the internal channels (vlcommon.settings.retry_service_config).

Two real encoder processes behind one target (as a headless Service's DNS name resolves);
Encode calls run without pause while one replica is killed with SIGKILL: the calls that were
on it come back UNAVAILABLE from the transport, and grpc retries them on the other replica,
so no caller sees an error. The same load through a channel without the retry policy loses
calls, which is what makes the first half a test of the policy and not of luck.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from qwenvl.common.v1 import tensor_pb2
from qwenvl.encoder.v1 import encoder_service_pb2 as pb
from qwenvl.encoder.v1 import encoder_service_pb2_grpc as pb_grpc

from splitvl.launcher import free_ports
from tests.conftest import rgb
from vlcommon import tensors
from vlcommon.imaging import plan_resize
from vlcommon.model_info import load_vision_spec
from vlcommon.settings import IDEMPOTENT_METHODS, channel_options, retry_service_config


def test_the_policy_names_only_idempotent_methods() -> None:
    import json

    config = json.loads(retry_service_config())
    [method_config] = config["methodConfig"]
    names = {(n["service"], n["method"]) for n in method_config["name"]}
    assert names == {(s, m) for s, ms in IDEMPOTENT_METHODS.items() for m in ms}
    assert ("qwenvl.decoder.v1.DecoderService", "Generate") not in names
    assert ("qwenvl.cache.v1.CacheService", "Put") not in names
    # CANCELLED received: the replica cancelled the call as it stopped (our own cancel
    # is never retried by grpc).
    assert method_config["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE", "CANCELLED"]
    opts = dict(channel_options())
    # An Encode carries an image's pixels: over gRPC's 256 KiB default it would never retry.
    assert int(opts["grpc.per_rpc_retry_buffer_size"]) >= int(opts["grpc.max_send_message_length"])


def _encoder(model: Path, port: int, metrics: int, log: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "encoder_service", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--metrics-port", str(metrics), "--model", str(model)]
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))


def _wait_serving(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 180
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise AssertionError(f"encoder on {port} not SERVING: {log.read_text()[-2000:]}")


def _request(model: Path, i: int) -> pb.EncodeRequest:
    spec = load_vision_spec(model)
    image = rgb(("astronaut.png", "chelsea.png", "coffee.png")[i % 3])
    plan = plan_resize(image.height, image.width, spec, index=0)
    return pb.EncodeRequest(
        images=[
            pb.EncodeImage(
                key=f"retry-{i}",  # distinct keys: the encoder's de-duplication stays out
                pixels=tensors.from_numpy(np.asarray(image)),
                plan=tensor_pb2.ResizePlan(
                    resized_height=plan.resized_height,
                    resized_width=plan.resized_width,
                    grid=tensor_pb2.GridTHW(t=1, h=plan.grid_h, w=plan.grid_w),
                ),
            )
        ]
    )


async def _load_and_kill(
    target: str, options: list[tuple[str, Any]], model: Path, victim: subprocess.Popen[bytes]
) -> tuple[int, list[grpc.StatusCode]]:
    """16 callers Encode back to back; the victim is killed 1.5 s in; 2 s more of calls."""
    requests = [_request(model, i) for i in range(16)]
    ok, errors = 0, []
    stop = asyncio.Event()
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        await asyncio.wait_for(channel.channel_ready(), 30)

        async def caller(request: pb.EncodeRequest) -> None:
            nonlocal ok
            while not stop.is_set():
                try:
                    reply = await stub.Encode(request, timeout=30)
                    assert reply.embeddings[0].key == request.images[0].key
                    ok += 1
                except grpc.aio.AioRpcError as err:
                    errors.append(err.code())

        tasks = [asyncio.create_task(caller(r)) for r in requests]
        await asyncio.sleep(1.5)
        victim.send_signal(signal.SIGKILL)
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.gather(*tasks)
    return ok, errors


@pytest.mark.e2e
def test_an_encode_on_a_killed_replica_is_retried_on_the_other(
    tiny_model: Path, tmp_path: Path
) -> None:
    p = free_ports(6)
    procs = [_encoder(tiny_model, p[i], p[3 + i], tmp_path / f"encoder{i}.log") for i in range(3)]
    try:
        for i, proc in enumerate(procs):
            _wait_serving(p[i], proc, tmp_path / f"encoder{i}.log")
        with_policy = channel_options()
        ok, errors = asyncio.run(
            _load_and_kill(
                f"ipv4:127.0.0.1:{p[0]},127.0.0.1:{p[1]}", with_policy, tiny_model, procs[0]
            )
        )
        assert errors == [] and ok > 16, (ok, errors)

        # Control: replicas 1 and 2, the same load through a channel with retries off.
        without = [o for o in with_policy if o[0] != "grpc.service_config"]
        without = [o if o[0] != "grpc.enable_retries" else (o[0], 0) for o in without]
        ok, errors = asyncio.run(
            _load_and_kill(f"ipv4:127.0.0.1:{p[1]},127.0.0.1:{p[2]}", without, tiny_model, procs[2])
        )
        assert grpc.StatusCode.UNAVAILABLE in errors, (ok, errors)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


class _CountingEncoder(pb_grpc.EncoderServiceServicer):
    """Answers every Encode (empty) and counts them."""

    def __init__(self) -> None:
        self.calls = 0

    async def Encode(self, request: pb.EncodeRequest, context: Any) -> pb.EncodeResponse:  # noqa: N802
        self.calls += 1
        return pb.EncodeResponse()


async def _replica(status: int) -> tuple[grpc.aio.Server, int, _CountingEncoder, Any]:
    from grpc_health.v1 import health

    server = grpc.aio.server()
    servicer, checker = _CountingEncoder(), health.aio.HealthServicer()
    pb_grpc.add_EncoderServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    await checker.set("", status)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port, servicer, checker


async def test_round_robin_sends_nothing_to_a_replica_that_is_not_serving() -> None:
    """A replica that is up but NOT_SERVING (loading its model, draining) gets no call
    while another one serves, and gets its share again once it reports SERVING: the
    internal channels watch each replica's health (healthCheckConfig)."""
    loading = await _replica(health_pb2.HealthCheckResponse.NOT_SERVING)
    ready = await _replica(health_pb2.HealthCheckResponse.SERVING)
    target = f"ipv4:127.0.0.1:{loading[1]},127.0.0.1:{ready[1]}"
    try:
        async with grpc.aio.insecure_channel(target, options=channel_options()) as channel:
            stub = pb_grpc.EncoderServiceStub(channel)
            for _ in range(20):
                await stub.Encode(pb.EncodeRequest(), timeout=10, wait_for_ready=True)
            assert (loading[2].calls, ready[2].calls) == (0, 20)
            await loading[3].set("", health_pb2.HealthCheckResponse.SERVING)
            deadline = time.monotonic() + 10
            while loading[2].calls == 0 and time.monotonic() < deadline:
                await stub.Encode(pb.EncodeRequest(), timeout=10)
            assert loading[2].calls > 0  # back in the rotation once SERVING
    finally:
        for server in (loading[0], ready[0]):
            await server.stop(None)
