"""A byte-identical file is an exact hit without decoding (issue 19).

- The resize plan read from a file's header (size and EXIF orientation, no decode) equals
  the plan of the decoded upright image, for all eight EXIF orientations.
- The bytes key changes with the bytes, the plan, the model revision and the decoder
  version, and is the same for the same bytes.
- Through the real gateway servicer and a real cache service (in process, grpc.aio on
  loopback): a file seen before is answered by its digest and never decoded; the same
  pixels as another file are an exact hit by pixel key, after which that file is found
  by its digest too; a file whose header and decoded plans differ is never answered by
  its digest.
- The warm-up starts every preprocess thread and counts no decoded image.
- End to end (tests/e2e/test_bytes_key.py, the session cluster): a 12 MP phone JPEG sent
  twice is not decoded the second time, with equal tokens; its pixels as a PNG are an
  exact hit.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import struct
import sys
import threading
import time
import zlib
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
from PIL import Image
from prometheus_client import REGISTRY
from qwenvl.cache.v1 import cache_service_pb2_grpc
from qwenvl.common.v1 import generation_pb2, tensor_pb2
from qwenvl.decoder.v1 import decoder_service_pb2_grpc
from qwenvl.encoder.v1 import encoder_service_pb2_grpc

from cache_service.servicer import CacheServicer
from cache_service.store import EmbeddingStore
from gateway.pipeline import Downstream, Pipeline
from gateway.pipeline.preprocess import DECODE_NICE
from gateway.pipeline.same_file import Claims
from gateway.pipeline.types import PreparedImage
from gateway.settings import GatewaySettings
from tests.conftest import in_process_server, png_bytes
from vlcommon import tensors
from vlcommon.deadline import NO_DEADLINE, Deadline
from vlcommon.errors import ServiceError
from vlcommon.imaging import (
    DECODER_VERSION,
    DESCRIPTOR_DIM,
    bytes_key,
    decode_image,
    exact_key,
    plan_resize,
    read_header,
)
from vlcommon.model_info import VisionSpec

REVISION = "rev-test"
# Qwen3-VL geometry with the tiny checkpoint's budget (no checkpoint needed to plan).
SPEC = VisionSpec(
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    min_pixels=4096,
    max_pixels=65536,
    out_hidden_size=128,
    n_deepstack=2,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
)
MAX_PIXELS = 40_000_000
# How a camera stores an upright scene under each orientation tag (the inverse of the
# transpose ImageOps.exif_transpose applies); 1 stores it as it is.
STORING = {
    1: None,
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_90,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_270,
}
UPRIGHT_SIZE = (720, 400)  # width, height: the budget plans it 320x160, sideways 160x320


def scene(size: tuple[int, int] = UPRIGHT_SIZE, seed: int = 0) -> Image.Image:
    """A photo-like RGB image: gradients plus noise."""
    width, height = size
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x ^ y) & 255], axis=-1)
    noise = np.random.default_rng(seed).normal(0, 6, rgb.shape)
    return Image.fromarray(np.clip(rgb + noise, 0, 255).astype(np.uint8))


def stored_file(orientation: int, fmt: str, upright: Image.Image | None = None) -> bytes:
    """``upright`` stored as a camera would under ``orientation``, with the EXIF tag."""
    upright = upright or scene()
    method = STORING[orientation]
    stored = upright if method is None else upright.transpose(method)
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    stored.save(buf, format=fmt, exif=exif, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def plan_of(height: int, width: int):  # type: ignore[no-untyped-def]
    return plan_resize(height, width, SPEC, index=0)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
@pytest.mark.parametrize("orientation", sorted(STORING))
def test_the_header_plan_equals_the_decoded_upright_plan(orientation: int, fmt: str) -> None:
    data = stored_file(orientation, fmt)
    header = read_header(data)
    assert header is not None and header.orientation == orientation
    swapped = orientation in (5, 6, 7, 8)
    # The file really is stored sideways for 5-8: a plan from the stored size is wrong.
    stored_size = UPRIGHT_SIZE[::-1] if swapped else UPRIGHT_SIZE
    assert (header.stored_width, header.stored_height) == stored_size
    decoded = decode_image(data, index=0, max_decoded_pixels=MAX_PIXELS)
    assert decoded.size == UPRIGHT_SIZE == (header.width, header.height)
    from_header = plan_of(header.height, header.width)
    assert from_header == plan_of(decoded.height, decoded.width)
    assert (from_header.resized_width, from_header.resized_height) == (320, 160)
    if swapped:
        assert plan_of(header.stored_height, header.stored_width) != from_header


def test_reading_the_header_decodes_no_pixels() -> None:
    # A PNG cut in the middle of its pixel data: any decode of it fails, so a header read
    # (size, mode, orientation) that succeeds decoded nothing. Pillow's own PNG getexif
    # would load the image to look for EXIF after the pixel data, and fail here.
    data = png_bytes(scene())
    cut = data[: len(data) * 3 // 5]
    with pytest.raises(ServiceError) as exc:
        decode_image(cut, index=0, max_decoded_pixels=MAX_PIXELS)
    assert exc.value.reason == "IMAGE_DECODE_FAILED"
    header = read_header(cut)
    assert header is not None
    assert (header.format, header.mode, header.width, header.height) == ("PNG", "RGB", 720, 400)
    assert header.orientation == 1
    assert read_header(b"") is None and read_header(b"not an image") is None


def test_bytes_key_changes_with_bytes_plan_revision_and_decoder() -> None:
    data = stored_file(6, "JPEG")
    plan = plan_of(400, 720)
    key = bytes_key(data, plan, REVISION)
    assert len(key) == 64 and int(key, 16) >= 0  # full SHA-256, hex
    assert bytes_key(bytes(bytearray(data)), plan, REVISION) == key  # same bytes, a copy
    # Same pixels, other bytes (a byte after the JPEG's end marker): another key; the
    # pixel key is the one that equates them.
    trailing = data + b"\0"
    assert bytes_key(trailing, plan, REVISION) != key
    same = decode_image(trailing, index=0, max_decoded_pixels=MAX_PIXELS)
    assert same.tobytes() == decode_image(data, index=0, max_decoded_pixels=MAX_PIXELS).tobytes()
    # Other pixels too (saved again with another quality).
    other_quality = io.BytesIO()
    Image.open(io.BytesIO(data)).save(other_quality, "JPEG", quality=80)
    assert bytes_key(other_quality.getvalue(), plan, REVISION) != key
    # One flipped bit in the middle of the scan data.
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    assert bytes_key(bytes(flipped), plan, REVISION) != key
    # Another pixel budget, another plan: another key.
    small = plan_resize(400, 720, SPEC, index=0, max_pixels=16384)
    assert small != plan and bytes_key(data, small, REVISION) != key
    assert bytes_key(data, plan, "rev-other") != key
    # Another Pillow or codec library, or another decode pipeline: another key.
    assert bytes_key(data, plan, REVISION, decoder=DECODER_VERSION + "x") != key
    assert "pillow=" in DECODER_VERSION and "pipeline=" in DECODER_VERSION
    # Never equal to the pixel key of the same image.
    image = decode_image(data, index=0, max_decoded_pixels=MAX_PIXELS)
    assert exact_key(image, plan, REVISION) != key


def png_with_exif_after_idat(image: Image.Image, orientation: int) -> bytes:
    """A PNG whose eXIf chunk comes after its pixel data (allowed; read only on load)."""
    data = png_bytes(image)
    exif = Image.Exif()
    exif[0x0112] = orientation
    payload = exif.tobytes()
    chunk = struct.pack(">I", len(payload)) + b"eXIf" + payload
    chunk += struct.pack(">I", zlib.crc32(b"eXIf" + payload))
    iend = data.rindex(b"\0\0\0\0IEND")
    return data[:iend] + chunk + data[iend:]


def decoded_total() -> float:
    return REGISTRY.get_sample_value("splitvl_gateway_images_decoded_total") or 0.0


@pytest.fixture
async def gateway_and_cache():
    """The real gateway servicer with a real cache service on loopback (no encoder or
    decoder: the tests call the preprocess and cache stages, and stand in for the encoder
    with embeddings of the right shape)."""
    store = EmbeddingStore(descriptor_dim=DESCRIPTOR_DIM, capacity_bytes=64 * 2**20)
    cache = CacheServicer(store, default_policy=generation_pb2.CACHE_POLICY_SIMILAR, max_queries=8)
    async with in_process_server(
        cache_service_pb2_grpc.add_CacheServiceServicer_to_server,
        cache,
        "qwenvl.cache.v1.CacheService",
    ) as channel:
        nowhere = grpc.aio.insecure_channel("127.0.0.1:9")
        servicer = Pipeline(
            GatewaySettings(max_decoded_pixels=MAX_PIXELS),
            SPEC,
            REVISION,
            (),
            Downstream(
                encoder=encoder_service_pb2_grpc.EncoderServiceStub(nowhere),
                decoder=decoder_service_pb2_grpc.DecoderServiceStub(nowhere),
                cache=cache_service_pb2_grpc.CacheServiceStub(channel),
            ),
        )
        yield servicer, store
        await nowhere.close()


async def prepare(servicer: Pipeline, data: bytes) -> PreparedImage:
    """The preprocess stage and both lookups, as Generate runs them; a miss is "encoded"
    (embeddings of the right shape) and put, as Generate does."""
    policy = generation_pb2.CACHE_POLICY_SIMILAR
    lo, hi = SPEC.min_pixels, SPEC.max_pixels
    intake = await servicer.images.prepare([data], lo, hi, policy, NO_DEADLINE)
    if intake.ask_cache:
        await servicer.cache.lookup([im for im in intake.images if im.decoded], policy, NO_DEADLINE)
    (im,) = intake.images
    if im.embedding is None:
        values = np.full((im.plan.tokens, SPEC.embedding_width), 0.5, np.float32)
        im.embedding = tensor_pb2.ImageEmbedding(
            embeddings=tensors.from_numpy(values),
            grid=tensor_pb2.GridTHW(t=im.plan.grid_t, h=im.plan.grid_h, w=im.plan.grid_w),
            key=im.key,
        )
        await servicer.cache.put([im], policy, NO_DEADLINE)
    return im


async def test_a_repeated_file_is_answered_by_its_digest_without_decoding(
    gateway_and_cache,
) -> None:
    servicer, store = gateway_and_cache
    jpeg = stored_file(6, "JPEG")
    before = decoded_total()
    first = await prepare(servicer, jpeg)
    assert first.decoded and first.tier == generation_pb2.CACHE_TIER_MISS and first.bytes_key
    assert decoded_total() == before + 1
    second = await prepare(servicer, jpeg)
    assert not second.decoded and second.tier == generation_pb2.CACHE_TIER_EXACT
    assert second.pixels is None and decoded_total() == before + 1  # no decode at all
    assert second.key == first.key  # the entry's pixel key, as the decoder's uuid
    assert second.embedding is not None and second.embedding.key == first.key
    # One entry, its bytes counted once: the embeddings plus the verification image.
    assert first.verification is not None
    embedding_bytes = first.plan.tokens * SPEC.embedding_width * 4
    assert len(store) == 1 and store.bytes == embedding_bytes + first.verification.nbytes

    # The same upright pixels as a lossless PNG: another file, found by its pixel key...
    png = png_bytes(decode_image(jpeg, index=0, max_decoded_pixels=MAX_PIXELS))
    by_pixels = await prepare(servicer, png)
    assert by_pixels.decoded and by_pixels.tier == generation_pb2.CACHE_TIER_EXACT
    assert by_pixels.key == first.key and decoded_total() == before + 2
    # ... which made the PNG's digest an alias: its next copy is not decoded either.
    by_digest = await prepare(servicer, png)
    assert not by_digest.decoded and by_digest.tier == generation_pb2.CACHE_TIER_EXACT
    assert by_digest.key == first.key and decoded_total() == before + 2
    assert len(store) == 1  # one entry for the three: nothing stored twice
    store.check_invariants()


async def test_a_repeat_is_answered_while_every_decode_thread_is_busy(gateway_and_cache) -> None:
    """Headers and digests have threads of their own: a byte-identical repeat used to wait
    behind other requests' decodes (12 MP each) only to learn it needed none."""
    import threading

    servicer, _ = gateway_and_cache
    jpeg = stored_file(8, "JPEG")
    first = await prepare(servicer, jpeg)
    assert first.decoded
    release = threading.Event()
    busy = [
        servicer.preprocessor.decode_threads.submit(release.wait, 30)
        for _ in range(servicer.settings.preprocess_threads)
    ]
    try:
        before = decoded_total()
        again = await asyncio.wait_for(prepare(servicer, jpeg), 10)
        assert not again.decoded and again.tier == generation_pb2.CACHE_TIER_EXACT
        assert again.key == first.key and decoded_total() == before
        assert not any(f.done() for f in busy)  # the decode threads were busy throughout
    finally:
        release.set()


