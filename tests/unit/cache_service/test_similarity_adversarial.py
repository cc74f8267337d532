"""Adversarial pairs for the similarity tier (issue 17): different images it must not serve
each other, and bad ``LookupQuery.reusable_grids``.

Each pair goes through what the gateway computes for an image (``decode_image`` of the
encoded bytes, ``plan_resize``, ``resize_to_plan``, ``similarity_descriptor(image,
resized)``, ``verification_image``, ``reusable_grids``) and what the cache decides
(cosine >= the 0.85 default threshold, a stored grid equal or reusable, ``verify``), the
same functions as ``gateway.pipeline.preprocess`` and ``cache_service/store.py``, in process (no
services started). A pair the tier would serve is a false hit: the model would be told
about pixels the user did not send.

Tests marked ``xfail(strict=True)`` are false hits found and not fixed; each reason says
which. Each fixed one says when it was found and what fixed it.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import skimage.data
from PIL import Image, ImageDraw, ImageEnhance, ImageFilter, ImageFont, ImageOps

from cache_service.servicer import MAX_REUSABLE_GRIDS, _reusable
from splitvl_tools.cache_eval import default_spec, encode_mjpeg
from vlcommon.errors import ServiceError
from vlcommon.grid_reuse import reusable_grids
from vlcommon.imaging import decode_image, plan_resize, resize_to_plan, similarity_descriptor
from vlcommon.model_info import VisionSpec
from vlcommon.verification import (
    VERIFY_TOLERANCE,
    JpegLuma,
    VerificationImage,
    _jpeg_score,
    chroma_shape,
    jpeg_matched_score,
    read_jpeg,
    verifiable,
    verification_image,
    verification_residual,
)

THRESHOLD = 0.85  # the cache's default similarity threshold (docs/cache.md)
TINY = default_spec()  # 4,096..65,536 pixels, cache-eval's default budget
QWEN = default_spec(65536, 16777216)  # Qwen3-VL's own budget
PHOTOS = default_spec(65536, 1280 * 32 * 32)  # the photo budget Qwen3-VL's guides give


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def _jpeg(image: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _gateway_view(
    image: Image.Image, spec: VisionSpec
) -> tuple[np.ndarray, tuple[int, int, int], np.ndarray | None, list[tuple[int, int, int]]]:
    """(descriptor, grid, verification image, reusable grids) as the gateway builds them."""
    decoded = decode_image(_png(image), index=0, max_decoded_pixels=40_000_000)
    plan = plan_resize(decoded.height, decoded.width, spec, index=0)
    pixels = np.asarray(decoded, dtype=np.uint8)
    if pixels.shape[:2] == (plan.resized_height, plan.resized_width):
        resized = pixels
    else:
        resized = resize_to_plan(pixels, plan).permute(1, 2, 0).contiguous().numpy()
    lo, hi = spec.min_pixels, spec.max_pixels
    reusable = reusable_grids(decoded.height, decoded.width, spec, min_pixels=lo, max_pixels=hi)
    plan_pixels = plan.resized_height * plan.resized_width
    verification = (
        verification_image(decoded)
        if verifiable(decoded.width, decoded.height, plan_pixels)
        else None
    )
    return similarity_descriptor(decoded, resized), plan.grid, verification, reusable[1:]


class Decision(NamedTuple):
    hit: bool
    cosine: float
    residual: float
    grid_ok: bool


def _served(stored: Image.Image, query: Image.Image, spec: VisionSpec) -> Decision:
    """What the similarity tier decides for ``query`` with ``stored`` in the cache."""
    da, ga, va, _ = _gateway_view(stored, spec)
    db, gb, vb, reusable_b = _gateway_view(query, spec)
    cosine = float(da @ db) if np.any(da) and np.any(db) else 0.0
    residual = verification_residual(va, vb)
    grid_ok = ga == gb or ga in reusable_b
    hit = cosine >= THRESHOLD and grid_ok and residual <= VERIFY_TOLERANCE
    return Decision(hit, cosine, residual, grid_ok)


def _photo(name: str) -> Image.Image:
    return Image.fromarray(getattr(skimage.data, name)()).convert("RGB")


def _disc(image: Image.Image, radius: int, colour: tuple[int, int, int]) -> Image.Image:
    out = image.copy()
    ImageDraw.Draw(out).ellipse([100 - radius, 100 - radius, 100 + radius, 100 + radius], colour)
    return out


def _page_photo(total: str, width: int, height: int, size: int) -> Image.Image:
    """A phone photo (lighting gradient, sensor noise: not document-like) of a few invoice
    lines in ``size`` px type at the top left, ending in ``TOTAL EUR {total}``."""
    rng = np.random.default_rng(1)
    bg = np.linspace(150, 235, height)[:, None] + np.linspace(-25, 10, width)[None, :]
    bg = (bg + rng.normal(0, 6, (height, width))).clip(0, 255)
    image = Image.fromarray(np.stack([bg, bg * 0.97, bg * 0.9], -1).astype(np.uint8))
    text = f"Paper A4, 10 boxes   182.40\nToner x4   316.00\nShipping   24.00\nTOTAL EUR {total}"
    font = ImageFont.load_default(size=size)
    ImageDraw.Draw(image).multiline_text((60, 60), text, font=font, fill=(30, 30, 30), spacing=8)
    return image


# --- false hits found today -------------------------------------------------------------


@pytest.mark.parametrize("spec", [TINY, QWEN], ids=["tiny", "qwen"])
def test_grayscale_copy_of_a_colour_photo_is_not_served_the_colour_one(spec: VisionSpec) -> None:
    """Found 2026-12-01 and fixed (chroma in the verification image): a luma-only
    verification saw a residual of 0 for a photo's grayscale copy (cosine ~0.94), and the
    grayscale request was answered with the colour photo's embeddings."""
    colour = _photo("astronaut")
    gray = ImageOps.grayscale(colour)  # sent as a mode-L PNG; decode_image makes it RGB
    same_luma = np.asarray(colour.convert("L")).astype(int) - np.asarray(gray).astype(int)
    assert np.abs(same_luma).max() <= 1  # the premise: luma alone cannot tell them apart
    decision = _served(colour, gray, spec)
    assert decision.grid_ok and decision.cosine >= THRESHOLD  # the premise
    assert decision.residual > 2 * VERIFY_TOLERANCE
    assert not decision.hit, decision


def test_equal_luma_colour_change_is_not_served() -> None:
    """Found 2026-12-01 and fixed (chroma): a red disc and a green disc of equal luma (r=15
    px on a 451x300 photo; a traffic light's colour, a cable's colour) had a luma residual
    of 0 and a descriptor cosine of ~0.94."""
    cat = _photo("chelsea")
    red, green = _disc(cat, 15, (255, 0, 0)), _disc(cat, 15, (0, 130, 0))
    # Pillow L: 0.299 R + 0.587 G + 0.114 B: 76.2 vs 76.3, the same 8-bit luma.
    assert np.array_equal(np.asarray(red.convert("L")), np.asarray(green.convert("L")))
    decision = _served(red, green, TINY)
    assert decision.cosine >= THRESHOLD and decision.grid_ok  # the premise
    assert decision.residual > 2 * VERIFY_TOLERANCE
    assert not decision.hit, decision


