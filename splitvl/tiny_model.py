"""Build a tiny random-weight Qwen3-VL checkpoint offline, deterministically.

``splitvl make-tiny-model DIR`` writes a checkpoint that loads with
``from_pretrained(DIR)`` in transformers and in vLLM (``HF_HUB_OFFLINE=1``): a
``Qwen3VLForConditionalGeneration`` with random weights from a fixed seed, a byte-level
BPE tokenizer trained here on text that ships with Python (Qwen2's normaliser, split
regex and ByteLevel pre-tokenizer, Qwen3-VL's special tokens in Qwen's order), a
Qwen3-VL-style chat template and processor configs. The configuration is the one
measured in ../shared/FACTS.md. The same seed gives byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SEED = 1234
# Qwen2/Qwen3 tokenizer pre-tokenisation regex (tokenizer.json of Qwen2-VL).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3-VL's added tokens, in the order of Qwen's vocabulary (151643 onwards).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
ADDED_NON_SPECIAL = [
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
BPE_VOCAB = 2000
VOCAB_PADDED = 2048

# Qwen3-VL's chat template, reduced to what splitvl uses: text, images and videos in
# ordered content parts; one <|image_pad|> per image (the processor or vLLM expands it).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif content['type'] == 'video' or 'video' in content %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in content %}{{- content['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The same reduced template with the assistant-turn logic of the published
# Qwen3-VL-*-Thinking chat template (chat_template.json of Qwen/Qwen3-VL-8B-Thinking, tools
# and vision ids left out as above): an assistant message's reasoning is its
# `reasoning_content` when that is a string, else what its content holds before `</think>`
# (the content keeping what follows); only assistant turns after the last user query (one
# that is not a wrapped <tool_response>) show their reasoning, between <think> and
# </think>, when they are the last message or have some; earlier turns keep only their
# content. The generation prompt opens the answer inside <think>: the Thinking models
# start by reasoning.
THINKING_CHAT_TEMPLATE = (
    "{%- macro render_content(content) %}"
    "{%- if content is string %}{{- content }}"
    "{%- else %}{%- for item in content %}"
    "{%- if item['type'] == 'image' or 'image' in item or 'image_url' in item %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'video' or 'video' in item %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in item %}{{- item['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{%- endmacro %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message['role'] == 'user' %}"
    "{%- set content = render_content(message['content']) %}"
    "{%- if not (content.startswith('<tool_response>')"
    " and content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}"
    "{%- endif %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = render_content(message['content']) %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if message['reasoning_content'] is string %}"
    "{%- set reasoning_content = message['reasoning_content'] %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n<think>\\n' + reasoning_content.strip('\\n')"
    " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + content }}"
    "{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + content }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)

_CORPUS_MODULES = [
    "this",
    "os",
    "json",
    "re",
    "argparse",
    "asyncio",
    "collections",
    "functools",
    "itertools",
    "logging",
    "pathlib",
    "subprocess",
    "textwrap",
    "typing",
    "unittest",
    "csv",
    "datetime",
    "decimal",
    "fractions",
    "statistics",
    "random",
    "string",
    "difflib",
    "pickle",
    "socket",
    "threading",
    "email",
    "http",
    "urllib",
    "zipfile",
    "tarfile",
    "shutil",
    "tempfile",
    "inspect",
    "dataclasses",
    "enum",
    "heapq",
    "bisect",
    "math",
    "colorsys",
    "calendar",
    "locale",
    "gettext",
    "pprint",
    "contextlib",
    "abc",
    "io",
]
_EXTRA_TEXT = (
    "Describe this image. What is in the picture? A photo of an astronaut, a cat, a cup "
    "of coffee, a rocket, a motorcycle, the sky, a person, a dog, a car, a street, a tree. "
    "The image shows colors: red, green, blue, yellow, black, white. Answer the question.\n"
)


def _corpus() -> list[str]:
    """Training text: the source files of a fixed list of standard-library modules.

    Read from disk (located with ``importlib.util.find_spec``, which imports nothing), so
    the text depends only on the Python installation, never on what ran before in the
    process (module attributes can be added or monkeypatched by other libraries).
    """
    import importlib.util
    from pathlib import Path

    texts = [_EXTRA_TEXT] * 20
    for name in _CORPUS_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        texts.append(Path(spec.origin).read_text(encoding="utf-8"))
    return texts


def build_tokenizer() -> Any:
    """Train the byte-level BPE and wrap it as a Qwen2Tokenizer with Qwen3-VL's tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    # Merges as tuples and None for the named tokens both work, though the stubs say str.
    kwargs: dict[str, Any] = {
        "vocab": model["vocab"],
        "merges": merges,
        "unk_token": None,
        "bos_token": None,
        "eos_token": None,
        "pad_token": None,
        "add_prefix_space": False,
    }
    qwen = Qwen2Tokenizer(**kwargs)
    # Specials first, in Qwen's order; eos/pad are named afterwards so they keep that order.
    qwen.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    qwen.add_tokens(ADDED_NON_SPECIAL)
    qwen.eos_token = "<|im_end|>"
    qwen.pad_token = "<|endoftext|>"
    qwen.chat_template = CHAT_TEMPLATE
    return qwen


