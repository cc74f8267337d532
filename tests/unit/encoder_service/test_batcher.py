"""The encoder's dynamic batcher, driven by a recording fake ViT (the real one: test_encoder)."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch

from encoder_service.batcher import Batcher
from encoder_service.engine import Preprocessed
from vlcommon.errors import ServiceError


class FakeViT:
    """Returns [tokens, 1] filled with the image's first pixel value; records batch sizes."""

    def __init__(self, oom_above_patches: int | None = None, delay_s: float = 0.0) -> None:
        self.calls: list[list[int]] = []
        self.oom_above = oom_above_patches
        self.delay_s = delay_s
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, images: list[Preprocessed]) -> list[torch.Tensor]:
        self.gate.wait(5)
        patches = [int(im.pixel_values.shape[0]) for im in images]
        if self.oom_above is not None and sum(patches) > self.oom_above:
            raise torch.OutOfMemoryError("fake OOM")
        self.calls.append(patches)
        if self.delay_s:
            threading.Event().wait(self.delay_s)
        return [torch.full((im.tokens, 1), float(im.pixel_values[0, 0])) for im in images]


def image(value: float, patches: int = 16) -> Preprocessed:
    return Preprocessed(torch.full((patches, 4), value), (1, patches // 4, 4), patches // 4)


def batcher(vit: FakeViT, **kw) -> Batcher:
    opts = {"max_batch_images": 4, "max_batch_patches": 1000, "max_wait_ms": 30, "max_queue": 64}
    opts.update(kw)
    b = Batcher(vit, **opts)
    b.start()
    return b


async def test_concurrent_images_share_packed_calls_in_order() -> None:
    vit = FakeViT()
    b = batcher(vit)
    outs = await asyncio.gather(*(b.submit(f"k{i}", image(i)) for i in range(6)))
    await b.stop()
    assert [float(o[0, 0]) for o in outs] == [0, 1, 2, 3, 4, 5]
    assert [len(c) for c in vit.calls] == [4, 2]


async def test_patch_budget_bounds_a_batch() -> None:
    vit = FakeViT()
    b = batcher(vit, max_batch_patches=40)
    await asyncio.gather(*(b.submit(f"k{i}", image(i, patches=16)) for i in range(4)))
    await b.stop()
    assert all(sum(c) <= 40 for c in vit.calls)
    assert sum(len(c) for c in vit.calls) == 4


async def test_cpu_default_runs_448_images_alone_and_packs_224_ones(monkeypatch) -> None:
    """ENCODER_MAX_BATCH_PATCHES=0 (the default) resolves by device: on CPU 1,024 patches
    per call, so 448x448 images (784 patches) are not held behind others and 224x224 ones
    (196) pack five to a call; on a GPU 16,384; an explicit value wins."""
    from encoder_service.settings import EncoderSettings, batch_patches_for

    monkeypatch.delenv("ENCODER_MAX_BATCH_PATCHES", raising=False)
    default = EncoderSettings().max_batch_patches
    assert batch_patches_for(default, "cuda") == 16384
    monkeypatch.setenv("ENCODER_MAX_BATCH_PATCHES", "3000")
    assert batch_patches_for(EncoderSettings().max_batch_patches, "cpu") == 3000
    cpu = batch_patches_for(default, "cpu")
    for patches, per_call in ((784, [1, 1, 1, 1, 1, 1]), (196, [5, 1])):
        vit = FakeViT()
        b = batcher(vit, max_batch_images=8, max_batch_patches=cpu)
        await asyncio.gather(*(b.submit(f"k{i}", image(i, patches)) for i in range(6)))
        await b.stop()
        assert [len(c) for c in vit.calls] == per_call


async def test_identical_keys_in_flight_are_encoded_once() -> None:
    vit = FakeViT()
    b = batcher(vit)
    outs = await asyncio.gather(*(b.submit("same", image(7)) for _ in range(5)))
    await b.stop()
    assert sum(len(c) for c in vit.calls) == 1
    assert all(float(o[0, 0]) == 7 for o in outs)


async def test_full_queue_answers_resource_exhausted_at_once() -> None:
    vit = FakeViT()
    vit.gate.clear()  # the worker blocks inside its first call
    b = batcher(vit, max_queue=2, max_batch_images=1, max_wait_ms=0)
    first = asyncio.ensure_future(b.submit("a", image(1)))
    await asyncio.sleep(0.05)  # "a" is in the ViT now
    queued = [asyncio.ensure_future(b.submit(k, image(2))) for k in ("b", "c")]
    await asyncio.sleep(0)
    with pytest.raises(ServiceError) as exc:
        await b.submit("d", image(3))
    assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit" in exc.value.metadata and exc.value.metadata["limit"] == "2"
    vit.gate.set()
    await asyncio.gather(first, *queued)
    await b.stop()


async def test_a_cancelled_caller_leaves_the_batch_without_breaking_others() -> None:
    vit = FakeViT()
    vit.gate.clear()
    b = batcher(vit, max_batch_images=1, max_wait_ms=0)
    blocker = asyncio.ensure_future(b.submit("blocker", image(0)))
    await asyncio.sleep(0.05)
    doomed = asyncio.ensure_future(b.submit("doomed", image(1)))
    kept = asyncio.ensure_future(b.submit("kept", image(2)))
    await asyncio.sleep(0)
    doomed.cancel()
    vit.gate.set()
    assert float((await kept)[0, 0]) == 2
    await blocker
    with pytest.raises(asyncio.CancelledError):
        await doomed
    await b.stop()
    encoded = [p for call in vit.calls for p in call]
    assert len(encoded) == 2  # the cancelled image never reached the ViT


async def test_images_without_keys_share_a_batch_and_the_batcher_lives_on() -> None:
    """Two keyless images (key "": never shared) in one batch: each is encoded as its own,
    and the batcher serves the next call. Items once compared field by field, down to
    their pixel tensors, which raised and killed the loop: every later call hung."""
    vit = FakeViT()
    b = batcher(vit)
    outs = await asyncio.wait_for(asyncio.gather(b.submit("", image(1)), b.submit("", image(2))), 5)
    assert [float(o[0, 0]) for o in outs] == [1, 2] and vit.calls == [[16, 16]]
    after = await asyncio.wait_for(b.submit("k", image(3)), 5)
    await b.stop()
    assert float(after[0, 0]) == 3


async def test_out_of_memory_splits_the_batch_and_fails_only_what_cannot_fit() -> None:
    vit = FakeViT(oom_above_patches=40)
    b = batcher(vit, max_batch_images=8, max_batch_patches=10_000)
    results = await asyncio.gather(
        b.submit("a", image(1, 16)),
        b.submit("b", image(2, 16)),
        b.submit("c", image(3, 16)),
        b.submit("huge", image(4, 64)),
        return_exceptions=True,
    )
    await b.stop()
    assert [float(r[0, 0]) for r in results[:3]] == [1, 2, 3]  # type: ignore[index]
    err = results[3]
    assert isinstance(err, ServiceError) and err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "64 patches" in err.message
    assert all(sum(c) <= 40 for c in vit.calls)
