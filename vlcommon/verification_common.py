"""What the verification's two modules share: the verification image (:class:`VerificationImage`,
with its :class:`JpegLuma`), its size cap and chroma scale, the score scale, the
photometric bound, and block statistics.

:mod:`vlcommon.verification` makes verification images and runs the six checks on a pair
of them; :mod:`vlcommon.verification_jpeg` runs the JPEG checks where one of the two was
decoded from a JPEG. Both scale every score so that :data:`VERIFY_TOLERANCE` is the pass
mark, bound the contrast gain they fit by :data:`MAX_PHOTOMETRIC_GAIN`, and average
residuals over windows with :func:`half_stride_block_means`. The constants are
importable from :mod:`vlcommon.verification` too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The verification image keeps the decoded image's own resolution up to this many pixels
# (2 MiB of luma, 3 MiB with the chroma per entry at most: a 1411x1411 photo is kept
# whole); larger images are area-averaged down to it.
VERIFY_MAX_PIXELS = 2_097_152
# The score every check is scaled to: a block score over it fails the verification.
VERIFY_TOLERANCE = 8.0
# Detail windows are 8x8 pixels of the compared resolution itself (no 2x2 reduce): the
# six checks' detail and isolation checks, and the JPEG-matched check's windows.
DETAIL_BLOCK = 8
# Chroma is kept at 1/CHROMA_SCALE of the luma's resolution per side (as JPEG keeps it),
# half a byte per pixel for both channels.
CHROMA_SCALE = 2
# Largest contrast gain the photometric normalisation may apply (either way). Near
# duplicates change contrast by a few percent (cache-eval: +-5%); without a bound, a query
# with a tenth of the contrast (a faint, blurred copy of another page) is predicted from any
# stored image of a similar layout within a tenth of the stored image's differences, so
# its residual stays under the tolerance whatever the detail
# (tests/unit/cache_service/test_similarity_adversarial.py).
MAX_PHOTOMETRIC_GAIN = 1.5
# A JPEG whose Y channel differs from its verification luma (clipped by the conversion to
# RGB) in more than this share of the pixels gets no JpegLuma: its differences are kept
# sparse (5 bytes each), and past a quarter they would cost more than the luma itself.
JPEG_MAX_CLIPPED_SHARE = 0.25


def block_sums(x: np.ndarray, block: int) -> np.ndarray:
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


def block_counts(shape: tuple[int, ...], block: int) -> np.ndarray:
    """The pixels in each ``block`` x ``block`` tile of a 2-D array of ``shape`` (the last
    row and column of tiles partial), float32."""
    h, w = shape[0], shape[1]
    rows = np.minimum(block, h - np.arange(0, h, block))
    cols = np.minimum(block, w - np.arange(0, w, block))
    return np.outer(rows, cols).astype(np.float32)


def block_means(x: np.ndarray, block: int) -> np.ndarray:
    """Means over ``block`` x ``block`` tiles of a 2-D array (the last row and column of
    tiles partial), float32."""
    return block_sums(x, block) / block_counts(x.shape, block)


def half_stride_block_means(x: np.ndarray, block: int) -> np.ndarray:
    """Means over every ``block`` x ``block`` window of a 2-D array at a stride of half a
    block (each window the sum of 2x2 half-block tiles): an edit that straddles the
    corner of four aligned blocks lies whole in one of these. One pass over ``x``."""
    half = block // 2
    sums, counts = block_sums(x, half), block_counts(x.shape, half)
    if sums.shape[0] > 1:
        sums, counts = sums[:-1] + sums[1:], counts[:-1] + counts[1:]
    if sums.shape[1] > 1:
        sums, counts = sums[:, :-1] + sums[:, 1:], counts[:, :-1] + counts[:, 1:]
    return sums / counts


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