@pytest.mark.parametrize("size", [20, 28, 40])
@pytest.mark.parametrize("budget", ["qwen", "photos"])
def test_one_digit_of_large_type_in_a_12mp_photo_is_refused(size: int, budget: str) -> None:
    """Found 2026-12-01 and fixed (``verifiable``): the verification image of a 12 MP photo
    is area-averaged to the cap (~3x per side), where a changed digit of 28 px type (or 40
    px) stayed under the tolerance, while Qwen3-VL's budget keeps the photo at ~12 MP and
    the model reads it. A 12 MP photo is now exact-only at every budget over VERIFY_MAX_PIXELS
    / VERIFY_MARGIN**2 (932,067 pixels): at Qwen3-VL's and at 1280 * 32 * 32 (photos)."""
    a = _page_photo("1234.50", 4000, 3000, size)
    b = _page_photo("1284.50", 4000, 3000, size)
    decision = _served(a, b, QWEN if budget == "qwen" else PHOTOS)
    assert decision.cosine >= THRESHOLD and decision.grid_ok  # the premise
    assert decision.residual == float("inf")  # not verifiable: no verification image
    assert not decision.hit, decision


def test_a_12mp_photo_at_the_tiny_budget_is_still_verified() -> None:
    """At 65,536 pixels the verification image (the cap, 2 MP) holds 32x the plan's
    pixels: the photo stays verifiable, its JPEG copy hits, and a changed 40 px digit
    (legible in the file, ~3 px in the plan) is refused."""
    a = _page_photo("1234.50", 4000, 3000, 40)
    b = _page_photo("1284.50", 4000, 3000, 40)
    copy = Image.open(io.BytesIO(_jpeg(a, 92)))
    assert _served(a, copy, TINY).hit
    refused = _served(a, b, TINY)
    assert refused.residual > VERIFY_TOLERANCE and not refused.hit


def _low_contrast_page(total: str, contrast: int) -> Image.Image:
    """Grey type ``contrast`` levels darker than a 180-level page with mild sensor noise."""
    rng = np.random.default_rng(1)
    bg = np.full((750, 1000), 180.0) + rng.normal(0, 3, (750, 1000))
    image = Image.fromarray(np.stack([bg] * 3, -1).clip(0, 255).astype(np.uint8))
    font = ImageFont.load_default(size=28)
    grey = (180 - contrast,) * 3
    ImageDraw.Draw(image).text((60, 60), f"TOTAL EUR {total}", font=font, fill=grey)
    return image


@pytest.mark.parametrize("contrast", [15, 20, 25])
def test_one_digit_of_low_contrast_type_is_refused(contrast: int) -> None:
    """Found 2026-12-01 and fixed (the contrast-relative check): VERIFY_TOLERANCE is an
    absolute 8 levels per block, so one digit of 28 px grey type at 25 levels of contrast
    (pencil, light print, a watermark; legible) on a 1000x750 image left ~7.6 and passed.
    The residual's structure is now also weighed against the block's own contrast."""
    a = _low_contrast_page("1234.50", contrast)
    b = _low_contrast_page("1284.50", contrast)
    decision = _served(a, b, TINY)
    assert decision.cosine >= THRESHOLD and decision.grid_ok  # the premise
    assert not decision.hit, decision


def test_one_digit_of_higher_contrast_type_is_refused() -> None:
    """The same page at 40 levels of contrast is refused (the tolerance's edge is between)."""
    decision = _served(_low_contrast_page("1234.50", 40), _low_contrast_page("1284.50", 40), TINY)
    assert decision.residual > VERIFY_TOLERANCE
    assert not decision.hit


# --- refused today (kept as regression tests) ---------------------------------------------


@pytest.mark.parametrize("total", ["1284.50", "123450", "-1234.50"], ids=["digit", "dot", "minus"])
def test_one_character_of_22px_type_in_a_1mp_photo_is_refused(total: str) -> None:
    a = _page_photo("1234.50", 1000, 750, 22)
    b = _page_photo(total, 1000, 750, 22)
    decision = _served(a, b, TINY)
    assert decision.cosine >= THRESHOLD  # the thumbnail cannot tell them apart
    assert decision.residual > 2 * VERIFY_TOLERANCE
    assert not decision.hit


def test_mirrored_photo_is_refused() -> None:
    photo = _photo("astronaut")
    decision = _served(photo, ImageOps.mirror(photo), QWEN)
    assert not decision.hit
    assert decision.cosine < THRESHOLD


# --- LookupQuery.reusable_grids -----------------------------------------------------------


def _grid_msgs(grids: list[tuple[int, int, int]]) -> list[object]:
    from qwenvl.common.v1 import tensor_pb2

    return [tensor_pb2.GridTHW(t=t, h=h, w=w) for t, h, w in grids]


@pytest.mark.parametrize(
    "grids, bad",
    [
        ([(1, 16, 16), (0, 16, 16)], 1),
        ([(1, 0, 16)], 0),
        ([(1, 16, 16), (1, 16, -2)], 1),
        ([(-1, 16, 16)], 0),
        ([(1, 15, 16)], 0),  # not a multiple of spatial_merge_size
    ],
)
def test_bad_reusable_grid_is_invalid_argument_naming_it(
    grids: list[tuple[int, int, int]], bad: int
) -> None:
    field = "queries[3].reusable_grids"
    with pytest.raises(ServiceError) as err:
        _reusable(_grid_msgs(grids), field, 2)  # type: ignore[arg-type]
    assert err.value.code.name == "INVALID_ARGUMENT"
    assert err.value.metadata["field"] == f"{field}[{bad}]"
    assert f"{field}[{bad}]" in err.value.message


def test_too_many_reusable_grids_is_invalid_argument_with_the_limit() -> None:
    grids = [(1, 2, 2 * (i + 1)) for i in range(MAX_REUSABLE_GRIDS + 1)]
    with pytest.raises(ServiceError) as err:
        _reusable(_grid_msgs(grids), "queries[0].reusable_grids", 2)  # type: ignore[arg-type]
    assert err.value.code.name == "INVALID_ARGUMENT"
    assert err.value.metadata == {
        "field": "queries[0].reusable_grids",
        "limit": str(MAX_REUSABLE_GRIDS),
    }


def test_duplicate_reusable_grids_collapse_and_a_huge_one_is_refused_by_the_grid_rule() -> None:
    """Duplicates collapse; the limit counts the sent list. A huge grid (int64 max) used
    to be accepted as a set member (it can match no entry); one grid rule holds wherever
    a grid arrives, so it is GRID_TOO_LARGE naming its place in the list."""
    big = 2**63 - 2
    assert _reusable(_grid_msgs([(1, 16, 16), (1, 16, 16)]), "q", 2) == {(1, 16, 16)}  # type: ignore[arg-type]
    with pytest.raises(ServiceError) as info:
        _reusable(_grid_msgs([(1, 16, 16), (1, big, big)]), "q", 2)  # type: ignore[arg-type]
    assert info.value.reason == "GRID_TOO_LARGE"
    assert info.value.metadata["field"] == "q[1]"
    dupes = [(1, 16, 16)] * (MAX_REUSABLE_GRIDS + 1)
    with pytest.raises(ServiceError):
        _reusable(_grid_msgs(dupes), "q", 2)  # type: ignore[arg-type]


