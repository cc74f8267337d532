"""The similarity descriptor: what the cache's near-duplicate tier compares.

:func:`similarity_descriptor` turns a decoded image into a unit vector (a 32x32 RGB
thumbnail, mean removed, L2-normalised), so the inner product of two descriptors is their
cosine similarity (:func:`cosine_similarity`); document-like images
(:func:`is_document_like`) get the zero vector and are served by the exact tier only.
:mod:`vlcommon.imaging` re-exports these names.

Usage::

    descriptor = similarity_descriptor(image, resized)  # float32 [DESCRIPTOR_DIM]
    score = cosine_similarity(descriptor, other)
"""

from __future__ import annotations

import numpy as np
from PIL import Image

# Similarity descriptor: a 32x32 RGB thumbnail (3,072 values). Calibrated with `splitvl
# cache-eval` (docs/cache.md): 16x16 lets the stereo pair motorcycle_left/right reach a
# cosine of 0.84, 32x32 keeps it at 0.73 while near duplicates stay above 0.85.
DESCRIPTOR_SIDE = 32
DESCRIPTOR_DIM = DESCRIPTOR_SIDE * DESCRIPTOR_SIDE * 3
# The document test looks at every k-th pixel, for a long side of at most this many pixels.
DESCRIPTOR_WORK_SIDE = 256
# Document-like images (text, screenshots, charts, line art) get no similarity descriptor:
# a luma level within +-16 of the most common one (the background) covers >= 75% of the
# pixels, and >= 36% of the remaining pixels differ from it by more than 96 levels (ink).
# One changed digit or word moves a thumbnail's cosine by ~1%, far less than a JPEG
# re-encode or a small crop does, so no threshold on a global descriptor could tell them
# apart; such images are served by the exact tier only. Luma, not RGB: JPEG's subsampled
# chroma smears coloured backgrounds around glyphs, its luma stays sharp. The fractions sit
# between what was measured (docs/cache.md): rendered text (black on white, white on
# blue/red/black, black on yellow; 640x104 to 1600x1200; PNG and JPEG q50-95) has
# background >= 0.84 and ink >= 0.47; photos with a large flat background have ink <= 0.26
# (hubble_deep_field, cell, moon, microaneurysms), and the one with high-contrast ink (the
# horse silhouette) has background 0.66.
DOCUMENT_BACKGROUND_FRACTION = 0.75
DOCUMENT_INK_FRACTION = 0.36
DOCUMENT_BACKGROUND_TOLERANCE = 16  # max |luma - background luma|, 8-bit levels
DOCUMENT_INK_CONTRAST = 96  # min |luma - background luma| of an ink pixel, 8-bit levels


