"""The one image pipeline: decode, validate, plan the resize, key, describe, resize.

The gateway first reads each file's header (:func:`read_header`: size and EXIF
orientation, no pixel decode), plans the resize from the upright size, and digests the
encoded bytes with that plan (:func:`bytes_key`): a file seen before is answered by the
exact tier without decoding. Otherwise it decodes the image once (:func:`decode_image`),
plans its resize with :func:`plan_resize` (Qwen's ``smart_resize``, so ``image_grid_thw``
and the placeholder count are known before any ViT work), and computes the exact key
(:func:`exact_key`) and the similarity descriptor (:func:`similarity_descriptor`, from
:mod:`vlcommon.similarity`). The gateway then resizes the pixels to that plan with
:func:`resize_to_plan` and sends the encoder pixels of the planned size (the decoder never
resizes), the exact resampling the Qwen2-VL fast image processor uses (torchvision
bicubic, antialiased), so splitvl's pixels equal what transformers and vLLM compute on
the raw image.
"""

from __future__ import annotations

import hashlib
import io
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import PIL
from PIL import ExifTags, Image, ImageOps, features

from vlcommon.errors import ServiceError
from vlcommon.model_info import VisionSpec
from vlcommon.refusals import Refusal

# The `X as X` imports re-export the similarity descriptor's names, which the gateway, the
# cache, the tools and the tests import from here.
from vlcommon.similarity import DESCRIPTOR_DIM as DESCRIPTOR_DIM
from vlcommon.similarity import DESCRIPTOR_SIDE as DESCRIPTOR_SIDE
from vlcommon.similarity import DESCRIPTOR_WORK_SIDE as DESCRIPTOR_WORK_SIDE
from vlcommon.similarity import DOCUMENT_BACKGROUND_FRACTION as DOCUMENT_BACKGROUND_FRACTION
from vlcommon.similarity import DOCUMENT_BACKGROUND_TOLERANCE as DOCUMENT_BACKGROUND_TOLERANCE
from vlcommon.similarity import DOCUMENT_INK_CONTRAST as DOCUMENT_INK_CONTRAST
from vlcommon.similarity import DOCUMENT_INK_FRACTION as DOCUMENT_INK_FRACTION
from vlcommon.similarity import cosine_similarity as cosine_similarity
from vlcommon.similarity import is_document_like as is_document_like
from vlcommon.similarity import similarity_descriptor as similarity_descriptor

if TYPE_CHECKING:
    import torch

# torch.from_numpy warns (once per process) that a read-only array stays read-only;
# resize_to_plan hands it read-only pixels on purpose and only reads them (see there).
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

# smart_resize (transformers and qwen-vl-utils alike) refuses aspect ratios above 200.
MAX_ASPECT_RATIO = 200.0
# Background for transparent pixels: white, as browsers show a transparent PNG on a page.
ALPHA_BACKGROUND = (255, 255, 255)
# Bump whenever decode_image / _to_rgb change the pixels a file decodes to (another
# background, another rule for a mode): the bytes key names the decode pipeline, so files
# seen by an older pipeline are decoded again instead of answered by their digest.
DECODE_PIPELINE_VERSION = 1
# EXIF orientations whose upright image is the stored one transposed (width and height
# swapped): 5 transpose, 6 rotate 90 CW, 7 transverse, 8 rotate 90 CCW (EXIF 2.3, tag 0x0112;
# the transposes of Pillow's ImageOps.exif_transpose).
SWAPPING_ORIENTATIONS = frozenset((5, 6, 7, 8))


def _decoder_version() -> str:
    """Pillow's version and the versions of the codec libraries it decodes with, plus
    :data:`DECODE_PIPELINE_VERSION`: what determines the pixels a file decodes to.

    A Pillow wheel bundles its codecs, but a distribution's Pillow links the system's
    libjpeg/zlib/libtiff/libwebp/libavif, so each library's version is named (``None``
    when absent; :func:`PIL.features.version`).
    """
    libraries = ("jpg", "libjpeg_turbo", "jpg_2000", "zlib", "zlib_ng", "libtiff", "webp", "avif")
    parts = [f"pillow={PIL.__version__}"]
    for name in libraries:
        try:
            parts.append(f"{name}={features.version(name)}")
        except ValueError:  # a name this Pillow does not know
            parts.append(f"{name}=None")
    parts.append(f"pipeline={DECODE_PIPELINE_VERSION}")
    return ";".join(parts)


