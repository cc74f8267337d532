"""The JPEG checks of the verification (:mod:`vlcommon.verification`), and the JPEG view
of a verification image they run on.

This module holds the JPEG view (:class:`JpegLuma`, read from the file by
:func:`read_jpeg`), the JPEG-matched check (libjpeg round trips, the first-generation
search) and the coefficient-interval check (block DCTs, the clip mask, the interval
score), scored together by :func:`jpeg_matched_score`, which
:func:`vlcommon.verification.verify` calls once the six checks pass. The six checks, the
verification image and the entry points are in :mod:`vlcommon.verification`; the
constants and block statistics both use are in :mod:`vlcommon.verification_common`.

A seventh check, **JPEG-matched**, runs where one of the two was decoded from a JPEG of the
other's size (:class:`JpegLuma`: the file's luma quantization table and its Y channel as
decoded, before the conversion to RGB). The other image's luma is encoded as a grayscale
JPEG with that table (libjpeg, as Pillow does) and decoded: if the JPEG was made from the
other picture by a libjpeg-compatible encoder (Pillow; OpenCV's and Chromium's are
libjpeg-turbo too), the two are bit-identical in every 8x8 block where the pictures do not
differ, since JPEG codes each block on its own. So where at least
:data:`JPEG_MATCHED_SHARE` of the textured blocks are identical (the same encoder), the
largest mean absolute difference of an 8x8 window at half-block stride must be within
:data:`JPEG_TOLERANCE`: a re-encode leaves 0, one digit of grey-on-grey 11 px type or of
an alpha-30 watermark 4.5-9 levels, however much JPEG residual the other checks must
tolerate elsewhere. Another encoder (another DCT, ffmpeg's, trellis quantisation) leaves
most textured blocks different (at most 33% identical measured), and so does any change
to the picture before its JPEG (one level of brightness, a dither, an earlier JPEG
generation); the check then does not apply. Where both are JPEGs, the better direction
where it applies decides (a re-save is exact one way round). Where the other side is not
a JPEG and the check applies but fails, the JPEG may be a second libjpeg generation (a
JPEG re-saved from a decoded JPEG): the other picture is put through libjpeg at each of
:data:`COEF_FIRST_GENERATIONS` first, and the best applicable score kept.

Where it does not apply, an eighth check, **coefficient-interval**, asks whether the JPEG
could have been coded from the other picture at all, by any encoder: JPEG codes each 8x8
block's DCT coefficients as multiples of its table's steps, so a JPEG of a picture has
every AC coefficient within about half a step of that picture's (:data:`COEF_BIAS` of a
step per JPEG side, plus :data:`COEF_SLACK` levels), whatever its DCT, rounding or colour
conversion, while an edit moves the coefficients of its blocks by more than the steps
wherever the steps are finer than the edit. Per block, the excesses beyond that allowance
(after a global contrast gain fitted on the large coefficients, within
:data:`MAX_PHOTOMETRIC_GAIN`; the block means are the six checks' part) form a gap in
levels; blocks near the clip in any colour channel are left out. It applies where at
least :data:`COEF_MATCHED_SHARE` of the textured blocks have a gap of at most
:data:`COEF_MATCHED_GAP` (a resize or a stronger change moves most blocks), and then
every block's gap must be within :data:`COEF_TOLERANCE`. Where one side is not a JPEG and
the other fails or does not apply, the JPEG may be a second generation: the first is
simulated through libjpeg at each of :data:`COEF_FIRST_GENERATIONS` and the best applicable
score kept (the simulated first generation of the other picture still holds the old
digit). It closes one digit of grey-on-grey 11 px type changed under ffmpeg's encoder,
with a one-level shift or a dither, or through two generations; a JPEG coarse enough
that the edit fits within its steps (ffmpeg qscale 5: steps of 10-40 levels) still
passes (docs/cache.md).
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable

import numpy as np
from PIL import Image

from vlcommon.imaging import exif_orientation
from vlcommon.verification_common import (
    CHROMA_SCALE,
    DETAIL_BLOCK,
    MAX_PHOTOMETRIC_GAIN,
    VERIFY_MAX_PIXELS,
    VERIFY_TOLERANCE,
    VerificationImage,
    half_stride_block_means,
)

# JPEG-matched check: an 8x8 block of the source luma is textured when its levels span at
# least JPEG_TEXTURE; the encoder counts as the query's own when at least
# JPEG_MATCHED_SHARE of the textured blocks (all blocks, if none is textured) decode
# bit-identically (measured 2026-12-03: 0.98-1.00 for Pillow's encoder with an edit of one
# digit or none, 0.02-0.33 for ffmpeg's encoder and for a float DCT); then no 8x8 window
# (half-block stride) may differ by more than JPEG_TOLERANCE levels on average (0 for a
# re-encode; 4.5-9 for the faint edits of tests/unit/cache_service/test_similarity_adversarial.py).
JPEG_TEXTURE = 8
JPEG_MATCHED_SHARE = 0.6
JPEG_TOLERANCE = 1.0
JPEG_BLOCK = 8
# libjpeg's largest image side (JPEG_MAX_DIMENSION): no JPEG is wider or taller, so a
# verification image over it has no JPEG view (and the round trip could not encode it).
JPEG_MAX_SIDE = 65_500
# Coefficient-interval check (module docstring). Measured 2026-12-03 over scikit-image's
# photos and a third of cache-eval's distinct images
# (tests/unit/cache_service/test_similarity_adversarial.py):
# block gaps 0-2.2 levels for a JPEG of the other picture by Pillow or ffmpeg (qscale
# 2-12), shifted one level or dithered +-1 before it; 3.7-29 for one digit of 11 px
# grey-on-grey type changed under ffmpeg qscale 2-3 or Pillow q80-90 with a shift or a
# dither. COEF_BIAS: ffmpeg's quantiser rounds with a bias of 3/8 (a dead zone of 0.625
# steps), libjpeg's to nearest (0.5). COEF_SLACK: the decoded pixels' rounding and integer
# IDCT, two encoders' RGB-to-Y conversions. COEF_FIT_STEPS: the gain is fitted on AC
# coefficients over that many allowances on both sides (smaller ones rounded to 0 would
# bias it low). COEF_CLIP_MARGIN: levels kept from the clip per colour channel, for the
# chroma's 2x2 averaging. COEF_FIRST_GENERATIONS: libjpeg qualities tried as an earlier
# generation, best first.
COEF_BIAS = 0.625
COEF_SLACK = 1.5
COEF_MATCHED_GAP = 1.0
COEF_MATCHED_SHARE = 0.6
COEF_TOLERANCE = 3.0
COEF_FIT_STEPS = 3.0
COEF_CLIP_MARGIN = 4.0
COEF_FIRST_GENERATIONS = (95, 90, 85, 80, 75, 70)


def read_jpeg(data: bytes, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray] | None:
    """What the JPEG-matched check reads of an encoded file: (its luma quantization table,
    uint16 [64] in natural order; its Y channel as decoded, uint8 [height, width]), or None.

    None unless ``data`` is a JPEG (JFIF or Exif; not MPO, not CMYK, not Adobe RGB-coded)
    of ``size`` (width, height) pixels, at most :data:`VERIFY_MAX_PIXELS` (the verification
    image is then the decoded pixels themselves), with no EXIF rotation (the decode's
    transpose would move the 8x8 block grid), whose luma table is baseline (values
    1..255). Costs one more decode of the luma alone (~5 ms for 2 MP: libjpeg skips the
    chroma's inverse DCT for a grayscale output). Never raises: the caller has decoded
    this file already, so a failure here only means an unusual file, which gets no check.
    """
    try:
        im = Image.open(io.BytesIO(data))
        if im.format != "JPEG" or im.size != size or size[0] * size[1] > VERIFY_MAX_PIXELS:
            return None
        if im.mode not in ("L", "RGB") or im.info.get("adobe_transform", 1) != 1:
            return None
        if exif_orientation(im) != 1:
            return None
        # JpegImageFile's attributes: the components' (id, h, v, table) and the tables.
        layer = getattr(im, "layer", None)
        table_id = layer[0][3] if layer else 0
        table = np.asarray(getattr(im, "quantization", {})[table_id], dtype=np.int64)
        if table.shape != (64,) or table.min() < 1 or table.max() > 255:
            return None
        im.draft("L", size)
        luma = np.asarray(im if im.mode == "L" else im.convert("L"), dtype=np.uint8)
        if luma.shape != (size[1], size[0]):
            return None
        return table.astype(np.uint16), luma
    except Exception:  # noqa: BLE001  (no check rather than an error: see above)
        return None


def jpeg_matched_score(a: VerificationImage, b: VerificationImage) -> float:
    """The JPEG checks' score (module docstring) of two comparable verification images,
    in :data:`VERIFY_TOLERANCE` units. The JPEG-matched check: the JPEG side predicted
    from the other's luma; where both are JPEGs, the better of the directions where it
    applies (one made from the other by re-saving explains the pair: a JPEG re-saved from
    its own decoded pixels at the same or a higher quality is bit-identical in one
    direction, and one quantisation step off in some blocks in the other). Where it
    applies in neither, the coefficient-interval check's score; 0 where neither check
    applies (no JPEG side, another size, or not one JPEG of the other picture)."""
    scores = []
    if b.jpeg is not None:
        scores.append(_jpeg_score(a.luma, b, search=a.jpeg is None))
    if a.jpeg is not None and scores != [0.0]:
        scores.append(_jpeg_score(b.luma, a, search=b.jpeg is None))
    applicable = [score for score in scores if score is not None]
    if applicable:
        return min(applicable)
    if a.jpeg is None and b.jpeg is None:
        return 0.0
    coefficient = _coefficient_score(a, b)
    return 0.0 if coefficient is None else coefficient


def _jpeg_round_trip(
    luma: np.ndarray, quantization: np.ndarray | None = None, *, quality: int = 75
) -> np.ndarray:
    """``luma`` encoded as a grayscale JPEG with that luma table (else libjpeg's standard
    table at ``quality``) and decoded, by libjpeg (Pillow), int16 [h, w]."""
    buffer = io.BytesIO()
    options: dict[str, object] = {"quality": quality}
    if quantization is not None:
        options = {"qtables": [[int(v) for v in quantization]]}
    Image.fromarray(np.ascontiguousarray(luma, dtype=np.uint8), "L").save(buffer, "JPEG", **options)
    with Image.open(buffer) as decoded:
        return np.asarray(decoded, dtype=np.int16)


def _jpeg_score(
    source: np.ndarray, target: VerificationImage, *, search: bool = False
) -> float | None:
    """The JPEG-matched score of ``target`` (decoded from a JPEG: its Y channel) predicted
    from ``source`` (the other image's luma, the same size): None where the check does
    not apply (another size, or not the same encoder: :data:`JPEG_MATCHED_SHARE`), else
    the worst window scaled so that :data:`JPEG_TOLERANCE` maps to
    :data:`VERIFY_TOLERANCE`. With ``search`` (``source`` is not a JPEG), where it applies
    and fails, the JPEG may be a second generation: ``source`` is put through libjpeg at
    each of :data:`COEF_FIRST_GENERATIONS` first and the best applicable score kept (a
    q90 JPEG re-saved at q75 scored 13-14 against its original without it)."""
    assert target.jpeg is not None
    if source.shape != target.luma.shape or max(source.shape) > JPEG_MAX_SIDE:
        return None
    b = JPEG_BLOCK
    h, w = (source.shape[0] // b) * b, (source.shape[1] // b) * b
    textured = None
    if h and w:
        low, high = _block_range(source, h, w, b)
        textured = (high.astype(np.int16) - low) >= JPEG_TEXTURE
    score = _jpeg_score_of(source, target, textured)
    if not search or score is None or score <= VERIFY_TOLERANCE:
        return score
    return _first_generation_search(
        score, source, lambda first: _jpeg_score_of(first.astype(np.uint8), target, textured)
    )


def _first_generation_search(
    score: float | None,
    pristine: np.ndarray,
    score_of: Callable[[np.ndarray], float | None],
) -> float | None:
    """The better of ``score`` and ``score_of`` each libjpeg first generation of
    ``pristine`` (uint8 [h, w], the side that is not a JPEG), at each of
    :data:`COEF_FIRST_GENERATIONS` (best first, stopping at the first that passes): the
    other side may be a JPEG of a JPEG of it. None stays None unless one applies."""
    for quality in COEF_FIRST_GENERATIONS:
        retry = score_of(_jpeg_round_trip(pristine, quality=quality))
        if retry is not None and (score is None or retry < score):
            score = retry
            if score <= VERIFY_TOLERANCE:
                break
    return score


def _jpeg_score_of(
    source: np.ndarray, target: VerificationImage, textured: np.ndarray | None
) -> float | None:
    """:func:`_jpeg_score` of one ``source`` plane, the gate taken over ``textured`` (bool
    [h / 8, w / 8] of the whole blocks; None when there is none)."""
    assert target.jpeg is not None
    y = target.jpeg.y(target.luma)
    diff = np.abs(_jpeg_round_trip(source, target.jpeg.quantization) - y)
    if textured is not None:
        b = JPEG_BLOCK
        h, w = textured.shape[0] * b, textured.shape[1] * b
        identical = _block_range(diff, h, w, b)[1] == 0
        pool = identical[textured] if textured.any() else identical
        if float(pool.mean()) < JPEG_MATCHED_SHARE:
            return None  # another encoder: the six checks decide
    worst = float(half_stride_block_means(diff.astype(np.float32), DETAIL_BLOCK).max())
    return worst * (VERIFY_TOLERANCE / JPEG_TOLERANCE)


def _dct_blocks(y: np.ndarray, h: int, w: int) -> np.ndarray:
    """The orthonormal 2-D DCT-II of every whole 8x8 block of ``y[:h, :w]`` (JPEG's
    forward DCT, levels centred on 128), float32 [h / 8, w / 8, 8, 8]: [vertical,
    horizontal] frequency, the order of :attr:`JpegLuma.quantization`. Two GEMMs over
    all the blocks' rows, then columns (a batched 8x8 matmul per block is 5x slower)."""
    b = JPEG_BLOCK
    basis = _dct_basis()
    x = y[:h, :w].astype(np.float32) - 128.0
    rows = (x.reshape(-1, b) @ basis.T).reshape(h // b, b, w // b, b)  # [H, row, W, u]
    cols = rows.transpose(0, 2, 3, 1).reshape(-1, b) @ basis.T  # [H, W, u, v]
    return np.ascontiguousarray(cols.reshape(h // b, w // b, b, b).transpose(0, 1, 3, 2))


def _block_range(x: np.ndarray, h: int, w: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(min, max) of every whole ``b`` x ``b`` block of ``x[:h, :w]``, [h / b, w / b]:
    over the block's rows first (elementwise across whole image rows), then over the
    short contiguous axis on an 8x smaller array (numpy reduces a short last axis slowly:
    axes (1, 3) at once cost ~10x more)."""
    rows = x[:h, :w].reshape(h // b, b, w)
    low = rows.min(axis=1).reshape(h // b, w // b, b).min(axis=2)
    high = rows.max(axis=1).reshape(h // b, w // b, b).max(axis=2)
    return low, high


@functools.cache
def _dct_basis() -> np.ndarray:
    n = np.arange(JPEG_BLOCK)
    basis = np.cos(np.pi * (2 * n[None, :] + 1) * n[:, None] / (2 * JPEG_BLOCK))
    basis *= np.sqrt(2.0 / JPEG_BLOCK)
    basis[0] /= np.sqrt(2.0)
    return basis.astype(np.float32)


def _unclipped_blocks(y: np.ndarray, chroma: np.ndarray, h: int, w: int) -> np.ndarray:
    """bool [h / 8, w / 8]: the 8x8 blocks of ``y[:h, :w]`` where no colour channel is
    near the clip. Elsewhere a block is not linear in the picture: the decoder clamped it
    (its pixels are no longer the coded coefficients' inverse DCT) or a brighter copy
    clipped a channel (the six checks' clipping and chroma checks look there). Each
    channel's range in a block is bounded from the luma's and the chroma's (ITU-R 601, as
    Pillow's YCbCr) ranges there, with :data:`COEF_CLIP_MARGIN` levels for the chroma's
    2x2 averaging."""
    ch, cw = h // CHROMA_SCALE, w // CHROMA_SCALE
    low, high = _block_range(y, h, w, JPEG_BLOCK)
    unclipped = (low > 0) & (high < 255)
    low, high = low.astype(np.float32), high.astype(np.float32)
    c = chroma[:ch, :cw].astype(np.float32) - 128.0
    cb, cr = c[..., 0], c[..., 1]
    for term in (1.402 * cr, -0.344136 * cb - 0.714136 * cr, 1.772 * cb):
        term_low, term_high = _block_range(term, ch, cw, JPEG_BLOCK // CHROMA_SCALE)
        unclipped &= low + term_low >= COEF_CLIP_MARGIN
        unclipped &= high + term_high <= 255 - COEF_CLIP_MARGIN
    return unclipped


def _coefficient_score(a: VerificationImage, b: VerificationImage) -> float | None:
    """The coefficient-interval score of two verification images of the same size, at
    least one decoded from a JPEG (module docstring): None where the check does not apply
    (another size, no whole block, or fewer than :data:`COEF_MATCHED_SHARE` of the
    textured blocks explained by the quantisation), else the largest block gap (levels)
    scaled so that :data:`COEF_TOLERANCE` maps to :data:`VERIFY_TOLERANCE`. Where one side
    is not a JPEG and the other fails, the JPEG may be a second generation (a JPEG of a
    JPEG of that picture): the first is simulated at each of
    :data:`COEF_FIRST_GENERATIONS` (libjpeg's tables) and the best applicable score kept."""
    if a.luma.shape != b.luma.shape or max(a.luma.shape) > JPEG_MAX_SIDE:
        return None
    bs = JPEG_BLOCK
    h, w = (a.luma.shape[0] // bs) * bs, (a.luma.shape[1] // bs) * bs
    if not h or not w:
        return None
    valid = np.ones((h // bs, w // bs), dtype=bool)
    spans = np.zeros((h // bs, w // bs), dtype=np.int16)
    planes, tables = [], []
    for side in (a, b):
        y = side.luma if side.jpeg is None else side.jpeg.y(side.luma)
        low, high = _block_range(y, h, w, bs)
        spans = np.maximum(spans, high.astype(np.int16) - low)
        valid &= _unclipped_blocks(y, side.chroma, h, w)
        planes.append(y)
        tables.append(None if side.jpeg is None else side.jpeg.quantization)
    if not valid.any():
        return None
    textured = valid & (spans >= JPEG_TEXTURE)
    coefficients = [_dct_blocks(y, h, w) for y in planes]
    score = _interval_score(coefficients, tables, valid, textured)
    if (score is not None and score <= VERIFY_TOLERANCE) or (tables[0] is None) == (
        tables[1] is None
    ):
        return score
    pristine = 0 if tables[0] is None else 1

    def score_of(first: np.ndarray) -> float | None:
        trial = list(coefficients)
        trial[pristine] = _dct_blocks(first, h, w)
        return _interval_score(trial, tables, valid, textured)

    return _first_generation_search(score, planes[pristine], score_of)


def _interval_score(
    coefficients: list[np.ndarray],
    tables: list[np.ndarray | None],
    valid: np.ndarray,
    textured: np.ndarray,
) -> float | None:
    """:func:`_coefficient_score` of two Y planes' block DCTs (:func:`_dct_blocks`) and
    their JPEG tables (None for a side that is not a JPEG) over the blocks ``valid`` (bool
    [h / 8, w / 8]), the gate taken over ``textured``."""
    bs = JPEG_BLOCK
    allowance = np.full((bs, bs), COEF_SLACK, dtype=np.float32)
    for table in tables:
        if table is not None:
            allowance += COEF_BIAS * table.astype(np.float32).reshape(bs, bs)
    fa_all, fb_all = coefficients
    # The contrast gain from a to b, within the six checks' photometric bound: a brighter
    # or contrastier copy scales every AC coefficient alike, an edit changes a few blocks.
    # Least squares over the AC coefficients of the textured blocks that are large on
    # both sides (COEF_FIT_STEPS allowances): rounding smaller ones to 0 would bias it low.
    fit = textured if textured.any() else valid
    fa, fb = fa_all[fit], fb_all[fit]
    large = (np.abs(fa) > COEF_FIT_STEPS * allowance) & (np.abs(fb) > COEF_FIT_STEPS * allowance)
    large[:, 0, 0] = False
    fa, fb = fa[large], fb[large]
    energy = float(np.square(fa).sum())
    gain = float((fa * fb).sum()) / energy if energy > 0 else 1.0
    gain = min(max(gain, 1.0 / MAX_PHOTOMETRIC_GAIN), MAX_PHOTOMETRIC_GAIN)
    if tables[0] is not None:  # a's quantisation steps scale with it
        allowance += (gain - 1.0) * COEF_BIAS * tables[0].astype(np.float32).reshape(bs, bs)
    gap = np.maximum(np.abs(gain * fa_all - fb_all) - allowance, 0.0)
    gap[..., 0, 0] = 0.0  # the block's mean: the six checks' photometric matching's part
    norms = np.sqrt(np.square(gap).reshape(valid.shape + (bs * bs,)).sum(axis=-1))
    pool = norms[textured] if textured.any() else norms[valid]
    if float((pool <= COEF_MATCHED_GAP).mean()) < COEF_MATCHED_SHARE:
        return None  # not one JPEG of the other picture: the six checks decide
    return float(norms[valid].max()) * (VERIFY_TOLERANCE / COEF_TOLERANCE)