def same_file_waits(outcome: str) -> float:
    return (
        REGISTRY.get_sample_value("splitvl_gateway_same_file_waits_total", {"outcome": outcome})
        or 0.0
    )


async def encode_and_put(servicer: Pipeline, im: PreparedImage) -> None:
    """Stands in for the encoder (embeddings of the right shape), then puts, as Generate."""
    values = np.full((im.plan.tokens, SPEC.embedding_width), 0.25, np.float32)
    im.embedding = tensor_pb2.ImageEmbedding(
        embeddings=tensors.from_numpy(values),
        grid=tensor_pb2.GridTHW(t=im.plan.grid_t, h=im.plan.grid_h, w=im.plan.grid_w),
        key=im.key,
    )
    await servicer.cache.put([im], generation_pb2.CACHE_POLICY_SIMILAR, NO_DEADLINE)


async def prepare_claiming(
    servicer: Pipeline, datas: list[bytes], claims: Claims, deadline: Deadline = NO_DEADLINE
) -> list[PreparedImage]:
    lo, hi = SPEC.min_pixels, SPEC.max_pixels
    policy = generation_pb2.CACHE_POLICY_SIMILAR
    intake = await servicer.images.prepare(datas, lo, hi, policy, deadline, None, claims)
    return intake.images


async def test_a_request_for_bytes_being_encoded_waits_for_that_put_and_decodes_nothing(
    gateway_and_cache,
) -> None:
    """The same file sent again while its first request is still encoding it: the second
    waits for the first one's put and is then an exact hit by digest, never decoded
    (before, it was decoded, looked up, encoded in the same ViT call and put again)."""
    servicer, _ = gateway_and_cache
    jpeg = stored_file(1, "JPEG", scene(seed=31))
    before, hits_before = decoded_total(), same_file_waits("hit")
    first_claims = servicer.images.claims()
    (first,) = await prepare_claiming(servicer, [jpeg], first_claims)
    assert (
        first.decoded
        and first_claims.keys == [first.bytes_key]
        and len(servicer.images.same_file) == 1
    )
    second_claims = servicer.images.claims()
    follower = asyncio.create_task(prepare_claiming(servicer, [jpeg], second_claims))
    await asyncio.sleep(0.3)
    assert not follower.done()  # waiting for the first request's put
    await encode_and_put(servicer, first)
    first_claims.land()  # as the put does once it stored the entry
    (second,) = await asyncio.wait_for(follower, 10)
    assert not second.decoded and second.tier == generation_pb2.CACHE_TIER_EXACT
    assert second.embedding is not None and second.key == first.key
    assert decoded_total() == before + 1 and second_claims.keys == []
    assert same_file_waits("hit") == hits_before + 1 and len(servicer.images.same_file) == 0


