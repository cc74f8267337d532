"""Multi-turn conversations with images, as clients send them: every turn re-sends the
whole history, earlier images included (the gRPC ``messages`` with roles, the OpenAI
``messages`` with earlier ``image_url`` parts and the assistant's answers as text).

Against the monolithic model (transformers' ``generate`` on the raw images and the same
history, greedy, float32): each turn's tokens through the gRPC front; the OpenAI front's
text equal to the gRPC front's for the same history; the earlier images served from the
cache (exact hits); and vLLM's prefix cache reusing the conversation so far (the decoder's
prefix-cache hit tokens grow by at least one block on turns 2 and 3).
"""

from __future__ import annotations

import base64
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from qwenvl.gateway.v1 import gateway_service_pb2 as gpb

from splitvl.client import generate
from tests.conftest import photo, rgb

pytestmark = pytest.mark.e2e
MAX_TOKENS = 8
#: (image or None, the user's text) per turn: images in turns 1 and 2.
TURNS = [
    ("astronaut.png", "Describe this image."),
    ("coffee.png", "And this one?"),
    (None, "Which of the two is brighter?"),
]
PREFIX_HITS = "splitvl_decoder_engine_prefix_cache_hit_tokens_total"

Part = tuple[str, str]  # ("image", file name) or ("text", text)


def _prefix_hits(cluster: Any) -> float:
    url = f"http://127.0.0.1:{cluster.ports.metrics['decoder']}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == PREFIX_HITS
    )


def _grpc_request(history: list[tuple[str, list[Part]]]) -> gpb.GenerateRequest:
    request = gpb.GenerateRequest()
    for role, parts in history:
        message = request.messages.add(role=role)
        for kind, value in parts:
            if kind == "image":
                message.parts.add(image=gpb.ImageInput(data=photo(value)))
            else:
                message.parts.add(text=value)
    request.sampling.temperature = 0.0
    request.sampling.ignore_eos = True
    request.sampling.max_tokens = MAX_TOKENS
    return request


def _openai_messages(history: list[tuple[str, list[Part]]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for role, parts in history:
        if role == "assistant":
            out.append({"role": role, "content": parts[0][1]})
            continue
        content = []
        for kind, value in parts:
            if kind == "image":
                url = "data:image/png;base64," + base64.b64encode(photo(value)).decode()
                content.append({"type": "image_url", "image_url": {"url": url}})
            else:
                content.append({"type": "text", "text": value})
        out.append({"role": role, "content": content})
    return out


def _reference(model: Any, proc: Any, history: list[tuple[str, list[Part]]]) -> list[int]:
    """transformers' greedy tokens for the conversation so far."""
    messages = [
        {
            "role": role,
            "content": [
                {"type": "image"} if kind == "image" else {"type": "text", "text": value}
                for kind, value in parts
            ],
        }
        for role, parts in history
    ]
    prompt = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = [rgb(value) for _, parts in history for kind, value in parts if kind == "image"]
    inputs = proc(text=[prompt], images=images, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(
            **inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False
        )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_three_turns_with_images_match_the_monolithic_model_on_both_fronts(
    cluster: Any, tiny_model: Path
) -> None:
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    proc = AutoProcessor.from_pretrained(tiny_model)
    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_model, dtype=torch.float32)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{cluster.ports.http}/v1", api_key="none", max_retries=0
    )
    history: list[tuple[str, list[Part]]] = []
    reused: list[float] = []
    for turn, (image, text) in enumerate(TURNS, 1):
        history.append(("user", ([("image", image)] if image else []) + [("text", text)]))
        before = _prefix_hits(cluster)
        result = generate(cluster.ports.address("gateway"), _grpc_request(history), timeout_s=120)
        deadline = time.monotonic() + 10  # the engine's stats reach the metric each step
        while (hits := _prefix_hits(cluster) - before) <= 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        reused.append(hits)

        assert result.token_ids == _reference(model, proc, history), f"turn {turn}"
        # Every image of an earlier turn comes back from the cache (the other tests may
        # have cached these photos already, so a new one may be an exact hit too).
        tiers = [im["tier"] for im in result.images]
        earlier = {1: 0, 2: 1, 3: 2}[turn]
        assert len(tiers) == min(turn, 2) and tiers[:earlier] == ["exact"] * earlier, tiers

        out = client.chat.completions.create(
            model=cluster.model,
            messages=_openai_messages(history),  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].message.content == result.text, f"turn {turn}"
        history.append(("assistant", [("text", result.text)]))
    # The decoder's block size on CPU is 32 tokens: turns 2 and 3 reuse at least one block
    # of the conversation they continue (turn 1's image alone is 64 tokens).
    assert reused[1] >= 32 and reused[2] >= 32, reused
