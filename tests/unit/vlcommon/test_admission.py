"""Admission control: a service past its concurrency limit answers RESOURCE_EXHAUSTED at
once with a retry hint (google.rpc.RetryInfo + ``retry-after-ms``), health stays open,
and the admitted calls still finish.

The encoder runs in process through the real bootstrap on the tiny checkpoint, with a
batch wait window long enough that admitted calls are still in flight when the others
arrive (a real setting, ``ENCODER_MAX_WAIT_MS``). The gateway's streaming limit is
checked end to end in tests/e2e/test_drain.py (it needs vLLM).
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from qwenvl.common.v1 import tensor_pb2
from qwenvl.encoder.v1 import encoder_service_pb2 as pb
from qwenvl.encoder.v1 import encoder_service_pb2_grpc as pb_grpc

from encoder_service.batcher import Batcher
from encoder_service.engine import VisionEngine
from encoder_service.servicer import EncoderServicer
from tests.conftest import in_process_server, rgb
from vlcommon import tensors
from vlcommon.errors import (
    ServiceError,
    error_info,
    resource_exhausted,
    retry_info,
    to_status,
)
from vlcommon.imaging import plan_resize
from vlcommon.relay import from_rpc_error
from vlcommon.settings import ServerSettings

LIMIT = 2
RETRY_MS = 750
PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "camera.png", "logo.png")


@pytest.fixture(scope="module")
def engine(tiny_model) -> VisionEngine:
    return VisionEngine.load(str(tiny_model), device="cpu")


def _image(name: str, engine: VisionEngine) -> pb.EncodeImage:
    image = rgb(name)
    plan = plan_resize(image.height, image.width, engine.spec, index=0)
    return pb.EncodeImage(
        key=name,
        pixels=tensors.from_numpy(np.asarray(image)),
        plan=tensor_pb2.ResizePlan(
            resized_height=plan.resized_height,
            resized_width=plan.resized_width,
            grid=tensor_pb2.GridTHW(t=1, h=plan.grid_h, w=plan.grid_w),
        ),
    )


def test_retry_hint_travels_in_the_status_and_survives_a_hop() -> None:
    err = resource_exhausted(
        "ENCODER_QUEUE_FULL", "queue full", field="images", limit=8, retry_after_ms=1250
    )
    status = to_status(err)
    assert ("retry-after-ms", "1250") in status.trailing_metadata
    # Without a hint, no RetryInfo and no retry-after-ms.
    plain = to_status(resource_exhausted("X", "m", field="f", limit=1))
    assert all(k != "retry-after-ms" for k, _ in plain.trailing_metadata)
    assert isinstance(err, ServiceError) and err.retry_after_ms == 1250


async def test_over_the_limit_is_refused_at_once_with_retry_info(engine) -> None:
    # The first image of a batch waits up to 4 s for company: the admitted calls stay in
    # flight while the others arrive.
    batcher = Batcher(
        engine.encode, max_batch_images=8, max_batch_patches=16384, max_wait_ms=4000, max_queue=64
    )
    batcher.start()
    servicer = EncoderServicer(
        engine, batcher, max_images_per_request=4, max_patches_per_image=4096
    )
    settings = ServerSettings(port=0, max_concurrent_rpcs=LIMIT, retry_after_ms=RETRY_MS)
    finished: list[str] = []
    try:
        async with in_process_server(
            pb_grpc.add_EncoderServiceServicer_to_server,
            servicer,
            "qwenvl.encoder.v1.EncoderService",
            settings=settings,
        ) as channel:
            stub = pb_grpc.EncoderServiceStub(channel)

            async def encode(name: str) -> pb.EncodeResponse | grpc.aio.AioRpcError:
                try:
                    response = await stub.Encode(
                        pb.EncodeRequest(images=[_image(name, engine)]), timeout=120
                    )
                    finished.append("ok")
                    return response
                except grpc.aio.AioRpcError as err:
                    finished.append(err.code().name)
                    return err

            calls = [asyncio.ensure_future(encode(name)) for name in PHOTOS[:5]]
            # Health is exempt from the limit: it answers while the service is full.
            while len(finished) < 3:
                await asyncio.sleep(0.05)
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            results = await asyncio.gather(*calls)

            ok = [r for r in results if isinstance(r, pb.EncodeResponse)]
            refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
            assert len(ok) == LIMIT and len(refused) == 5 - LIMIT
            # The refused calls ended before either admitted one: never queued, never hung.
            assert finished[: len(refused)] == ["RESOURCE_EXHAUSTED"] * len(refused)
            assert finished[len(refused) :] == ["ok"] * LIMIT
            for response in ok:
                rows, width = response.embeddings[0].embeddings.shape
                assert width == engine.spec.embedding_width and rows > 0
            for err in refused:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert f"limit of {LIMIT} concurrent requests" in (err.details() or "")
                info = error_info(err)
                assert info is not None and info.reason == "TOO_MANY_REQUESTS"
                assert info.metadata["limit"] == str(LIMIT)
                assert info.metadata["field"] == "max_concurrent_rpcs"
                retry = retry_info(err)
                assert isinstance(retry, error_details_pb2.RetryInfo)
                assert retry.retry_delay.ToMilliseconds() == RETRY_MS
                trailing = dict(err.trailing_metadata() or ())
                assert trailing.get("retry-after-ms") == str(RETRY_MS)
                # A gateway re-raising it keeps the code and the hint.
                again = from_rpc_error(err, dependency="encoder")
                assert again.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert again.retry_after_ms == RETRY_MS

            # The slots were released: a new call is admitted.
            response = await stub.Encode(
                pb.EncodeRequest(images=[_image(PHOTOS[5], engine)]), timeout=120
            )
            assert len(response.embeddings) == 1
    finally:
        await batcher.stop()


async def test_full_encoder_queue_answers_at_once_with_a_retry_hint(engine) -> None:
    """The batcher's bounded queue: while the ViT is busy with one image and one waits,
    a third is refused ENCODER_QUEUE_FULL with a RetryInfo hint; the two still finish."""
    import threading

    gate = threading.Event()

    def encode_when_let(images):  # type: ignore[no-untyped-def]
        gate.wait(60)  # holds the ViT worker so the queue fills, then the real encode
        return engine.encode(images)

    batcher = Batcher(
        encode_when_let, max_batch_images=1, max_batch_patches=16384, max_wait_ms=0, max_queue=1
    )
    batcher.start()
    try:
        pre = {
            name: engine.preprocess(
                np.asarray(rgb(name)),
                plan_resize(rgb(name).height, rgb(name).width, engine.spec, index=0),
            )
            for name in PHOTOS[:3]
        }
        running = asyncio.ensure_future(batcher.submit("a", pre[PHOTOS[0]]))
        while batcher._queue.qsize():  # the first image is taken into its batch
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        waiting = asyncio.ensure_future(batcher.submit("b", pre[PHOTOS[1]]))
        await asyncio.sleep(0.05)
        assert batcher._queue.qsize() == 1
        with pytest.raises(ServiceError) as err:
            await batcher.submit("c", pre[PHOTOS[2]])
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.reason == "ENCODER_QUEUE_FULL"
        assert err.value.metadata["limit"] == "1"
        assert err.value.retry_after_ms is not None and err.value.retry_after_ms >= 100
        gate.set()
        a, b = await asyncio.gather(running, waiting)
        assert a.shape[1] == b.shape[1] == engine.spec.embedding_width
    finally:
        gate.set()
        await batcher.stop()
