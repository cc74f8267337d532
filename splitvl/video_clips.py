"""Deterministic clips for the demo, the tests and the benchmarks: pans and zooms over
scikit-image's photos.

Usage::

    data = pan_clip("astronaut.png", seconds=3, fps=10, size=(96, 128))   # MP4 bytes

Each frame is a crop of the photo moving (pan) or shrinking (zoom) linearly in time,
resized with Pillow, and encoded with PyAV (H.264 through libx264 when the wheel has it,
else MPEG-4 Part 2) at a fixed key-frame interval, so the same call gives the same bytes.
"""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image


def photo(name: str) -> Image.Image:
    """One of scikit-image's sample photos (``skimage/data/NAME``) as RGB."""
    import skimage

    return Image.open(Path(skimage.__file__).parent / "data" / name).convert("RGB")


def encode_clip(
    frames: list[np.ndarray],
    *,
    fps: float,
    codec: str = "",
    container: str = "mp4",
    gop: int = 4,
    rotation: int = 0,
    pts: list[int] | None = None,
    time_base: Fraction | None = None,
) -> bytes:
    """Encode uint8 ``[h, w, 3]`` RGB frames (even sides) into a file's bytes.

    Args:
        fps: Nominal frame rate.
        codec: FFmpeg encoder; "" picks libx264 (or mpeg4 without it).
        gop: Frames between key frames.
        rotation: Display matrix rotation, degrees counterclockwise (FFmpeg's convention).
        pts: Presentation times in ``time_base`` units (variable frame rate); default i.
    """
    import av

    if not codec:
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    buf = io.BytesIO()
    rate = Fraction(fps).limit_denominator(1000)
    with av.open(buf, "w", format=container) as out:
        stream: Any = out.add_stream(codec, rate=rate)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        stream.codec_context.gop_size = gop
        if codec == "libx264":
            # Deterministic output: one thread, no B-frame reordering surprises across hosts.
            stream.codec_context.options = {"threads": "1", "bframes": "0", "crf": "18"}
        else:
            stream.codec_context.thread_count = 1
        if time_base is not None:
            stream.codec_context.time_base = time_base
            stream.time_base = time_base
        if rotation:
            stream.set_display_rotation(rotation)
        for i, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            frame.pts = pts[i] if pts is not None else i
            if time_base is not None:
                frame.time_base = time_base
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def pan_frames(name: str, n: int, size: tuple[int, int]) -> list[np.ndarray]:
    """``n`` frames of ``size`` (h, w) panning left to right over a photo's middle band."""
    im = photo(name)
    h, w = size
    crop_w = min(im.width, im.height * w // h) * 3 // 4
    crop_h = crop_w * h // w
    top = (im.height - crop_h) // 2
    out = []
    for i in range(n):
        left = (im.width - crop_w) * i // max(1, n - 1)
        box = (left, top, left + crop_w, top + crop_h)
        out.append(np.asarray(im.crop(box).resize((w, h), Image.Resampling.BILINEAR)))
    return out


def zoom_frames(name: str, n: int, size: tuple[int, int]) -> list[np.ndarray]:
    """``n`` frames of ``size`` (h, w) zooming into a photo's centre, to 1/3 of its side."""
    im = photo(name)
    h, w = size
    out = []
    for i in range(n):
        scale = 1.0 - (2.0 / 3.0) * i / max(1, n - 1)
        cw = min(im.width, im.height * w / h) * scale
        ch = cw * h / w
        cx, cy = im.width / 2, im.height / 2
        box = (round(cx - cw / 2), round(cy - ch / 2), round(cx + cw / 2), round(cy + ch / 2))
        out.append(np.asarray(im.crop(box).resize((w, h), Image.Resampling.BILINEAR)))
    return out


def pan_clip(
    name: str, *, seconds: float, fps: float, size: tuple[int, int], **kw: object
) -> bytes:
    """An MP4 (bytes) panning over ``name`` for ``seconds`` at ``fps``."""
    frames = pan_frames(name, max(1, round(seconds * fps)), size)
    return encode_clip(frames, fps=fps, **kw)  # type: ignore[arg-type]


def zoom_clip(
    name: str, *, seconds: float, fps: float, size: tuple[int, int], **kw: object
) -> bytes:
    """An MP4 (bytes) zooming into ``name`` for ``seconds`` at ``fps``."""
    frames = zoom_frames(name, max(1, round(seconds * fps)), size)
    return encode_clip(frames, fps=fps, **kw)  # type: ignore[arg-type]
