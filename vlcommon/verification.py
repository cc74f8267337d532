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

A block where one digit, word, cell or bar differs has a residual of tens of levels; JPEG
re-encoding (q70-95) and resizes of up to 10% leave a few. The same functions run in the
gateway (:func:`verification_image`), the cache service (:func:`verify`) and ``splitvl
cache-eval`` (calibration), so what is measured is what is served. Calibration, costs and
memory: docs/cache.md.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image

from vlcommon.imaging import exif_orientation

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
# The score every check is scaled to: a block score over it fails the verification.
VERIFY_TOLERANCE = 8.0
# Largest mean |luma difference| of one 4x4 block of the 2x2-reduced images (8x8 pixels),
# at half-block stride, 8-bit levels, after photometric and sharpness matching. Calibrated
# with `splitvl cache-eval` and the digit scans of tests/test_similarity_adversarial.py
# (docs/cache.md).
LUMA_TOLERANCE = 6.0
# The same for 8x8-pixel blocks at the compared resolution itself (no 2x2 reduce): a
# 1-2 px stroke of 11 px type changed ('6' to '8') is halved by the reduce.
DETAIL_BLOCK = 8
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
# JPEG-matched check: an 8x8 block of the source luma is textured when its levels span at
# least JPEG_TEXTURE; the encoder counts as the query's own when at least
# JPEG_MATCHED_SHARE of the textured blocks (all blocks, if none is textured) decode
# bit-identically (measured 2026-12-03: 0.98-1.00 for Pillow's encoder with an edit of one
# digit or none, 0.02-0.33 for ffmpeg's encoder and for a float DCT); then no 8x8 window
# (half-block stride) may differ by more than JPEG_TOLERANCE levels on average (0 for a
# re-encode; 4.5-9 for the faint edits of tests/test_similarity_adversarial.py).
JPEG_TEXTURE = 8
JPEG_MATCHED_SHARE = 0.6
JPEG_TOLERANCE = 1.0
JPEG_BLOCK = 8
# A JPEG whose Y channel differs from its verification luma (clipped by the conversion to
# RGB) in more than this share of the pixels gets no JpegLuma: its differences are kept
# sparse (5 bytes each), and past a quarter they would cost more than the luma itself.
JPEG_MAX_CLIPPED_SHARE = 0.25
# libjpeg's largest image side (JPEG_MAX_DIMENSION): no JPEG is wider or taller, so a
# verification image over it has no JPEG view (and the round trip could not encode it).
JPEG_MAX_SIDE = 65_500
# Coefficient-interval check (module docstring). Measured 2026-12-03 over scikit-image's
# photos and a third of cache-eval's distinct images (tests/test_similarity_adversarial.py):
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
class JpegLuma:
    """What the JPEG-matched check needs of an image decoded from a JPEG.

    The file's Y channel as libjpeg decodes it, before the conversion to RGB, equals the
    verification image's luma except where that conversion clipped (saturated colours:
    0.01-7% of the pixels of scikit-image's photos at q90), so only those pixels are kept.

    Attributes:
        quantization: uint16 [64]: the luma component's quantization table, in natural
            (row-major) order as Pillow's ``JpegImageFile.quantization`` gives it, each
            value in 1..255 (baseline precision).
        clipped_index: uint32 [n]: the flat indices (row-major in the luma's [h, w]) where
            the Y channel differs from the luma, strictly increasing; at most
            :data:`JPEG_MAX_CLIPPED_SHARE` of the pixels.
        clipped_luma: uint8 [n]: the Y channel there.
    """

    quantization: np.ndarray
    clipped_index: np.ndarray
    clipped_luma: np.ndarray

    @classmethod
    def of(cls, quantization: np.ndarray, y: np.ndarray, luma: np.ndarray) -> JpegLuma | None:
        """From a JPEG's table and Y channel (:func:`read_jpeg`) and the verification
        image's ``luma`` of the same shape; None when more than
        :data:`JPEG_MAX_CLIPPED_SHARE` of the pixels differ."""
        index = np.flatnonzero(y.reshape(-1) != luma.reshape(-1))
        if index.size > JPEG_MAX_CLIPPED_SHARE * luma.size:
            return None
        return cls(
            np.asarray(quantization, dtype=np.uint16),
            index.astype(np.uint32),
            y.reshape(-1)[index].astype(np.uint8),
        )

    @property
    def nbytes(self) -> int:
        return int(self.quantization.nbytes + self.clipped_index.nbytes + self.clipped_luma.nbytes)

    def y(self, luma: np.ndarray) -> np.ndarray:
        """The Y channel, uint8 [h, w], rebuilt on the verification image's ``luma``."""
        if not self.clipped_index.size:
            return luma
        out = np.array(luma, dtype=np.uint8, copy=True)
        out.reshape(-1)[self.clipped_index] = self.clipped_luma
        return out

    def copy(self) -> JpegLuma:
        return JpegLuma(
            self.quantization.copy(), self.clipped_index.copy(), self.clipped_luma.copy()
        )


