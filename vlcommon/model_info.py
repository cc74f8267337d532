"""What the services need to know about a Qwen3-VL checkpoint, read from its JSON files.

The gateway uses this to plan resizes and compute keys from the checkpoint's JSON alone
(no weights are loaded; the module itself imports no torch, although the gateway's resize
does); the encoder and decoder use it to validate shapes. ``resolve_model_dir`` accepts a local
directory or a Hugging Face hub id (resolved through the local hub cache; with
``HF_HUB_OFFLINE=1`` nothing is downloaded).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path


def resolve_model_dir(model: str) -> Path:
    """A local directory holding the checkpoint's files.

    Args:
        model: A directory path or a hub id such as ``Qwen/Qwen3-VL-2B-Instruct``.

    Raises:
        FileNotFoundError: ``model`` is neither a directory nor resolvable from the hub.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model))


def model_error(model: str) -> str | None:
    """Why a service's ``--model`` cannot be loaded, as one line naming it; None if it can.

    A local path (absolute, or starting with ``.`` or ``~``, or existing) must be a directory
    holding ``config.json``. Anything else is resolved as a hub id by ``resolve_model_dir``
    (the local hub cache; a download unless ``HF_HUB_OFFLINE=1``), as the service would at
    start. The services call this before they bind a port, so a wrong path is a usage error
    (exit status 2) instead of a traceback after "listening".
    """
    path = Path(model).expanduser()
    if model.startswith(("/", ".", "~")) or path.exists():
        if not path.is_dir():
            return f"--model {model!r}: no such checkpoint directory"
        if not (path / "config.json").is_file():
            return f"--model {model!r}: the directory has no config.json (not a checkpoint)"
        return None
    try:
        resolved = resolve_model_dir(model)
    # huggingface_hub raises a different type per cause (an invalid id, offline and not
    # cached, not found, HTTP errors); each is the same usage error here.
    except Exception as err:  # noqa: BLE001
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"--model {model!r}: not a directory, nor a resolvable hub id ({reason})"
    if not (resolved / "config.json").is_file():
        return f"--model {model!r}: the hub snapshot has no config.json (not a checkpoint)"
    return None


@dataclass(frozen=True)
class VisionSpec:
    """Qwen3-VL vision geometry and widths.

    Attributes:
        patch_size: ViT patch side, pixels (16 for Qwen3-VL).
        spatial_merge_size: Patches merged per side into one LLM token (2).
        temporal_patch_size: Frames per temporal patch (2; a still image is repeated).
        min_pixels: Default lower bound on resized height*width (processor ``size.shortest_edge``).
        max_pixels: Default upper bound on resized height*width (processor ``size.longest_edge``).
        out_hidden_size: Width of one merged image token (the LLM hidden size).
        n_deepstack: Number of deepstack feature levels (``len(deepstack_visual_indexes)``).
        image_mean, image_std: Normalisation per RGB channel.
    """

    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    out_hidden_size: int
    n_deepstack: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @property
    def factor(self) -> int:
        """Resize factor: sides are multiples of patch_size * spatial_merge_size (32)."""
        return self.patch_size * self.spatial_merge_size

    @property
    def embedding_width(self) -> int:
        """Width of the embeddings the decoder takes: out_hidden * (1 + n_deepstack)."""
        return self.out_hidden_size * (1 + self.n_deepstack)

    def tokens(self, t: int, h: int, w: int) -> int:
        """Image tokens for a grid: t*h*w / spatial_merge_size**2."""
        return (t * h * w) // (self.spatial_merge_size**2)


def _image_processor_config(model_dir: Path) -> dict:
    proc = model_dir / "processor_config.json"
    if proc.exists():
        data = json.loads(proc.read_text())
        if "image_processor" in data:
            return dict(data["image_processor"])
    pre = model_dir / "preprocessor_config.json"
    if pre.exists():
        return dict(json.loads(pre.read_text()))
    raise FileNotFoundError(f"{model_dir}: no processor_config.json or preprocessor_config.json")


def load_vision_spec(model_dir: Path) -> VisionSpec:
    """Read the VisionSpec from ``config.json`` and the processor config."""
    config = json.loads((model_dir / "config.json").read_text())
    vision = config["vision_config"]
    proc = _image_processor_config(model_dir)
    size = proc.get("size") or {}
    min_pixels = int(proc.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
    max_pixels = int(proc.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
    return VisionSpec(
        patch_size=int(proc.get("patch_size", vision.get("patch_size", 16))),
        spatial_merge_size=int(proc.get("merge_size", vision.get("spatial_merge_size", 2))),
        temporal_patch_size=int(
            proc.get("temporal_patch_size", vision.get("temporal_patch_size", 2))
        ),
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        out_hidden_size=int(vision["out_hidden_size"]),
        n_deepstack=len(vision.get("deepstack_visual_indexes", [])),
        image_mean=tuple(proc.get("image_mean", (0.5, 0.5, 0.5))),  # type: ignore[arg-type]
        image_std=tuple(proc.get("image_std", (0.5, 0.5, 0.5))),  # type: ignore[arg-type]
    )


def model_revision(model_dir: Path) -> str:
    """A short digest naming the checkpoint, part of every exact cache key.

    A hub snapshot directory is named by its commit hash, which is used as is. Otherwise
    the digest covers the JSON configs and, for each weight file, its size and its first
    and last MiB (the safetensors header lists every tensor's offsets and the tail holds
    real weights), so a re-trained checkpoint with the same shapes gets a new revision
    without reading gigabytes at startup.
    """
    if len(model_dir.name) == 40 and model_dir.parent.name == "snapshots":
        return model_dir.name[:16]
    h = hashlib.sha256()
    for path in sorted(model_dir.iterdir()):
        if path.suffix == ".json":
            h.update(path.name.encode() + b"\0" + path.read_bytes())
        elif path.suffix == ".safetensors":
            size = path.stat().st_size
            h.update(path.name.encode() + b"\0" + str(size).encode())
            with path.open("rb") as f:
                h.update(f.read(1 << 20))
                f.seek(max(0, size - (1 << 20)))
                h.update(f.read(1 << 20))
    return h.hexdigest()[:16]
