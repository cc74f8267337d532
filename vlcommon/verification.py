"""Verification of similarity-tier candidates on the decoded image, whatever the plan.

The similarity descriptor (:func:`vlcommon.imaging.similarity_descriptor`, a 32x32
thumbnail) finds candidates; it cannot tell a receipt that says ``$19.33`` from one that
says ``$79.33``, a chart with one bar changed, or an image built to share another's
thumbnail with different detail (cache poisoning): each cell averages 1/1024 of the image.
So every similarity candidate is also *verified* on a **verification image**: the luma of
the **decoded** image (upright, alpha on white, Pillow ``L``), at its own resolution, shrunk
(area average) only when it holds more than :data:`VERIFY_MAX_PIXELS` pixels. It does not
depend on the resize plan, so an edit legible in the image the client sent (one digit of a
total, one word) is seen even when the plan shrinks the image below legibility (the tiny
checkpoint's 65,536 pixels, or the small budgets real-time deployments use).

Two verification images pass (:func:`verify`) when:

* their sizes agree within :data:`MAX_SIDE_RATIO` per side and their aspect ratios within
  :data:`MAX_ASPECT_DIFFERENCE` (neither holds much more detail than the other: a full-size
  photo and its thumbnail are not compared at the thumbnail's resolution);
* at the smaller one's resolution (the larger resampled onto it with Pillow's Lanczos
  filter), both 2x2 box-averaged, after a global photometric normalisation (mean and
  standard deviation of one matched to the other's over the pixels unsaturated in both, the
  prediction clipped to [0, 255]: brightness and contrast changes, clipped highlights; a
  gain beyond :data:`MAX_PHOTOMETRIC_GAIN` either way fails), the
  mean absolute luma difference of every 4x4 block (8x8 pixels of the compared resolution)
  stays within :data:`VERIFY_TOLERANCE`, in the better direction.

A block where one digit, word, cell or bar differs has a residual of tens of levels; JPEG
re-encoding (q70-95) and resizes of up to 10% leave a few. The same functions run in the
gateway (:func:`verification_image`), the cache service (:func:`verify`) and ``splitvl
cache-eval`` (calibration), so what is measured is what is served. Calibration, costs and
memory: docs/cache.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
from PIL import Image

# The verification image keeps the decoded image's own resolution up to this many pixels
# (1 MiB of uint8 luma per entry at most); larger images are area-averaged down to it.
VERIFY_MAX_PIXELS = 1_048_576
# After resampling onto a common size, both are box-averaged 2x2 (which also evens out the
# resampling filters' differences), then compared in 4x4 blocks (8x8 pixels).
VERIFY_REDUCE = 2
VERIFY_BLOCK = 4
# Largest mean |luma difference| of one block, 8-bit levels, after photometric matching.
# Calibrated with `splitvl cache-eval` (docs/cache.md).
VERIFY_TOLERANCE = 8.0
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
# A verification image larger than this many bytes is refused (INVALID_ARGUMENT). Larger
# than VERIFY_MAX_PIXELS so that older gateways' images (a quarter of a plan of up to
# 16,777,216 pixels) are still accepted.
MAX_VERIFICATION_BYTES = 4_194_304


def verification_size(width: int, height: int) -> tuple[int, int]:
    """(width, height) of the verification image of a decoded image of that size: the same
    size up to :data:`VERIFY_MAX_PIXELS` pixels, else scaled down (aspect kept) to fit."""
    if width * height <= VERIFY_MAX_PIXELS:
        return width, height
    scale = math.sqrt(VERIFY_MAX_PIXELS / (width * height))
    return max(1, int(width * scale)), max(1, int(height * scale))


def verification_image(image: Image.Image | np.ndarray) -> np.ndarray:
    """The verification image of one decoded image.

    Args:
        image: The decoded image (``vlcommon.imaging.decode_image``: upright 8-bit RGB) as
            a Pillow image, or uint8 [height, width, 3] RGB.

    Returns:
        uint8 [h, w]: ITU-R 601 luma (Pillow ``L``) at the image's own size, or
        area-averaged (Pillow ``BOX``) to :func:`verification_size` when it holds more than
        :data:`VERIFY_MAX_PIXELS` pixels.
    """
    if isinstance(image, np.ndarray):
        image = Image.fromarray(np.ascontiguousarray(image, dtype=np.uint8), "RGB")
    luma = image.convert("L")
    size = verification_size(*luma.size)
    if size != luma.size:
        luma = luma.resize(size, Image.Resampling.BOX)
    return np.asarray(luma, dtype=np.uint8)


def _block_means(x: np.ndarray) -> np.ndarray:
    rows = np.arange(0, x.shape[0], VERIFY_BLOCK)
    cols = np.arange(0, x.shape[1], VERIFY_BLOCK)
    sums = np.add.reduceat(np.add.reduceat(x, rows, axis=0), cols, axis=1)
    counts = np.outer(np.diff(np.append(rows, x.shape[0])), np.diff(np.append(cols, x.shape[1])))
    return sums / counts


def comparable(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Both present, 2-D, non-empty, sizes within :data:`MAX_SIDE_RATIO` per side and
    aspect ratios within :data:`MAX_ASPECT_DIFFERENCE` of each other."""
    if a is None or b is None or a.ndim != 2 or b.ndim != 2 or a.size == 0 or b.size == 0:
        return False
    (ha, wa), (hb, wb) = a.shape, b.shape
    if max(ha, hb) > MAX_SIDE_RATIO * min(ha, hb) or max(wa, wb) > MAX_SIDE_RATIO * min(wa, wb):
        return False
    aspect_a, aspect_b = wa / ha, wb / hb
    return abs(aspect_a - aspect_b) <= MAX_ASPECT_DIFFERENCE * min(aspect_a, aspect_b)