# --- contrast: the photometric normalisation's gain -------------------------------------


def _faint(image: Image.Image, gain: float, blur: float) -> Image.Image:
    """``image`` blurred (Gaussian, ``blur`` px) with its contrast scaled by ``gain``."""
    pixels = np.asarray(image.filter(ImageFilter.GaussianBlur(blur))).astype(np.float64)
    return Image.fromarray(
        ((pixels - pixels.mean()) * gain + 128).round().clip(0, 255).astype(np.uint8)
    )


@pytest.mark.parametrize("gain, blur", [(0.05, 4), (0.1, 0), (0.1, 4)])
def test_faint_copy_of_another_page_is_not_served_the_stored_one(gain: float, blur: float) -> None:
    """Found 2026-12-01 and fixed (``MAX_PHOTOMETRIC_GAIN``): the gain was unbounded, so a
    query with a tenth of the contrast (15-22 levels: visible, but its own text blurred or
    faint) was predicted from the stored image within a tenth of their difference. Another
    user's faint, blurred copy of their own invoice (total 9999.99) was served the stored
    invoice's embeddings (1284.50): the model reads out a total the requester never sent."""
    victim = _page_photo("1284.50", 1000, 750, 28)
    query = _faint(_page_photo("9999.99", 1000, 750, 28), gain, blur)
    decision = _served(victim, query, TINY)
    assert decision.cosine >= THRESHOLD and decision.grid_ok  # the thumbnail cannot tell
    assert decision.residual == float("inf")
    assert not decision.hit


@pytest.mark.parametrize("gain", [0.01, 0.1])
def test_near_flat_copy_of_a_photo_is_not_served_the_photo(gain: float) -> None:
    """A near-uniform grey image (2 levels of contrast at 0.01) is not the photo."""
    photo = _photo("astronaut")
    decision = _served(photo, _faint(photo, gain, 0), QWEN)
    assert not decision.hit


@pytest.mark.parametrize("factor", [0.95, 1.05, 1.1])
def test_contrast_change_of_a_photo_still_verifies(factor: float) -> None:
    """The near duplicates the normalisation is for (cache-eval: contrast +-5%) pass."""
    photo = _photo("coffee")
    decision = _served(photo, ImageEnhance.Contrast(photo).enhance(factor), QWEN)
    assert decision.hit, decision


def test_contrast_boost_that_blows_out_detail_is_refused() -> None:
    """+20% contrast clips the coffee photo's highlights where the original has texture
    (the clipping check: the detail the stored image has beyond the clip); the request's
    image does not show it, so it is not served the original's embeddings."""
    photo = _photo("coffee")
    decision = _served(photo, ImageEnhance.Contrast(photo).enhance(1.2), QWEN)
    assert decision.cosine >= THRESHOLD and decision.residual > VERIFY_TOLERANCE
    assert not decision.hit


# --- crops through the grid-reuse bound ---------------------------------------------------


@pytest.mark.parametrize("name", ["coffee", "chelsea", "astronaut"])
@pytest.mark.parametrize("frac", [0.02, 0.035])
def test_one_sided_crop_is_refused(name: str, frac: float) -> None:
    """A crop of one side (content removed) is a miss at both budgets. Note: the grid
    bound alone admits some (astronaut cropped 2-3.5% at Qwen3-VL's budget: its plan is in
    the crop's class, although vlcommon/grid_reuse.py says a crop to another aspect ratio
    never is); the verification's stretch onto one size is what refuses them."""
    photo = _photo(name)
    crop = photo.crop((0, 0, round(photo.width * (1 - frac)), photo.height))
    for spec in (TINY, QWEN):
        decision = _served(photo, crop, spec)
        assert decision.residual > 4 * VERIFY_TOLERANCE
        assert not decision.hit
    if name == "astronaut":
        assert _served(photo, crop, QWEN).grid_ok


# --- clipped highlights -------------------------------------------------------------------


def _sign_scene(text: str) -> Image.Image:
    """A dark scene (left half 20-90) beside a grey sign (130) with ``text`` in light grey
    (205), 40 px type, sensor noise."""
    rng = np.random.default_rng(3)
    left = np.linspace(20, 90, 600)[:, None] + np.zeros((1, 450))
    bg = np.concatenate([left, np.full((600, 450), 130.0)], 1) + rng.normal(0, 4, (600, 900))
    image = Image.fromarray(np.stack([bg] * 3, -1).clip(0, 255).astype(np.uint8))
    font = ImageFont.load_default(size=40)
    ImageDraw.Draw(image).text((520, 250), text, fill=(205, 205, 205), font=font)
    return image


def test_over_exposed_copy_of_another_sign_is_not_served_the_stored_one() -> None:
    """Found 2026-12-01 and fixed (the clipping check): the prediction is clipped to
    [0, 255], so where the query was blown out to white every stored detail the offset
    also pushed past 255 counted as matched: an over-exposed copy (+140) of the scene with
    PIN 0000, its sign pure white, was served the stored scene's embeddings (PIN 4711)."""
    victim = _sign_scene("PIN 4711")
    pixels = np.asarray(_sign_scene("PIN 0000")).astype(np.int16) + 140
    query = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
    sign = np.asarray(query)[240:300, 500:900]
    assert (sign == 255).mean() > 0.999  # the sign is blank white: no PIN in the query
    decision = _served(victim, query, TINY)
    assert decision.cosine >= THRESHOLD and decision.grid_ok  # the premise
    assert not decision.hit, decision


def test_the_same_sign_scene_not_over_exposed_is_refused() -> None:
    decision = _served(_sign_scene("PIN 4711"), _sign_scene("PIN 0000"), TINY)
    assert decision.residual > 2 * VERIFY_TOLERANCE and not decision.hit


# --- false hits found 2026-12-02 (not fixed) ----------------------------------------------


def _status_dot(image: Image.Image, colour: tuple[int, int, int]) -> Image.Image:
    """A 12 px disc centred on the corner (160, 160) of four 16x16 chroma blocks."""
    out = image.copy()
    ImageDraw.Draw(out).ellipse([154, 154, 165, 165], colour)
    return out


def _route_line(image: Image.Image, colour: tuple[int, int, int]) -> Image.Image:
    """A 2 px horizontal line across the photo (a chart series, a route on a map)."""
    out = image.copy()
    ImageDraw.Draw(out).line([(20, 150), (430, 150)], fill=colour, width=2)
    return out


def _dark_ui(
    text: str,
    size: int,
    colour: tuple[int, int, int] = (230, 230, 230),
    xy: tuple[int, int] = (120, 80),
    *,
    dark: bool = True,
) -> Image.Image:
    """cache-eval's app screenshot (400x300, not document-like; dark unless ``dark`` is
    False) with one line of text at ``xy``."""
    from splitvl_tools.cache_eval import ui_screen

    image = ui_screen("", dark=dark, size=size)
    font = ImageFont.load_default(size=size)
    ImageDraw.Draw(image).text(xy, text, fill=colour, font=font)
    return image


_RED, _GREEN = (255, 0, 0), (0, 130, 0)  # the same 8-bit luma (76)


