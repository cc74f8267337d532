"""A second language on the public API: clients/node/generate.js (@grpc/grpc-js and
@grpc/proto-loader, protos loaded from protos/ at run time) streams Generate from the
session's gateway, and its tokens equal the Python client's for the same greedy request.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from splitvl.client import build_request, generate
from tests.conftest import photo

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
NODE_CLIENT = ROOT / "clients" / "node"
PROMPT = "Describe this image."
MAX_TOKENS = 16


@pytest.fixture(scope="session")
def node_client() -> Path:
    """clients/node with its npm dependencies installed (``npm ci`` when node_modules is absent)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.fail("Node.js >= 18 with npm is required for the Node.js client test")
    if not (NODE_CLIENT / "node_modules" / ".package-lock.json").exists():
        out = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"],
            cwd=NODE_CLIENT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, f"npm ci failed:\n{out.stdout}\n{out.stderr}"
    return NODE_CLIENT


def run_node(
    client_dir: Path, address: str, image: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            "node",
            str(client_dir / "generate.js"),
            "--address",
            address,
            "--image",
            str(image),
            "--prompt",
            PROMPT,
            "--max-tokens",
            str(MAX_TOKENS),
            "--ignore-eos",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_node_client_streams_the_same_tokens_as_python(
    cluster: Any, node_client: Path, tmp_path: Path
) -> None:
    address = cluster.ports.address("gateway")
    data = photo("astronaut.png")
    image = tmp_path / "astronaut.png"
    image.write_bytes(data)

    expected = generate(
        address,
        build_request([data], PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True),
        timeout_s=120,
    )
    out = run_node(node_client, address, image)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)

    assert len(expected.token_ids) == MAX_TOKENS  # ignore_eos: exactly max_tokens
    assert result["token_ids"] == expected.token_ids
    assert result["token_count"] == MAX_TOKENS
    assert result["text"] == expected.text
    assert result["finish_reason"] == "FINISH_REASON_LENGTH"
    assert result["usage"]["completion_tokens"] == MAX_TOKENS
    assert result["usage"]["prompt_tokens"] == expected.usage["prompt_tokens"]
    # The same image gives the same grid and cache key whichever language sent it.
    (info,) = result["images"]
    assert info["grid"] == expected.images[0]["grid"]
    assert info["key"] == expected.images[0]["key"]
    assert info["tokens"] == expected.images[0]["tokens"] > 0


def test_node_client_sees_invalid_argument_for_a_bad_image(
    cluster: Any, node_client: Path, tmp_path: Path
) -> None:
    image = tmp_path / "not-an-image.png"
    image.write_bytes(b"\x89PNG\r\n\x1a\n this is not a PNG")
    out = run_node(node_client, cluster.ports.address("gateway"), image)
    assert out.returncode == 1
    error = json.loads(out.stderr.strip().splitlines()[-1])
    assert error["code"] == "INVALID_ARGUMENT"
    assert "images[0]" in error["details"]
    assert out.stdout == ""