@dataclass(frozen=True)
class VerificationImage:
    """What the cache verifies a similarity candidate on.

    Attributes:
        luma: uint8 [h, w]: ITU-R 601 luma (Pillow ``L``) of the decoded image, at most
            :data:`VERIFY_MAX_PIXELS` pixels.
        chroma: uint8 [ceil(h / CHROMA_SCALE), ceil(w / CHROMA_SCALE), 2]: Cb and Cr
            (Pillow ``YCbCr``) area-averaged :data:`CHROMA_SCALE` x :data:`CHROMA_SCALE`.
        jpeg: for an image decoded from a JPEG whose verification image is the file's own
            pixels (same size and orientation: :func:`read_jpeg`), what the JPEG-matched
            check needs; None otherwise.
    """

    luma: np.ndarray
    chroma: np.ndarray
    jpeg: JpegLuma | None = None

    @property
    def nbytes(self) -> int:
        extra = 0 if self.jpeg is None else self.jpeg.nbytes
        return int(self.luma.nbytes + self.chroma.nbytes + extra)

    def copy(self) -> VerificationImage:
        return VerificationImage(
            np.array(self.luma, dtype=np.uint8, copy=True),
            np.array(self.chroma, dtype=np.uint8, copy=True),
            None if self.jpeg is None else self.jpeg.copy(),
        )


def chroma_shape(height: int, width: int) -> tuple[int, int, int]:
    """The chroma image's shape for a luma image of ``height`` x ``width``."""
    return -(-height // CHROMA_SCALE), -(-width // CHROMA_SCALE), 2


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


def _block_sums(x: np.ndarray, block: int = VERIFY_BLOCK) -> np.ndarray:
    """Sums over ``block`` x ``block`` tiles of a 2-D array (the last row and column of
    tiles partial), as float32 (exact enough: 16 squares of 8-bit values). Strided adds,
    not a reshape-and-sum: numpy sums a short inner axis several times slower."""
    h, w = x.shape
    hb, wb = -(-h // block), -(-w // block)
    if (hb * block, wb * block) != (h, w):
        padded = np.zeros((hb * block, wb * block), dtype=np.float32)
        padded[:h, :w] = x
        x = padded
    rows = x[0::block].astype(np.float32, copy=True)
    for k in range(1, block):
        rows += x[k::block]
    out = rows[:, 0::block].copy()
    for k in range(1, block):
        out += rows[:, k::block]
    return out


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
    worst = float(_half_stride_block_means(diff.astype(np.float32), DETAIL_BLOCK).max())
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


def _half_stride_block_means(x: np.ndarray, block: int) -> np.ndarray:
    """Means over every ``block`` x ``block`` window of a 2-D array at a stride of half a
    block (each window the sum of 2x2 half-block tiles): an edit that straddles the
    corner of four aligned blocks lies whole in one of these. One pass over ``x``."""
    half = block // 2
    sums, counts = _block_sums(x, half), _block_counts(x.shape, half)
    if sums.shape[0] > 1:
        sums, counts = sums[:-1] + sums[1:], counts[:-1] + counts[1:]
    if sums.shape[1] > 1:
        sums, counts = sums[:, :-1] + sums[:, 1:], counts[:, :-1] + counts[:, 1:]
    return sums / counts


def _reduce(x: np.ndarray) -> np.ndarray:
    """2x2 box average (the last row and column partial)."""
    return _block_means(x, VERIFY_REDUCE) if min(x.shape) >= 2 * VERIFY_REDUCE else x


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
    detail = _half_stride_block_means(np.abs(signed_full), DETAIL_BLOCK).ravel()
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
    luma_shifted = _half_stride_block_means(np.abs(signed), VERIFY_BLOCK)
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
    luma = _block_means(np.abs(signed))
    rows, cols = np.nonzero(luma > RELATIVE_FLOOR / 2)
    if len(rows) and max(scores) <= VERIFY_TOLERANCE:  # (a failing check decides)
        d, t, p = (_tiles(x, rows, cols) for x in (signed, target, predicted))
        structure = np.abs(d - d.mean(axis=1, keepdims=True)).mean(axis=1)
        contrast = np.maximum(t.std(axis=1), p.std(axis=1)) + RELATIVE_FLOOR
        relative = np.where(structure > RELATIVE_FLOOR, structure / contrast, 0.0)
        scores.append(float(relative.max()) * (VERIFY_TOLERANCE / RELATIVE_TOLERANCE))
    # Chroma: the distance from neutral (128) scaled by the luma's gain.
    cb_diff, cr_diff = (np.abs((x - 128.0) * gain + 128.0 - y) for x, y in zip(ca, cb, strict=True))
    chroma = _half_stride_block_means(np.maximum(cb_diff, cr_diff), CHROMA_BLOCK)
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
