"""Verification of similarity-tier candidates at the resolution the ViT sees.

The similarity descriptor (:func:`vlcommon.imaging.similarity_descriptor`, a 32x32
thumbnail) finds candidates; it cannot tell a receipt that says ``$19.33`` from one that
says ``$79.33``, a chart with one bar changed, or an image built to share another's
thumbnail with different detail (cache poisoning): each cell averages 1/1024 of the image.
So every similarity candidate is also *verified* on a **verification image**: the luma of
the resized pixels the encoder would get (the resize plan's ``resized_height x
resized_width``, i.e. exactly what the ViT patches), box-averaged 2x2. Two images pass
when, after a global photometric normalisation (mean and standard deviation of one matched
to the other's over the pixels unsaturated in both, the prediction clipped to [0, 255]:
brightness and contrast changes of a few percent, highlights that clip), the mean absolute
luma difference of every 4x4 block of the verification image (8x8 resized pixels, a quarter
of a 16x16 ViT patch) stays within :data:`VERIFY_TOLERANCE`, in the better direction.
A block where one digit, word or bar differs has a residual of tens of levels; JPEG
re-encoding (q70-95) and resizes that keep the plan leave a few.

The same functions run in the gateway (:func:`verification_image`), the cache service
(:func:`verify`) and ``splitvl cache-eval`` (calibration), so what is measured is what is
served. Calibration and costs: docs/cache.md.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from PIL import Image

# 2x2 box average of the plan-size luma: 1/12 of the RGB pixels' bytes. One 4x4 block is
# 8x8 resized pixels (a quarter of a 16x16 ViT patch): 8x8 blocks diluted a changed digit
# of a receipt photo to 3 levels, 4x4 blocks keep it above 10.
VERIFY_REDUCE = 2
VERIFY_BLOCK = 4
# Largest mean |luma difference| of one block, 8-bit levels, after photometric matching.
# Calibrated with `splitvl cache-eval` (docs/cache.md): near duplicates that keep their
# plan reach 5.4, the closest distinct pair (a receipt photo, one digit changed) 10.4.
VERIFY_TOLERANCE = 7.5
# A verification image larger than this many bytes is refused (INVALID_ARGUMENT): the
# largest plan Qwen3-VL's processor allows is 16,777,216 pixels -> 4,194,304 bytes.
MAX_VERIFICATION_BYTES = 4_194_304


def verification_image(pixels: np.ndarray) -> np.ndarray:
    """The verification image of one resized image.

    Args:
        pixels: uint8 [resized_height, resized_width, 3], RGB at the resize plan's size
            (what the gateway sends to the encoder).

    Returns:
        uint8 [ceil(h / 2), ceil(w / 2)]: ITU-R 601 luma (Pillow ``L``), 2x2 box average
        (Pillow ``Image.reduce``).
    """
    luma = Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8), "RGB").convert("L")
    return np.asarray(luma.reduce(VERIFY_REDUCE), dtype=np.uint8)


def _block_means(x: np.ndarray) -> np.ndarray:
    rows = np.arange(0, x.shape[0], VERIFY_BLOCK)
    cols = np.arange(0, x.shape[1], VERIFY_BLOCK)
    sums = np.add.reduceat(np.add.reduceat(x, rows, axis=0), cols, axis=1)
    counts = np.outer(np.diff(np.append(rows, x.shape[0])), np.diff(np.append(cols, x.shape[1])))
    return sums / counts


def _comparable(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Both present, 2-D, non-empty and of one shape (equal plan sizes)."""
    return a is not None and b is not None and a.shape == b.shape and a.size > 0 and a.ndim == 2


def _residuals(a: np.ndarray, b: np.ndarray) -> Iterator[float]:
    """The residual in both directions, lazily: a brightened copy clips highlights, which
    only the darker image can predict."""
    fa = a.astype(np.float32)
    fb = b.astype(np.float32)
    yield _residual(fa, fb)
    yield _residual(fb, fa)


def verification_residual(a: np.ndarray, b: np.ndarray) -> float:
    """The largest 4x4-block mean absolute luma difference of two verification images,
    after matching one's mean and standard deviation to the other's (the smaller of the
    two directions).

    Args:
        a, b: uint8 [h, w] from :func:`verification_image`.

    Returns:
        8-bit luma levels (0 for identical images); ``inf`` when the shapes differ or an
        image is empty.
    """
    return min(_residuals(a, b)) if _comparable(a, b) else float("inf")


def _residual(fa: np.ndarray, fb: np.ndarray) -> float:
    """Largest block mean |clip(gain * (a - mean_a) + mean_b) - b|."""
    unsaturated = (fa >= 2) & (fa <= 253) & (fb >= 2) & (fb <= 253)
    if np.count_nonzero(unsaturated) < unsaturated.size // 2:
        unsaturated = np.ones_like(unsaturated)
    xa, xb = fa[unsaturated], fb[unsaturated]
    ma, mb = float(xa.mean()), float(xb.mean())
    sa, sb = float(xa.std()), float(xb.std())
    gain = sb / sa if sa > 1e-3 and sb > 1e-3 else 1.0
    diff = np.abs(np.clip((fa - ma) * gain + mb, 0.0, 255.0) - fb)
    return float(_block_means(diff).max())


def verify(a: np.ndarray | None, b: np.ndarray | None, tolerance: float = VERIFY_TOLERANCE) -> bool:
    """Whether two verification images show the same picture (see the module docstring).

    False when either is missing: an entry or a query without one is never a similarity
    hit (it can still hit exactly). Same as ``verification_residual(a, b) <= tolerance``,
    computing the second direction only when the first fails.
    """
    if not _comparable(a, b):
        return False
    assert a is not None and b is not None
    return any(r <= tolerance for r in _residuals(a, b))
