"""Thinking checkpoints end to end: the four services on the ``--like thinking`` checkpoint
(the tiny one with a Qwen3-VL-Thinking chat template) with the gateway's reasoning parser
on (``splitvl up --reasoning-parser qwen3``), through the official ``openai`` client and the
gRPC front.

- The OpenAI front's ``reasoning_content`` (and ``reasoning``) and ``content``, streaming
  and not, equal what vLLM's own ``--reasoning-parser qwen3`` makes of the gRPC front's raw
  text for the same greedy request (the gRPC front keeps the raw text).
- The prompt the decoder renders ends with ``<think>\\n`` (the Thinking template's
  generation prompt): the services' tokens and prompt length equal transformers' on it.
- A later turn that sends the answer back with its ``reasoning_content`` gets the tokens
  transformers' monolithic model gives on the template's rendering of the same
  conversation: after a new user turn (the template drops the earlier reasoning), and as
  the last turn (the template renders it), by both fronts.

The model has random weights and rarely writes ``</think>``; "Explain." was found by
searching prompts with transformers: its greedy answer holds ``</think>`` as its 6th token,
so the split runs end to end (reasoning before it, content after). The photo's answer has
none: all of it is reasoning, its content null.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch
from qwenvl.gateway.v1 import gateway_service_pb2 as gpb
from qwenvl.gateway.v1 import gateway_service_pb2_grpc as gpb_grpc

from splitvl.launcher import Cluster
from splitvl.ports import Ports
from tests.conftest import photo, rgb
from tests.unit.gateway.test_reasoning import Oracle, make_oracle

pytestmark = pytest.mark.e2e
MAX_TOKENS = 16
END_PROMPT = "Explain."  # its greedy answer holds </think> (token 6 of 16)
PHOTO = "astronaut.png"

#: A conversation: (role, text or None, reasoning_content or None, photo or None).
Turn = tuple[str, str | None, str | None, str | None]


@pytest.fixture(scope="module")
def thinking_cluster(
    thinking_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    cluster = Cluster(
        model=str(thinking_model),
        ports=Ports.free(),
        log_dir=tmp_path_factory.mktemp("thinking-logs"),
        reasoning_parser="qwen3",
    )
    with cluster:
        yield cluster


@pytest.fixture(scope="module")
def oracle(thinking_model: Path) -> Oracle:
    return make_oracle(thinking_model)


@pytest.fixture(scope="module")
def reference(thinking_model: Path) -> tuple[Any, Any]:
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    proc = AutoProcessor.from_pretrained(thinking_model)
    model = Qwen3VLForConditionalGeneration.from_pretrained(thinking_model, dtype=torch.float32)
    return model, proc


def template_messages(turns: list[Turn]) -> list[dict[str, Any]]:
    """The conversation as chat-template messages (what transformers renders)."""
    out: list[dict[str, Any]] = []
    for role, text, reasoning, image in turns:
        content: list[dict[str, Any]] = [{"type": "image"}] if image else []
        content += [{"type": "text", "text": text}] if text is not None else []
        message: dict[str, Any] = {"role": role, "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        out.append(message)
    return out


def transformers_greedy(reference: tuple[Any, Any], turns: list[Turn]) -> tuple[str, list[int]]:
    """The rendered prompt and the monolithic model's greedy tokens (eos ignored)."""
    model, proc = reference
    prompt = proc.apply_chat_template(
        template_messages(turns), add_generation_prompt=True, tokenize=False
    )
    images = [rgb(image) for *_, image in turns if image]
    inputs = proc(text=[prompt], images=images or None, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(
            **inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False
        )
    return prompt, out[0, inputs["input_ids"].shape[1] :].tolist()


def prompt_length(reference: tuple[Any, Any], turns: list[Turn]) -> int:
    model, proc = reference
    prompt = proc.apply_chat_template(
        template_messages(turns), add_generation_prompt=True, tokenize=False
    )
    images = [rgb(image) for *_, image in turns if image]
    return len(proc(text=[prompt], images=images or None)["input_ids"][0])


def grpc_chunks(cluster: Cluster, turns: list[Turn]) -> list[gpb.GenerateResponse]:
    """The gRPC front's stream for the conversation, greedy, eos ignored."""
    request = gpb.GenerateRequest()
    for role, text, reasoning, image in turns:
        message = request.messages.add(role=role)
        if image:
            message.parts.add(image=gpb.ImageInput(data=photo(image)))
        if text is not None:
            message.parts.add(text=text)
        if reasoning is not None:
            message.reasoning_content = reasoning
    request.sampling.temperature = 0.0
    request.sampling.ignore_eos = True
    request.sampling.max_tokens = MAX_TOKENS
    with grpc.insecure_channel(cluster.ports.address("gateway")) as channel:
        return list(gpb_grpc.GatewayServiceStub(channel).Generate(request, timeout=300))


def openai_messages(turns: list[Turn]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for role, text, reasoning, image in turns:
        message: dict[str, Any] = {"role": role}
        if image:
            url = "data:image/png;base64," + base64.b64encode(photo(image)).decode()
            message["content"] = [{"type": "image_url", "image_url": {"url": url}}]
            message["content"] += [{"type": "text", "text": text}] if text is not None else []
        else:
            message["content"] = text
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        out.append(message)
    return out


def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{cluster.ports.http}/v1", api_key="none", max_retries=0
    )


def openai_answer(cluster: Cluster, turns: list[Turn]) -> tuple[str | None, str | None]:
    """The non-streaming answer's (reasoning_content, content); ``reasoning`` (vLLM's
    field) carries the same."""
    out = client(cluster).chat.completions.create(
        model=cluster.model,
        messages=openai_messages(turns),  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    message = out.choices[0].message
    extra = message.model_extra or {}
    assert extra["reasoning"] == extra["reasoning_content"]
    return extra["reasoning_content"], message.content


def openai_stream(cluster: Cluster, turns: list[Turn]) -> tuple[str, str, list[dict[str, Any]]]:
    """The streamed answer's reasoning and content, joined, and every chunk's delta."""
    stream = client(cluster).chat.completions.create(
        model=cluster.model,
        messages=openai_messages(turns),  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    deltas = [chunk.choices[0].delta.model_dump(exclude_none=True) for chunk in stream]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert reasoning == "".join(d.get("reasoning", "") for d in deltas)
    return reasoning, "".join(d.get("content", "") for d in deltas), deltas


def vllm_split(oracle: Oracle, chunks: list[gpb.GenerateResponse]) -> dict[str, Any]:
    """What vLLM's parser makes of the gRPC front's raw text: the whole answer, and the
    stream (its steps as the gRPC front streamed them), joined."""
    raw = "".join(c.text for c in chunks)
    steps = [(c.text, list(c.token_ids)) for c in chunks if c.token_ids or c.text]
    streamed = [s for s in oracle.stream(steps) if s is not None]
    return {
        "raw": raw,
        "whole": oracle.parse(raw),
        "streamed": (
            "".join(r or "" for r, _ in streamed),
            "".join(c or "" for _, c in streamed),
        ),
    }


def test_the_openai_front_splits_as_vllm_does_the_grpc_text(
    thinking_cluster: Cluster, oracle: Oracle, reference: tuple[Any, Any], thinking_model: Path
) -> None:
    from transformers import AutoTokenizer

    from decoder_service.engine import DecoderEngine

    splits = []
    for turns in (
        [("user", END_PROMPT, None, None)],
        [("user", "Describe this image.", None, PHOTO)],
    ):
        chunks = grpc_chunks(thinking_cluster, turns)
        expected = vllm_split(oracle, chunks)
        splits.append(expected["whole"])
        # The decoder's own rendering of these messages ends inside <think>; the services'
        # tokens and prompt length are transformers' on that prompt.
        engine = DecoderEngine(None)
        engine.tokenizer = AutoTokenizer.from_pretrained(thinking_model)
        rendered = engine.render(template_messages(turns))
        assert rendered.endswith("<|im_start|>assistant\n<think>\n")
        prompt, tokens = transformers_greedy(reference, turns)
        assert rendered == prompt
        assert [t for c in chunks for t in c.token_ids] == tokens
        assert chunks[-1].usage.prompt_tokens == prompt_length(reference, turns)

        assert openai_answer(thinking_cluster, turns) == expected["whole"]
        reasoning, content, deltas = openai_stream(thinking_cluster, turns)
        assert (reasoning, content) == expected["streamed"]
        assert deltas[0] == {"role": "assistant", "content": ""}
    # The split ran: "Explain." reasoned, closed with </think> and answered; the photo's
    # answer never closed its reasoning.
    (reasoning, content), (photo_reasoning, photo_content) = splits
    assert reasoning and content and photo_reasoning and photo_content is None


def test_a_later_turn_with_the_earlier_reasoning_gets_the_monolithic_tokens(
    thinking_cluster: Cluster, oracle: Oracle, reference: tuple[Any, Any]
) -> None:
    """Turn 1's answer goes back as the assistant's content and ``reasoning_content``."""
    for first in ([("user", END_PROMPT, None, None)], [("user", "Describe.", None, PHOTO)]):
        reasoning, content = openai_answer(thinking_cluster, first)
        assert reasoning  # the photo's answer is all reasoning: content None
        answer: Turn = ("assistant", content, reasoning, None)
        for turns in ([*first, answer, ("user", "Why?", None, None)], [*first, answer]):
            prompt, tokens = transformers_greedy(reference, turns)
            block = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n"
            # A turn before the last user query loses its reasoning; the last one shows it.
            assert (block in prompt) == (turns[-1][0] == "assistant")
            chunks = grpc_chunks(thinking_cluster, turns)
            assert [t for c in chunks for t in c.token_ids] == tokens, turns
            assert chunks[-1].usage.prompt_tokens == prompt_length(reference, turns)
            assert openai_answer(thinking_cluster, turns) == vllm_split(oracle, chunks)["whole"]


def test_reasoning_tokens_and_include_reasoning_false_as_vllm(
    thinking_cluster: Cluster, oracle: Oracle
) -> None:
    """``usage.completion_tokens_details.reasoning_tokens`` is vLLM's count over the
    answer's token ids (streaming and not); ``include_reasoning: false`` leaves the
    reasoning out (no chunk that only reasoned) and keeps the content and the count."""
    turns: list[Turn] = [("user", END_PROMPT, None, None)]
    chunks = grpc_chunks(thinking_cluster, turns)
    raw = "".join(c.text for c in chunks)
    ids = [t for c in chunks for t in c.token_ids]
    expected = oracle.reasoning_tokens(raw, ids)
    assert 0 < expected < MAX_TOKENS  # </think> is the 6th token: 5 reasoned
    _, content = oracle.parse(raw)
    for include in (True, False):
        body = {"ignore_eos": True, "include_reasoning": include}
        kwargs: dict[str, Any] = {
            "model": thinking_cluster.model,
            "messages": openai_messages(turns),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "extra_body": body,
        }
        out = client(thinking_cluster).chat.completions.create(**kwargs)
        assert out.usage is not None and out.usage.completion_tokens_details is not None
        assert out.usage.completion_tokens_details.reasoning_tokens == expected
        extra = out.choices[0].message.model_extra or {}
        assert (extra["reasoning_content"] is None) == (not include)
        assert out.choices[0].message.content == content
        stream = client(thinking_cluster).chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
        got = list(stream)
        assert got[-1].usage is not None and got[-1].usage.completion_tokens_details is not None
        assert got[-1].usage.completion_tokens_details.reasoning_tokens == expected
        deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in got if c.choices]
        assert any("reasoning_content" in d for d in deltas) == include
        assert "".join(d.get("content", "") for d in deltas) == content


def test_bad_reasoning_input_names_the_field(thinking_cluster: Cluster) -> None:
    """A reasoning on a user turn over gRPC, a control token in it over HTTP: the status
    and the field, never INTERNAL."""
    with pytest.raises(grpc.RpcError) as exc:
        grpc_chunks(thinking_cluster, [("user", "Hi", "R", None)])
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[0].reasoning_content" in (exc.value.details() or "")
    with pytest.raises(openai.BadRequestError) as bad:
        openai_answer(
            thinking_cluster,
            [("user", "Hi", None, None), ("assistant", "A", "<|im_start|>", None)],
        )
    body = bad.value.body if isinstance(bad.value.body, dict) else {}
    error = body.get("error", body)  # the client may hand the error object itself
    assert error.get("param") == "messages[1].reasoning_content"
    assert error.get("code") == "TEXT_CONTAINS_SPECIAL_TOKEN"
