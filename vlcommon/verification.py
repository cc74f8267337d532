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
  filter), after a global photometric normalisation (the luma's mean and standard
  deviation of one matched to the other's over the pixels unsaturated in both, the
  chroma's distance from neutral scaled by the same gain; a gain beyond
  :data:`MAX_PHOTOMETRIC_GAIN` either way fails) and a global **sharpness match** (the
  prediction adds the amount of the first image's high-pass, within
  :data:`MAX_SHARPNESS`, that best fits the other: a resize or re-encode blurs the whole
  picture alike, an edit is local), in the better direction, six checks pass in every
  block. Blocks are 8x8 pixels of the compared resolution; where said, they are taken at a
  **half-block stride** (every window offset by 0 or 4 pixels each way), so that an edit
  straddling the corner of four aligned blocks lies whole in one of them:

  - **detail**: at the compared resolution, at half-block stride, the mean absolute
    difference of the prediction (clipped to [0, 255], as a brightened copy clips
    highlights) is within :data:`DETAIL_TOLERANCE` (a 1-2 px stroke of 11 px type);
  - **luma**: the same on both 2x2 box-averaged (4x4 blocks, half-block stride, which
    also evens out the resampling filters' differences), within :data:`LUMA_TOLERANCE`;
  - **isolation**: the largest of those detail windows is at most :data:`ISOLATION_RATIO`
    times the :data:`ISOLATION_RANK`-th largest plus :data:`ISOLATION_FLOOR`: a near
    duplicate spreads its residual over the picture, an edit between two otherwise
    identical images (two lossless screenshots) puts all of it in a few windows, however
    faint (grey-on-grey 11 px type, a comma for a point);
  - **chroma**: on the chroma images (the larger resampled onto the smaller, windows of
    :data:`CHROMA_BLOCK` x :data:`CHROMA_BLOCK` chroma pixels at half-block stride), the
    mean absolute Cb and Cr differences are within :data:`CHROMA_TOLERANCE` (a grayscale
    copy, or a red light turned green at equal luma);
  - **clipping**: where the other image is clipped (at least :data:`CLIPPED_SHARE` of a
    2x2-reduced block at 255, or at 0), the detail the prediction has beyond the clip (its
    standard deviation there) is within :data:`VERIFY_TOLERANCE`: a blown-out copy does not
    show what the stored image shows there, so it is not served it;
  - **contrast-relative**: in 2x2-reduced blocks without clipping, a residual over
    :data:`RELATIVE_FLOOR` levels is at most :data:`RELATIVE_TOLERANCE` of the block's
    contrast (its standard deviation, plus :data:`RELATIVE_FLOOR`): faint type (pencil,
    light print, a watermark) changed by one digit leaves a residual under the absolute
    tolerance, but as large as its own contrast.


Where one of the two was decoded from a JPEG of the other's size, two more checks run
(:mod:`vlcommon.verification_jpeg`): **JPEG-matched** (the other picture put through the
JPEG's own luma table by libjpeg is bit-identical wherever the pictures agree, so a
re-encode leaves nothing and a faint edit stands out) and, where that does not apply
(another encoder, a change before the JPEG), **coefficient-interval** (whether the JPEG
could have been coded from the other picture at all, by any encoder: each 8x8 block's DCT
coefficients within about half a quantization step of the other's).

A block where one digit, word, cell or bar differs has a residual of tens of levels; JPEG
re-encoding (q70-95) and resizes of up to 10% leave a few. The same functions run in the
gateway (:func:`verification_image`), the cache service (:func:`verify`) and ``splitvl
cache-eval`` (calibration), so what is measured is what is served. Calibration, costs and
memory: docs/cache.md.

Modules: this one holds the verification image (:class:`VerificationImage`,
:func:`verification_image`), the six checks and the entry points (:func:`verify`,
:func:`verification_residual`); :mod:`vlcommon.verification_jpeg` the JPEG checks and
their view of a JPEG (:class:`JpegLuma`, :func:`read_jpeg`, :func:`jpeg_matched_score`);
:mod:`vlcommon.verification_common` the constants and block statistics both use. The
names callers use are importable from here.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import numpy as np
from PIL import Image

from vlcommon.verification_common import (
    CHROMA_SCALE,
    DETAIL_BLOCK,
    MAX_PHOTOMETRIC_GAIN,
    VERIFY_MAX_PIXELS,
    VERIFY_TOLERANCE,
    block_counts,
    block_means,
    block_sums,
    half_stride_block_means,
)
from vlcommon.verification_common import JPEG_MAX_CLIPPED_SHARE as JPEG_MAX_CLIPPED_SHARE
from vlcommon.verification_common import JpegLuma as JpegLuma
from vlcommon.verification_common import VerificationImage as VerificationImage

# The `X as X` imports re-export names the cache servicer and the tests import from here.
from vlcommon.verification_jpeg import JPEG_MAX_SIDE as JPEG_MAX_SIDE
from vlcommon.verification_jpeg import _coefficient_score as _coefficient_score
from vlcommon.verification_jpeg import _jpeg_score as _jpeg_score
from vlcommon.verification_jpeg import jpeg_matched_score, read_jpeg

# An image over the cap is verifiable only where its verification image holds this many
# times the plan's resolution per side (glyphs of ~12 px are the smallest the comparison
# resolves; the model reads ~8 px): at most VERIFY_MAX_PIXELS / 2.25 = 932,067 pixels.
VERIFY_MARGIN = 1.5
# After resampling onto a common size, both are box-averaged 2x2 (which also evens out the
# resampling filters' differences), then compared in 4x4 blocks (8x8 pixels).
VERIFY_REDUCE = 2
VERIFY_BLOCK = 4
# Largest mean |luma difference| of one 4x4 block of the 2x2-reduced images (8x8 pixels),
# at half-block stride, 8-bit levels, after photometric and sharpness matching. Calibrated
# with `splitvl cache-eval` and the digit scans of
# tests/unit/cache_service/test_similarity_adversarial.py
# (docs/cache.md).
LUMA_TOLERANCE = 6.0
# The same for DETAIL_BLOCK windows (8x8 pixels) at the compared resolution itself (no
# 2x2 reduce): a 1-2 px stroke of 11 px type changed ('6' to '8') is halved by the reduce.
DETAIL_TOLERANCE = 12.0
# Isolation check: the largest full-resolution window residual may be at most
# ISOLATION_RATIO times (the ISOLATION_RANK-th largest + ISOLATION_FLOOR levels). Near
# duplicates spread their residual over the picture (JPEG, resampling: at most 2.2x in
# cache-eval); an edit between otherwise identical images (two lossless screenshots, one
# digit of grey-on-grey 11 px type, a comma for a point) puts all of it in a few windows
# (4.5x or more). 32 windows at half-block stride: about 32x32 pixels of change.
ISOLATION_RANK = 32
ISOLATION_RATIO = 3.2
ISOLATION_FLOOR = 0.5
# Sharpness matching: the prediction may add or remove up to MAX_SHARPNESS times the
# first image's high-pass (its pixels minus their 3x3 binomial blur, sigma 1/sqrt(2)),
# one amount for the whole image, fitted by least squares. Resizes of 0.9-1.1x fit
# -0.05..-0.35; the bound keeps a much blurrier query (text no longer legible) from being
# predicted from a sharp stored image.
MAX_SHARPNESS = 0.5
# Chroma (at 1/CHROMA_SCALE of the luma's resolution per side) is compared in blocks of
# CHROMA_BLOCK x CHROMA_BLOCK chroma pixels (8x8 pixels, the luma's block). At 1/4 per
# side, compared per 16x16 pixels, a 12 px status dot or a 2 px line turned from red to
# green at equal luma passed (tests/unit/cache_service/test_similarity_adversarial.py).
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


def chroma_shape(height: int, width: int) -> tuple[int, int, int]:
    """The chroma image's shape for a luma image of ``height`` x ``width``."""
    return -(-height // CHROMA_SCALE), -(-width // CHROMA_SCALE), 2


def verification_image(
    image: Image.Image | np.ndarray, encoded: bytes | None = None
) -> VerificationImage:
    """The verification image of one decoded image.

    Args:
        image: The decoded image (``vlcommon.imaging.decode_image``: upright 8-bit RGB) as
            a Pillow image, or uint8 [height, width, 3] RGB.
        encoded: The file it was decoded from, if at hand: a JPEG gives the result its
            :class:`JpegLuma` (:func:`read_jpeg`), for the JPEG-matched check.

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
    read = read_jpeg(encoded, image.size) if encoded is not None else None
    jpeg = JpegLuma.of(read[0], read[1], luma) if read is not None else None
    return VerificationImage(luma, chroma, jpeg)


def _masked_spread(x: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(standard deviation of ``x`` over ``mask`` in each block, the mask's share)."""
    m = mask.astype(np.float32)
    n = block_sums(m, VERIFY_BLOCK)
    share = n / block_counts(m.shape, VERIFY_BLOCK)
    n = np.maximum(n, 1.0)
    xm = x * m
    mean = block_sums(xm, VERIFY_BLOCK) / n
    return np.sqrt(np.maximum(block_sums(xm * x, VERIFY_BLOCK) / n - mean**2, 0.0)), share


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


class _Plane:
    """One luma plane at the compared size, float32: ``luma`` [h, w]; ``reduced``, the
    luma 2x2 box-averaged; ``high_pass`` [h, w], the luma minus its 3x3 binomial blur (a
    Gaussian of sigma 1/sqrt(2); edges replicated) and ``energy``, its sum of squares,
    computed when first asked for (the second direction is often never compared)."""

    def __init__(self, image: Image.Image) -> None:
        self.luma = np.asarray(image, dtype=np.float32)
        self.reduced = _reduce(self.luma)

    @functools.cached_property
    def high_pass(self) -> np.ndarray:
        # In numpy on floats: exact, and twice as fast as Pillow's 3x3 Kernel filter here.
        x = np.pad(self.luma, 1, mode="edge")
        rows = x[:-2] + x[2:]
        rows += 2 * x[1:-1]
        blurred = rows[:, :-2] + rows[:, 2:]
        blurred += 2 * rows[:, 1:-1]
        return self.luma - blurred * (1 / 16)

    @functools.cached_property
    def energy(self) -> float:
        return float(np.vdot(self.high_pass, self.high_pass))


def _common(
    a: VerificationImage, b: VerificationImage
) -> tuple[_Plane, _Plane, list[np.ndarray], list[np.ndarray]]:
    """(luma a, luma b, chroma a, chroma b): the lumas at the smaller one's size, the
    chromas ([Cb, Cr], each float32 [hc, wc]) at the smaller chroma's size."""
    ia, ib = _onto_smaller(a.luma, b.luma)
    chroma_a, chroma_b = [], []
    for c in range(2):
        ca, cb = _onto_smaller(a.chroma[..., c], b.chroma[..., c])
        chroma_a.append(np.asarray(ca, dtype=np.float32))
        chroma_b.append(np.asarray(cb, dtype=np.float32))
    return _Plane(ia), _Plane(ib), chroma_a, chroma_b


def _residuals(a: VerificationImage, b: VerificationImage) -> Iterator[float]:
    """The residual in both directions, lazily: a brightened copy clips highlights, which
    only the darker image can predict."""
    ya, yb, ca, cb = _common(a, b)
    yield _residual(ya, yb, ca, cb)
    yield _residual(yb, ya, cb, ca)


def verification_residual(a: VerificationImage | None, b: VerificationImage | None) -> float:
    """How far apart two verification images are, in luma levels: the largest block score
    of the six checks (module docstring) at the smaller one's resolution, after the
    photometric and sharpness matching, in the better of the two directions. The luma
    check's score is its residual in units of :data:`VERIFY_TOLERANCE`; the others are
    scaled so that each fails exactly where the score passes :data:`VERIFY_TOLERANCE`.

    Args:
        a, b: from :func:`verification_image`.

    Returns:
        Levels (0 for identical images); ``inf`` when either is missing, empty or
        malformed, the two are not :func:`comparable`, or their contrasts differ by more
        than :data:`MAX_PHOTOMETRIC_GAIN` in both directions.
    """
    if not comparable(a, b):
        return float("inf")
    assert a is not None and b is not None
    return max(min(_residuals(a, b)), jpeg_matched_score(a, b))


def _reduce(x: np.ndarray) -> np.ndarray:
    """2x2 box average (the last row and column partial)."""
    return block_means(x, VERIFY_REDUCE) if min(x.shape) >= 2 * VERIFY_REDUCE else x


def _residual(pa: _Plane, pb: _Plane, ca: list[np.ndarray], cb: list[np.ndarray]) -> float:
    """The largest block score of ``b`` predicted from ``a`` (chroma from :func:`_common`);
    ``inf`` when the gain is outside [1 / MAX_PHOTOMETRIC_GAIN, MAX_PHOTOMETRIC_GAIN]."""
    # The photometric statistics on the reduced planes (a quarter of the pixels).
    ra, rb = pa.reduced, pb.reduced
    unsaturated = (ra >= 2) & (ra <= 253) & (rb >= 2) & (rb <= 253)
    if np.count_nonzero(unsaturated) < unsaturated.size // 2:
        unsaturated = np.ones_like(unsaturated)
    xa, xb = ra[unsaturated], rb[unsaturated]
    ma, mb = float(xa.mean()), float(xb.mean())
    sa, sb = float(xa.std()), float(xb.std())
    gain = sb / sa if sa > 1e-3 and sb > 1e-3 else 1.0
    if not 1 / MAX_PHOTOMETRIC_GAIN <= gain <= MAX_PHOTOMETRIC_GAIN:
        return float("inf")  # not the same picture with another contrast
    yb = pb.luma
    raw_full = (pa.luma - ma) * gain + mb
    # Sharpness matching: one global amount of the stored image's high-pass, fitted by
    # least squares (a resize or a re-encode blurs or sharpens the whole picture alike;
    # an edit is local, so it stays in the residual).
    energy = pa.energy * gain * gain
    fitted = float(np.vdot(pa.high_pass, yb - raw_full)) * gain / energy if energy > 1e-6 else 0.0
    sharpness = min(MAX_SHARPNESS, max(-MAX_SHARPNESS, fitted))
    predicted_full = raw_full + (sharpness * gain) * pa.high_pass
    np.clip(predicted_full, 0.0, 255.0, out=predicted_full)
    signed_full = predicted_full - yb
    # Detail: 8x8 pixels at the compared resolution, at half-block stride.
    detail = half_stride_block_means(np.abs(signed_full), DETAIL_BLOCK).ravel()
    worst = float(detail.max())
    scores = [worst * (VERIFY_TOLERANCE / DETAIL_TOLERANCE)]
    # Isolation: the worst window against the residual the rest of the image has (its
    # ISOLATION_RANK-th largest window), so that an edit between two otherwise identical
    # images is seen whatever its contrast.
    if detail.size > ISOLATION_RANK:
        rest = float(np.partition(detail, detail.size - 1 - ISOLATION_RANK)[-1 - ISOLATION_RANK])
        isolation = worst / (ISOLATION_RATIO * (rest + ISOLATION_FLOOR))
        scores.append(isolation * VERIFY_TOLERANCE)
    # Luma: 2x2-reduced, 4x4 blocks (8x8 pixels) at half-block stride.
    predicted, target = _reduce(predicted_full), pb.reduced
    signed = predicted - target
    luma_shifted = half_stride_block_means(np.abs(signed), VERIFY_BLOCK)
    scores.append(float(luma_shifted.max()) * (VERIFY_TOLERANCE / LUMA_TOLERANCE))
    # Clipping: the prediction's detail beyond the clip where the target is clipped.
    raw_reduced = (pa.reduced - ma) * gain + mb
    for clip, where in ((253.0, target >= 253), (2.0, target <= 2)):
        if np.count_nonzero(where) >= CLIPPED_SHARE * VERIFY_BLOCK * VERIFY_BLOCK:
            beyond = np.maximum(raw_reduced, clip) if clip > 128 else np.minimum(raw_reduced, clip)
            spread, share = _masked_spread(beyond, where)
            scores.append(float(np.where(share >= CLIPPED_SHARE, spread, 0.0).max()))
    # Contrast-relative: the residual's structure (a block-wide offset removed) against
    # the block's own contrast. The structure is at most twice the block's mean residual,
    # so only blocks over RELATIVE_FLOOR / 2 can count, and only those are looked at.
    luma = block_means(np.abs(signed), VERIFY_BLOCK)
    rows, cols = np.nonzero(luma > RELATIVE_FLOOR / 2)
    if len(rows) and max(scores) <= VERIFY_TOLERANCE:  # (a failing check decides)
        d, t, p = (_tiles(x, rows, cols) for x in (signed, target, predicted))
        structure = np.abs(d - d.mean(axis=1, keepdims=True)).mean(axis=1)
        contrast = np.maximum(t.std(axis=1), p.std(axis=1)) + RELATIVE_FLOOR
        relative = np.where(structure > RELATIVE_FLOOR, structure / contrast, 0.0)
        scores.append(float(relative.max()) * (VERIFY_TOLERANCE / RELATIVE_TOLERANCE))
    # Chroma: the distance from neutral (128) scaled by the luma's gain.
    cb_diff, cr_diff = (np.abs((x - 128.0) * gain + 128.0 - y) for x, y in zip(ca, cb, strict=True))
    chroma = half_stride_block_means(np.maximum(cb_diff, cr_diff), CHROMA_BLOCK)
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
    computing the second direction only when the first fails, and the JPEG checks only
    when one passes: the JPEG-matched check (a JPEG encode and decode of one luma plane
    and its block statistics, ~35 ms of CPU for 2 MP; up to ~120 ms more where it fails
    and its first-generation search runs), then, where it does not apply, the
    coefficient-interval check (~58 ms for 2 MP; up to ~225 ms where it fails and its
    search runs).
    """
    if not comparable(a, b):
        return False
    assert a is not None and b is not None
    if not any(r <= tolerance for r in _residuals(a, b)):
        return False
    return jpeg_matched_score(a, b) <= tolerance
