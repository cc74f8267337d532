"""``make-tiny-model --like``: real configurations with random weights, served in their dtype."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from splitvl.launcher import Cluster, Ports, checkpoint_dtype, decoder_default_args
from splitvl.tiny_model import LIKE, build_tokenizer, make_tiny_model, tiny_config

# Qwen/Qwen3-VL-2B-Instruct's published config.json, the fields that fix its shapes
# (the sources are named at QWEN3_VL_2B_INSTRUCT in splitvl/tiny_model.py).
PUBLISHED_2B_TEXT = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
}
PUBLISHED_2B_VISION = {
    "depth": 24,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_heads": 16,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 2048,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [5, 11, 17],
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_like_2b_config_has_every_published_dimension() -> None:
    """Built without weights (2.1 B parameters take minutes here): the config object."""
    overrides = json.loads(json.dumps(LIKE["Qwen/Qwen3-VL-2B-Instruct"][0]))
    config = tiny_config(build_tokenizer(), **overrides)
    text, vision = config.text_config, config.vision_config
    for name, value in PUBLISHED_2B_TEXT.items():
        assert getattr(text, name) == value, name
    for name, value in PUBLISHED_2B_VISION.items():
        assert getattr(vision, name) == value, name
    assert text.rope_parameters["mrope_section"] == [24, 20, 20]
    assert text.rope_parameters["rope_theta"] == 5_000_000.0
    assert text.rope_parameters["mrope_interleaved"] is True
    assert config.tie_word_embeddings is True
    # 8,192 values per image token: main + 3 deepstack levels at 2,048.
    assert vision.out_hidden_size * (1 + len(vision.deepstack_visual_indexes)) == 8192


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("wide") / "model", like="wide")


def test_wide_checkpoint_is_bf16_at_2b_embedding_width(wide: Path) -> None:
    from safetensors import safe_open

    from vlcommon.model_info import load_vision_spec

    config = json.loads((wide / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert config["text_config"]["hidden_size"] == 2048
    assert config["text_config"]["num_hidden_layers"] == 2
    assert config["vision_config"]["depth"] == 4
    spec = load_vision_spec(wide)
    assert spec.embedding_width == 8192
    # The real model's processor budget: 256x256 .. 4096x4096 pixels.
    assert (spec.min_pixels, spec.max_pixels) == (65536, 16777216)
    proc = json.loads((wide / "processor_config.json").read_text())
    assert proc["video_processor"]["size"] == {"longest_edge": 25165824, "shortest_edge": 4096}
    with safe_open(str(wide / "model.safetensors"), "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118
    assert dtypes == {"BF16"}


def test_wide_checkpoint_is_deterministic(wide: Path, tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again", like="wide")
    assert sha256(again / "model.safetensors") == sha256(wide / "model.safetensors")
    assert (again / "config.json").read_bytes() == (wide / "config.json").read_bytes()


def test_unknown_like_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="known are"):
        make_tiny_model(tmp_path / "x", like="Qwen/Qwen3-VL-999B")


def test_services_get_the_checkpoints_own_dtype(wide: Path, tiny_model: Path) -> None:
    assert checkpoint_dtype(str(wide)) == "bfloat16"
    assert checkpoint_dtype(str(tiny_model)) == "float32"
    assert checkpoint_dtype("Qwen/Qwen3-VL-2B-Instruct") is None  # a hub id: not resolved
    args = decoder_default_args(str(wide))
    assert args[args.index("--dtype") + 1] == "bfloat16"
    cluster = Cluster(model=str(wide), ports=Ports.free(), log_dir=wide.parent)
    decoder = cluster._command("decoder")
    # The last --dtype wins in vLLM's argparse: the checkpoint's, unless the operator's.
    assert decoder[len(decoder) - 1 - decoder[::-1].index("--dtype") + 1] == "bfloat16"
    encoder = cluster._command("encoder")
    assert encoder[encoder.index("--dtype") + 1] == "bfloat16"
    tiny = Cluster(model=str(tiny_model), ports=Ports.free(), log_dir=wide.parent)
    assert tiny._command("decoder").count("float32") == 1


def test_the_thinking_checkpoint_is_the_tiny_one_with_a_thinking_template(
    thinking_model: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """Same weights, tokenizer and processor files as the tiny checkpoint; only the chat
    template (and the marker) differ, and the same seed gives the same bytes."""
    from splitvl.tiny_model import THINKING_CHAT_TEMPLATE

    names = {p.name for p in tiny_model.iterdir()}
    assert names == {p.name for p in thinking_model.iterdir()}
    differ = {
        n for n in names if (tiny_model / n).read_bytes() != (thinking_model / n).read_bytes()
    }
    assert differ == {"chat_template.jinja", "SPLITVL_TINY_MODEL"}
    assert (thinking_model / "chat_template.jinja").read_text() == THINKING_CHAT_TEMPLATE
    assert (thinking_model / "SPLITVL_TINY_MODEL").read_text() == "kind=like thinking\nseed=1234\n"
    again = make_tiny_model(tmp_path / "again", like="thinking")
    for name in names:
        assert (again / name).read_bytes() == (thinking_model / name).read_bytes(), name


def test_the_thinking_template_renders_as_the_published_one(thinking_model: Path) -> None:
    """transformers' apply_chat_template on the saved checkpoint (its tokenizer, as the
    decoder renders, and its processor, as the reference model's inputs are made), against
    the published Qwen3-VL-*-Thinking template's output written out: an assistant turn
    before the last user query keeps only its content (its reasoning dropped, whether it
    came as reasoning_content or inside the content), the last turn after the query shows
    its reasoning, and the generation prompt opens <think>."""
    from transformers import AutoProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(thinking_model)
    proc = AutoProcessor.from_pretrained(thinking_model)
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}
    answer = {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}
    turns = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        user,
        {**answer, "reasoning_content": "\nIt is furry.\n"},
        {"role": "user", "content": [{"type": "text", "text": "Sure?"}]},
    ]
    head = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What?<|im_end|>\n"
    )
    three = head + (
        "<|im_start|>assistant\nA cat.<|im_end|>\n"
        "<|im_start|>user\nSure?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    in_content = {"role": "assistant", "content": "<think>\nIt is furry.\n</think>\n\nA cat."}
    for render in (tok.apply_chat_template, proc.apply_chat_template):
        assert render(turns, add_generation_prompt=True, tokenize=False) == three
        split = [*turns[:2], in_content, turns[3]]
        assert render(split, add_generation_prompt=True, tokenize=False) == three
        last = head + "<|im_start|>assistant\n<think>\nIt is furry.\n</think>\n\nA cat.<|im_end|>\n"
        assert render(turns[:3], add_generation_prompt=False, tokenize=False) == last
        assert render(turns[:3], add_generation_prompt=True, tokenize=False) == (
            last + "<|im_start|>assistant\n<think>\n"
        )
        # The last turn shows a <think> block even without reasoning; earlier ones do not.
        assert render([*turns[:2], answer], add_generation_prompt=False, tokenize=False) == (
            head + "<|im_start|>assistant\n<think>\n\n</think>\n\nA cat.<|im_end|>\n"
        )
