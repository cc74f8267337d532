"""The similarity tier's verification and revision rule, through the real CacheService.

Every image goes through the gateway's own pipeline (encoded bytes -> ``decode_image`` ->
``plan_resize`` -> ``similarity_descriptor``, ``resize_to_plan`` -> ``verification_image``)
and then through a real in-process ``grpc.aio`` CacheService with a real FAISS index. The
adversarial pairs (``splitvl_tools.cache_eval.adversarial_pairs``: receipt photos, charts, UI
screenshots one number/word/bar apart, and the 32x32-average poisoning construction)
score a cosine of 0.98-1.00 on the descriptor, so only the verification stands between
them and a false hit.
"""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from PIL import Image, ImageEnhance
from qwenvl.cache.v1 import cache_service_pb2 as pb
from qwenvl.cache.v1 import cache_service_pb2_grpc as pb_grpc
from qwenvl.common.v1 import generation_pb2, tensor_pb2

from cache_service.servicer import CacheServicer
from cache_service.store import EmbeddingStore
from gateway.pipeline.types import verification_fields
from splitvl_tools import cache_eval
from tests.conftest import in_process_server, photo
from tests.unit.gateway.test_bytes_key import gateway_and_cache  # noqa: F401  (a fixture)
from tests.unit.gateway.test_bytes_key import prepare as gateway_prepare
from vlcommon import tensors
from vlcommon.grid_reuse import reusable_grids
from vlcommon.imaging import (
    DESCRIPTOR_DIM,
    cosine_similarity,
    decode_image,
    exact_key,
    plan_resize,
    similarity_descriptor,
)
from vlcommon.model_info import VisionSpec
from vlcommon.verification import (
    VERIFY_MARGIN,
    VERIFY_MAX_PIXELS,
    VERIFY_TOLERANCE,
    VerificationImage,
    chroma_shape,
    verifiable,
    verification_image,
    verification_residual,
    verification_size,
    verify,
)

SPEC = cache_eval.default_spec()  # Qwen3-VL geometry, the tiny checkpoint's pixel budget
WIDTH = 6
REV = "rev-A"
SIMILAR = generation_pb2.CACHE_TIER_SIMILAR
MISS = generation_pb2.CACHE_TIER_MISS


@dataclass
class Prepared:
    """What the gateway computes for one image before any ViT work."""

    key: str
    descriptor: np.ndarray
    grid: tuple[int, int, int]
    tokens: int
    verification: VerificationImage