@pytest.mark.parametrize("kind", ["dot", "line", "text"])
def test_small_colour_change_is_not_served(kind: str) -> None:
    """Found 2026-12-01 and fixed (chroma at half resolution, CHROMA_SCALE 2, compared in
    8x8-pixel blocks): with chroma 4x4-averaged and compared per 16x16 pixels, a red vs
    green 12 px status dot on the corner of four chroma blocks (equal luma: cosine 0.995,
    residual 7.15), a 2 px red vs green line across the photo (5.08) and 16 px '+2.41%' in
    green vs red on a dark UI (6.83) all hit: an LED's state, which series a chart line
    is, a gain shown as a loss."""
    if kind == "text":
        a = _dark_ui("+2.41%", 16, (30, 160, 60), (120, 120))
        b = _dark_ui("+2.41%", 16, (220, 40, 40), (120, 120))
    else:
        draw = _status_dot if kind == "dot" else _route_line
        cat = _photo("chelsea")
        a, b = draw(cat, _RED), draw(cat, _GREEN)
    for spec in (TINY, QWEN):
        decision = _served(a, b, spec)
        assert decision.cosine >= THRESHOLD and decision.grid_ok  # the premise
        assert not decision.hit, decision


# One digit swapped in 11-12 px UI text, at offsets that put the changed strokes across
# block corners: (a, b) digits of 'Total: 1,2{a}4.50'. '6'->'8' and '9'->'8' differ by one
# 1-2 px stroke segment; '3'->'8' by two.
_DIGIT_SWAPS = (("3", "8"), ("6", "8"), ("9", "8"), ("1", "7"), ("5", "6"))
# Every offset modulo the half-block stride (4 px).
_OFFSETS = tuple((120 + dx, 80 + dy) for dx in range(4) for dy in range(4))


@pytest.mark.parametrize("size,dark", [(11, True), (11, False), (12, True)])
def test_one_digit_of_small_ui_text_is_not_served_at_any_offset(size: int, dark: bool) -> None:
    """Found 2026-12-01 and fixed (half-block-stride blocks, an 8x8 check at the compared
    resolution without the 2x2 reduce, one global sharpness match): one digit of 11 px
    UI text ('Total: 1,234.50' vs '1,284.50', light grey on a dark card) had cosine 1.000
    and a residual of 5.88: the 2x2 average and aligned 8x8 blocks diluted the changed
    strokes. A scan of 10 digit swaps x 12 offsets hit 24/120 at 11 px (dark), 8/120
    (light), 9/120 at 12 px; after the fix 0/480, the lowest score 8.12
    (benchmarks/cache-calibration.md).
    Qwen3-VL's budget keeps such a screenshot whole and the model reads it."""
    colour = (230, 230, 230) if dark else (0, 0, 0)
    scores = []
    for a, b in _DIGIT_SWAPS:
        for xy in _OFFSETS:
            stored = _dark_ui(f"Total: 1,2{a}4.50", size, colour, xy, dark=dark)
            query = _dark_ui(f"Total: 1,2{b}4.50", size, colour, xy, dark=dark)
            va, vb = verification_image(stored), verification_image(query)
            scores.append((verification_residual(va, vb), a, b, xy))
    assert min(scores)[0] > VERIFY_TOLERANCE, min(scores)


def test_one_digit_of_11px_ui_text_is_not_served() -> None:
    """The first pair of the scan above through the whole tier, at both budgets."""
    a, b = _dark_ui("Total: 1,234.50", 11), _dark_ui("Total: 1,284.50", 11)
    for spec in (TINY, QWEN):
        decision = _served(a, b, spec)
        assert decision.cosine >= THRESHOLD and decision.grid_ok  # the premise
        assert not decision.hit, decision


def _watermark(image: Image.Image, text: str, alpha: int) -> Image.Image:
    """White 36 px ``text`` at ``alpha`` (of 255) near the bottom left of ``image``."""
    layer = Image.new("RGBA", image.size, (0, 0, 0, 0))
    font = ImageFont.load_default(size=36)
    xy = (40, image.size[1] - 72)
    ImageDraw.Draw(layer).text(xy, text, fill=(255, 255, 255, alpha), font=font)
    return Image.alpha_composite(image.convert("RGBA"), layer).convert("RGB")


_YEARS = (("2024", "2021"), ("2023", "2028"), ("2019", "2010"))


@pytest.mark.parametrize(
    "name,alpha",
    [("astronaut", 30), ("coffee", 20), ("coffee", 30)]
    + [(name, 40) for name in ("astronaut", "chelsea", "coffee", "rocket")],
)
def test_faint_watermark_over_a_photo_is_not_served(name: str, alpha: int) -> None:
    """Found 2026-12-01 and fixed (as above): a white 36 px watermark at alpha 30 (up to
    28 levels) over astronaut, '(c) 2024 Alice Smith' vs '(c) 2021 ...', had cosine 1.000
    and a residual of 6.63: the contrast-relative check weighs the change against the
    block's own contrast, which there is the photo's texture. Three year changes each."""
    photo = _photo(name)
    for year_a, year_b in _YEARS:
        a = _watermark(photo, f"(c) {year_a} Alice Smith", alpha)
        b = _watermark(photo, f"(c) {year_b} Alice Smith", alpha)
        residual = verification_residual(verification_image(a), verification_image(b))
        assert residual > VERIFY_TOLERANCE, (year_a, year_b, residual)
        if (name, alpha, year_a) == ("astronaut", 30, "2024"):
            for spec in (TINY, QWEN):
                decision = _served(a, b, spec)
                assert decision.cosine >= THRESHOLD and decision.grid_ok  # the premise
                assert not decision.hit, decision


def _jpeg_copy(image: Image.Image, quality: int) -> Image.Image:
    return Image.open(io.BytesIO(_jpeg(image, quality))).convert("RGB")


def _jpeg_view(image: Image.Image, quality: int, **kw: object) -> VerificationImage:
    """The verification image the gateway builds for a JPEG of ``image`` (Pillow's encoder,
    i.e. libjpeg): decoded by ``decode_image``, with the file (its :class:`JpegLuma`)."""
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=quality, **kw)
    data = buf.getvalue()
    view = verification_image(decode_image(data, index=0, max_decoded_pixels=10**8), data)
    assert view.jpeg is not None  # the premise: the JPEG-matched check applies
    return view


def _ffmpeg_jpeg_view(image: Image.Image, qscale: int) -> VerificationImage:
    """The same for a JPEG from ffmpeg's own MJPEG encoder (``cache_eval.encode_mjpeg``):
    another DCT and quantiser than libjpeg's, as phones' hardware encoders and trellis
    encoders are."""
    data = encode_mjpeg(image, qscale)
    return verification_image(decode_image(data, index=0, max_decoded_pixels=10**8), data)


@pytest.mark.parametrize("name", ["chelsea", "rocket"])
def test_faint_watermark_over_fine_texture_is_not_served(name: str) -> None:
    """Found 2026-12-01 and fixed (the isolation check): the same watermark at alpha 30
    over the cat's fur or the rocket's gravel changes its strokes by 10-12 levels on
    average over a background of standard deviation 30-45, about what JPEG q70 leaves
    there; 2 of 3 year changes hit (residual 6.7-7.9). All of the difference lies in the
    watermark's windows, none elsewhere: refused now (11.3-15.7)."""
    photo = _photo(name)
    for year_a, year_b in _YEARS:
        a = _watermark(photo, f"(c) {year_a} Alice Smith", 30)
        b = _watermark(photo, f"(c) {year_b} Alice Smith", 30)
        residual = verification_residual(verification_image(a), verification_image(b))
        assert residual > VERIFY_TOLERANCE, (year_a, year_b, residual)


