"""The vision engine and the Encoder servicer, in process, on the tiny checkpoint."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch
from qwenvl.common.v1 import tensor_pb2
from qwenvl.encoder.v1 import encoder_service_pb2 as pb
from qwenvl.encoder.v1 import encoder_service_pb2_grpc as pb_grpc

from encoder_service.batcher import Batcher
from encoder_service.engine import VisionEngine
from encoder_service.servicer import EncoderServicer
from tests.conftest import in_process_server, rgb
from vlcommon import tensors
from vlcommon.imaging import plan_resize


@pytest.fixture(scope="module")
def engine(tiny_model) -> VisionEngine:
    return VisionEngine.load(str(tiny_model), device="cpu")


def test_engine_equals_the_full_models_vision_tower(engine, tiny_model) -> None:
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_model, dtype=torch.float32)
    proc = AutoProcessor.from_pretrained(tiny_model)
    image = rgb("astronaut.png")
    inputs = proc.image_processor(images=[image], return_tensors="pt")
    with torch.inference_mode():
        ref = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
    expected = torch.cat([ref.pooler_output, *ref.deepstack_features], dim=1)
    plan = plan_resize(image.height, image.width, engine.spec, index=0)
    [ours] = engine.encode([engine.preprocess(np.asarray(image), plan)])
    assert ours.shape == (64, 384) == expected.shape  # FACTS.md: 64 tokens, 128 x (1 + 2)
    # The CPU fast path (oneDNN GEMM, patch embedding as a matmul) changes float rounding only.
    assert torch.allclose(ours, expected, atol=1e-5)
    stock = VisionEngine.load(str(tiny_model), device="cpu", fast_cpu_kernels=False)
    [plain] = stock.encode([stock.preprocess(np.asarray(image), plan)])
    assert torch.allclose(plain, expected, atol=1e-6)


def test_cpu_fast_path_swaps_layers(engine) -> None:
    from encoder_service.engine import _OneDNNLinear, _PatchEmbedAsLinear

    kinds = [type(m) for m in engine.visual.modules()]
    assert _PatchEmbedAsLinear in kinds
    assert kinds.count(_OneDNNLinear) >= 4 * 4  # qkv, proj, fc1, fc2 in each of 4 blocks


def test_packed_batch_equals_one_by_one(engine) -> None:
    images = [rgb(n) for n in ("chelsea.png", "coffee.png", "astronaut.png")]
    pre = [
        engine.preprocess(np.asarray(im), plan_resize(im.height, im.width, engine.spec, index=0))
        for im in images
    ]
    packed = engine.encode(pre)
    single = [engine.encode([p])[0] for p in pre]
    assert [t.shape[0] for t in packed] == [54, 54, 64]
    for a, b in zip(packed, single, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.fixture
async def encoder_stub(engine):
    batcher = Batcher(
        engine.encode, max_batch_images=8, max_batch_patches=16384, max_wait_ms=5, max_queue=4
    )
    batcher.start()
    servicer = EncoderServicer(
        engine, batcher, max_images_per_request=4, max_patches_per_image=4096
    )
    async with in_process_server(
        pb_grpc.add_EncoderServiceServicer_to_server, servicer, "qwenvl.encoder.v1.EncoderService"
    ) as channel:
        yield pb_grpc.EncoderServiceStub(channel)
    await batcher.stop()


def _image(name: str, engine: VisionEngine, key: str = "") -> pb.EncodeImage:
    image = rgb(name)
    plan = plan_resize(image.height, image.width, engine.spec, index=0)
    return pb.EncodeImage(
        key=key or name,
        pixels=tensors.from_numpy(np.asarray(image)),
        plan=tensor_pb2.ResizePlan(
            resized_height=plan.resized_height,
            resized_width=plan.resized_width,
            grid=tensor_pb2.GridTHW(t=1, h=plan.grid_h, w=plan.grid_w),
        ),
    )


async def test_encode_rpc_returns_embeddings_with_grid(encoder_stub, engine) -> None:
    request = pb.EncodeRequest(
        images=[_image("astronaut.png", engine), _image("chelsea.png", engine)],
        output_dtype=tensor_pb2.DATA_TYPE_BF16,
    )
    response = await encoder_stub.Encode(request)
    shapes = [list(e.embeddings.shape) for e in response.embeddings]
    assert shapes == [[64, 384], [54, 384]]
    assert [(e.grid.h, e.grid.w) for e in response.embeddings] == [(16, 16), (12, 18)]
    assert response.embeddings[0].embeddings.dtype == tensor_pb2.DATA_TYPE_BF16
    assert response.embeddings[1].key == "chelsea.png"


async def test_concurrent_identical_images_are_encoded_once(encoder_stub, engine) -> None:
    from encoder_service import metrics

    before = metrics.DEDUPLICATED._value.get()
    request = pb.EncodeRequest(images=[_image("coffee.png", engine, key="same")])
    results = await asyncio.gather(*(encoder_stub.Encode(request) for _ in range(3)))
    assert metrics.DEDUPLICATED._value.get() - before >= 1
    datas = {r.embeddings[0].embeddings.data for r in results}
    assert len(datas) == 1


async def test_bad_requests_get_invalid_argument_naming_the_field(encoder_stub, engine) -> None:
    good = _image("chelsea.png", engine)
    bad_plan = pb.EncodeImage()
    bad_plan.CopyFrom(good)
    bad_plan.plan.resized_height = 300  # not a multiple of 32
    bad_pixels = pb.EncodeImage()
    bad_pixels.CopyFrom(good)
    bad_pixels.pixels.shape[2] = 4
    cases = [
        (pb.EncodeRequest(), "images is empty"),
        (pb.EncodeRequest(images=[good, bad_plan]), "images[1].plan: resized size 300x"),
        (pb.EncodeRequest(images=[bad_pixels]), "images[0].pixels.data has"),
        (pb.EncodeRequest(images=[good] * 5), "the limit is 4"),
        # The whole request is checked before any image is looked at: a bad output_dtype
        # or readers beside a bad image (or none) names itself, not the image.
        (pb.EncodeRequest(output_dtype=99), "output_dtype must be FP32 or BF16"),
        (pb.EncodeRequest(images=[bad_pixels], readers=99), "readers is 99"),
    ]
    for request, message in cases:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await encoder_stub.Encode(request)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
        assert message in exc.value.details()
    big = _image("astronaut.png", engine)
    big.plan.resized_height = big.plan.resized_width = 2048
    big.plan.grid.h = big.plan.grid.w = 128
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await encoder_stub.Encode(pb.EncodeRequest(images=[big]))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "16384 patches; the limit is 4096" in exc.value.details()
    # Still serving.
    assert len((await encoder_stub.Encode(pb.EncodeRequest(images=[good]))).embeddings) == 1


async def test_same_key_with_two_plans_gives_two_encodes(encoder_stub, engine) -> None:
    small = _image("chelsea.png", engine, key="dup")
    big = pb.EncodeImage()
    big.CopyFrom(small)
    big.plan.resized_height, big.plan.resized_width = 64, 64
    big.plan.grid.h, big.plan.grid.w = 4, 4
    response = await encoder_stub.Encode(pb.EncodeRequest(images=[small, big]))
    assert [list(e.embeddings.shape) for e in response.embeddings] == [[54, 384], [4, 384]]
    assert [e.key for e in response.embeddings] == ["dup", "dup"]


@pytest.mark.parametrize("on_loop_bytes", [0, 1 << 40], ids=["worker-thread", "event-loop"])
async def test_held_answers_equal_inline_ones_wherever_they_are_built(
    engine, tmp_path, monkeypatch, on_loop_bytes: int
) -> None:
    """The answer (cast, then held in a segment) is built on a worker thread above
    ANSWER_ON_LOOP_BYTES and on the event loop below it; either way each ref holds the same
    bytes as the inline answer, for its own image."""
    from encoder_service import servicer as encoder_servicer
    from vlcommon.handoff import Holder

    monkeypatch.setattr(encoder_servicer, "ANSWER_ON_LOOP_BYTES", on_loop_bytes)
    holder = Holder("encoder", shm_dir=tmp_path)
    batcher = Batcher(
        engine.encode, max_batch_images=8, max_batch_patches=16384, max_wait_ms=5, max_queue=4
    )
    batcher.start()
    servicer = EncoderServicer(
        engine, batcher, max_images_per_request=4, max_patches_per_image=4096, holder=holder
    )
    images = [_image("astronaut.png", engine), _image("chelsea.png", engine)]
    async with in_process_server(
        pb_grpc.add_EncoderServiceServicer_to_server, servicer, "qwenvl.encoder.v1.EncoderService"
    ) as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        bf16 = tensor_pb2.DATA_TYPE_BF16
        inline = await stub.Encode(pb.EncodeRequest(images=images, output_dtype=bf16))
        held = await stub.Encode(
            pb.EncodeRequest(images=images, output_dtype=bf16, transport=tensor_pb2.TRANSPORT_SHM)
        )
    await batcher.stop()
    for want, got in zip(inline.embeddings, held.embeddings, strict=True):
        assert got.ref.shm_name and not got.embeddings.data
        assert list(got.embeddings.shape) == list(want.embeddings.shape)
        found = holder.read_bytes(got.ref.ticket)
        assert found is not None and bytes(found[1]) == want.embeddings.data
    holder.close()