def _common(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both at the smaller one's size, 2x2 box-averaged, as float32."""
    ia = Image.fromarray(np.ascontiguousarray(a, dtype=np.uint8), "L")
    ib = Image.fromarray(np.ascontiguousarray(b, dtype=np.uint8), "L")
    if ia.size != ib.size:
        if ia.size[0] * ia.size[1] > ib.size[0] * ib.size[1]:
            ia = ia.resize(ib.size, Image.Resampling.LANCZOS)
        else:
            ib = ib.resize(ia.size, Image.Resampling.LANCZOS)
    if min(ia.size) >= 2 * VERIFY_REDUCE:
        ia, ib = ia.reduce(VERIFY_REDUCE), ib.reduce(VERIFY_REDUCE)
    return np.asarray(ia, dtype=np.float32), np.asarray(ib, dtype=np.float32)


def _residuals(a: np.ndarray, b: np.ndarray) -> Iterator[float]:
    """The residual in both directions, lazily: a brightened copy clips highlights, which
    only the darker image can predict."""
    fa, fb = _common(a, b)
    yield _residual(fa, fb)
    yield _residual(fb, fa)


def verification_residual(a: np.ndarray | None, b: np.ndarray | None) -> float:
    """The largest 4x4-block mean absolute luma difference of two verification images at
    the smaller one's resolution, 2x2-reduced, after matching one's mean and standard
    deviation to the other's (the smaller of the two directions).

    Args:
        a, b: uint8 [h, w] from :func:`verification_image`.

    Returns:
        8-bit luma levels (0 for identical images); ``inf`` when either is missing or empty,
        the two are not :func:`comparable`, or their contrasts differ by more than
        :data:`MAX_PHOTOMETRIC_GAIN` in both directions.
    """
    return min(_residuals(a, b)) if comparable(a, b) else float("inf")  # type: ignore[arg-type]


def _residual(fa: np.ndarray, fb: np.ndarray) -> float:
    """Largest block mean |clip(gain * (a - mean_a) + mean_b) - b|; ``inf`` when the gain
    is outside [1 / MAX_PHOTOMETRIC_GAIN, MAX_PHOTOMETRIC_GAIN]."""
    unsaturated = (fa >= 2) & (fa <= 253) & (fb >= 2) & (fb <= 253)
    if np.count_nonzero(unsaturated) < unsaturated.size // 2:
        unsaturated = np.ones_like(unsaturated)
    xa, xb = fa[unsaturated], fb[unsaturated]
    ma, mb = float(xa.mean()), float(xb.mean())
    sa, sb = float(xa.std()), float(xb.std())
    gain = sb / sa if sa > 1e-3 and sb > 1e-3 else 1.0
    if not 1 / MAX_PHOTOMETRIC_GAIN <= gain <= MAX_PHOTOMETRIC_GAIN:
        return float("inf")  # not the same picture with another contrast
    diff = np.abs(np.clip((fa - ma) * gain + mb, 0.0, 255.0) - fb)
    return float(_block_means(diff).max())


def verify(a: np.ndarray | None, b: np.ndarray | None, tolerance: float = VERIFY_TOLERANCE) -> bool:
    """Whether two verification images show the same picture (see the module docstring).

    False when either is missing: an entry or a query without one is never a similarity
    hit (it can still hit exactly). Same as ``verification_residual(a, b) <= tolerance``,
    computing the second direction only when the first fails.
    """
    if not comparable(a, b):
        return False
    assert a is not None and b is not None
    return any(r <= tolerance for r in _residuals(a, b))