def test_faint_watermark_over_fine_texture_is_not_served_as_a_jpeg() -> None:
    """Found 2026-12-01 (a strict xfail until 2026-12-03): the same alpha-30 watermark over
    fur with one side a JPEG (q70-90): the JPEG's residual over the texture hid the change
    from the isolation check ('2023' vs '2028' over chelsea: 7.33). Fixed by the
    JPEG-matched check: the other image encoded with the JPEG's own table is bit-identical
    to it outside the changed year (48-70 now), whichever side is the JPEG."""
    photo = _photo("chelsea")
    for year_a, year_b in _YEARS:
        a = _watermark(photo, f"(c) {year_a} Alice Smith", 30)
        b = _watermark(photo, f"(c) {year_b} Alice Smith", 30)
        for quality in (70, 90):
            query = verification_residual(verification_image(a), _jpeg_view(b, quality))
            stored = verification_residual(_jpeg_view(a, quality), verification_image(b))
            assert min(query, stored) > VERIFY_TOLERANCE, (year_a, year_b, quality)


def _grey_ui(text: str, size: int, xy: tuple[int, int], card: int, ink: int) -> Image.Image:
    """The dark app screenshot with a grey card (``card`` levels) and ``ink`` text on it."""
    from splitvl_tools.cache_eval import ui_screen

    image = ui_screen("", dark=True, size=size)
    draw = ImageDraw.Draw(image)
    draw.rectangle((110, 60, 380, 280), fill=(card,) * 3)
    draw.text(xy, text, fill=(ink,) * 3, font=ImageFont.load_default(size=size))
    return image


_GREYS = ((80, 120), (120, 80), (200, 170), (50, 110))  # (card, ink) levels


def _digit_swaps(
    greys: tuple[tuple[int, int], ...] = _GREYS,
) -> Iterator[tuple[tuple[object, ...], Image.Image, Image.Image]]:
    """(label, a, b): 'Total: 1,2x4.50' in 11 px type, one digit swapped, for every swap,
    (card, ink) grey of ``greys`` and every fifth offset: 20 pairs per grey."""
    for d_a, d_b in _DIGIT_SWAPS:
        for card, ink in greys:
            for xy in _OFFSETS[::5]:
                a = _grey_ui(f"Total: 1,2{d_a}4.50", 11, xy, card, ink)
                b = _grey_ui(f"Total: 1,2{d_b}4.50", 11, xy, card, ink)
                yield (d_a, d_b, card, ink, xy), a, b


def test_one_digit_of_low_contrast_11px_ui_text_is_not_served() -> None:
    """Found 2026-12-01 by an adversarial pass and fixed (the isolation check): one digit
    of 11 px grey-on-grey UI text (ink 120 on a card of 80, legible) hit 44 of 48 digit
    swaps x offsets (residual down to 1.8), 14 px 17 of 48: the changed strokes move no
    window by the absolute tolerances, and JPEG q70 leaves more than that on sharp edges.
    Between two otherwise identical screenshots all of the residual is in the digit's
    windows: refused now, every swap, offset and grey, at both budgets for the first."""
    a = _grey_ui("Total: 1,234.50", 11, (120, 80), 80, 120)
    b = _grey_ui("Total: 1,284.50", 11, (120, 80), 80, 120)
    for spec in (TINY, QWEN):
        decision = _served(a, b, spec)
        assert decision.cosine >= THRESHOLD and decision.grid_ok  # the premise
        assert not decision.hit, decision
    scores = []
    for card, ink in _GREYS:
        for d_a, d_b in _DIGIT_SWAPS:
            for xy in _OFFSETS[::5]:
                stored = _grey_ui(f"Total: 1,2{d_a}4.50", 11, xy, card, ink)
                query = _grey_ui(f"Total: 1,2{d_b}4.50", 11, xy, card, ink)
                residual = verification_residual(
                    verification_image(stored), verification_image(query)
                )
                scores.append((residual, card, ink, d_a, d_b, xy))
    assert min(scores)[0] > VERIFY_TOLERANCE, min(scores)


def test_a_jpeg_copy_of_a_low_contrast_screenshot_is_still_served() -> None:
    """The isolation check's other side: a JPEG copy (q80-95) spreads its residual over
    every glyph, so it passes (2.4-4.9 measured 2026-12-01)."""
    for card, ink in _GREYS:
        stored = _grey_ui("Total: 1,234.50", 11, (120, 80), card, ink)
        va = verification_image(stored)
        for quality in (80, 90, 95):
            residual = verification_residual(va, verification_image(_jpeg_copy(stored, quality)))
            assert residual <= VERIFY_TOLERANCE, (card, ink, quality, residual)


def test_one_digit_of_low_contrast_11px_ui_text_is_not_served_as_a_jpeg() -> None:
    """Found 2026-12-01 (a strict xfail until 2026-12-03): the same one-digit edit of 11 px
    grey-on-grey type with one side a JPEG (q80-95): the JPEG's residual over the other
    glyphs hid the edit from the isolation check, and its pixels are under the absolute
    tolerances: 2-4 of 8 swaps hit (residual 3.5-5.2). Fixed by the JPEG-matched check
    (42-73 now), every swap, grey and quality, the JPEG on either side."""
    for d_a, d_b in _DIGIT_SWAPS:
        for card, ink in _GREYS:
            a = _grey_ui(f"Total: 1,2{d_a}4.50", 11, (120, 80), card, ink)
            b = _grey_ui(f"Total: 1,2{d_b}4.50", 11, (120, 80), card, ink)
            for quality in (80, 90, 95):
                query = verification_residual(verification_image(a), _jpeg_view(b, quality))
                stored = verification_residual(_jpeg_view(a, quality), verification_image(b))
                assert min(query, stored) > VERIFY_TOLERANCE, (d_a, d_b, card, ink, quality)


def test_one_digit_of_low_contrast_11px_ui_text_from_another_jpeg_encoder() -> None:
    """Found 2026-12-03 (a strict xfail until later that day): the same one-digit edit of
    11 px grey-on-grey type in a JPEG from another encoder (ffmpeg's MJPEG, qscale 2-3):
    its blocks are not libjpeg's, so the JPEG-matched check does not apply (12-33% of the
    textured blocks identical) and the six checks alone passed 4.0-8.8. Fixed by the
    coefficient-interval check: the JPEG's coefficients cannot have come from the other
    picture in the digit's blocks (every swap, grey, offset and qscale)."""
    for label, a, b in _digit_swaps():
        for qscale in (2, 3):
            residual = verification_residual(verification_image(a), _ffmpeg_jpeg_view(b, qscale))
            assert residual > VERIFY_TOLERANCE, (label, qscale)


def _shifted(image: Image.Image, levels: int) -> Image.Image:
    return Image.fromarray(
        (np.asarray(image, dtype=np.int16) + levels).clip(0, 255).astype(np.uint8), "RGB"
    )


def _dithered(image: Image.Image, seed: int = 0) -> Image.Image:
    noise = np.random.default_rng(seed).integers(-1, 2, size=np.asarray(image).shape)
    return Image.fromarray(
        (np.asarray(image, dtype=np.int16) + noise).clip(0, 255).astype(np.uint8), "RGB"
    )


