"""MoE checkpoints (Qwen3-VL-30B-A3B's family): a tiny random-weight
``Qwen3VLMoeForConditionalGeneration`` built here (``make-tiny-model --like moe``), its
vision tower in the encoder, its experts in vLLM (the CPU backend's MoE kernels), and
greedy tokens equal to transformers' monolithic model on photos and a video."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from splitvl.client import build_request, generate
from splitvl.launcher import Cluster
from splitvl.ports import Ports
from splitvl.tiny_model import MOE_TEXT, make_tiny_model
from tests.conftest import photo, rgb
from tests.e2e.test_video_e2e import PROMPT as VIDEO_PROMPT
from tests.e2e.test_video_e2e import chat

PROMPT = "Describe the image."
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("moe") / "model", like="moe")


def test_the_moe_checkpoint_is_qwen3_vl_moe_and_deterministic(
    moe_model: Path, tmp_path: Path
) -> None:
    import json

    config = json.loads((moe_model / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl_moe"
    assert config["architectures"] == ["Qwen3VLMoeForConditionalGeneration"]
    from transformers import AutoConfig

    # Read as vLLM reads it (transformers writes num_experts as num_local_experts).
    text = AutoConfig.from_pretrained(moe_model).text_config
    assert {k: getattr(text, k) for k in MOE_TEXT} == MOE_TEXT
    # The experts in the published checkpoints' layout (what vLLM reads), which
    # transformers transposes on load.
    from safetensors.torch import load_file
    from transformers import Qwen3VLMoeForConditionalGeneration

    stored = load_file(moe_model / "model.safetensors")
    name = "model.language_model.layers.0.mlp.experts."
    hidden, inter, experts = 128, MOE_TEXT["moe_intermediate_size"], MOE_TEXT["num_experts"]
    assert stored[name + "gate_up_proj"].shape == (experts, hidden, 2 * inter)
    assert stored[name + "down_proj"].shape == (experts, inter, hidden)
    loaded = dict(Qwen3VLMoeForConditionalGeneration.from_pretrained(moe_model).named_parameters())
    for part in ("gate_up_proj", "down_proj"):
        assert torch.equal(loaded[name + part], stored[name + part].transpose(1, 2))
    again = make_tiny_model(tmp_path / "again", like="moe")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (again / name).read_bytes() == (moe_model / name).read_bytes(), name


def test_the_encoder_loads_the_moe_vision_tower(moe_model: Path) -> None:
    """The encoder's tower (only ``model.visual.*`` read) equals the full model's."""
    import numpy as np
    from transformers import Qwen3VLMoeForConditionalGeneration

    from encoder_service.engine import VisionEngine
    from vlcommon.imaging import plan_resize

    engine = VisionEngine.load(str(moe_model), device="cpu", dtype="float32")
    assert type(engine.visual).__name__ == "Qwen3VLMoeVisionModel"
    pixels = np.asarray(rgb("astronaut.png"))
    plan = plan_resize(pixels.shape[0], pixels.shape[1], engine.spec, index=0)
    prepared = engine.preprocess(pixels, plan)
    [ours] = engine.encode([prepared])
    full = Qwen3VLMoeForConditionalGeneration.from_pretrained(moe_model, dtype=torch.float32)
    grid = torch.tensor([prepared.grid])
    with torch.inference_mode():
        out = full.model.visual(prepared.pixel_values, grid_thw=grid)
    theirs = torch.cat([out.pooler_output, *out.deepstack_features], dim=1)
    assert ours.shape == theirs.shape == (plan.tokens, 128 * 3)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_no_token_sits_near_a_routing_tie(moe_model: Path) -> None:
    """On the photos the equality test uses, every token's last chosen expert beats the
    first one left out by far more than float32 noise, relative to the spread of its
    router logits (transformers' loop and vLLM's fused CPU kernels add the same numbers in
    another order: ~1e-6 relative). A token near a tie could be routed differently by two
    correct implementations, and greedy equality would be a coin toss. Measured: 2.5e-4
    over 698 router calls; the scaled router once planned does not move this ratio (margin
    and noise scale alike)."""
    from transformers import AutoProcessor, Qwen3VLMoeForConditionalGeneration

    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(moe_model, dtype=torch.float32)
    proc = AutoProcessor.from_pretrained(moe_model)
    k = MOE_TEXT["num_experts_per_tok"]
    margins: list[torch.Tensor] = []

    def record(module, args, output):  # type: ignore[no-untyped-def]
        hidden = args[0].reshape(-1, args[0].shape[-1])
        logits = torch.nn.functional.linear(hidden, module.weight)
        top = logits.topk(k + 1, dim=-1).values
        margins.append((top[:, k - 1] - top[:, k]) / logits.std(dim=-1))

    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    assert len(gates) == model.config.text_config.num_hidden_layers
    hooks = [g.register_forward_hook(record) for g in gates]
    try:
        for names in (["astronaut.png"], ["chelsea.png"], ["astronaut.png", "chelsea.png"]):
            inputs = proc(
                text=[chat(moe_model, ["image"] * len(names), PROMPT)],
                images=[rgb(n) for n in names],
                return_tensors="pt",
            )
            with torch.inference_mode():
                model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    finally:
        for hook in hooks:
            hook.remove()
    smallest = float(torch.cat(margins).min())
    assert smallest > 1e-5, smallest


@pytest.fixture(scope="module")
def moe_cluster(moe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(
        model=str(moe_model), ports=Ports.free(), log_dir=tmp_path_factory.mktemp("moe-logs")
    )
    with cluster:
        yield cluster


@pytest.mark.e2e
def test_moe_services_equal_transformers_on_photos_and_a_video(
    moe_cluster: Cluster, moe_model: Path
) -> None:
    """Greedy float32, eos ignored: transformers' Qwen3VLMoeForConditionalGeneration on the
    raw photos, and on a clip's sampled frames, against the four services (the encoder's
    MoE vision tower, vLLM's MoE language model on the embeddings)."""
    from transformers import AutoProcessor, Qwen3VLMoeForConditionalGeneration
    from transformers.video_utils import VideoMetadata

    from splitvl.video_clips import pan_clip
    from tests.e2e.test_video_e2e import sampled, video_part

    proc = AutoProcessor.from_pretrained(moe_model)
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(moe_model, dtype=torch.float32)
    kw = {"max_new_tokens": MAX_TOKENS, "min_new_tokens": MAX_TOKENS, "do_sample": False}
    jobs = [["astronaut.png"], ["chelsea.png"], ["astronaut.png", "chelsea.png"]]
    hf = []
    for job in jobs:
        inputs = proc(
            text=[chat(moe_model, ["image"] * len(job), PROMPT)],
            images=[rgb(n) for n in job],
            return_tensors="pt",
        )
        with torch.inference_mode():
            out = model.generate(**inputs, **kw)
        hf.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    clip = pan_clip("astronaut.png", seconds=3.0, fps=10, size=(96, 128))
    video = sampled(moe_model, clip)
    inputs = proc(
        text=[chat(moe_model, ["video"])],
        videos=[torch.from_numpy(video.frames).permute(0, 3, 1, 2)],
        video_metadata=[
            VideoMetadata(
                total_num_frames=video.sampling.source_frames,
                fps=video.sampling.video_fps,
                frames_indices=list(video.sampling.indices),
            )
        ],
        do_sample_frames=False,
        do_resize=False,
        return_tensors="pt",
    )
    with torch.inference_mode():
        out = model.generate(**inputs, **kw)
    hf_video = out[0, inputs["input_ids"].shape[1] :].tolist()
    del model

    address = moe_cluster.ports.address("gateway")
    ours = [
        generate(
            address,
            build_request([photo(n) for n in job], PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True),
            timeout_s=300,
        ).token_ids
        for job in jobs
    ]
    request = build_request(
        [video_part(clip)], VIDEO_PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True
    )
    ours_video = generate(address, request, timeout_s=300).token_ids
    assert all(len(t) == MAX_TOKENS for t in hf)
    assert len({tuple(t) for t in hf}) == 3  # the images decide the answers
    assert ours == hf
    assert ours_video == hf_video