# Computed once: what the bytes key says about the decoder.
DECODER_VERSION = _decoder_version()


@dataclass(frozen=True)
class ResizePlan:
    """Target size and patch grid of one image.

    Attributes:
        resized_height, resized_width: Pixels, multiples of ``spec.factor``.
        grid_t, grid_h, grid_w: ``image_grid_thw`` in patches.
        tokens: LLM tokens for this image, ``grid_t*grid_h*grid_w / merge**2``.
    """

    resized_height: int
    resized_width: int
    grid_t: int
    grid_h: int
    grid_w: int
    tokens: int

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.grid_t, self.grid_h, self.grid_w)


def decode_image(data: bytes, *, index: int, max_decoded_pixels: int) -> Image.Image:
    """Decode one encoded image to upright 8-bit RGB.

    EXIF orientation is applied (``ImageOps.exif_transpose``) before anything else sees
    the pixels; animated images (GIF, APNG, WebP, multi-page TIFF) use their first frame
    (``seek(0)``); every mode becomes RGB by the rules of :func:`_to_rgb` (transparency
    composited on white, high bit depths scaled to 8 bits). A file that ends before its
    image data does is rejected: Pillow's ``LOAD_TRUNCATED_IMAGES`` is never switched on.
    A file whose container is complete but whose compressed data stops short (a PNG whose
    zlib stream ends after a few rows; a JPEG cut and closed with an EOI marker) decodes
    with what the codec fills in (zero rows; grey blocks), as Pillow, browsers and vLLM's
    own image loader take it: its pixels are what the cache keys and the ViT see, so the
    answer is about the picture as decoded, never about another one.

    Args:
        data: The encoded file (PNG, JPEG, WebP, GIF, BMP, TIFF, ...).
        index: The image's position in the request, for error messages.
        max_decoded_pixels: Width*height above which the image is refused before its
            pixel data is decoded (decompression bombs).

    Returns:
        A PIL image in mode ``RGB``.

    Raises:
        ServiceError: INVALID_ARGUMENT ``IMAGE_DECODE_FAILED`` naming ``images[index]``;
            RESOURCE_EXHAUSTED ``IMAGE_TOO_LARGE`` naming the pixel limit.
    """
    field = f"images[{index}]"
    if not data:
        raise Refusal.IMAGE_DECODE_FAILED.error(
            f"{field} could not be decoded: the image data is empty", field=field
        )
    im: Image.Image | None = None
    try:
        im = Image.open(io.BytesIO(data))
        width, height = im.size
        if width * height > max_decoded_pixels:
            raise Refusal.IMAGE_TOO_LARGE.error(
                f"{field} is {width}x{height} = {width * height} pixels; the limit is "
                f"{max_decoded_pixels} decoded pixels",
                field=field,
                limit=max_decoded_pixels,
            )
        if getattr(im, "is_animated", False):
            im.seek(0)
        im.load()
        # In place: an upright file (orientation 1) is not copied (exif_transpose returns a
        # copy otherwise), and a sideways one is transposed once, as before.
        ImageOps.exif_transpose(im, in_place=True)
        rgb = _to_rgb(im)
        if rgb is not im:
            im.close()
        # Not closed when it is the result (close() destroys the pixels); its file is a
        # BytesIO over ``data``, nothing to release but memory.
        return rgb
    except (ServiceError, MemoryError):
        if im is not None:
            im.close()
        raise
    except Exception as exc:  # noqa: BLE001
        if im is not None:
            im.close()
        raise _decode_refusal(exc, field, max_decoded_pixels) from exc