def test_one_digit_of_low_contrast_11px_ui_text_changed_before_its_jpeg() -> None:
    """Found 2026-12-03 by an adversarial pass (a strict xfail until later that day): the
    same one-digit edit with the edited side also shifted by one level of brightness, or
    dithered +-1, or through two JPEG generations (q70 then q90; Pillow q80 then ffmpeg
    qscale 2) before the JPEG the query sends: its blocks are no longer the other image's
    re-encoded, the JPEG-matched check does not apply, and the six checks alone passed
    (3.5-7.8; 69-71 of 80 pairs each). Fixed by the coefficient-interval check (a shift
    moves only each block's mean, a dither less than its slack) and its first-generation
    search (the other picture through libjpeg at q70-95 still has the old digit)."""
    for label, a, b in _digit_swaps(_GREYS[:2]):
        stored = verification_image(a)
        first = decode_image(_jpeg(b, 70), index=0, max_decoded_pixels=10**8)
        first80 = decode_image(_jpeg(b, 80), index=0, max_decoded_pixels=10**8)
        for how, query in (
            ("shift+1 q90", _jpeg_view(_shifted(b, 1), 90)),
            ("shift-1 q80", _jpeg_view(_shifted(b, -1), 80)),
            ("dither q90", _jpeg_view(_dithered(b), 90)),
            ("q70 then q90", _jpeg_view(first, 90)),
            ("q80 then q75", _jpeg_view(first80, 75)),
            ("q80 then ffmpeg 2", _ffmpeg_jpeg_view(first80, 2)),
        ):
            residual = verification_residual(stored, query)
            assert residual > VERIFY_TOLERANCE, (label, how, residual)


@pytest.mark.xfail(
    strict=True,
    reason="the coefficient-interval check's limit (2026-12-03): the same one-digit edit "
    "of 11 px grey-on-grey type under a coarse JPEG (ffmpeg qscale 5, steps of 10-40 "
    "levels): the digit's coefficient changes fit within the quantisation steps, so the "
    "JPEG could have come from either picture (5 of 80 pairs pass). Two JPEGs of "
    "different qualities, one of each picture, leak 2-3 of 80 the same way",
)
def test_one_digit_of_low_contrast_11px_ui_text_under_a_coarse_jpeg() -> None:
    for label, a, b in _digit_swaps():
        residual = verification_residual(verification_image(a), _ffmpeg_jpeg_view(b, 5))
        assert residual > VERIFY_TOLERANCE, (label, residual)


@pytest.mark.xfail(
    strict=True,
    reason="the coefficient-interval check's limit (found 2026-12-03 by an adversarial "
    "pass): faint type on a card at or near white (255 / 248) or black: JPEG ringing "
    "brings the digit's blocks within 4 levels of the clip, the check leaves them out, "
    "and the six checks alone pass (12-17 of 20 swaps x offsets; the ffmpeg JPEG of a "
    "page that is over a quarter pure white gets no JPEG view at all: swscale decodes "
    "white as (254, 255, 253))",
)
def test_one_digit_of_faint_type_on_a_white_card_as_another_encoders_jpeg() -> None:
    for label, a, b in _digit_swaps(((255, 200),)):
        residual = verification_residual(verification_image(a), _ffmpeg_jpeg_view(b, 3))
        assert residual > VERIFY_TOLERANCE, (label, residual)


@pytest.mark.xfail(
    strict=True,
    reason="the coefficient-interval check's limit (found 2026-12-03 by an adversarial "
    "pass): the edited side also blurred (Gaussian 0.5) or sharpened (Pillow 1.3, "
    "UnsharpMask) before its JPEG: most blocks move beyond the quantisation, the check's "
    "gate says 'not one JPEG of the other picture', and the six checks alone pass "
    "(36-75 of 80). Fitting a global tone curve and 3x3 kernel first was tried and lost "
    "more copies than it kept (benchmarks/cache-calibration.md)",
)
def test_one_digit_of_low_contrast_11px_ui_text_blurred_before_its_jpeg() -> None:
    for label, a, b in _digit_swaps(_GREYS[:1]):
        blurred = b.filter(ImageFilter.GaussianBlur(0.5))
        residual = verification_residual(verification_image(a), _jpeg_view(blurred, 90))
        assert residual > VERIFY_TOLERANCE, (label, residual)