async def test_a_follower_decodes_when_the_claimant_ends_without_a_put(gateway_and_cache) -> None:
    """The first request failed (or was cancelled) before its put: the waiting one looks
    up again, misses, and decodes as it always did; nothing waits for ever."""
    servicer, _ = gateway_and_cache
    png = stored_file(1, "PNG", scene(seed=32))
    before, misses_before = decoded_total(), same_file_waits("miss")
    first_claims = servicer.images.claims()
    await prepare_claiming(servicer, [png], first_claims)
    follower = asyncio.create_task(prepare_claiming(servicer, [png], servicer.images.claims()))
    await asyncio.sleep(0.3)
    assert not follower.done()
    first_claims.land()  # Generate's finally, no put
    (second,) = await asyncio.wait_for(follower, 10)
    assert second.decoded and second.tier == generation_pb2.CACHE_TIER_MISS
    assert decoded_total() == before + 2 and same_file_waits("miss") == misses_before + 1


async def test_a_request_holding_a_claim_never_waits_so_two_cannot_wait_on_each_other(
    gateway_and_cache,
) -> None:
    """Request A encodes X; request B sends [X, Y]: B claims Y and, holding a claim, does
    not wait for X (were it to wait, and A to wait for Y, neither would ever put)."""
    servicer, _ = gateway_and_cache
    x, y = (stored_file(1, "JPEG", scene(seed=s)) for s in (33, 34))
    a_claims = servicer.images.claims()
    await prepare_claiming(servicer, [x], a_claims)
    b_claims = servicer.images.claims()
    images = await asyncio.wait_for(prepare_claiming(servicer, [x, y], b_claims), 10)
    assert [im.decoded for im in images] == [True, True]
    assert b_claims.keys == [images[1].bytes_key] and a_claims.keys == [images[0].bytes_key]
    a_claims.land()
    b_claims.land()
    assert len(servicer.images.same_file) == 0