def _decode_refusal(exc: Exception, field: str, max_decoded_pixels: int) -> ServiceError:
    """The refusal of an image whose decode raised ``exc`` (what :func:`decode_image`
    raises from it).

    Returns:
        RESOURCE_EXHAUSTED ``IMAGE_TOO_LARGE`` for Pillow's decompression-bomb guard,
        INVALID_ARGUMENT ``IMAGE_DECODE_FAILED`` for anything else, naming ``field``.
    """
    if isinstance(exc, Image.DecompressionBombError):
        # Pillow's own guard fires first for headers past 2x its MAX_IMAGE_PIXELS: report it
        # with our limit only, the same way as decode_image's own check (quoting Pillow's
        # message put its limit beside ours: two limits in one refusal).
        found = re.search(r"\((\d+) pixels\)", str(exc))
        size = f"{found.group(1)} pixels" if found else "larger than the limit"
        return Refusal.IMAGE_TOO_LARGE.error(
            f"{field} is {size}; the limit is {max_decoded_pixels} decoded pixels",
            field=field,
            limit=max_decoded_pixels,
        )
    # Pillow's decoders raise more than OSError/ValueError on hostile files (seen:
    # NotImplementedError for DDS, IndexError for a fuzzed GIF, AttributeError for a
    # fuzzed SPIDER file). Whatever a decoder raises, the input is what is wrong.
    reason = (
        "not a recognised image format"  # Pillow: "cannot identify image file <BytesIO>"
        if isinstance(exc, Image.UnidentifiedImageError)
        else _clean(exc)
    )
    return Refusal.IMAGE_DECODE_FAILED.error(f"{field} could not be decoded: {reason}", field=field)


def _clean(exc: BaseException) -> str:
    """An exception's message without object addresses (``<_io.BytesIO object at 0x...>``)."""
    text = re.sub(r"<[\w.]+ object at 0x[0-9a-f]+>", "the data", str(exc)) or type(exc).__name__
    return text[:300]