def _dotted(edited: Image.Image, original: Image.Image, card: int) -> Image.Image:
    """The poisoner's stored picture: ``edited`` with one 2x2 dot of a saturated colour of
    the card's luma (B or R at 255) in every 8x8 block where it differs from
    ``original``."""
    e, o = np.asarray(edited, dtype=np.int16), np.asarray(original, dtype=np.int16)
    changed = np.abs(e - o).max(axis=-1) > 0
    if card < 120:
        colour = (0, round((card - 0.114 * 255) / 0.587), 255)
    else:
        colour = (255, round((card - 0.299 * 255) / 0.587), 0)
    out = np.asarray(edited).copy()
    for by in range(changed.shape[0] // 8):
        for bx in range(changed.shape[1] // 8):
            if changed[8 * by : 8 * by + 8, 8 * bx : 8 * bx + 8].any():
                out[8 * by + 2 : 8 * by + 4, 8 * bx + 2 : 8 * bx + 4] = colour
    return Image.fromarray(out, "RGB")


@pytest.mark.xfail(
    strict=True,
    reason="the coefficient-interval check's limit (found 2026-12-03 by an adversarial "
    "pass): cache poisoning. The poisoner stores the edited screenshot (PNG) with one "
    "luma-matched saturated 2x2 dot in each edited block; the victim's ffmpeg JPEG of the "
    "original then meets blocks near the clip in a colour channel, which the check leaves "
    "out, and the six checks alone pass (17 of 20 here, 70-78 of 80 over four greys; "
    "the dots move the chroma by ~6 of its 24 tolerance)",
)
def test_a_poisoned_entry_with_saturated_dots_in_the_edited_blocks() -> None:
    for label, original, edited in _digit_swaps(_GREYS[:1]):
        stored = verification_image(_dotted(edited, original, 80))
        residual = verification_residual(stored, _ffmpeg_jpeg_view(original, 2))
        assert residual > VERIFY_TOLERANCE, (label, residual)


def test_the_coefficient_interval_check_passes_what_it_must() -> None:
    """The coefficient-interval check's other side (measured 2026-12-03 over scikit-image's
    photos and a third of cache-eval's distinct images: one loss, retina.jpg at contrast
    1.05). Copies of the same picture where the JPEG-matched check does not apply: another
    encoder (ffmpeg qscale 2-8), a shift of one level or a +-1 dither before a JPEG, a
    second JPEG generation coarser or finer than the first (found by the first-generation
    search), and a brighter or contrastier PNG of a decoded JPEG (the gain fit; colour
    channels near the clip are left to the six checks)."""
    for name in ("astronaut", "coffee", "chelsea", "camera"):
        photo = _photo(name)
        stored = verification_image(photo)
        d90 = decode_image(_jpeg(photo, 90), index=0, max_decoded_pixels=10**8)
        d70 = decode_image(_jpeg(photo, 70), index=0, max_decoded_pixels=10**8)
        copies = {
            "ffmpeg 2": _ffmpeg_jpeg_view(photo, 2),
            "ffmpeg 5": _ffmpeg_jpeg_view(photo, 5),
            "shift+1 q90": _jpeg_view(_shifted(photo, 1), 90),
            "dither q90": _jpeg_view(_dithered(photo), 90),
            "q90 then q70": _jpeg_view(d90, 70),
            "q70 then q90": _jpeg_view(d70, 90),
            "q90 then ffmpeg 3": _ffmpeg_jpeg_view(d90, 3),
        }
        for how, query in copies.items():
            residual = verification_residual(stored, query)
            assert residual <= VERIFY_TOLERANCE, (name, how, residual)
    data = (Path(skimage.data.__file__).parent / "rocket.jpg").read_bytes()
    source = verification_image(decode_image(data, index=0, max_decoded_pixels=10**8), data)
    decoded = decode_image(data, index=0, max_decoded_pixels=10**8)
    for factor in (0.95, 1.03, 1.05):
        for enhance in (ImageEnhance.Brightness, ImageEnhance.Contrast):
            query = verification_image(enhance(decoded).enhance(factor))
            residual = verification_residual(source, query)
            assert residual <= VERIFY_TOLERANCE, (enhance.__name__, factor, residual)


def test_the_jpeg_matched_check_passes_what_it_must() -> None:
    """The JPEG-matched check's other side. A libjpeg copy of the same picture decodes
    bit-identically to the other image encoded with its table: a score of 0, for photos
    with saturated colours too (the JPEG's own luma is kept where the conversion to RGB
    clipped, and then counted in the entry's bytes), at 4:4:4 and 4:2:0, progressive, and
    for a JPEG re-saved from a decoded JPEG. ffmpeg's copy is another encoder: the check
    does not apply, and the coefficient-interval check passes it."""
    for name in ("astronaut", "coffee", "camera"):
        photo = _photo(name)
        stored = verification_image(photo)
        for kw in ({}, {"subsampling": 0}, {"progressive": True}):
            query = _jpeg_view(photo, 85, **kw)
            assert jpeg_matched_score(stored, query) == 0.0, (name, kw)
            assert verification_residual(stored, query) <= VERIFY_TOLERANCE, (name, kw)
        query = _jpeg_view(photo, 85)
        assert query.jpeg is not None
        clipped = query.jpeg.clipped_index.size
        assert (clipped > 0) is (name != "camera")  # camera is grey: its Y is its luma
        assert query.nbytes == query.luma.nbytes + query.chroma.nbytes + 128 + 5 * clipped
        read = read_jpeg(_jpeg(photo, 85), photo.size)
        assert read is not None and np.array_equal(query.jpeg.y(query.luma), read[1])
        # A JPEG re-saved from its own decoded pixels, at a lower, the same or a higher
        # quality (found 2026-12-03 by an adversarial pass: at the same or a higher one the
        # check scored 20-60 in the direction from the re-save to the original, where
        # re-quantising puts some blocks one step off; either direction explains the pair).
        for q1, q2 in ((90, 70), (75, 75), (90, 90), (90, 95)):
            first = _jpeg_view(photo, q1)
            decoded = decode_image(_jpeg(photo, q1), index=0, max_decoded_pixels=10**8)
            resaved = _jpeg_view(decoded, q2)
            assert jpeg_matched_score(first, resaved) == 0.0, (name, q1, q2)
            assert verification_residual(first, resaved) <= VERIFY_TOLERANCE, (name, q1, q2)
    ui = _grey_ui("Total: 1,234.50", 11, (120, 80), 80, 120)
    other = _ffmpeg_jpeg_view(ui, 2)
    assert _jpeg_score(verification_image(ui).luma, other) is None  # another encoder
    assert verification_residual(verification_image(ui), other) <= VERIFY_TOLERANCE


def test_a_second_libjpeg_generation_is_matched_through_its_first() -> None:
    """A JPEG re-saved from a decoded JPEG (q90, then q75: Pillow's default) against the
    PNG original: the JPEG-matched check applies (most blocks bit-identical) but the first
    generation's rounding leaves some one level off (13.25 for cell.png, found by
    cache-eval's ``two-jpegs-q90-q75`` on 2026-12-03). Its first-generation search puts
    the PNG through libjpeg at q95-70 first: at q90 the chain is exact again. An edit
    through the same chain stays refused (the previous test)."""
    data = (Path(skimage.data.__file__).parent / "cell.png").read_bytes()
    original = decode_image(data, index=0, max_decoded_pixels=10**8)
    stored = verification_image(original, data)
    first = decode_image(_jpeg(original, 90), index=0, max_decoded_pixels=10**8)
    query = _jpeg_view(first, 75)
    plain = _jpeg_score(stored.luma, query)
    assert plain is not None and plain > VERIFY_TOLERANCE
    searched = _jpeg_score(stored.luma, query, search=True)
    assert searched is not None and searched <= VERIFY_TOLERANCE
    assert verification_residual(stored, query) <= VERIFY_TOLERANCE


def test_where_the_coefficient_interval_check_does_not_apply() -> None:
    """None (the six checks decide) for images of different sizes, under one whole 8x8
    block, with every block near the clip (white paper, a blown-out sky), or wider than
    a JPEG can be; never an exception."""
    from vlcommon.verification import JPEG_MAX_SIDE, _coefficient_score

    def view(luma: np.ndarray, table: bool) -> VerificationImage:
        h, w = luma.shape
        chroma = np.full(chroma_shape(h, w), 128, dtype=np.uint8)
        jpeg = None
        if table:
            jpeg = JpegLuma(
                np.full(64, 4, np.uint16), np.zeros(0, np.uint32), np.zeros(0, np.uint8)
            )
        return VerificationImage(luma, chroma, jpeg)

    rng = np.random.default_rng(0)
    textured = rng.integers(40, 200, (64, 64), dtype=np.uint8)
    assert _coefficient_score(view(textured, True), view(textured, False)) == 0.0
    assert _coefficient_score(view(textured, True), view(textured[:56], False)) is None
    small = textured[:7, :7]
    assert _coefficient_score(view(small, True), view(small, False)) is None
    white = np.full((64, 64), 255, dtype=np.uint8)
    assert _coefficient_score(view(white, True), view(white, False)) is None
    wide = np.full((8, JPEG_MAX_SIDE + 8), 128, dtype=np.uint8)
    assert _coefficient_score(view(wide, True), view(wide, False)) is None
    # A saturated colour (a channel within the margin of the clip) takes a block out too.
    red = view(textured, True)
    red.chroma[..., 1] = 255  # Cr at its maximum: R = Y + 178 clips for Y over 77
    assert _coefficient_score(red, view(textured, False)) is None


def test_what_gets_no_jpeg_view() -> None:
    """No JpegLuma (and so no JPEG-matched check) for a PNG, a JPEG with an EXIF rotation
    (the decode's transpose moves the block grid), a CMYK JPEG, a JPEG over the
    verification image's cap (its verification image is not the file's pixels), or one
    whose conversion to RGB clipped more than a quarter of its pixels."""
    photo = _photo("astronaut")
    assert read_jpeg(_png(photo), photo.size) is None
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    photo.save(buf, "JPEG", quality=90, exif=exif)
    assert read_jpeg(buf.getvalue(), (photo.height, photo.width)) is None
    buf = io.BytesIO()
    photo.convert("CMYK").save(buf, "JPEG", quality=90)
    assert read_jpeg(buf.getvalue(), photo.size) is None
    big = photo.resize((1600, 1400))
    assert read_jpeg(_jpeg(big, 90), big.size) is None
    assert read_jpeg(_jpeg(photo, 90), (photo.width, photo.height + 1)) is None
    fine = read_jpeg(_jpeg(photo, 90), photo.size)
    assert fine is not None and fine[0].shape == (64,)
    assert fine[1].shape == (photo.height, photo.width)
    table, y = fine
    luma = np.asarray(Image.open(io.BytesIO(_jpeg(photo, 90))).convert("L"))
    assert JpegLuma.of(table, y, luma) is not None
    off = y.copy()
    off.reshape(-1)[::3] ^= 1  # a third of the pixels differ
    assert JpegLuma.of(table, off, luma) is None


def test_a_verification_image_wider_than_any_jpeg_gets_no_jpeg_check() -> None:
    """Found 2026-12-03 by an adversarial pass: a luma of [1, 70000] with a JPEG table (no
    JPEG is wider than 65,500 pixels) made the round trip's encoder raise, which the
    cache service turned into INTERNAL for every query that met the entry. The check
    now does not apply there (and the cache refuses such fields: test_cache_verification)."""
    rng = np.random.default_rng(0)
    for shape in ((1, 70000), (8, 66000), (2, 65536)):
        luma = rng.integers(0, 256, shape, dtype=np.uint8)
        chroma = np.full(chroma_shape(*shape), 128, np.uint8)
        table = np.full(64, 2, np.uint16)
        empty_index, empty_luma = np.zeros(0, np.uint32), np.zeros(0, np.uint8)
        jpeg = VerificationImage(luma, chroma, JpegLuma(table, empty_index, empty_luma))
        assert jpeg_matched_score(VerificationImage(luma, chroma), jpeg) == 0.0
        assert verification_residual(VerificationImage(luma, chroma), jpeg) <= VERIFY_TOLERANCE


def test_a_decimal_point_turned_comma_in_10px_text_is_not_served() -> None:
    """Found 2026-12-01 by an adversarial pass and fixed (the isolation check): a decimal
    point turned comma in 9-10 px text ('1,234.50' vs '1,234,50', 5 pixels) hit at every
    offset (residual 2.8-5.4)."""
    for size in (9, 10):
        for xy in _OFFSETS:
            a = _dark_ui("Total: 1,234.50", size, xy=xy)
            b = _dark_ui("Total: 1,234,50", size, xy=xy)
            residual = verification_residual(verification_image(a), verification_image(b))
            assert residual > VERIFY_TOLERANCE, (size, xy, residual)
    a, b = _dark_ui("Total: 1,234.50", 10), _dark_ui("Total: 1,234,50", 10)
    for spec in (TINY, QWEN):
        assert not _served(a, b, spec).hit


def test_a_decimal_point_turned_comma_in_10px_text_is_not_served_as_a_jpeg() -> None:
    """Found 2026-12-01 (a strict xfail until 2026-12-03): the same comma with one side a
    JPEG q80-95 (residual 5.1-6.0): 5 changed pixels are less than what the JPEG leaves
    around every glyph. Fixed by the JPEG-matched check: every offset and quality."""
    for xy in _OFFSETS[::3]:
        a, b = _dark_ui("Total: 1,234.50", 10, xy=xy), _dark_ui("Total: 1,234,50", 10, xy=xy)
        for quality in (80, 90, 95):
            query = verification_residual(verification_image(a), _jpeg_view(b, quality))
            stored = verification_residual(_jpeg_view(a, quality), verification_image(b))
            assert min(query, stored) > VERIFY_TOLERANCE, (xy, quality)


@pytest.mark.parametrize("dark", [True, False])
def test_a_small_muted_status_dot_turned_from_red_to_green_is_not_served(dark: bool) -> None:
    """Found 2026-12-01 by an adversarial pass and fixed (chroma windows at half-block
    stride): a dot of radius 3, (220, 90, 90) vs (90, 160, 90), on the corner of four
    aligned chroma blocks scored 6.42 (18.2 inside one); 13 of 36 dots hit. Now 0 of 144
    in a scan of 4 colour pairs x 3 radii x 6 positions on both screens (lowest 8.23)."""
    from splitvl_tools.cache_eval import ui_screen

    base = ui_screen("", dark=dark, size=14)

    def dot(colour: tuple[int, int, int], radius: int, xy: tuple[int, int]) -> Image.Image:
        out = base.copy()
        x, y = xy
        ImageDraw.Draw(out).ellipse((x - radius, y - radius, x + radius, y + radius), colour)
        return out

    scores = []
    for red, green in (((220, 90, 90), (90, 160, 90)), ((200, 120, 120), (130, 155, 130))):
        for radius in (3, 4):
            for xy in ((160, 160), (163, 163), (164, 160), (161, 167)):
                a, b = dot(red, radius, xy), dot(green, radius, xy)
                residual = verification_residual(verification_image(a), verification_image(b))
                scores.append((residual, red, radius, xy))
    assert min(scores)[0] > VERIFY_TOLERANCE, min(scores)


@pytest.mark.parametrize("radius,served", [(0.5, True), (1.0, False), (1.5, False)])
def test_the_sharpness_match_is_bounded(radius: float, served: bool) -> None:
    """The sharpness match absorbs a mild blur (a resize's, radius 0.5: a near duplicate)
    but not a blur that takes 11 px type to the edge of legibility: with the bound
    (MAX_SHARPNESS 0.5) a radius-1.0 copy scores 20.0, with a bound of 5 it would pass at
    5.5 and be served the sharp screenshot's embeddings (measured 2026-12-01)."""
    sharp = _dark_ui("Total: 1,234.50", 11)
    blurred = sharp.filter(ImageFilter.GaussianBlur(radius))
    residual = verification_residual(verification_image(sharp), verification_image(blurred))
    assert (residual <= VERIFY_TOLERANCE) is served, residual


def _contrast(image: Image.Image, gain: float) -> Image.Image:
    """``image`` with its contrast scaled by ``gain`` around its own mean."""
    pixels = np.asarray(image).astype(np.float64)
    out = (pixels - pixels.mean()) * gain + pixels.mean()
    return Image.fromarray(out.round().clip(0, 255).astype(np.uint8))


def test_one_digit_with_the_query_at_two_thirds_contrast_is_not_served() -> None:
    """Found 2026-12-01 and fixed (scores in the higher-contrast image's levels): the
    residual was measured in the lower-contrast image's levels, so a query at 0.67x
    contrast passed edits up to ~1.5x the tolerance: one digit of 16 px UI text, refused at
    full contrast (10.69), hit with the query at 0.67x (7.36)."""
    a = _dark_ui("Total: 1,254.50", 16)
    b = _dark_ui("Total: 1,264.50", 16)
    assert _served(a, b, TINY).residual > VERIFY_TOLERANCE  # refused at full contrast
    decision = _served(a, _contrast(b, 0.67), TINY)
    assert decision.cosine >= THRESHOLD and decision.grid_ok  # the premise
    assert not decision.hit, decision