async def test_a_waiter_leaves_half_its_deadline_for_decoding_and_encoding_itself(
    gateway_and_cache,
) -> None:
    """The holder is slow: the waiter gives up after half of what is left to its deadline
    (not all of it: it would then fail a request it could still serve) and decodes."""

    servicer, _ = gateway_and_cache
    png = stored_file(1, "PNG", scene(seed=35))
    holder = servicer.images.claims()
    await prepare_claiming(servicer, [png], holder)
    misses_before = same_file_waits("miss")
    t0 = time.perf_counter()
    (im,) = await prepare_claiming(servicer, [png], servicer.images.claims(), Deadline.after(1.0))
    elapsed = time.perf_counter() - t0
    assert im.decoded and 0.45 < elapsed < 0.9, elapsed  # waited ~0.5 s, then decoded
    assert same_file_waits("miss") == misses_before + 1
    holder.land()


async def test_a_bad_file_beside_one_being_encoded_fails_at_once(gateway_and_cache) -> None:
    """A file without a digest (its header unreadable) is never waited on behind another:
    the request fails now with INVALID_ARGUMENT, not after the holder's encode."""
    servicer, _ = gateway_and_cache
    good = stored_file(1, "JPEG", scene(seed=36))
    holder = servicer.images.claims()
    await prepare_claiming(servicer, [good], holder)
    t0 = time.perf_counter()
    with pytest.raises(ServiceError) as err:
        await asyncio.wait_for(
            prepare_claiming(servicer, [good, b"not an image"], servicer.images.claims()), 10
        )
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert time.perf_counter() - t0 < 2
    holder.land()


