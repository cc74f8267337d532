"""The gateway's cache, encode and decode stages (gateway.pipeline), each a unit against a
service on loopback: the real cache service over a real store, the real encoder over the
tiny checkpoint's ViT, and a scripted decoder (the end-to-end tests run the real one)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import numpy as np
import pytest
from prometheus_client import REGISTRY
from qwenvl.cache.v1 import cache_service_pb2 as cpb
from qwenvl.cache.v1 import cache_service_pb2_grpc
from qwenvl.common.v1 import generation_pb2, tensor_pb2
from qwenvl.decoder.v1 import decoder_service_pb2 as dpb
from qwenvl.decoder.v1 import decoder_service_pb2_grpc
from qwenvl.encoder.v1 import encoder_service_pb2 as epb
from qwenvl.encoder.v1 import encoder_service_pb2_grpc
from qwenvl.gateway.v1 import gateway_service_pb2 as gpb

from cache_service.servicer import CacheServicer
from cache_service.store import EmbeddingStore
from gateway.pipeline.cache import CacheStage
from gateway.pipeline.decode import DecodeStage, RefsLost
from gateway.pipeline.encode import EncodeStage
from gateway.pipeline.types import PreparedImage
from tests.conftest import in_process_server, rgb
from vlcommon import tensors
from vlcommon.deadline import NO_DEADLINE
from vlcommon.errors import ServiceError, abort
from vlcommon.imaging import ResizePlan, plan_resize
from vlcommon.model_info import VisionSpec
from vlcommon.verification import verification_image

SPEC = VisionSpec(
    patch_size=16, spatial_merge_size=2, temporal_patch_size=2, min_pixels=1024,
    max_pixels=65536, out_hidden_size=4, n_deepstack=1, image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
)  # fmt: skip
PLAN = ResizePlan(64, 64, 1, 4, 4, 4)  # 4 tokens of width 8
DIM = 16
SIMILAR = generation_pb2.CACHE_POLICY_SIMILAR


def failures(op: str) -> float:
    value = REGISTRY.get_sample_value("splitvl_gateway_cache_failures_total", {"op": op})
    return value or 0.0


def image(i: int, rows: int = 4) -> PreparedImage:
    """Image ``i``: its descriptor, verification image and embeddings all derive from ``i``."""
    rng = np.random.default_rng(i)
    descriptor = rng.standard_normal(DIM).astype(np.float32)
    pixels = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    im = PreparedImage(
        index=0,
        plan=PLAN,
        key=f"key-{i}",
        decoded=True,
        pixels=pixels,
        descriptor=descriptor / np.linalg.norm(descriptor),
        verification=verification_image(pixels),
    )
    values = np.full((rows, SPEC.embedding_width), float(i), np.float32)
    im.embedding = tensor_pb2.ImageEmbedding(
        embeddings=tensors.from_numpy(values), grid=tensor_pb2.GridTHW(t=1, h=4, w=4), key=im.key
    )
    return im


def fresh(im: PreparedImage) -> PreparedImage:
    """The same image as a new request brings it: no tier, no embedding yet."""
    return PreparedImage(
        index=im.index,
        plan=im.plan,
        key=im.key,
        decoded=True,
        pixels=im.pixels,
        descriptor=im.descriptor,
        verification=im.verification,
    )


@pytest.fixture
async def cache_stage():
    store = EmbeddingStore(descriptor_dim=DIM, capacity_bytes=1 << 20)
    servicer = CacheServicer(store, default_policy=SIMILAR, max_queries=8)
    async with in_process_server(
        cache_service_pb2_grpc.add_CacheServiceServicer_to_server,
        servicer,
        "qwenvl.cache.v1.CacheService",
    ) as channel:
        yield (
            CacheStage(
                cache_service_pb2_grpc.CacheServiceStub(channel),
                spec=SPEC,
                revision="r1",
                transport=tensor_pb2.TRANSPORT_UNSPECIFIED,  # inline: no holder in this test
                timeout_s=10,
                put_timeout_s=10,
            ),
            store,
        )


async def test_a_put_image_is_an_exact_hit_with_its_own_embeddings(cache_stage) -> None:
    stage, store = cache_stage
    a, b = image(1), image(2)
    timings = gpb.StageTimings()
    await stage.put([a, b], SIMILAR, NO_DEADLINE, timings)
    assert "key-1" in store and "key-2" in store and timings.put_ms > 0
    asked = [fresh(b), fresh(a), fresh(image(3))]
    await stage.lookup(asked, SIMILAR, NO_DEADLINE)
    assert [im.tier for im in asked] == [
        generation_pb2.CACHE_TIER_EXACT,
        generation_pb2.CACHE_TIER_EXACT,
        generation_pb2.CACHE_TIER_MISS,
    ]
    got = [tensors.to_numpy(im.embedding.embeddings) for im in asked[:2]]  # type: ignore[union-attr]
    assert got[0][0, 0] == 2.0 and got[1][0, 0] == 1.0  # each image's own entry
    assert asked[2].embedding is None


async def test_a_hit_that_does_not_fit_the_model_is_a_counted_miss(cache_stage) -> None:
    """An entry of width 6 (another model's, or a bad one) under this image's key and grid
    is never bound: the image stays a miss, and the bad entry is counted."""
    stage, _ = cache_stage
    other = image(4)
    other.embedding.embeddings.CopyFrom(  # type: ignore[union-attr]
        tensors.from_numpy(np.zeros((4, 6), np.float32))
    )
    await stage.put([other], SIMILAR, NO_DEADLINE)
    before = failures("bad_entry")
    asked = [fresh(other)]
    await stage.lookup(asked, SIMILAR, NO_DEADLINE)
    assert asked[0].tier == generation_pb2.CACHE_TIER_MISS and asked[0].embedding is None
    assert failures("bad_entry") == before + 1

    nan = image(5)
    nan.embedding.embeddings.CopyFrom(  # type: ignore[union-attr]
        tensors.from_numpy(np.full((4, SPEC.embedding_width), np.nan, np.float32))
    )
    assert not stage.usable_hit(nan.embedding, nan)  # type: ignore[arg-type]
    assert stage.usable_hit(image(6).embedding, image(6))  # type: ignore[arg-type]


async def test_an_unreachable_cache_leaves_misses_and_counts_one_failure() -> None:
    channel = grpc.aio.insecure_channel("127.0.0.1:9")
    stage = CacheStage(
        cache_service_pb2_grpc.CacheServiceStub(channel),
        spec=SPEC,
        revision="r1",
        transport=tensor_pb2.TRANSPORT_UNSPECIFIED,
        timeout_s=2,
        put_timeout_s=2,
    )
    before = failures("lookup")
    asked = [fresh(image(7))]
    await stage.lookup(asked, SIMILAR, NO_DEADLINE)
    assert asked[0].tier == generation_pb2.CACHE_TIER_MISS and asked[0].embedding is None
    assert failures("lookup") == before + 1
    assert await stage.lookup_files([None], NO_DEADLINE) == {}
    await channel.close()


async def test_without_a_cache_the_stage_does_nothing() -> None:
    stage = CacheStage(None, spec=SPEC, revision="r1", transport=0, timeout_s=1, put_timeout_s=1)
    asked = [fresh(image(8))]
    await stage.lookup(asked, SIMILAR, NO_DEADLINE)
    await stage.put([image(8)], SIMILAR, NO_DEADLINE)
    assert asked[0].embedding is None and asked[0].tier == generation_pb2.CACHE_TIER_MISS


@pytest.fixture(scope="module")
def engine(tiny_model):
    from encoder_service.engine import VisionEngine

    return VisionEngine.load(tiny_model, device="cpu")


def encodable(name: str, engine) -> PreparedImage:  # type: ignore[no-untyped-def]
    picture = rgb(name)
    plan = plan_resize(picture.height, picture.width, engine.spec, index=0)
    pixels = np.asarray(picture.resize((plan.resized_width, plan.resized_height)))
    return PreparedImage(index=0, plan=plan, key=name, decoded=True, pixels=pixels)


async def test_the_encode_stage_binds_each_miss_its_own_embeddings(engine) -> None:
    from encoder_service.batcher import Batcher
    from encoder_service.servicer import EncoderServicer

    batcher = Batcher(
        engine.encode, max_batch_images=8, max_batch_patches=16384, max_wait_ms=5, max_queue=4
    )
    batcher.start()
    servicer = EncoderServicer(
        engine, batcher, max_images_per_request=4, max_patches_per_image=4096
    )
    async with in_process_server(
        encoder_service_pb2_grpc.add_EncoderServiceServicer_to_server,
        servicer,
        "qwenvl.encoder.v1.EncoderService",
    ) as channel:
        stage = EncodeStage(
            encoder_service_pb2_grpc.EncoderServiceStub(channel), transport=0, timeout_s=30
        )
        misses = [encodable("astronaut.png", engine), encodable("chelsea.png", engine)]
        await stage.encode(misses, NO_DEADLINE)
        alone = [encodable("chelsea.png", engine)]
        await stage.encode(alone, NO_DEADLINE)
    await batcher.stop()
    shapes = [list(im.embedding.embeddings.shape) for im in misses]  # type: ignore[union-attr]
    assert shapes == [[im.plan.tokens, engine.spec.embedding_width] for im in misses]
    assert [im.embedding.key for im in misses] == ["astronaut.png", "chelsea.png"]  # type: ignore[union-attr]
    np.testing.assert_array_equal(
        tensors.to_numpy(misses[1].embedding.embeddings),  # type: ignore[union-attr]
        tensors.to_numpy(alone[0].embedding.embeddings),  # type: ignore[union-attr]
    )


class _ShortEncoder(encoder_service_pb2_grpc.EncoderServiceServicer):
    """Answers one embedding whatever it is asked (a broken or mismatched encoder)."""

    async def Encode(self, request, context):  # type: ignore[no-untyped-def]
        return epb.EncodeResponse(embeddings=[tensor_pb2.ImageEmbedding()])


async def test_an_encoder_answering_the_wrong_count_or_down_is_unavailable(engine) -> None:
    misses = [encodable("astronaut.png", engine), encodable("chelsea.png", engine)]
    async with in_process_server(
        encoder_service_pb2_grpc.add_EncoderServiceServicer_to_server,
        _ShortEncoder(),
        "qwenvl.encoder.v1.EncoderService",
    ) as channel:
        stage = EncodeStage(
            encoder_service_pb2_grpc.EncoderServiceStub(channel), transport=0, timeout_s=30
        )
        with pytest.raises(ServiceError) as err:
            await stage.encode(misses, NO_DEADLINE)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.reason == "ENCODER_BAD_RESPONSE"
    assert err.value.message == "encoder answered 1 embeddings for 2 images"
    assert all(im.embedding is None for im in misses)

    channel = grpc.aio.insecure_channel("127.0.0.1:9")
    stage = EncodeStage(
        encoder_service_pb2_grpc.EncoderServiceStub(channel), transport=0, timeout_s=5
    )
    with pytest.raises(ServiceError) as err:
        await stage.encode(misses, NO_DEADLINE)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "encoder" in err.value.message
    await channel.close()


class _Decoder(decoder_service_pb2_grpc.DecoderServiceServicer):
    """A scripted decoder (a servicer unit test's stand-in): streams ``tokens`` one chunk
    each, then fails with ``error`` if set, or ends; records whether its call was
    cancelled."""

    def __init__(self, tokens: int, error: ServiceError | None = None) -> None:
        self.tokens, self.error = tokens, error
        self.cancelled = asyncio.Event()

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        try:
            for i in range(self.tokens):
                yield dpb.GenerateResponse(token_ids=[100 + i])
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:  # grpc cancels the handler when its call is
            self.cancelled.set()
            raise
        if self.error is not None:
            await abort(context, self.error)
        while self.tokens == 0 and self.error is None:  # hold the stream open
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def decode_stage(decoder: _Decoder):  # type: ignore[no-untyped-def]
    async with in_process_server(
        decoder_service_pb2_grpc.add_DecoderServiceServicer_to_server,
        decoder,
        "qwenvl.decoder.v1.DecoderService",
    ) as channel:
        yield DecodeStage(decoder_service_pb2_grpc.DecoderServiceStub(channel))


GONE = ServiceError(
    grpc.StatusCode.UNAVAILABLE,
    "EMBEDDING_REF_GONE",
    "images[0].ref: the encoder no longer holds ticket ab12",
    {"field": "images[0].ref"},
)


async def test_the_decode_stage_streams_every_chunk_in_order() -> None:
    async with decode_stage(_Decoder(tokens=5)) as stage:
        got = [c.token_ids[0] async for c in stage.stream(dpb.GenerateRequest(), NO_DEADLINE)]
    assert got == [100, 101, 102, 103, 104]


async def test_a_lost_ref_before_the_first_token_is_refs_lost_and_after_it_an_error() -> None:
    """Before any chunk, the gateway may encode again (RefsLost); once tokens streamed,
    the status goes to the client as UNAVAILABLE naming the image."""
    async with decode_stage(_Decoder(tokens=0, error=GONE)) as stage:
        with pytest.raises(RefsLost) as lost:
            [c async for c in stage.stream(dpb.GenerateRequest(), NO_DEADLINE)]
    assert lost.value.error.code == grpc.StatusCode.UNAVAILABLE
    assert lost.value.error.reason == "EMBEDDING_REF_GONE"
    assert lost.value.error.message.startswith("decoder unavailable: images[0].ref")
    async with decode_stage(_Decoder(tokens=2, error=GONE)) as stage:
        got = []
        with pytest.raises(ServiceError) as err:
            async for chunk in stage.stream(dpb.GenerateRequest(), NO_DEADLINE):
                got.append(chunk.token_ids[0])
    assert got == [100, 101] and not isinstance(err.value, RefsLost)
    assert err.value.reason == "EMBEDDING_REF_GONE"
    assert err.value.metadata["dependency"] == "decoder"


async def test_closing_the_stream_cancels_the_decoder_call() -> None:
    """A client that goes away closes the stage's stream: the decoder's call is cancelled
    (the decoder then aborts the vLLM request)."""
    decoder = _Decoder(tokens=50)
    async with decode_stage(decoder) as stage:
        async with contextlib.aclosing(stage.stream(dpb.GenerateRequest(), NO_DEADLINE)) as chunks:
            async for _ in chunks:
                break
        await asyncio.wait_for(decoder.cancelled.wait(), timeout=10)


# -- refs the gateway receives and no reader will read are released -----------------------


async def freed(holder, left: int = 0, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    """Whether the holder is down to ``left`` entries within ``timeout_s`` (releases go
    out in the background)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(holder) > left:
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


@contextlib.asynccontextmanager
async def held_entries(tmp_path, n: int, rows: int = 4, width: int = SPEC.embedding_width):  # type: ignore[no-untyped-def]
    """A real holder (its HandoffService on loopback) holding ``n`` entries, as messages."""
    from tests.unit.vlcommon.test_handoff import serving
    from vlcommon import handoff

    holder = handoff.Holder("cache", shm_dir=tmp_path)
    async with serving(holder):
        msgs = []
        for i in range(n):
            values = np.full((rows, width), float(i), np.float32)
            ref = holder.hold(
                values.tobytes(),
                tensor_pb2.DATA_TYPE_FP32,
                values.shape,
                transport=tensor_pb2.TRANSPORT_SHM,
            )
            msg = tensor_pb2.ImageEmbedding(grid=tensor_pb2.GridTHW(t=1, h=4, w=4), key=f"key-{i}")
            msg.embeddings.dtype, msg.embeddings.shape[:] = tensor_pb2.DATA_TYPE_FP32, [rows, width]
            msg.ref.CopyFrom(ref)
            msgs.append(msg)
        assert len(holder) == n
        yield holder, msgs
    holder.close()


class _Cache(cache_service_pb2_grpc.CacheServiceServicer):
    """Answers every Lookup with ``results`` (a servicer unit test's stand-in)."""

    def __init__(self, results) -> None:  # type: ignore[no-untyped-def]
        self.results = results

    async def Lookup(self, request, context):  # type: ignore[no-untyped-def]
        return cpb.LookupResponse(results=self.results)


@contextlib.asynccontextmanager
async def scripted_cache_stage(results, releaser):  # type: ignore[no-untyped-def]
    """A CacheStage (shared-memory refs) over a cache that answers ``results``."""
    async with in_process_server(
        cache_service_pb2_grpc.add_CacheServiceServicer_to_server,
        _Cache(results),
        "qwenvl.cache.v1.CacheService",
    ) as channel:
        yield CacheStage(
            cache_service_pb2_grpc.CacheServiceStub(channel),
            spec=SPEC, revision="r1", transport=tensor_pb2.TRANSPORT_SHM, timeout_s=10,
            put_timeout_s=10, releaser=releaser,
        )  # fmt: skip


async def test_a_hit_the_gateway_will_not_use_is_released_at_its_holder(tmp_path) -> None:
    """An exact hit of the wrong width is not bound (a miss), and its held entry is
    released at once, not kept leased until its TTL; a usable hit is kept for the decoder
    (in ``held``); a malformed answer (one result for two queries) releases every ref."""
    from gateway.pipeline.types import HeldRefs
    from vlcommon import handoff

    releaser = handoff.Reader()
    async with held_entries(tmp_path, 2, width=6) as (holder, bad):
        results = [cpb.LookupResult(tier=generation_pb2.CACHE_TIER_EXACT, embedding=bad[0])]
        async with scripted_cache_stage(results, releaser) as stage:
            held = HeldRefs()
            asked = [fresh(image(1))]
            await stage.lookup(asked, SIMILAR, NO_DEADLINE, held)
            assert asked[0].embedding is None and held.refs == []
            assert await freed(holder, left=1)  # the unusable one, and only it
            assert len(holder) == 1
            # One result for two queries: nothing is bound, every ref is released.
            results[0].embedding.CopyFrom(bad[1])
            await stage.lookup([fresh(image(2)), fresh(image(3))], SIMILAR, NO_DEADLINE, held)
            assert await freed(holder)
    async with held_entries(tmp_path, 1) as (holder, good):
        results = [cpb.LookupResult(tier=generation_pb2.CACHE_TIER_EXACT, embedding=good[0])]
        async with scripted_cache_stage(results, releaser) as stage:
            held = HeldRefs()
            asked = [fresh(image(1))]
            await stage.lookup(asked, SIMILAR, NO_DEADLINE, held)
            assert asked[0].embedding is not None and held.refs == [good[0].ref]
            await asyncio.sleep(0.3)
            assert len(holder) == 1  # kept: it is the decoder's to read
    await releaser.close()


async def test_a_decode_request_that_never_reached_the_decoder_releases_its_refs(
    tmp_path,
) -> None:
    from vlcommon import handoff

    releaser = handoff.Reader()
    async with held_entries(tmp_path, 2) as (holder, msgs):
        channel = grpc.aio.insecure_channel("127.0.0.1:9")
        stage = DecodeStage(decoder_service_pb2_grpc.DecoderServiceStub(channel), releaser)
        request = dpb.GenerateRequest(images=msgs[:1])
        request.videos.add(embedding=msgs[1])
        with pytest.raises(ServiceError) as err:
            [c async for c in stage.stream(request, NO_DEADLINE)]
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert await freed(holder)
        await channel.close()
    await releaser.close()


class _SlowHoldingEncoder(encoder_service_pb2_grpc.EncoderServiceServicer):
    """Holds one entry per image in a real holder and answers after ``answer_after_s``
    (a servicer unit test's stand-in for an encoder whose answer is on its way)."""

    def __init__(self, holder, answer_after_s: float) -> None:  # type: ignore[no-untyped-def]
        self.holder, self.answer_after_s = holder, answer_after_s

    async def Encode(self, request, context):  # type: ignore[no-untyped-def]
        response = epb.EncodeResponse()
        for image in request.images:
            values = np.zeros((4, SPEC.embedding_width), np.float32)
            emb = response.embeddings.add(key=image.key, grid=image.plan.grid)
            emb.embeddings.dtype, emb.embeddings.shape[:] = tensor_pb2.DATA_TYPE_FP32, [4, 8]
            emb.ref.CopyFrom(
                self.holder.hold(
                    values.tobytes(), tensor_pb2.DATA_TYPE_FP32, values.shape,
                    transport=tensor_pb2.TRANSPORT_SHM, readers=2,
                )
            )  # fmt: skip
        # The holds are made; the answer takes a while to reach the gateway.
        await asyncio.sleep(self.answer_after_s)
        return response


async def test_a_request_cancelled_while_its_encode_is_answered_releases_the_answer(
    tmp_path,
) -> None:
    """The client goes away while the Encode is in flight. The call is left to finish, and
    the refs of its answer (held for two readers, the decoder and the cache) are freed;
    cancelling the call would lose an answer already on its way, and its holds would
    stay until their TTL (found by an adversarial probe: a miss cancelled 20-30 ms after
    it was sent left its image held for 120 s)."""
    from tests.unit.vlcommon.test_handoff import serving
    from vlcommon import handoff

    holder = handoff.Holder("encoder", shm_dir=tmp_path)
    releaser = handoff.Reader()
    async with serving(holder):
        async with in_process_server(
            encoder_service_pb2_grpc.add_EncoderServiceServicer_to_server,
            _SlowHoldingEncoder(holder, answer_after_s=0.5),
            "qwenvl.encoder.v1.EncoderService",
        ) as channel:
            stage = EncodeStage(
                encoder_service_pb2_grpc.EncoderServiceStub(channel),
                transport=tensor_pb2.TRANSPORT_SHM,
                timeout_s=10,
                releaser=releaser,
            )
            misses = [fresh(image(1)), fresh(image(2))]
            task = asyncio.ensure_future(stage.encode(misses, NO_DEADLINE, readers=2))
            await asyncio.sleep(0.2)
            assert len(holder) == 2
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await freed(holder)
    await releaser.close()
    holder.close()


async def test_cache_calls_go_to_the_replica_the_key_hashes_to_and_pass_over_a_dead_one() -> None:
    """Two cache replicas behind the gateway's ring: each image's Put and Lookups reach
    the same replica, so its repeats meet the replica that holds it; keys spread over
    both; a replica that is gone is passed over (the call is a miss, the next one goes to
    the next replica on the key's ring)."""
    from gateway.pipeline.route import DecoderRouter, Endpoint

    stores = [EmbeddingStore(descriptor_dim=DIM, capacity_bytes=1 << 20) for _ in range(2)]
    servicers = [CacheServicer(s, default_policy=SIMILAR, max_queries=8) for s in stores]
    async with contextlib.AsyncExitStack() as stack:
        channels = [
            await stack.enter_async_context(
                in_process_server(
                    cache_service_pb2_grpc.add_CacheServiceServicer_to_server,
                    servicer,
                    "qwenvl.cache.v1.CacheService",
                )
            )
            for servicer in servicers
        ]
        router = DecoderRouter()
        router.set_endpoints(
            [
                Endpoint(f"cache-{i}", cache_service_pb2_grpc.CacheServiceStub(ch), ch)
                for i, ch in enumerate(channels)
            ]
        )
        stage = CacheStage(
            router, spec=SPEC, revision="r1", transport=0, timeout_s=10, put_timeout_s=10
        )
        images = [image(i) for i in range(20, 32)]
        for im in images:
            await stage.put([im], SIMILAR, NO_DEADLINE)
        held = [{k for k in s.keys()} for s in stores]
        assert held[0] and held[1] and not held[0] & held[1]  # spread, each key once
        for im in images:  # each repeat is answered by the replica holding it
            asked = [fresh(im)]
            await stage.lookup(asked, SIMILAR, NO_DEADLINE)
            assert asked[0].tier == generation_pb2.CACHE_TIER_EXACT, im.key
        assert sum(s.hits["exact"] for s in servicers) == len(images)
        assert all(s.hits["miss"] == 0 for s in servicers)
        # The replica holding images[0] goes away (its address answers nothing now): a
        # miss, then the other replica.
        home = 0 if images[0].key in held[0] else 1
        dead = grpc.aio.insecure_channel("127.0.0.1:9")
        stack.push_async_callback(dead.close)
        endpoints = list(router.endpoints)
        endpoints[home] = Endpoint(
            f"cache-{home}", cache_service_pb2_grpc.CacheServiceStub(dead), dead
        )
        router.set_endpoints(endpoints)
        asked = [fresh(images[0])]
        await stage.lookup(asked, SIMILAR, NO_DEADLINE)
        assert asked[0].embedding is None
        before = servicers[1 - home].hits["miss"]
        await stage.lookup([fresh(images[0])], SIMILAR, NO_DEADLINE)
        assert servicers[1 - home].hits["miss"] == before + 1
