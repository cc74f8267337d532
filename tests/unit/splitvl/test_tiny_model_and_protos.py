"""The tiny checkpoint builder and the proto contracts."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_same_seed_gives_byte_identical_files(tiny_model: Path, tmp_path: Path) -> None:
    from splitvl.tiny_model import make_tiny_model

    again = make_tiny_model(tmp_path / "again")
    assert digests(again) == digests(tiny_model)
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "processor_config.json",
        "chat_template.jinja",
    } <= set(digests(again))
    other = make_tiny_model(tmp_path / "other", seed=7)
    assert digests(other)["model.safetensors"] != digests(tiny_model)["model.safetensors"]


def test_tokenizer_has_qwen_special_tokens_in_order(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    from splitvl.tiny_model import SPECIAL_TOKENS

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok.convert_tokens_to_ids(SPECIAL_TOKENS)
    assert ids == list(range(ids[0], ids[0] + len(SPECIAL_TOKENS)))
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = "Describe this photo, café!"
    assert tok.decode(tok(text)["input_ids"]) == text
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_buf_lint_standard_passes() -> None:
    buf = shutil.which("buf") or str(Path(__import__("sys").executable).parent / "buf")
    if not Path(buf).exists():
        pytest.fail("buf (PyPI buf-bin, in the dev extra) is not installed")
    result = subprocess.run([buf, "lint"], cwd=ROOT / "protos", capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_stubs_are_generated_not_committed() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "protos"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    assert not [p for p in tracked if p.endswith(("_pb2.py", "_pb2_grpc.py"))]
    from qwenvl.gateway.v1 import gateway_service_pb2

    assert "GatewayService" in gateway_service_pb2.DESCRIPTOR.services_by_name