def _sample_luma(image: Image.Image) -> np.ndarray:
    """uint8 [h, w]: luma (ITU-R 601, Pillow's ``L``) of every k-th pixel of ``image``
    (nearest neighbour, no averaging), for a long side of at most
    :data:`DESCRIPTOR_WORK_SIDE`. Sampling instead of averaging keeps thin text strokes
    at full contrast whatever the page size."""
    step = -(-max(image.size) // DESCRIPTOR_WORK_SIDE)
    if step > 1:
        size = (max(1, image.width // step), max(1, image.height // step))
        image = image.resize(size, Image.Resampling.NEAREST)
    return np.asarray(image.convert("L"), dtype=np.uint8)


def _is_document_like(luma: np.ndarray) -> bool:
    flat = luma.reshape(-1)
    # The background is the most common luma, in 4-level bins (JPEG noise and
    # antialiasing move a flat background by a few levels).
    background_luma = int(np.bincount(flat >> 2, minlength=64).argmax()) * 4 + 2
    distance = np.abs(flat.astype(np.int16) - background_luma)
    background = distance <= DOCUMENT_BACKGROUND_TOLERANCE
    n_background = int(np.count_nonzero(background))
    if n_background < DOCUMENT_BACKGROUND_FRACTION * len(flat) or n_background == len(flat):
        return False
    n_ink = int(np.count_nonzero(distance > DOCUMENT_INK_CONTRAST))
    return n_ink >= DOCUMENT_INK_FRACTION * (len(flat) - n_background)


def is_document_like(image: Image.Image) -> bool:
    """Whether ``image`` looks like text, a screenshot, a chart or line art.

    True when one background luma (+-16 levels around the most common one) covers at
    least 75% of the pixels and at least 36% of the other pixels differ from it by more
    than 96 levels (ink), counted on every k-th pixel (long side <= 256 samples). Such
    images get the zero similarity descriptor (exact tier only): see
    :func:`similarity_descriptor`.
    """
    return _is_document_like(_sample_luma(image))


def similarity_descriptor(image: Image.Image, resized: np.ndarray | None = None) -> np.ndarray:
    """A cheap descriptor for near-duplicate search, computed before any ViT work.

    What: the image is area-averaged (box filter) to a 32x32 RGB thumbnail (aspect ratio
    not kept), each channel's mean is subtracted, and the 3,072 values are L2-normalised,
    so the inner product of two descriptors is the Pearson correlation of the thumbnails
    (a cosine similarity).

    Why it finds near duplicates: one thumbnail cell averages 1/1024 of the image, which
    removes the high frequencies that JPEG re-encoding (quality >= 70) changes, and the
    stretch to a fixed 32x32 grid makes a 1-10% resize land on the same cells; mean removal
    and the L2 norm cancel brightness offsets and contrast gains of a few percent. Crops of
    1-3% shift content by under one cell for most photos (fine textures such as brick or
    gravel cropped at a corner are the exception: a miss, never a wrong hit).

    Why it separates different content: the 1,024 cells keep the layout of the scene, so
    different photos score <= 0.54 and even the stereo pair motorcycle_left/right (the
    same scene from two viewpoints) 0.73, below the 0.85 default threshold. What a
    thumbnail cannot see is a small local edit on a document (one digit or word moves
    the cosine by ~1%): document-like images (:func:`is_document_like`) therefore get the
    zero vector, as do flat images; a zero descriptor has cosine 0 with everything, so such
    an image can only ever hit exactly.

    Cost: about 0.8 ms of CPU for a 448x448 image, 7 ms for 2000x2000 (docs/cache.md),
    against 213-231 ms for the bench checkpoint's ViT on one 448x448 image
    (docs/benchmarks.md).

    Args:
        image: The decoded image (full size): the document test samples it, so thin
            strokes keep their contrast whatever the resize does to them.
        resized: Optional: the same image's resized pixels, uint8 [height, width, 3]
            (:func:`vlcommon.imaging.resize_to_plan`); the thumbnail is then averaged
            from them instead of from ``image``: the gateway passes them, so a 12 MP
            photo's descriptor costs one pass over 1.3 MP instead of one over 12 MP
            (issue 19). A cell of the thumbnail averages ~1,200 resized pixels either
            way; the cosine between the two versions of one photo is >= 0.999
            (tests/unit/vlcommon/test_imaging.py).

    Returns:
        float32 [DESCRIPTOR_DIM] (3,072), unit L2 norm, or all zeros.
    """
    if is_document_like(image):
        return np.zeros(DESCRIPTOR_DIM, dtype=np.float32)
    source = image if resized is None else Image.fromarray(np.ascontiguousarray(resized), "RGB")
    thumb = source.resize((DESCRIPTOR_SIDE, DESCRIPTOR_SIDE), Image.Resampling.BOX)
    arr = np.asarray(thumb, dtype=np.float32).reshape(-1, 3)
    arr = arr - arr.mean(axis=0, keepdims=True)
    vec = arr.reshape(-1)
    norm = float(np.linalg.norm(vec))
    if norm < 1e-3:
        return np.zeros(DESCRIPTOR_DIM, dtype=np.float32)
    return (vec / norm).astype(np.float32)


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two vectors, clamped to [-1, 1]."""
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return 0.0
    return max(-1.0, min(1.0, float(np.dot(a, b)) / (na * nb)))