def _to_rgb(im: Image.Image) -> Image.Image:
    """Any Pillow mode to 8-bit RGB, by fixed rules (not by Pillow's clipping defaults).

    - ``I;16``/``I;16L``/``I;16B``/``I;16N`` (16-bit grayscale): ``value >> 8``, so 65535
      is white (Pillow's own conversion clips at 255, turning most of the range white).
    - ``I`` (32-bit signed): negatives clip to 0; values that fit 8 bits are kept, values
      that fit 16 bits are shifted as 16-bit, larger ones by their bit length (top 8 bits).
    - ``F`` (32-bit float): NaN is 0; an image within [0, 1] is scaled by 255, any other
      range is clipped to [0, 255] (Pillow's rule), both rounded.
    - ``1`` (bilevel): 0 is black, 1 white. ``CMYK`` (incl. Adobe inverted JPEG),
      ``YCbCr``, ``L``, ``P``: Pillow's conversion.
    - Transparency (``RGBA``, ``LA``, ``PA``, premultiplied ``RGBa``/``La``, and a
      ``transparency`` key on ``P``/``L``/``RGB``, i.e. PNG tRNS or a GIF transparent
      index): alpha-composited over ``ALPHA_BACKGROUND`` (white), as a browser shows the
      image on a page: ``out = a * colour + (1 - a) * 255`` per channel.
    """
    if im.mode in ("I;16", "I;16L", "I;16B", "I;16N"):
        words = np.asarray(im).astype(np.uint32)
        im = Image.fromarray(np.right_shift(words, 8).astype(np.uint8))
    elif im.mode == "I":
        ints = np.clip(np.asarray(im).astype(np.int64), 0, None)
        top = int(ints.max()) if ints.size else 0
        bits = 8 if top <= 0xFF else 16 if top <= 0xFFFF else top.bit_length()
        im = Image.fromarray(np.right_shift(ints, bits - 8).astype(np.uint8))
    elif im.mode == "F":
        reals = np.nan_to_num(np.asarray(im, dtype=np.float64), nan=0.0, posinf=255.0, neginf=0.0)
        if reals.size and reals.min() >= 0.0 and reals.max() <= 1.0:
            reals = reals * 255.0
        im = Image.fromarray(np.clip(np.rint(reals), 0, 255).astype(np.uint8))
    if im.mode in ("P", "L", "RGB") and "transparency" in im.info:
        im = im.convert("RGBA")  # tRNS / transparent index becomes an alpha channel
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (*ALPHA_BACKGROUND, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    # Pillow's convert() copies an image already in the target mode: 36 MB for a 12 MP
    # JPEG (which libjpeg decodes to RGB), for nothing.
    return im if im.mode == "RGB" else im.convert("RGB")


def plan_resize(
    height: int,
    width: int,
    spec: VisionSpec,
    *,
    index: int,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> ResizePlan:
    """Plan the resize of one image with Qwen's ``smart_resize``.

    Both sides become multiples of ``spec.factor`` (patch_size * spatial_merge_size),
    with height*width in ``[min_pixels, max_pixels]`` and the aspect ratio kept as
    closely as possible. Images smaller than the factor are scaled up to at least
    ``min_pixels`` (case C01), so the gateway's grid, the encoder's pixels and the
    decoder's placeholder count agree.

    Raises:
        ServiceError: INVALID_ARGUMENT ``IMAGE_ASPECT_RATIO_TOO_LARGE`` when
            max(h, w) / min(h, w) > 200 (qwen-vl-utils' MAX_RATIO), naming the ratio.
    """
    field = f"images[{index}]"
    lo = spec.min_pixels if min_pixels is None else min_pixels
    hi = spec.max_pixels if max_pixels is None else max_pixels
    ratio = max(height, width) / max(1, min(height, width))
    if ratio > MAX_ASPECT_RATIO:
        raise Refusal.IMAGE_ASPECT_RATIO_TOO_LARGE.error(
            f"{field} is {width}x{height}: aspect ratio {ratio:.1f} exceeds the limit of "
            f"{MAX_ASPECT_RATIO:g}",
            field=field,
            limit=f"{MAX_ASPECT_RATIO:g}",
            actual=f"{ratio:.3f}",
        )
    # transformers' smart_resize, not qwen-vl-utils': the two round differently (1093x5 ->
    # 32x960 vs 32x1088) and the checkpoint's own processor, which vLLM and transformers
    # use on raw images, is transformers'. Using it keeps splitvl's grids equal to theirs.
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    if lo < spec.factor**2 or hi < lo:
        raise Refusal.PIXEL_BUDGET_INVALID.error(
            f"pixel budget [{lo}, {hi}] is invalid: min_pixels must be >= {spec.factor**2} "
            "and max_pixels >= min_pixels",
            field="pixel_budget",
            limit=spec.factor**2,
        )
    rh, rw = smart_resize(height, width, factor=spec.factor, min_pixels=lo, max_pixels=hi)
    rh, rw = _fit_max_pixels(rh, rw, spec.factor, hi)
    grid_h, grid_w = rh // spec.patch_size, rw // spec.patch_size
    return ResizePlan(
        resized_height=rh,
        resized_width=rw,
        grid_t=1,
        grid_h=grid_h,
        grid_w=grid_w,
        tokens=spec.tokens(1, grid_h, grid_w),
    )


def _fit_max_pixels(rh: int, rw: int, factor: int, max_pixels: int) -> tuple[int, int]:
    """Shrink the longer side of a planned size until ``rh * rw <= max_pixels``.

    transformers' ``smart_resize`` can overshoot ``max_pixels``: when the short side is
    clamped to ``factor`` (3200x32 -> 32x2560 = 81,920 px for a 65,536 budget), or when
    scaling a small image up rounds both sides up (128x96 at min = max = 65,536 -> 320x224
    = 71,680 px). The encoder refuses more than ``max_pixels / patch_size**2`` patches, so
    the overshoot would be refused after the gateway accepted it. ``max_pixels`` is the hard
    bound; ``min_pixels`` yields when both cannot hold. Sizes smart_resize keeps within the
    budget (every ordinary image) are returned unchanged, so grids stay equal to the
    checkpoint's own processor (and to vLLM on raw images).
    """
    if rh * rw <= max_pixels:
        return rh, rw
    if rh >= rw:
        rh = max(factor, max_pixels // (rw * factor) * factor)
    else:
        rw = max(factor, max_pixels // (rh * factor) * factor)
    return rh, rw


@dataclass(frozen=True)
class ImageHeader:
    """What a file's header says, read without decoding its pixels (:func:`read_header`).

    Attributes:
        format: Pillow's format name (``JPEG``, ``PNG``, ``WEBP``, ...).
        mode: Pillow mode of the stored pixels (before the conversion to RGB).
        stored_width, stored_height: Size of the stored pixels (the first frame's canvas
            for an animated file), before the EXIF orientation is applied.
        orientation: EXIF orientation 1..8 (1 when absent or not a valid value, as
            ``ImageOps.exif_transpose`` treats it).
    """

    format: str
    mode: str
    stored_width: int
    stored_height: int
    orientation: int

    @property
    def width(self) -> int:
        """Upright width, pixels: what :func:`decode_image` returns."""
        swap = self.orientation in SWAPPING_ORIENTATIONS
        return self.stored_height if swap else self.stored_width

    @property
    def height(self) -> int:
        """Upright height, pixels."""
        swap = self.orientation in SWAPPING_ORIENTATIONS
        return self.stored_width if swap else self.stored_height


def exif_orientation(im: Image.Image) -> int:
    """An opened file's EXIF orientation, 1..8, read from the EXIF and XMP that opening it
    parsed (``Image.Image.getexif``, the base class's: PNG's own decodes the whole image to
    look for EXIF after the pixel data); 1 when absent or not a valid value, as
    ``ImageOps.exif_transpose`` treats it."""
    value = Image.Image.getexif(im).get(ExifTags.Base.Orientation, 1)
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def read_header(data: bytes) -> ImageHeader | None:
    """Read a file's size, mode and EXIF orientation from its header, decoding no pixels.

    ``Image.open`` parses the container up to the image data (a JPEG's markers up to the
    scan, EXIF in APP1; a PNG's chunks before IDAT), and the orientation is read from the
    EXIF and XMP that parsing found (``Image.Image.getexif``, the base class's, because
    PNG's own ``getexif`` decodes the whole image to look for EXIF after the pixel data).
    The frame count is not read: counting a GIF's frames walks the whole file, and the
    first frame, the one decoded, has the header's canvas size.

    A file whose orientation only shows after its pixel data (a PNG with eXIf or XMP after
    IDAT) gets the orientation 1 here and its true one from :func:`decode_image`; the
    gateway then sees the two plans differ and does not let the file's digest answer for
    it (it is decoded every time, never served wrongly).

    Args:
        data: The encoded file.

    Returns:
        The header, or None when it cannot be read (an empty file, an unknown format, a
        header past Pillow's decompression-bomb guard): :func:`decode_image` then names
        the fault with its status. The caller applies its own pixel limits.
    """
    if not data:
        return None
    try:
        with Image.open(io.BytesIO(data)) as im:
            width, height = im.size
            return ImageHeader(str(im.format), im.mode, width, height, exif_orientation(im))
    except Exception:  # noqa: BLE001 - decode_image reports it, by the same rules
        return None


def bytes_key(
    data: bytes, plan: ResizePlan, revision: str, *, decoder: str = DECODER_VERSION
) -> str:
    """The exact-tier key of one encoded file: found without decoding it.

    A full SHA-256 (64 hex digits) over a version tag, the decoder version (``decoder``:
    Pillow's and its codec libraries' versions and :data:`DECODE_PIPELINE_VERSION`), the
    resize plan (resized size and ``image_grid_thw``), the model revision, the file's
    length and its bytes. Safe as a key because the same bytes decode to the same pixels
    under the same decoder (Pillow's decoders are deterministic for a given version): the
    entry it finds holds the embeddings of exactly the pixels :func:`decode_image` would
    return. The pixel key (:func:`exact_key`) stays the key that equates different files
    with the same pixels; the cache stores this one as an alias of it.

    Args:
        data: The encoded file, as received (about 0.6 ms per MB to hash).
        plan: Its resize plan, from the header's upright size (:func:`read_header`).
        revision: The model revision (:func:`vlcommon.model_info.model_revision`).
        decoder: The decoder version; the default is this process's.

    Returns:
        64 lowercase hex characters.
    """
    h = hashlib.sha256()
    h.update(b"splitvl-bytes-v1\0")
    h.update(f"{decoder}\0".encode())
    h.update(f"{plan.resized_height}x{plan.resized_width}\0{plan.grid}\0{revision}\0".encode())
    h.update(f"{len(data)}\0".encode())
    h.update(data)
    return h.hexdigest()


def exact_key(image: Image.Image | np.ndarray, plan: ResizePlan, revision: str) -> str:
    """The exact-tier cache key of one image: a digest of the pixels the ViT sees.

    A full SHA-256 (64 hex digits, no truncation) over a version tag, the pixels' width
    and height, the resize plan (resized size and ``image_grid_thw``), the model revision,
    and the raw RGB bytes. The shape is hashed before the bytes, so equal bytes with a
    different shape (64x64 vs 32x128) never collide.

    The gateway passes the **resized** pixels (:func:`resize_to_plan`'s output, exactly
    what the encoder patches), not the full-size decode: the embeddings are a function of
    those pixels, the plan and the model alone, so two files whose resized pixels agree
    have the same embeddings and may share an entry, and hashing 3.8 MB instead of a 12 MP
    photo's 36 MB takes one full-size pass (about 20 ms) out of every miss (issue 19).
    The pixels come from :func:`decode_image` (EXIF orientation applied, alpha composited
    on :data:`ALPHA_BACKGROUND`), so an EXIF-rotated JPEG keys like the same pixels stored
    upright and an RGBA image keys like its RGB composite.

    Args:
        image: RGB pixels: uint8 [height, width, 3], or a PIL image in mode ``RGB`` (its
            pixels, as ``np.asarray`` gives them: the same key as the array).
        plan: The resize plan (:func:`plan_resize`); another pixel budget is another key.
        revision: The model revision (:func:`vlcommon.model_info.model_revision`).

    Returns:
        64 lowercase hex characters.
    """
    pixels = np.ascontiguousarray(image, dtype=np.uint8)
    height, width = pixels.shape[:2]
    h = hashlib.sha256()
    h.update(b"splitvl-exact-v2\0")
    h.update(f"{width}x{height}x{pixels.shape[2:]}\0".encode())
    h.update(f"{plan.resized_height}x{plan.resized_width}\0{plan.grid}\0{revision}\0".encode())
    h.update(pixels.data)  # no copy: a C-contiguous uint8 buffer
    return h.hexdigest()


def resize_to_plan(pixels: np.ndarray | Image.Image, plan: ResizePlan) -> torch.Tensor:
    """Resize RGB pixels to the plan's size: uint8 [3, resized_height, resized_width].

    Uses ``torchvision.transforms.v2.functional.resize`` (bicubic, antialiased) on the
    uint8 tensor, as transformers' Qwen2-VL fast image processor does, so the result is
    bit-identical to what transformers and vLLM feed their ViT for the raw image.
    """
    import torch
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as F

    arr = np.asarray(pixels, dtype=np.uint8)
    # No private copy (a full-size pass): the pixels are often read-only (a protobuf
    # buffer's view, Pillow's bytes), but resize only reads its input, and the no-resize
    # case below returns a new tensor (contiguous() of the permuted view).
    chw = torch.from_numpy(arr).permute(2, 0, 1)
    if chw.shape[1] == plan.resized_height and chw.shape[2] == plan.resized_width:
        return chw.contiguous()
    return F.resize(
        chw,
        [plan.resized_height, plan.resized_width],
        interpolation=InterpolationMode.BICUBIC,
        antialias=True,
    )