def tiny_config(tokenizer: Any, *, moe: bool = False, **overrides: Any) -> Any:
    """The tiny Qwen3VLConfig of FACTS.md, with token ids from ``tokenizer``; with ``moe``
    a Qwen3VLMoeConfig (``MOE_TEXT`` over the same dimensions)."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert len(tokenizer) <= VOCAB_PADDED, len(tokenizer)
    # Unused vocabulary rows past the tokenizer are allowed (the config pads the vocabulary).
    text = {
        "vocab_size": VOCAB_PADDED,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "max_position_embeddings": 32768,
        "hidden_act": "silu",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [12, 10, 10],
            "mrope_interleaved": True,
        },
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    vision = {
        "depth": 4,
        "hidden_size": 64,
        "num_heads": 2,
        "intermediate_size": 128,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 128,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [1, 2],
        "hidden_act": "gelu_pytorch_tanh",
    }
    if moe:
        text.update(MOE_TEXT)
    text.update(overrides.pop("text", {}))
    vision.update(overrides.pop("vision", {}))
    overrides.setdefault("tie_word_embeddings", False)
    return (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        **overrides,
    )


def build_processor(
    tokenizer: Any,
    *,
    patch_size: int = 16,
    merge_size: int = 2,
    min_pixels: int = 4096,
    max_pixels: int = 65536,
    video_min_pixels: int | None = None,
    video_max_pixels: int | None = None,
    chat_template: str = CHAT_TEMPLATE,
) -> Any:
    """Qwen3VLProcessor with the fast (torchvision) image processor and mean/std 0.5.

    The video budget defaults to ``min_pixels`` .. ``4 * max_pixels`` (the tiny and bench
    checkpoints); ``video_min_pixels``/``video_max_pixels`` set it explicitly.
    ``chat_template``: the Jinja template (:data:`CHAT_TEMPLATE`, or
    :data:`THINKING_CHAT_TEMPLATE` for ``--like thinking``).
    """
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    common = {
        "patch_size": patch_size,
        "merge_size": merge_size,
        "temporal_patch_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    image_processor = Qwen2VLImageProcessor(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, **common
    )
    video_processor = Qwen3VLVideoProcessor(
        size={
            "shortest_edge": min_pixels if video_min_pixels is None else video_min_pixels,
            "longest_edge": max_pixels * 4 if video_max_pixels is None else video_max_pixels,
        },
        **common,
    )
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=chat_template,
    )


# The "bench" checkpoint (FACTS.md): the ViT-to-LLM FLOPs ratio of Qwen3-VL-2B-Instruct at
# 448x448 (splitvl_tools.flops: 0.98 here vs 1.03 for 2B), 74 M parameters, runs here in minutes.
BENCH_OVERRIDES: dict[str, Any] = {
    "text": {
        "vocab_size": 16384,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 14,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
    },
    "vision": {
        "depth": 8,
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_heads": 4,
        "out_hidden_size": 512,
        "deepstack_visual_indexes": [1, 3, 5],
    },
}
BENCH_MAX_PIXELS = 448 * 448


# Qwen/Qwen3-VL-2B-Instruct's published configuration (config.json, 1.51 kB, and
# preprocessor_config.json / video_preprocessor_config.json of
# https://huggingface.co/Qwen/Qwen3-VL-2B-Instruct, transformers 4.57.0.dev0 format).
# No hub access here: the numbers were read from third-party copies of that config.json
# (OpenVINO GenAI's Qwen3-VL config test, and a Rust model-resolver test, which agree
# field by field) and cross-checked against the published 4B config (same vision tower,
# deepstack [5, 11, 17], mrope [24, 20, 20], rope_theta 5e6; 2B differs in text widths,
# out_hidden_size 2048 and tied embeddings). Token ids are not copied: the tokenizer is
# the tiny one (Qwen's vocabulary cannot be had offline), so the specials get its ids and
# the embedding matrix keeps the real 151,936 rows.
QWEN3_VL_2B_INSTRUCT: dict[str, Any] = {
    "text": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "hidden_act": "silu",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
    },
    "vision": {
        "depth": 24,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 2048,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [5, 11, 17],
        "hidden_act": "gelu_pytorch_tanh",
    },
    "tie_word_embeddings": True,
}
# The real model's processor budget: images 65,536 .. 16,777,216 pixels (256x256 ..
# 4096x4096), videos 4,096 .. 25,165,824 pixels in all.
QWEN3_VL_PROCESSOR_BUDGET = {
    "min_pixels": 65536,
    "max_pixels": 16777216,
    "video_min_pixels": 4096,
    "video_max_pixels": 25165824,
}

# The "wide" checkpoint (issue 14's bench): Qwen3-VL-2B's embedding width (out_hidden 2048
# with 3 deepstack levels: 8,192 values per image token, 16 MiB of bf16 for 1,024 tokens)
# but a 4-block ViT and a 2-layer language model, so that moving embeddings, not the
# models, dominates a request's time. The language model's hidden size must equal
# out_hidden_size (image tokens enter its residual stream), so it keeps 2B's width.
WIDE_OVERRIDES: dict[str, Any] = {
    "text": {
        "vocab_size": VOCAB_PADDED,
        "hidden_size": 2048,
        "intermediate_size": 2048,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "rope_parameters": dict(QWEN3_VL_2B_INSTRUCT["text"]["rope_parameters"]),
    },
    "vision": {
        "depth": 4,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_heads": 4,
        "out_hidden_size": 2048,
        "deepstack_visual_indexes": [1, 2, 3],
    },
}

# Qwen3-VL-30B-A3B-Instruct's text model scaled down: its routing kept (every layer sparse,
# 128 experts, 8 per token, moe_intermediate_size 768 against hidden 2048, no shared
# expert, top-k weights renormalised), fewer and smaller experts here: 8 experts, 2 per
# token (the same 1:16 would leave one), width 96 against hidden 128.
MOE_TEXT: dict[str, Any] = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 96,  # 2 x 96 != hidden 128: the file's layout is unambiguous
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}

# No scaling of the router's weights (an earlier plan, to keep tokens away from routing
# ties): a tie is decided by the top-k margin against the noise of the logits, and both
# scale with the weights, so it changes nothing there. What holds ties off is measured
# instead: tests/e2e/test_moe.py checks the smallest margin on its photos against float32
# noise (docs/usage.md, "MoE checkpoints").

#: ``make-tiny-model --like NAME``: (config overrides, processor budget, torch dtype).
LIKE: dict[str, tuple[dict[str, Any], dict[str, int], str]] = {
    "Qwen/Qwen3-VL-2B-Instruct": (QWEN3_VL_2B_INSTRUCT, QWEN3_VL_PROCESSOR_BUDGET, "bfloat16"),
    "wide": (WIDE_OVERRIDES, QWEN3_VL_PROCESSOR_BUDGET, "bfloat16"),
    # The tiny checkpoint's dimensions and processor with the MoE text model (MOE_TEXT).
    "moe": ({}, {}, "float32"),
    # The tiny checkpoint itself (same weights, tokenizer and processor) with a Thinking
    # chat template (THINKING_CHAT_TEMPLATE, LIKE_CHAT_TEMPLATES).
    "thinking": ({}, {}, "float32"),
}
#: The chat template of a ``--like`` kind that does not use :data:`CHAT_TEMPLATE`.
LIKE_CHAT_TEMPLATES: dict[str, str] = {"thinking": THINKING_CHAT_TEMPLATE}


def _write_experts_as_published(out: Path) -> None:
    """Rewrite the fused expert tensors in the layout of the published Qwen3-VL MoE
    checkpoints: ``gate_up_proj`` [experts, hidden, 2 x moe_intermediate] and ``down_proj``
    [experts, moe_intermediate, hidden].

    transformers keeps them transposed in memory ([experts, 2 x intermediate, hidden]) and
    transposes the published layout on load (its ``conversion_mapping``), but
    ``save_pretrained`` writes the memory layout back; vLLM reads the published layout
    (``is_fused_checkpoint_transposed``) and refused the file (a shape mismatch).
    """
    from safetensors.torch import load_file, save_file

    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                tensors[name] = tensor.transpose(1, 2).contiguous()
        save_file(tensors, path, metadata={"format": "pt"})


def make_tiny_model(
    out_dir: str | Path, *, seed: int = SEED, bench: bool = False, like: str | None = None
) -> Path:
    """Write the tiny (or, with ``bench``, the bench-sized) checkpoint to ``out_dir``.

    Args:
        out_dir: Target directory (created).
        seed: Seed of torch's generator for the random weights.
        bench: Build the bench checkpoint (BENCH_OVERRIDES, images up to 448x448).
        like: A name in :data:`LIKE`: that configuration instead (``Qwen/Qwen3-VL-2B-Instruct``:
            every dimension of the real model, 2.1 B parameters, 4.3 GB in bf16; ``wide``:
            its embedding width with a shallow ViT and language model), with the real
            model's processor budget and weights in bf16; ``moe``: the tiny dimensions
            with a Qwen3-VL-MoE text model; ``thinking``: the tiny checkpoint (the same
            files but the chat template) with :data:`THINKING_CHAT_TEMPLATE`, as the
            Qwen3-VL-*-Thinking checkpoints ship.

    Raises:
        ValueError: ``like`` is not a known name, or given with ``bench``.
    """
    import torch
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

    if like is not None and like not in LIKE:
        raise ValueError(f"--like {like!r}: known are {', '.join(LIKE)}")
    if like is not None and bench:
        raise ValueError("--like and --bench are exclusive")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    chat_template = LIKE_CHAT_TEMPLATES.get(like or "", CHAT_TEMPLATE)
    tokenizer.chat_template = chat_template
    budget: dict[str, int] = {}
    dtype = torch.float32
    if like is not None:
        template, budget, dtype_name = LIKE[like]
        overrides = json.loads(json.dumps(template))
        dtype = getattr(torch, dtype_name)
    else:
        overrides = json.loads(json.dumps(BENCH_OVERRIDES)) if bench else {}
    moe = like == "moe"
    config = tiny_config(tokenizer, moe=moe, **overrides)
    torch.manual_seed(seed)
    # Initialised in its own dtype: a 2 B-parameter model built in float32 first would need
    # 8.5 GB here before the cast. The same seed and dtype give the same weights.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        cls = Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration
        model = cls(config).eval()  # type: ignore[arg-type]
    finally:
        torch.set_default_dtype(previous)
    model = model.to(dtype)
    model.save_pretrained(out)
    if moe:
        _write_experts_as_published(out)
    if like is not None and budget:
        processor = build_processor(tokenizer, chat_template=chat_template, **budget)
    elif bench:
        processor = build_processor(tokenizer, max_pixels=BENCH_MAX_PIXELS)
    else:
        processor = build_processor(tokenizer, chat_template=chat_template)
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    kind = f"like {like}" if like else ("bench" if bench else "tiny")
    (out / "SPLITVL_TINY_MODEL").write_text(f"kind={kind}\nseed={seed}\n")
    return out