async def test_a_failed_lookup_after_the_wait_stops_asking_the_cache(
    gateway_and_cache, monkeypatch
) -> None:
    """The cache fails the lookup after the wait: the image is decoded and the request
    asks the cache no more (no pixel-key lookup into a failing cache)."""
    servicer, _ = gateway_and_cache
    png = stored_file(1, "PNG", scene(seed=37))
    holder = servicer.images.claims()
    await prepare_claiming(servicer, [png], holder)
    real = servicer.cache.lookup_files
    calls = 0

    async def second_fails(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return None if calls == 2 else await real(*args, **kwargs)

    monkeypatch.setattr(servicer.cache, "lookup_files", second_fails)
    lo, hi = SPEC.min_pixels, SPEC.max_pixels
    policy = generation_pb2.CACHE_POLICY_SIMILAR
    follower = asyncio.create_task(
        servicer.images.prepare([png], lo, hi, policy, NO_DEADLINE, None, servicer.images.claims())
    )
    await asyncio.sleep(0.2)
    holder.land()
    intake = await asyncio.wait_for(follower, 10)
    (im,) = intake.images
    assert calls == 2 and im.decoded and intake.ask_cache is False


async def test_same_file_flights_claim_follow_and_land() -> None:
    from gateway.pipeline.same_file import SameFileFlights

    flights = SameFileFlights()
    mine: list[str] = []
    assert flights.claim_or_follow(["a", "b", "a"], mine) == {}  # "a" twice: claimed once
    assert mine == ["a", "b"] and len(flights) == 2
    theirs: list[str] = []
    follow = flights.claim_or_follow(["b", "c"], theirs)
    assert list(follow) == [0] and theirs == ["c"] and not follow[0].done()
    flights.land(["b"])
    assert follow[0].done() and len(flights) == 2  # "a" and "c" still held
    flights.land(["b", "a", "c"])  # landing twice is harmless
    assert len(flights) == 0


async def test_claims_land_once_by_their_one_owner() -> None:
    """A request keeps the claims its put will store, hands them to the put, and its own
    finally then lands nothing the put still holds."""
    from gateway.pipeline.same_file import SameFileFlights

    flights = SameFileFlights()
    claims = Claims(flights)
    assert claims.claim_or_follow(["a", "b"]) == {} and claims.keys == ["a", "b"]
    follower = flights.claim_or_follow(["a", "b"], [])
    claims.keep({"b"})  # "a" was a hit after all: its follower looks up now
    assert follower[0].done() and not follower[1].done() and claims.keys == ["b"]
    put = claims.hand_over()
    claims.land()  # the request's finally, before the put has ended
    assert not claims and not follower[1].done() and len(flights) == 1
    put.land()  # the put, once the entry is stored
    assert follower[1].done() and len(flights) == 0 and not put


async def test_a_file_whose_header_plan_differs_is_decoded_every_time(gateway_and_cache) -> None:
    servicer, store = gateway_and_cache
    # Orientation 6 only after the pixel data: the header says 720x400 stored as it is,
    # the decode turns it upright to 400x720 (another plan).
    odd = png_with_exif_after_idat(scene(seed=1), 6)
    header = read_header(odd)
    assert header is not None and header.orientation == 1
    assert decode_image(odd, index=0, max_decoded_pixels=MAX_PIXELS).size == (400, 720)
    before = decoded_total()
    first = await prepare(servicer, odd)
    assert first.decoded and first.bytes_key == ""  # the digest is not stored as an alias
    assert (first.plan.resized_width, first.plan.resized_height) == (160, 320)
    again = await prepare(servicer, odd)
    assert again.decoded and again.tier == generation_pb2.CACHE_TIER_EXACT  # by pixel key
    assert again.key == first.key and decoded_total() == before + 2
    store.check_invariants()


@contextlib.asynccontextmanager
async def lone_gateway(preprocess_threads: int) -> AsyncIterator[Pipeline]:
    """A gateway servicer with no cache, whose encoder and decoder are never called."""
    nowhere = grpc.aio.insecure_channel("127.0.0.1:9")
    try:
        yield Pipeline(
            GatewaySettings(preprocess_threads=preprocess_threads, cache_address=""),
            SPEC,
            REVISION,
            (),
            Downstream(
                encoder=encoder_service_pb2_grpc.EncoderServiceStub(nowhere),
                decoder=decoder_service_pb2_grpc.DecoderServiceStub(nowhere),
                cache=None,
            ),
        )
    finally:
        await nowhere.close()


async def test_warm_up_starts_every_preprocess_thread_and_counts_no_decode() -> None:
    async with lone_gateway(preprocess_threads=3) as servicer:
        before = decoded_total()
        await servicer.warm_up()
        assert len(servicer.preprocessor.decode_threads._threads) == 3
        assert decoded_total() == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
async def test_decode_threads_yield_the_cpu_to_the_header_threads() -> None:
    """Found 2026-12-01 (bench --photos, 32 in flight on 2 cores): a byte-identical
    repeat's digest took 4-35 ms while the decode threads and the encoder held both
    cores, against 1.4-3.3 ms one at a time. The decode threads run DECODE_NICE lower."""

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    loop = asyncio.get_running_loop()
    base = nice()
    async with lone_gateway(preprocess_threads=2) as servicer:
        decode = await loop.run_in_executor(servicer.preprocessor.decode_threads, nice)
        headers = await loop.run_in_executor(servicer.preprocessor.header_threads, nice)
    assert (decode, headers) == (min(base + DECODE_NICE, 19), base)