def encode(image: Image.Image, fmt: str = "PNG", **kw: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def prepare(data: bytes, revision: str = REV, spec: VisionSpec = SPEC) -> Prepared:
    image = decode_image(data, index=0, max_decoded_pixels=40_000_000)
    plan = plan_resize(image.height, image.width, spec, index=0)
    return Prepared(
        key=exact_key(image, plan, revision),
        descriptor=similarity_descriptor(image),
        grid=plan.grid,
        tokens=plan.tokens,
        verification=verification_image(image, data),
    )


def put_entry(p: Prepared, revision: str = REV, with_verification: bool = True) -> pb.PutEntry:
    t, h, w = p.grid
    entry = pb.PutEntry(
        key=p.key,
        descriptor=tensors.from_numpy(p.descriptor),
        embedding=tensor_pb2.ImageEmbedding(
            embeddings=tensors.from_numpy(np.ones((p.tokens, WIDTH), np.float32)),
            grid=tensor_pb2.GridTHW(t=t, h=h, w=w),
            key=p.key,
        ),
        revision=revision,
    )
    if with_verification:
        for name, value in verification_fields(p.verification).items():
            _set(entry, name, value)
    return entry


def _set(msg: pb.PutEntry | pb.LookupQuery, name: str, value: object) -> None:
    """One of ``verification_fields``' values on a message: a list, bytes or a tensor."""
    if isinstance(value, list):
        getattr(msg, name).extend(value)
    elif isinstance(value, bytes):
        setattr(msg, name, value)
    else:
        getattr(msg, name).CopyFrom(value)


def query(p: Prepared, revision: str = REV, with_verification: bool = True) -> pb.LookupQuery:
    t, h, w = p.grid
    q = pb.LookupQuery(
        key=p.key,
        descriptor=tensors.from_numpy(p.descriptor),
        grid=tensor_pb2.GridTHW(t=t, h=h, w=w),
        revision=revision,
    )
    if with_verification:
        for name, value in verification_fields(p.verification).items():
            _set(q, name, value)
    return q


@pytest.fixture
async def cache() -> AsyncIterator[tuple[pb_grpc.CacheServiceStub, EmbeddingStore]]:
    store = EmbeddingStore(descriptor_dim=DESCRIPTOR_DIM, capacity_bytes=10**8)
    servicer = CacheServicer(
        store, default_policy=generation_pb2.CACHE_POLICY_SIMILAR, max_queries=64
    )
    async with in_process_server(
        pb_grpc.add_CacheServiceServicer_to_server, servicer, "qwenvl.cache.v1.CacheService"
    ) as channel:
        yield pb_grpc.CacheServiceStub(channel), store


async def lookup(stub: pb_grpc.CacheServiceStub, *queries: pb.LookupQuery) -> list:
    resp = await stub.Lookup(pb.LookupRequest(queries=list(queries), include_embeddings=True))
    return list(resp.results)


def _gray(luma: np.ndarray) -> VerificationImage:
    """The verification image of a grey picture: ``luma`` with neutral chroma (128)."""
    return VerificationImage(luma, np.full(chroma_shape(*luma.shape), 128, np.uint8))


def test_verification_image_and_residual() -> None:
    pixels = np.zeros((64, 96, 3), np.uint8)
    pixels[:, :, 0] = 255  # pure red: luma 76 (ITU-R 601), Cr far above neutral
    v = verification_image(pixels)
    # The decoded image's own size: no plan in it; chroma at half per side.
    assert v.luma.dtype == np.uint8 and v.luma.shape == (64, 96) and int(v.luma[0, 0]) == 76
    assert v.chroma.dtype == np.uint8 and v.chroma.shape == (32, 48, 2)
    assert int(v.chroma[0, 0, 1]) > 200 and int(v.chroma[0, 0, 0]) < 128  # Cr high, Cb low
    same = verification_image(Image.fromarray(pixels))
    assert same.luma.tolist() == v.luma.tolist() and same.chroma.tolist() == v.chroma.tolist()
    assert v.nbytes == 64 * 96 + 32 * 48 * 2
    # Over VERIFY_MAX_PIXELS: area-averaged to fit, aspect kept.
    big = verification_image(Image.new("RGB", (4032, 3024), (255, 0, 0)))
    assert big.luma.size <= VERIFY_MAX_PIXELS and big.luma.shape == (1254, 1672)
    assert big.chroma.shape == (627, 836, 2) and int(big.luma[5, 5]) == 76
    rng = np.random.default_rng(0)
    a = _gray(rng.integers(0, 200, (64, 96), dtype=np.uint8))
    assert verification_residual(a, a) == 0.0
    # A global gain and offset (contrast and brightness) is normalised away: what is left
    # is rounding, spread evenly (the isolation check scores an even residual at most
    # VERIFY_TOLERANCE / ISOLATION_RATIO = 2.5, and this one at about 1).
    b = _gray(np.clip(a.luma.astype(np.float32) * 1.05 + 6, 0, 255).round().astype(np.uint8))
    assert verification_residual(a, b) < 1.5 and verify(a, b)
    # One 8x8 area (one 4x4 block after the 2x2 reduction) changed by 40 levels.
    c = a.luma.copy()
    c[16:24, 16:24] = np.clip(c[16:24, 16:24].astype(np.int16) + 40, 0, 255).astype(np.uint8)
    assert verification_residual(a, _gray(c)) > 30 and not verify(a, _gray(c))
    # The same luma with another colour in one 8x8 area (chroma only) fails too.
    d = VerificationImage(a.luma, a.chroma.copy())
    d.chroma[8:12, 8:12, 1] = 200
    assert verification_residual(a, d) > VERIFY_TOLERANCE and not verify(a, d)
    # Another aspect ratio, a size more than 12% apart or a missing image never passes;
    # nor does a chroma image of the wrong shape.
    assert verification_residual(a, _gray(a.luma[:, :80])) == float("inf")
    half = np.asarray(Image.fromarray(a.luma).resize((48, 32), Image.Resampling.BOX))
    assert verification_residual(a, _gray(half)) == float("inf")
    assert not verify(a, None) and not verify(None, a)
    bad = VerificationImage(a.luma, a.chroma[:, :-1])
    assert not verify(bad, bad) and verification_residual(a, bad) == float("inf")
    # A smooth image and a 5% smaller copy of it are compared at the smaller's size.
    y, x = np.mgrid[0:200, 0:300]
    smooth = (100 + 60 * np.sin(x / 23.0) * np.cos(y / 17.0)).astype(np.uint8)
    smaller = np.asarray(Image.fromarray(smooth).resize((285, 190), Image.Resampling.BICUBIC))
    assert verification_residual(_gray(smooth), _gray(smaller)) < 2.0
    assert verify(_gray(smaller), _gray(smooth))


def test_verifiable_only_when_the_verification_sees_what_the_plan_keeps() -> None:
    """An image over the cap whose plan keeps more than 1/VERIFY_MARGIN of the
    verification image's resolution per side would let the model read detail the
    verification does not resolve: such an image is exact-only."""
    assert verifiable(1000, 750, 65536)  # the plan shrinks it: the verification sees more
    assert verifiable(1000, 750, 2_000_000)  # the whole image is verified: nothing is lost
    w, h = verification_size(4032, 3024)
    assert verifiable(4032, 3024, int(w * h / VERIFY_MARGIN**2))
    assert not verifiable(4032, 3024, int(w * h / VERIFY_MARGIN**2) + 100)
    assert not verifiable(4032, 3024, 1280 * 32 * 32)  # the photos budget: exact-only
    assert not verifiable(4032, 3024, 4032 * 3024)  # Qwen3-VL's budget keeps ~12 MP
    assert verifiable(4032, 3024, 65536)  # the tiny checkpoint's budget


async def test_adversarial_pairs_never_hit_through_the_cache(cache) -> None:
    stub, store = cache
    pairs = cache_eval.adversarial_pairs()
    kinds = {kind for kind, _, _ in pairs}
    assert {"receipt-gradient", "chart-one-bar", "ui-light", "ui-dark"} <= kinds
    assert {"page-photo-12px", "screen-dark-11px", "invoice-photo", "random-pixels"} <= kinds
    fooled = 0
    for kind, a, b in pairs:
        pa = prepare(encode(a))
        await stub.Put(pb.PutRequest(entries=[put_entry(pa)]))
        for data in (encode(b), encode(b, "JPEG", quality=90)):
            pb_ = prepare(data)
            cos = cosine_similarity(pa.descriptor, pb_.descriptor)
            fooled += cos >= store.threshold and pb_.grid == pa.grid
            (result,) = await lookup(stub, query(pb_))
            assert result.tier == MISS, (kind, cos, result.matched_key)
            assert verification_residual(pa.verification, pb_.verification) > VERIFY_TOLERANCE
    # The descriptor alone would have answered most of them with the other picture.
    assert fooled >= len(pairs) // 2


async def test_photographed_invoice_one_digit_is_refused_at_every_budget(cache) -> None:
    """The verification image is the decoded image's, not the plan's: a photographed
    invoice whose total differs in one digit (28 px type on a 1200x1600 page) is refused at
    the tiny checkpoint's budget, where the plan shrinks the glyphs to ~5 px, as at Qwen3-VL's."""
    stub, _ = cache
    a, b = (encode(cache_eval.invoice_photo(t, seed=0)) for t in cache_eval.INVOICE_TOTALS[0])
    for spec in (SPEC, cache_eval.default_spec(65536, 16777216)):
        pa, pb_ = prepare(a, spec=spec), prepare(b, spec=spec)
        assert cosine_similarity(pa.descriptor, pb_.descriptor) > 0.99 and pa.grid == pb_.grid
        await stub.Put(pb.PutRequest(entries=[put_entry(pa)]))
        (result,) = await lookup(stub, query(pb_))
        assert result.tier == MISS, spec.max_pixels
        assert verification_residual(pa.verification, pb_.verification) > 2 * VERIFY_TOLERANCE


def test_small_text_on_a_photographed_page_is_verified_at_every_budget() -> None:
    """12 px and 22 px text on an 800x600 page photo shrink to ~4-8 px at the tiny
    checkpoint's 65,536-pixel budget, where one changed digit was within resampling noise
    at the plan's resolution (residual ~1-2 levels, a false hit before). The verification
    image is the decoded page at its own 800x600, the same at every budget, and the edit is
    over the tolerance."""
    big = cache_eval.default_spec(65536, 16777216)
    for size in (12, 22):
        a, b = (
            encode(cache_eval.text_page_photo(t, seed=0, size=size))
            for t in cache_eval.ONE_CHARACTER[0]
        )
        tiny_a, qwen_a = prepare(a), prepare(a, spec=big)
        assert tiny_a.grid != qwen_a.grid  # two plans, one verification image
        assert tiny_a.verification.luma.tolist() == qwen_a.verification.luma.tolist()
        assert tiny_a.verification.luma.shape == (600, 800)
        residual = verification_residual(tiny_a.verification, prepare(b).verification)
        assert residual > 1.3 * VERIFY_TOLERANCE, size


async def test_poisoning_construction_never_hits(cache) -> None:
    """The attacker's image shares the victim's 32x32 box averages (descriptor cosine
    ~1.0) and is stored first; the victim's own photo must not get its embeddings, while a
    JPEG of the victim still finds the victim's genuine entry behind the attacker's (the
    next candidate is tried)."""
    stub, store = cache
    victim = Image.open(io.BytesIO(photo("astronaut.png"))).convert("RGB").resize((256, 256))
    attacker = cache_eval.lowfreq_swap(victim, Image.open(io.BytesIO(photo("chelsea.png"))))
    pa, pv = prepare(encode(attacker)), prepare(encode(victim))
    assert cosine_similarity(pa.descriptor, pv.descriptor) > 0.99 and pa.grid == pv.grid
    await stub.Put(pb.PutRequest(entries=[put_entry(pa)]))
    (result,) = await lookup(stub, query(pv))
    assert result.tier == MISS and result.similarity > 0.99
    # The victim's genuine entry, then a near duplicate of it: the attacker's entry is the
    # closer descriptor for some queries, the victim's is the only one that verifies.
    await stub.Put(pb.PutRequest(entries=[put_entry(pv)]))
    near = prepare(encode(victim, "JPEG", quality=80))
    (result,) = await lookup(stub, query(near))
    assert result.tier == SIMILAR and result.matched_key == pv.key


async def test_near_duplicates_still_hit(cache) -> None:
    stub, _ = cache
    for name in ("astronaut.png", "coffee.png", "rocket.jpg"):
        image = decode_image(photo(name), index=0, max_decoded_pixels=40_000_000)
        original = prepare(photo(name))
        await stub.Put(pb.PutRequest(entries=[put_entry(original)]))
        variants = [
            encode(image, "JPEG", quality=70),
            encode(image, "JPEG", quality=95),
            encode(ImageEnhance.Brightness(image).enhance(1.03)),
            encode(ImageEnhance.Contrast(image).enhance(0.95)),
            encode(image.resize((round(image.width * 0.98), round(image.height * 0.98)))),
        ]
        for i, data in enumerate(variants):
            (result,) = await lookup(stub, query(prepare(data)))
            assert result.tier == SIMILAR and result.matched_key == original.key, (name, i)
            assert list(result.embedding.embeddings.shape) == [original.tokens, WIDTH]


async def test_other_revision_never_hits_and_missing_verification_never_hits(cache) -> None:
    stub, _ = cache
    image = decode_image(photo("chelsea.png"), index=0, max_decoded_pixels=40_000_000)
    stored = prepare(photo("chelsea.png"), revision="rev-A")
    await stub.Put(pb.PutRequest(entries=[put_entry(stored, revision="rev-A")]))
    jpeg = encode(image, "JPEG", quality=90)
    same, other = prepare(jpeg, revision="rev-A"), prepare(jpeg, revision="rev-B")
    same_rev, other_rev, no_verify = await lookup(
        stub,
        query(same, revision="rev-A"),
        query(other, revision="rev-B"),
        query(same, revision="rev-A", with_verification=False),
    )
    assert same_rev.tier == SIMILAR and same_rev.matched_key == stored.key
    assert other_rev.tier == MISS and other_rev.similarity > 0.85
    assert no_verify.tier == MISS
    # An entry stored without a verification image is never a similarity hit either.
    coffee = decode_image(photo("coffee.png"), index=0, max_decoded_pixels=40_000_000)
    bare = prepare(photo("coffee.png"))
    await stub.Put(pb.PutRequest(entries=[put_entry(bare, with_verification=False)]))
    (result,) = await lookup(stub, query(prepare(encode(coffee, "JPEG", quality=90))))
    assert result.tier == MISS and result.similarity > 0.85
    # ... while its exact key still hits exactly.
    (result,) = await lookup(stub, query(bare))
    assert result.tier == generation_pb2.CACHE_TIER_EXACT


async def test_verification_counts_in_the_budget_and_bad_ones_are_invalid(cache) -> None:
    stub, store = cache
    p = prepare(photo("coffee.png"))
    await stub.Put(pb.PutRequest(entries=[put_entry(p)]))
    assert store.bytes == p.tokens * WIDTH * 4 + p.verification.nbytes
    store.check_invariants()
    bad = put_entry(prepare(photo("rocket.jpg")))
    bad.verification.CopyFrom(tensors.from_numpy(p.verification.luma.astype(np.float32)))
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Put(pb.PutRequest(entries=[bad]))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "entries[0].verification" in exc.value.details()
    q = query(p)
    q.verification.CopyFrom(tensors.from_numpy(np.zeros((4,), np.uint8)))
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await lookup(stub, q)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "queries[0].verification" in exc.value.details()
    # A chroma image that does not fit its luma names both shapes.
    q = query(p)
    h, w = p.verification.luma.shape
    q.verification_chroma.CopyFrom(tensors.from_numpy(np.zeros((h // 2 + 1, w // 2, 2), np.uint8)))
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await lookup(stub, q)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details() == (
        f"queries[0].verification_chroma.shape is [{h // 2 + 1}, {w // 2}, 2]; for "
        f"queries[0].verification.shape [{h}, {w}] it must be {[-(-h // 2), -(-w // 2), 2]} "
        "(ceil(h / 2), ceil(w / 2), 2)"
    )


def _grey_total(total: str) -> Image.Image:
    """A dark app screen with a grey card and 11 px grey-on-grey text (ink 120 on 80)."""
    from PIL import ImageDraw, ImageFont

    image = cache_eval.ui_screen("", dark=True, size=11)
    draw = ImageDraw.Draw(image)
    draw.rectangle((110, 60, 380, 280), fill=(80, 80, 80))
    draw.text(
        (120, 80), f"Total: {total}", fill=(120, 120, 120), font=ImageFont.load_default(size=11)
    )
    return image


async def test_a_faint_edit_under_a_jpeg_is_a_miss_either_way_round(cache) -> None:
    """The JPEG-matched check through the service: a screenshot and a JPEG (q90) of it with
    one digit of faint 11 px type changed. Stored as the PNG, the JPEG query is a miss; a
    JPEG of the same screenshot is a similarity hit. Stored as the JPEG (its table and luma
    kept with the entry), the edited PNG is a miss and the PNG itself a hit. Before the
    check both edits were served (2026-12-01)."""
    stub, store = cache
    original, edited = _grey_total("1,234.50"), _grey_total("1,284.50")
    png, jpeg = prepare(encode(original)), prepare(encode(edited, "JPEG", quality=90))
    assert jpeg.verification.jpeg is not None and png.verification.jpeg is None
    await stub.Put(pb.PutRequest(entries=[put_entry(png)]))
    edit, same = await lookup(
        stub, query(jpeg), query(prepare(encode(original, "JPEG", quality=90)))
    )
    assert edit.tier == MISS and edit.similarity > 0.85
    assert same.tier == SIMILAR and same.matched_key == png.key
    # The other way round, under another revision (the PNG's entry cannot answer): the
    # JPEG stored, lossless queries.
    before = store.bytes
    stored = prepare(encode(original, "JPEG", quality=90), revision="rev-B")
    await stub.Put(pb.PutRequest(entries=[put_entry(stored, revision="rev-B")]))
    assert store.bytes - before == stored.tokens * WIDTH * 4 + stored.verification.nbytes
    edit, same = await lookup(
        stub,
        query(prepare(encode(edited), revision="rev-B"), revision="rev-B"),
        query(prepare(encode(original), revision="rev-B"), revision="rev-B"),
    )
    assert edit.tier == MISS and edit.similarity > 0.85
    assert same.tier == SIMILAR and same.matched_key == stored.key


async def test_the_gateway_sends_a_jpegs_table_and_its_faint_edit_is_a_miss(
    gateway_and_cache,  # noqa: F811  (the fixture imported above)
) -> None:
    """The same through the real gateway servicer (its preprocess stage reads the JPEG's
    table from the file it decoded, its cache stage sends it) and a real CacheService: the
    PNG screenshot is stored; a JPEG of it is a similarity hit; a JPEG of it with one
    faint digit changed is a miss."""
    servicer, _ = gateway_and_cache
    original, edited = _grey_total("1,234.50"), _grey_total("1,284.50")
    first = await gateway_prepare(servicer, encode(original))
    assert first.tier == MISS and first.verification is not None
    assert first.verification.jpeg is None
    same = await gateway_prepare(servicer, encode(original, "JPEG", quality=90))
    assert same.verification is not None and same.verification.jpeg is not None
    assert same.tier == SIMILAR and same.embedding is not None
    assert same.embedding.key == first.key
    edit = await gateway_prepare(servicer, encode(edited, "JPEG", quality=90))
    assert edit.tier == MISS and edit.similarity > 0.85


async def test_a_faint_edit_in_another_encoders_jpeg_is_a_miss(cache) -> None:
    """The coefficient-interval check through the service: the PNG screenshot stored, an
    ffmpeg JPEG (qscale 2) of it is a similarity hit, and an ffmpeg JPEG of it with one
    digit of faint 11 px type changed is a miss, as is a Pillow JPEG of the edit shifted
    one level first. Until 2026-12-03 both edits were served (the JPEG-matched check does
    not apply to them)."""
    stub, _ = cache
    original, edited = _grey_total("1,234.50"), _grey_total("1,284.50")
    png = prepare(encode(original))
    await stub.Put(pb.PutRequest(entries=[put_entry(png)]))
    brighter = Image.fromarray((np.asarray(edited, dtype=np.int16) + 1).astype(np.uint8), "RGB")
    queries = [
        prepare(cache_eval.encode_mjpeg(original, 2)),
        prepare(cache_eval.encode_mjpeg(edited, 2)),
        prepare(encode(brighter, "JPEG", quality=90)),
    ]
    assert all(q.verification.jpeg is not None for q in queries)
    same, edit, shifted = await lookup(stub, *(query(q) for q in queries))
    assert same.tier == SIMILAR and same.matched_key == png.key
    assert edit.tier == MISS and edit.similarity > 0.85
    assert shifted.tier == MISS and shifted.similarity > 0.85


async def test_bad_jpeg_fields_are_invalid(cache) -> None:
    """verification_jpeg_quantization must be 64 values in 1..255; the clipped pixels'
    indices strictly increasing, inside the image, at most a quarter of it, one value
    each; and every JPEG field needs the verification image and the table:
    INVALID_ARGUMENT naming the field and the rule."""
    stub, _ = cache
    p = prepare(encode(_grey_total("1,234.50"), "JPEG", quality=90))
    h, w = p.verification.luma.shape

    async def refused(q: pb.LookupQuery) -> str:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await lookup(stub, q)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return exc.value.details()

    q = query(p)
    del q.verification_jpeg_quantization[63]
    table = list(q.verification_jpeg_quantization)
    assert await refused(q) == (
        f"queries[0].verification_jpeg_quantization has 63 values from {min(table)} to "
        f"{max(table)}; it must be a baseline JPEG luma table: 64 values in 1..255"
    )
    q = query(p)
    q.verification_jpeg_quantization[5] = 256
    assert f"from {min(table)} to 256" in await refused(q)
    q = query(p)
    q.verification_jpeg_quantization[0] = 0
    assert "from 0 to" in await refused(q)
    pixels = h * w
    q = query(p)
    q.verification_jpeg_clipped_index.extend([5, 3])
    q.verification_jpeg_clipped_luma = b"ab"
    assert await refused(q) == (
        "queries[0].verification_jpeg_clipped_index must be strictly increasing flat "
        f"indices below {pixels} (h * w of queries[0].verification)"
    )
    q = query(p)
    q.verification_jpeg_clipped_index.extend([3, pixels])
    q.verification_jpeg_clipped_luma = b"ab"
    assert "strictly increasing flat indices below" in await refused(q)
    q = query(p)
    q.verification_jpeg_clipped_index.extend([3, 5])
    q.verification_jpeg_clipped_luma = b"a"
    assert await refused(q) == (
        "queries[0].verification_jpeg_clipped_luma has 1 bytes; it must have one per index "
        "of queries[0].verification_jpeg_clipped_index (2)"
    )
    q = query(p)
    q.verification_jpeg_clipped_index.extend(range(pixels // 4 + 1))
    q.verification_jpeg_clipped_luma = bytes(pixels // 4 + 1)
    assert await refused(q) == (
        f"queries[0].verification_jpeg_clipped_index has {pixels // 4 + 1} indices; at "
        f"most {pixels // 4} (0.25 of the {pixels} pixels of queries[0].verification)"
    )
    q = query(p)
    q.ClearField("verification_jpeg_quantization")
    q.verification_jpeg_clipped_index.append(3)
    q.verification_jpeg_clipped_luma = b"a"
    assert await refused(q) == (
        "queries[0].verification_jpeg_clipped_index is set without "
        "queries[0].verification_jpeg_quantization (64 values)"
    )
    q = query(p, with_verification=False)
    q.verification_jpeg_quantization.extend([1] * 64)
    assert await refused(q) == (
        "queries[0].verification_jpeg_quantization is set without queries[0].verification: "
        "it describes the verification image's JPEG"
    )
    # No JPEG is wider than 65,500 pixels: a table on a wider verification image is refused
    # (it made the check's encoder raise: INTERNAL for every query that met the entry).
    wide = pb.LookupQuery(
        key="wide",
        descriptor=q.descriptor,
        grid=q.grid,
        revision=REV,
        verification=tensors.from_numpy(np.zeros((1, 70000), np.uint8)),
        verification_chroma=tensors.from_numpy(np.zeros(chroma_shape(1, 70000), np.uint8)),
        verification_jpeg_quantization=[2] * 64,
    )
    assert await refused(wide) == (
        "queries[0].verification_jpeg_quantization is set on queries[0].verification of "
        "shape [1, 70000]; a JPEG is at most 65500 pixels per side"
    )
    entry = put_entry(p)
    entry.verification_jpeg_quantization.append(3)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Put(pb.PutRequest(entries=[entry]))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "entries[0].verification_jpeg_quantization has 65 values" in exc.value.details()


async def test_luma_without_chroma_is_exact_only(cache) -> None:
    """An older gateway sends the luma alone: accepted, but luma cannot tell a grayscale
    copy from the colour photo, so neither such an entry nor such a query is ever a
    similarity hit (the same image still hits exactly)."""
    stub, store = cache

    def jpeg_of(name: str) -> Prepared:
        image = decode_image(photo(name), index=0, max_decoded_pixels=10**8)
        return prepare(encode(image, "JPEG", quality=90))

    old = put_entry(prepare(photo("coffee.png")))
    old.ClearField("verification_chroma")
    await stub.Put(pb.PutRequest(entries=[old]))
    assert store.bytes == len(old.embedding.embeddings.data)  # no verification stored
    (result,) = await lookup(stub, query(jpeg_of("coffee.png")))
    assert result.tier == MISS  # the entry is not verifiable
    (result,) = await lookup(stub, query(prepare(photo("coffee.png"))))
    assert result.tier == generation_pb2.CACHE_TIER_EXACT
    # A verifiable entry: the near copy hits with chroma, never without.
    await stub.Put(pb.PutRequest(entries=[put_entry(prepare(photo("rocket.jpg")))]))
    bare = query(jpeg_of("rocket.jpg"))
    bare.ClearField("verification_chroma")
    (result,) = await lookup(stub, bare)
    assert result.tier == MISS
    (result,) = await lookup(stub, query(jpeg_of("rocket.jpg")))
    assert result.tier == SIMILAR


def with_reusable(q: pb.LookupQuery, data: bytes, spec: VisionSpec) -> pb.LookupQuery:
    """The query with the grids of its aspect class, as the gateway computes them."""
    image = decode_image(data, index=0, max_decoded_pixels=40_000_000)
    grids = reusable_grids(
        image.height, image.width, spec, min_pixels=spec.min_pixels, max_pixels=spec.max_pixels
    )
    q.reusable_grids.extend(tensor_pb2.GridTHW(t=t, h=h, w=w) for t, h, w in grids[1:])
    return q


async def test_a_resized_copy_is_served_with_the_stored_grid_within_the_bound(cache) -> None:
    """At Qwen3-VL's budget a 4% smaller copy of a photo gets another grid. Listing the
    grids of its aspect class lets the similarity tier answer with the stored entry (its
    embeddings and its grid); without them, and for a half-size copy, it is a miss. The
    exact tier never answers with another grid."""
    stub, _ = cache
    qwen = cache_eval.default_spec(65536, 16777216)
    image = decode_image(photo("astronaut.png"), index=0, max_decoded_pixels=40_000_000)
    stored = prepare(photo("astronaut.png"), spec=qwen)
    await stub.Put(pb.PutRequest(entries=[put_entry(stored)]))
    smaller = encode(image.resize((round(image.width * 0.96), round(image.height * 0.96))))
    half = encode(image.resize((image.width // 2, image.height // 2)))
    ps, ph = prepare(smaller, spec=qwen), prepare(half, spec=qwen)
    assert ps.grid != stored.grid and ph.grid != stored.grid
    plain, served, half_result = await lookup(
        stub,
        query(ps),
        with_reusable(query(ps), smaller, qwen),
        with_reusable(query(ph), half, qwen),
    )
    assert plain.tier == MISS and plain.similarity > 0.99
    assert served.tier == SIMILAR and served.matched_key == stored.key
    g = served.embedding.grid
    assert (g.t, g.h, g.w) == stored.grid
    assert list(served.embedding.embeddings.shape) == [stored.tokens, WIDTH]
    assert half_result.tier == MISS and stored.grid not in [
        (r.t, r.h, r.w) for r in with_reusable(query(ph), half, qwen).reusable_grids
    ]
    # The exact key with a reusable grid listed is still a miss under another grid.
    exact = query(stored)
    exact.grid.CopyFrom(tensor_pb2.GridTHW(t=1, h=ps.grid[1], w=ps.grid[2]))
    exact.reusable_grids.add(t=1, h=stored.grid[1], w=stored.grid[2])
    exact.ClearField("descriptor")
    (result,) = await lookup(stub, exact)
    assert result.tier == MISS


async def test_an_equal_grid_candidate_is_preferred_and_bad_reusable_grids_are_invalid(
    cache,
) -> None:
    stub, _ = cache
    qwen = cache_eval.default_spec(65536, 16777216)
    image = decode_image(photo("coffee.png"), index=0, max_decoded_pixels=40_000_000)
    big = prepare(photo("coffee.png"), spec=qwen)
    smaller = encode(image.resize((round(image.width * 0.96), round(image.height * 0.96))))
    small = prepare(smaller, spec=qwen)
    await stub.Put(pb.PutRequest(entries=[put_entry(big), put_entry(small)]))
    # A JPEG of the smaller copy: both entries verify, the equal grid one answers.
    jpeg = encode(decode_image(smaller, index=0, max_decoded_pixels=10**8), "JPEG", quality=90)
    (result,) = await lookup(stub, with_reusable(query(prepare(jpeg, spec=qwen)), jpeg, qwen))
    assert result.tier == SIMILAR and result.matched_key == small.key
    bad = with_reusable(query(small), smaller, qwen)
    bad.reusable_grids.add(t=1, h=3, w=4)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await lookup(stub, bad)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"queries[0].reusable_grids[{len(bad.reusable_grids) - 1}]" in exc.value.details()
