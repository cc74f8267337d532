"""Issue 14, must-show 3: a 1,024-token image at Qwen3-VL-2B's embedding width, end to end.

The ``--like wide`` checkpoint (2B's out_hidden 2048 with 3 deepstack levels: 8,192 bf16
values per image token, so 16 MiB of embeddings for one 1,024x1,024 image; a shallow ViT
and language model) through the four services of ``splitvl up``, in its own dtype (bf16).
Its tokens must equal vLLM's fed the same embeddings directly, and the repeat must be an
exact hit with the same tokens. The full ``--like Qwen/Qwen3-VL-2B-Instruct`` checkpoint
is not used here: on this CI class of machine (2 AVX2 cores, no bf16 instructions: vLLM
falls back from oneDNN to torch's bf16 linear) one prefill of ~1,050 tokens through its 28
layers, twice (services and reference), plus its 24-block ViT on 4,096 patches, is many
minutes of compute, and it holds 4.3 GB of weights per engine (docs/benchmarks.md,
"Real widths").

Peak memory per service (VmHWM of each service's process tree) is printed as
``PEAK_RSS {json}`` (run with ``-s`` to see it).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from qwenvl.cache.v1 import cache_service_pb2 as cpb
from qwenvl.cache.v1 import cache_service_pb2_grpc as cpb_grpc
from qwenvl.common.v1 import generation_pb2, tensor_pb2

from splitvl.client import build_request, generate
from tests.conftest import rgb
from vlcommon import tensors

ROOT = Path(__file__).resolve().parents[2]
SIDE = 1024  # 1,024x1,024 pixels -> 64x64 patches -> 1,024 merged tokens
MAX_TOKENS = 8
PROMPT = "Describe this image."


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from splitvl.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("wide") / "model", like="wide")


@pytest.fixture(scope="module")
def wide_cluster(wide_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from splitvl.launcher import Cluster, Ports

    c = Cluster(model=str(wide_model), ports=Ports.free(), log_dir=tmp_path_factory.mktemp("logs"))
    with c:
        yield c


def peak_rss_mib(pid: int) -> dict[str, float]:
    """VmHWM (resident high-water mark) of ``pid`` and each descendant, MiB, by command."""
    import psutil

    out: dict[str, float] = {}
    proc = psutil.Process(pid)
    for p in [proc, *proc.children(recursive=True)]:
        try:
            status = Path(f"/proc/{p.pid}/status").read_text()
            name = " ".join(p.cmdline()[:3])[-60:]
        except (OSError, psutil.Error):
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                out[f"{p.pid} {name}"] = int(line.split()[1]) / 1024
    return out


def chat_prompt(model: Path) -> str:
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(model)
    content = [{"type": "image"}, {"type": "text", "text": PROMPT}]
    return str(
        proc.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
    )


def test_1024_token_image_at_2b_width_equals_vllm_fed_the_same_embeddings(
    wide_cluster, wide_model: Path, tmp_path: Path
) -> None:
    cluster = wide_cluster
    buf = io.BytesIO()
    rgb("astronaut.png").resize((SIDE, SIDE)).save(buf, format="PNG")
    image = buf.getvalue()

    def ask():
        request = build_request([image], PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
        return generate(cluster.ports.address("gateway"), request, timeout_s=600)

    first = ask()
    assert first.images[0]["tier"] == "miss"
    assert first.images[0]["grid"] == [1, 64, 64]
    assert first.images[0]["tokens"] == 1024
    assert len(first.token_ids) == MAX_TOKENS
    second = ask()
    assert second.images[0]["tier"] == "exact"
    assert second.token_ids == first.token_ids

    # The embeddings the decoder was fed, as the cache holds them (the repeat hit them).
    with grpc.insecure_channel(
        cluster.ports.address("cache"), options=[("grpc.max_receive_message_length", 64 << 20)]
    ) as channel:
        found = cpb_grpc.CacheServiceStub(channel).Lookup(
            cpb.LookupRequest(
                queries=[
                    cpb.LookupQuery(
                        key=first.images[0]["key"], grid=tensor_pb2.GridTHW(t=1, h=64, w=64)
                    )
                ],
                policy=generation_pb2.CACHE_POLICY_EXACT_ONLY,
                include_embeddings=True,
            ),
            timeout=60,
        )
    [result] = found.results
    assert result.tier == generation_pb2.CACHE_TIER_EXACT
    emb = result.embedding.embeddings
    # bf16 end to end: the encoder ran the checkpoint's dtype, nothing widened it to fp32.
    assert emb.dtype == tensor_pb2.DATA_TYPE_BF16
    assert list(emb.shape) == [1024, 8192]
    assert tensors.payload_nbytes(emb) == 16 * 1024 * 1024
    embeds = tensors.to_torch(emb)
    assert embeds.dtype == torch.bfloat16
    path = tmp_path / "embeds.pt"
    torch.save(embeds.clone(), path)

    jobs = [{"embeds": str(path), "grid": [1, 64, 64], "prompt": chat_prompt(wide_model)}]
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "vllm_embeds.py"),
            str(wide_model),
            str(MAX_TOKENS),
            json.dumps(jobs),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("TOKENS ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    [reference] = json.loads(lines[-1].removeprefix("TOKENS "))
    assert first.token_ids == reference

    # The decoder's engine ran bf16 (vLLM logs its model config once at start).
    decoder_log = (cluster.log_dir / "decoder.log").read_text()
    assert "dtype=torch.bfloat16" in decoder_log

    peaks = {name: peak_rss_mib(proc.pid) for name, proc in cluster.procs.items()}
    print("PEAK_RSS " + json.dumps(peaks))
