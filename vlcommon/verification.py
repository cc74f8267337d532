"""Verification of similarity-tier candidates on the decoded image, whatever the plan.

The similarity descriptor (:func:`vlcommon.imaging.similarity_descriptor`, a 32x32
thumbnail) finds candidates; it cannot tell a receipt that says ``$19.33`` from one that
says ``$79.33``, a chart with one bar changed, or an image built to share another's
thumbnail with different detail (cache poisoning): each cell averages 1/1024 of the image.
So every similarity candidate is also *verified* on a **verification image**
(:class:`VerificationImage`): the luma of the **decoded** image (upright, alpha on
white, Pillow ``L``, ITU-R 601) at its own resolution, shrunk (area average) only when
it holds more than :data:`VERIFY_MAX_PIXELS` pixels, and its chroma (Pillow ``YCbCr``'s
Cb and Cr) area-averaged :data:`CHROMA_SCALE` x :data:`CHROMA_SCALE`. It does not depend
on the resize plan, so an edit legible in the image the client sent (one digit of a
total, one word) is seen even when the plan shrinks the image below legibility (the tiny
checkpoint's 65,536 pixels, or the small budgets real-time deployments use). An image
over the cap whose plan keeps more than 1/:data:`VERIFY_MARGIN` of its verification
image's resolution (a 12 MP photo at a budget over 932,067 pixels: the model could read
detail the verification does not resolve) gets none (:func:`verifiable`): it is only ever
an exact hit.

Two verification images pass (:func:`verify`) when:

* their sizes agree within :data:`MAX_SIDE_RATIO` per side and their aspect ratios within
  :data:`MAX_ASPECT_DIFFERENCE` (neither holds much more detail than the other: a full-size
  photo and its thumbnail are not compared at the thumbnail's resolution);
* at the smaller one's resolution (the larger resampled onto it with Pillow's Lanczos
  filter), both 2x2 box-averaged, after a global photometric normalisation (the luma's mean
  and standard deviation of one matched to the other's over the pixels unsaturated in both,
  the chroma's distance from neutral scaled by the same gain; a gain beyond
  :data:`MAX_PHOTOMETRIC_GAIN` either way fails), in the better direction, every 4x4 block
  (8x8 pixels of the compared resolution) passes four checks:

  - **luma**: the mean absolute difference of the prediction (clipped to [0, 255], as a
    brightened copy clips highlights) is within :data:`VERIFY_TOLERANCE`;
  - **chroma**: on the chroma images (the larger resampled onto the smaller, blocks of
    :data:`CHROMA_BLOCK` x :data:`CHROMA_BLOCK` chroma pixels), the mean absolute Cb and Cr
    differences are within :data:`CHROMA_TOLERANCE` (a grayscale copy, or a red light
    turned green at equal luma);
  - **clipping**: where the other image is clipped (at least :data:`CLIPPED_SHARE` of the
    block at 255, or at 0), the detail the prediction has beyond the clip (its standard
    deviation there) is within :data:`VERIFY_TOLERANCE`: a blown-out copy does not show
    what the stored image shows there, so it is not served it;
  - **contrast-relative**: in blocks without clipping, a residual over
    :data:`RELATIVE_FLOOR` levels is at most :data:`RELATIVE_TOLERANCE` of the block's
    contrast (its standard deviation, plus :data:`RELATIVE_FLOOR`): faint type (pencil,
    light print, a watermark) changed by one digit leaves a residual under the absolute
    tolerance, but as large as its own contrast.

A block where one digit, word, cell or bar differs has a residual of tens of levels; JPEG
re-encoding (q70-95) and resizes of up to 10% leave a few. The same functions run in the
gateway (:func:`verification_image`), the cache service (:func:`verify`) and ``splitvl
cache-eval`` (calibration), so what is measured is what is served. Calibration, costs and
memory: docs/cache.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image

# The verification image keeps the decoded image's own resolution up to this many pixels
# (2 MiB of luma, 3 MiB with the chroma per entry at most: a 1411x1411 photo is kept
# whole); larger images are area-averaged down to it.
VERIFY_MAX_PIXELS = 2_097_152
# An image over the cap is verifiable only where its verification image holds this many
# times the plan's resolution per side (glyphs of ~12 px are the smallest the comparison
# resolves; the model reads ~8 px): at most VERIFY_MAX_PIXELS / 2.25 = 932,067 pixels.
VERIFY_MARGIN = 1.5
# After resampling onto a common size, both are box-averaged 2x2 (which also evens out the
# resampling filters' differences), then compared in 4x4 blocks (8x8 pixels).
VERIFY_REDUCE = 2
VERIFY_BLOCK = 4
# Largest mean |luma difference| of one block, 8-bit levels, after photometric matching.
# Calibrated with `splitvl cache-eval` (docs/cache.md).
VERIFY_TOLERANCE = 8.0
# Chroma is kept at 1/CHROMA_SCALE of the luma's resolution per side (as JPEG keeps it),
# half a byte per pixel for both channels, and compared in blocks of CHROMA_BLOCK x
# CHROMA_BLOCK chroma pixels (8x8 pixels, the luma's block). At 1/4 per side, compared per
# 16x16 pixels, a 12 px status dot or a 2 px line turned from red to green at equal luma
# passed (tests/test_similarity_adversarial.py).
CHROMA_SCALE = 2
CHROMA_BLOCK = 4
# Largest mean |Cb or Cr difference| of one chroma block, 8-bit levels (calibrated with
# `splitvl cache-eval`, docs/cache.md).
CHROMA_TOLERANCE = 24.0
# A block counts as clipped in an image when at least this share of its pixels is at
# 253 or more (or at 2 or less).
CLIPPED_SHARE = 0.25
# Contrast-relative check: a block residual over RELATIVE_FLOOR levels must stay within
# RELATIVE_TOLERANCE * (block standard deviation + RELATIVE_FLOOR). Near duplicates stay
# under ~0.15 (JPEG q70, resizes); a changed digit of faint type reaches ~0.6.
RELATIVE_FLOOR = 4.0
RELATIVE_TOLERANCE = 0.4
# Largest contrast gain the photometric normalisation may apply (either way). Near
# duplicates change contrast by a few percent (cache-eval: +-5%); without a bound, a query
# with a tenth of the contrast (a faint, blurred copy of another page) is predicted from any
# stored image of a similar layout within a tenth of the stored image's differences, so
# its residual stays under the tolerance whatever the detail (tests/test_similarity_adversarial.py).
MAX_PHOTOMETRIC_GAIN = 1.5
# Sizes compared: each side of the smaller image at least this share of the larger's (a
# 10% resize rounded), aspect ratios within this relative difference.
MAX_SIDE_RATIO = 1.12
MAX_ASPECT_DIFFERENCE = 0.04
# A verification luma image larger than this many bytes is refused (INVALID_ARGUMENT).
# Larger than VERIFY_MAX_PIXELS so that older gateways' images (a quarter of a plan of up
# to 16,777,216 pixels, sent without chroma: never a similarity hit) are still accepted.
MAX_VERIFICATION_BYTES = 4_194_304


def verification_size(width: int, height: int) -> tuple[int, int]:
    """(width, height) of the verification image of a decoded image of that size: the same
    size up to :data:`VERIFY_MAX_PIXELS` pixels, else scaled down (aspect kept) to fit."""
    if width * height <= VERIFY_MAX_PIXELS:
        return width, height
    scale = math.sqrt(VERIFY_MAX_PIXELS / (width * height))
    return max(1, int(width * scale)), max(1, int(height * scale))


def verifiable(width: int, height: int, plan_pixels: int) -> bool:
    """Whether a decoded image of ``width`` x ``height`` whose resize plan holds
    ``plan_pixels`` pixels may be a similarity hit: its verification image is the whole
    decoded image, or holds :data:`VERIFY_MARGIN` times the plan's resolution per side.
    Otherwise the model could read detail the verification cannot: a 12 MP photo keeps
    ~12 MP at Qwen3-VL's budget, and at 1280 * 32 * 32 pixels it shows 28 px type at ~9 px,
    which a verification image at the same resolution does not resolve. Such an image is
    only ever an exact hit."""
    w, h = verification_size(width, height)
    return (w, h) == (width, height) or plan_pixels * VERIFY_MARGIN**2 <= w * h


@dataclass(frozen=True)
class VerificationImage:
    """What the cache verifies a similarity candidate on.

    Attributes:
        luma: uint8 [h, w]: ITU-R 601 luma (Pillow ``L``) of the decoded image, at most
            :data:`VERIFY_MAX_PIXELS` pixels.
        chroma: uint8 [ceil(h / CHROMA_SCALE), ceil(w / CHROMA_SCALE), 2]: Cb and Cr
            (Pillow ``YCbCr``) area-averaged :data:`CHROMA_SCALE` x :data:`CHROMA_SCALE`.
    """

    luma: np.ndarray
    chroma: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.luma.nbytes + self.chroma.nbytes)

    def copy(self) -> VerificationImage:
        return VerificationImage(
            np.array(self.luma, dtype=np.uint8, copy=True),
            np.array(self.chroma, dtype=np.uint8, copy=True),
        )


def chroma_shape(height: int, width: int) -> tuple[int, int, int]:
    """The chroma image's shape for a luma image of ``height`` x ``width``."""
    return -(-height // CHROMA_SCALE), -(-width // CHROMA_SCALE), 2


def verification_image(image: Image.Image | np.ndarray) -> VerificationImage:
    """The verification image of one decoded image.

    Args:
        image: The decoded image (``vlcommon.imaging.decode_image``: upright 8-bit RGB) as
            a Pillow image, or uint8 [height, width, 3] RGB.

    Returns:
        Its luma at the image's own size, or area-averaged (Pillow ``BOX``) to
        :func:`verification_size` when it holds more than :data:`VERIFY_MAX_PIXELS`
        pixels, and the chroma of that (see :class:`VerificationImage`).
    """
    if isinstance(image, np.ndarray):
        image = Image.fromarray(np.ascontiguousarray(image, dtype=np.uint8), "RGB")
    image = image if image.mode == "RGB" else image.convert("RGB")
    size = verification_size(*image.size)
    luma_image = image.convert("L")
    if size != image.size:
        luma_image = luma_image.resize(size, Image.Resampling.BOX)
    luma = np.asarray(luma_image, dtype=np.uint8)
    # The chroma from the RGB image area-averaged to 1/CHROMA_SCALE of the luma's size
    # (Pillow's reduce by the largest whole factor first: one fast pass over the full-size
    # pixels), then converted: YCbCr is affine in RGB, so this is the average of the
    # chroma, at a quarter of the conversion's cost.
    ch, cw, _ = chroma_shape(size[1], size[0])
    factor = min(image.size[0] // cw, image.size[1] // ch)
    small = image.reduce(factor) if factor >= 2 else image
    if small.size != (cw, ch):
        small = small.resize((cw, ch), Image.Resampling.BOX)
    _, cb, cr = small.convert("YCbCr").split()
    chroma = np.stack([np.asarray(cb, dtype=np.uint8), np.asarray(cr, dtype=np.uint8)], -1)
    return VerificationImage(luma, chroma)


def _block_sums(x: np.ndarray, block: int = VERIFY_BLOCK) -> np.ndarray:
    """Sums over ``block`` x ``block`` tiles of a 2-D array (the last row and column of
    tiles partial), as float32 (exact enough: 16 squares of 8-bit values)."""
    h, w = x.shape
    hb, wb = -(-h // block), -(-w // block)
    if (hb * block, wb * block) != (h, w):
        padded = np.zeros((hb * block, wb * block), dtype=np.float32)
        padded[:h, :w] = x
        x = padded
    rows = x.reshape(hb, block, wb * block).sum(axis=1, dtype=np.float32)
    return rows.reshape(hb, wb, block).sum(axis=2, dtype=np.float32)


def _block_counts(shape: tuple[int, ...], block: int = VERIFY_BLOCK) -> np.ndarray:
    h, w = shape[0], shape[1]
    rows = np.minimum(block, h - np.arange(0, h, block))
    cols = np.minimum(block, w - np.arange(0, w, block))
    return np.outer(rows, cols).astype(np.float32)


def _block_means(x: np.ndarray, block: int = VERIFY_BLOCK) -> np.ndarray:
    return _block_sums(x, block) / _block_counts(x.shape, block)


def _masked_spread(x: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(standard deviation of ``x`` over ``mask`` in each block, the mask's share)."""
    m = mask.astype(np.float32)
    n = _block_sums(m)
    share = n / _block_counts(m.shape)
    n = np.maximum(n, 1.0)
    xm = x * m
    mean = _block_sums(xm) / n
    return np.sqrt(np.maximum(_block_sums(xm * x) / n - mean**2, 0.0)), share


def comparable(a: VerificationImage | None, b: VerificationImage | None) -> bool:
    """Both present, well formed (uint8 luma [h, w] with its :func:`chroma_shape`),
    non-empty, sizes within :data:`MAX_SIDE_RATIO` per side and aspect ratios within
    :data:`MAX_ASPECT_DIFFERENCE` of each other."""
    if a is None or b is None:
        return False
    for v in (a, b):
        if v.luma.ndim != 2 or v.luma.size == 0:
            return False
        if v.chroma.shape != chroma_shape(*v.luma.shape):
            return False
    (ha, wa), (hb, wb) = a.luma.shape, b.luma.shape
    if max(ha, hb) > MAX_SIDE_RATIO * min(ha, hb) or max(wa, wb) > MAX_SIDE_RATIO * min(wa, wb):
        return False
    aspect_a, aspect_b = wa / ha, wb / hb
    return abs(aspect_a - aspect_b) <= MAX_ASPECT_DIFFERENCE * min(aspect_a, aspect_b)


def _onto_smaller(a: np.ndarray, b: np.ndarray) -> tuple[Image.Image, Image.Image]:
    """Two uint8 [h, w] planes as Pillow images, the larger Lanczos-resampled onto the
    smaller's size."""
    ia = Image.fromarray(np.ascontiguousarray(a, dtype=np.uint8), "L")
    ib = Image.fromarray(np.ascontiguousarray(b, dtype=np.uint8), "L")
    if ia.size != ib.size:
        if ia.size[0] * ia.size[1] > ib.size[0] * ib.size[1]:
            ia = ia.resize(ib.size, Image.Resampling.LANCZOS)
        else:
            ib = ib.resize(ia.size, Image.Resampling.LANCZOS)
    return ia, ib


def _common(
    a: VerificationImage, b: VerificationImage
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(luma a, luma b, chroma a, chroma b) as float32: the lumas at the smaller one's
    size, 2x2 box-averaged, the chromas at the smaller chroma's size."""
    ia, ib = _onto_smaller(a.luma, b.luma)
    if min(ia.size) >= 2 * VERIFY_REDUCE:
        ia, ib = ia.reduce(VERIFY_REDUCE), ib.reduce(VERIFY_REDUCE)
    chroma_a, chroma_b = [], []
    for c in range(2):
        ca, cb = _onto_smaller(a.chroma[..., c], b.chroma[..., c])
        chroma_a.append(np.asarray(ca, dtype=np.float32))
        chroma_b.append(np.asarray(cb, dtype=np.float32))
    return (
        np.asarray(ia, dtype=np.float32),
        np.asarray(ib, dtype=np.float32),
        np.stack(chroma_a, -1),
        np.stack(chroma_b, -1),
    )


def _residuals(a: VerificationImage, b: VerificationImage) -> Iterator[float]:
    """The residual in both directions, lazily: a brightened copy clips highlights, which
    only the darker image can predict."""
    ya, yb, ca, cb = _common(a, b)
    yield _residual(ya, yb, ca, cb)
    yield _residual(yb, ya, cb, ca)


def verification_residual(a: VerificationImage | None, b: VerificationImage | None) -> float:
    """How far apart two verification images are, in luma levels: the largest block score
    of the four checks (module docstring) at the smaller one's resolution, 2x2-reduced,
    after the photometric normalisation, in the better of the two directions. The luma
    check's score is its residual; the others are scaled so that each fails exactly where
    the score passes :data:`VERIFY_TOLERANCE`.

    Args:
        a, b: from :func:`verification_image`.

    Returns:
        Levels (0 for identical images); ``inf`` when either is missing, empty or
        malformed, the two are not :func:`comparable`, or their contrasts differ by more
        than :data:`MAX_PHOTOMETRIC_GAIN` in both directions.
    """
    return min(_residuals(a, b)) if comparable(a, b) else float("inf")  # type: ignore[arg-type]


def _residual(ya: np.ndarray, yb: np.ndarray, ca: np.ndarray, cb: np.ndarray) -> float:
    """The largest block score of ``b`` predicted from ``a`` (luma float32 [h, w], chroma
    float32 [hc, wc, 2]); ``inf`` when the gain is outside [1 / MAX_PHOTOMETRIC_GAIN,
    MAX_PHOTOMETRIC_GAIN]."""
    unsaturated = (ya >= 2) & (ya <= 253) & (yb >= 2) & (yb <= 253)
    if np.count_nonzero(unsaturated) < unsaturated.size // 2:
        unsaturated = np.ones_like(unsaturated)
    xa, xb = ya[unsaturated], yb[unsaturated]
    ma, mb = float(xa.mean()), float(xb.mean())
    sa, sb = float(xa.std()), float(xb.std())
    gain = sb / sa if sa > 1e-3 and sb > 1e-3 else 1.0
    if not 1 / MAX_PHOTOMETRIC_GAIN <= gain <= MAX_PHOTOMETRIC_GAIN:
        return float("inf")  # not the same picture with another contrast
    raw = (ya - ma) * gain + mb
    predicted = np.clip(raw, 0.0, 255.0)
    signed = predicted - yb
    luma = _block_means(np.abs(signed))
    scores = [float(luma.max())]
    # Clipping: the prediction's detail beyond the clip where the target is clipped.
    for clip, where in ((253.0, yb >= 253), (2.0, yb <= 2)):
        if np.count_nonzero(where) >= CLIPPED_SHARE * VERIFY_BLOCK * VERIFY_BLOCK:
            beyond = np.maximum(raw, clip) if clip > 128 else np.minimum(raw, clip)
            spread, share = _masked_spread(beyond, where)
            scores.append(float(np.where(share >= CLIPPED_SHARE, spread, 0.0).max()))
    # Contrast-relative: the residual's structure (a block-wide offset removed) against
    # the block's own contrast. The structure is at most twice the block's mean residual,
    # so only blocks over RELATIVE_FLOOR / 2 can count, and only those are looked at.
    rows, cols = np.nonzero(luma > RELATIVE_FLOOR / 2)
    if len(rows) and scores[0] <= VERIFY_TOLERANCE:  # (a failing luma check decides)
        d, t, p = (_tiles(x, rows, cols) for x in (signed, yb, predicted))
        structure = np.abs(d - d.mean(axis=1, keepdims=True)).mean(axis=1)
        contrast = np.maximum(t.std(axis=1), p.std(axis=1)) + RELATIVE_FLOOR
        relative = np.where(structure > RELATIVE_FLOOR, structure / contrast, 0.0)
        scores.append(float(relative.max()) * (VERIFY_TOLERANCE / RELATIVE_TOLERANCE))
    # Chroma: the distance from neutral (128) scaled by the luma's gain.
    chroma = _block_means(np.abs((ca - 128.0) * gain + 128.0 - cb).max(axis=-1), CHROMA_BLOCK)
    scores.append(float(chroma.max()) * (VERIFY_TOLERANCE / CHROMA_TOLERANCE))
    # In the higher-contrast image's levels: a query at 2/3 of the stored contrast would
    # otherwise shrink every difference, and the tolerance with it, by a third.
    return max(scores) * max(1.0, 1.0 / gain)


def _tiles(x: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """The pixels of blocks (``rows``, ``cols``) of a 2-D array: [len(rows), BLOCK**2];
    partial edge blocks are completed with their edge pixels."""
    b = VERIFY_BLOCK
    h, w = x.shape
    padded = np.pad(x, ((0, -h % b), (0, -w % b)), mode="edge")
    grid = padded.reshape(padded.shape[0] // b, b, padded.shape[1] // b, b)
    return grid[rows, :, cols, :].reshape(len(rows), b * b)


def verify(
    a: VerificationImage | None, b: VerificationImage | None, tolerance: float = VERIFY_TOLERANCE
) -> bool:
    """Whether two verification images show the same picture (see the module docstring).

    False when either is missing: an entry or a query without one is never a similarity
    hit (it can still hit exactly). Same as ``verification_residual(a, b) <= tolerance``,
    computing the second direction only when the first fails.
    """
    if not comparable(a, b):
        return False
    assert a is not None and b is not None
    return any(r <= tolerance for r in _residuals(a, b))
