"""FLOPs of Qwen3-VL's two halves, to size the bench checkpoint like the real model.

Counts multiply-accumulates as 2 FLOPs, dense layers only plus attention scores (the terms
that dominate; norms, activations and rotary embeddings are ignored). The ratio that the
bench checkpoint must match is::

    vit_flops_per_image_token / llm_prefill_flops_per_token

where the ViT side covers the blocks over the 4 patches (spatial_merge_size**2) behind
each image token, plus the patch merger and the deepstack mergers, and the LLM side is
one prefill token through all decoder layers (attention over ``context`` tokens).
Sources: transformers' ``modeling_qwen3_vl.py`` (module shapes) and the published
``config.json`` of Qwen/Qwen3-VL-2B-Instruct (the dimensions in ``QWEN3_VL_2B``).
"""

from __future__ import annotations

from typing import Any

# Qwen/Qwen3-VL-2B-Instruct config.json (text = Qwen3-1.7B's shape).
QWEN3_VL_2B: dict[str, Any] = {
    "vision": {
        "depth": 24,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "out_hidden_size": 2048,
        "spatial_merge_size": 2,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "deepstack_visual_indexes": [5, 11, 17],
    },
    "text": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
}


def vit_flops_per_token(vision: dict[str, Any], patches_per_image: int) -> float:
    """ViT FLOPs per merged image token (blocks over its patches + mergers)."""
    h, inter = vision["hidden_size"], vision["intermediate_size"]
    merge = vision["spatial_merge_size"] ** 2
    patch_in = 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    per_patch = 2 * patch_in * h  # patch embedding (a Conv3d with kernel == stride)
    per_patch += vision["depth"] * (
        2 * (4 * h * h + 2 * h * inter)  # qkv + proj, fc1 + fc2
        + 4 * patches_per_image * h  # QK^T and AV over the image's patches
    )
    merger_in = h * merge
    per_merger = 2 * (merger_in * merger_in + merger_in * vision["out_hidden_size"])
    n_mergers = 1 + len(vision.get("deepstack_visual_indexes", []))
    return merge * per_patch + n_mergers * per_merger


def llm_flops_per_token(text: dict[str, Any], context: int) -> float:
    """Decoder FLOPs for one prefill token attending over ``context`` tokens."""
    h, inter = text["hidden_size"], text["intermediate_size"]
    q = text["num_attention_heads"] * text["head_dim"]
    kv = text["num_key_value_heads"] * text["head_dim"]
    per_layer = 2 * (h * q + 2 * h * kv + q * h + 3 * h * inter) + 4 * context * q
    return text["num_hidden_layers"] * per_layer


def vit_to_llm_ratio(config: dict[str, Any], image_side: int = 448) -> float:
    """ViT FLOPs / LLM prefill FLOPs over the image tokens of one square image."""
    vision, text = config["vision"], config["text"]
    patches = (image_side // vision["patch_size"]) ** 2
    tokens = patches // vision["spatial_merge_size"] ** 2
    return vit_flops_per_token(vision, patches) / llm_flops_per_token(text, tokens)
