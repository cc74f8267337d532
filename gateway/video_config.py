"""The server's default video sampling, read from the checkpoint's video processor config
(:func:`load_video_config`); :mod:`gateway.video` samples and decodes with it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vlcommon.model_info import VisionSpec


@dataclass(frozen=True)
class VideoConfig:
    """The server's default video sampling, from the checkpoint's video processor config.

    Attributes:
        fps: Frames per second sampled from a file (``fps``, 2 for Qwen3-VL).
        min_frames, max_frames: Bounds on the sampled frame count (4 and 768).
        frame_min_pixels: Lower bound on each resized frame's height*width
            (``size.shortest_edge``).
        frame_max_pixels: Upper bound on each resized frame's height*width:
            ``max_video_tokens * (2 * patch_size)**2`` (qwen-vl-utils' VIDEO_MAX_TOKEN_NUM).
        total_pixels: The pixel budget of a whole video (``size.longest_edge``); qwen-vl-utils
            gives each frame at most ``total_pixels / frames * 2``.
    """

    fps: float
    min_frames: int
    max_frames: int
    frame_min_pixels: int
    frame_max_pixels: int
    total_pixels: int


def load_video_config(model_dir: Path, spec: VisionSpec) -> VideoConfig:
    """Read :class:`VideoConfig` from ``processor_config.json`` (``video_processor``) or
    ``video_preprocessor_config.json``; transformers' Qwen3VLVideoProcessor defaults fill
    what neither gives."""
    proc: dict = {}
    nested = model_dir / "processor_config.json"
    if nested.exists():
        proc = dict(json.loads(nested.read_text()).get("video_processor") or {})
    single = model_dir / "video_preprocessor_config.json"
    if not proc and single.exists():
        proc = dict(json.loads(single.read_text()))
    factor = spec.factor
    size = proc.get("size") or {}
    return VideoConfig(
        fps=float(proc.get("fps") or 2.0),
        min_frames=int(proc.get("min_frames") or 4),
        max_frames=int(proc.get("max_frames") or 768),
        frame_min_pixels=int(size.get("shortest_edge") or 128 * factor * factor),
        frame_max_pixels=int(proc.get("max_video_tokens") or 768) * factor * factor,
        total_pixels=int(size.get("longest_edge") or 768 * factor * factor * 32),
    )
