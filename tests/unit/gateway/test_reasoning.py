"""Thinking checkpoints without services: the reasoning splitter against vLLM's own
``--reasoning-parser qwen3`` (the oracle, imported from the venv), the OpenAI front's
answers with the parser on and off, and an earlier turn's ``reasoning_content`` on the way
in (the OpenAI front, the gateway's rules, the decoder's chat-template messages)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from pydantic import ValidationError
from qwenvl.common.v1 import generation_pb2
from qwenvl.decoder.v1 import decoder_service_pb2 as dpb
from qwenvl.gateway.v1 import gateway_service_pb2 as gpb

from gateway.openai_protocol import ChatCompletionRequest, to_generate_request
from gateway.openai_render import ChatCompletionRenderer
from gateway.pipeline import GenerateEvent
from gateway.reasoning import ReasoningDelta, ReasoningParser
from vlcommon.errors import ServiceError

#: Answers a Thinking model may give (its prompt ends with "<think>\n"): with and without
#: <think> and </think>, text after it, empty reasoning, markup lookalikes, a repeated
#: </think>, <think> in the answer, <tool_call> (an implicit end), a marker cut at the end,
#: special-token text, nothing.
OUTPUTS = [
    "The photo shows a cat.\n</think>\n\nA cat on a mat.",
    "<think>\nLet me look.\n</think>\n\nA cat.",
    "Still thinking about it, no end",
    "</think>\n\nNo reasoning at all.",
    "Only reasoning.</think>",
    "a < b and c > d</think>x</think>y <think> z",
    "Maybe <tool_call>{}</tool_call> then</think>after",
    "r <function=f> <parameter=p>1</parameter></function></think> ok",
    "Ends inside a marker </thi",
    "\n\n</think>\n\n",
    "<|im_end|>a</think>b<|vision_start|>",
    "",
]
Split = tuple[str | None, str | None] | None


@dataclass
class Oracle:
    """vLLM's serving-layer parser for ``--reasoning-parser qwen3`` on one checkpoint, used
    as ``vllm serve`` uses it (one parser per request)."""

    tokenizer: Any
    parser_cls: Any
    request: Any
    prompt_ids: list[int]

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """The non-streaming message's (reasoning, content)."""
        reasoning, content, _ = self.parser_cls(self.tokenizer, None).parse(text, self.request)
        return reasoning, content

    def reasoning_tokens(self, text: str, token_ids: list[int]) -> int:
        """The non-streaming usage's ``reasoning_tokens`` (vLLM parses the text with the
        output's token ids, then counts)."""
        parser = self.parser_cls(self.tokenizer, None)
        parser.parse(text, self.request, model_output_token_ids=token_ids)
        return int(parser.count_reasoning_tokens(token_ids))

    def stream_reasoning_tokens(
        self, deltas: Sequence[tuple[str, Sequence[int]]], token_ids: list[int]
    ) -> int:
        """The streaming usage's ``reasoning_tokens`` after ``deltas``."""
        parser = self.parser_cls(self.tokenizer, None)
        for i, (text, ids) in enumerate(deltas):
            parser.parse_delta(
                text,
                list(ids),
                self.request,
                prompt_token_ids=self.prompt_ids,
                finished=i == len(deltas) - 1,
            )
        return int(parser.count_reasoning_tokens(token_ids))

    def stream(self, deltas: Sequence[tuple[str, Sequence[int]]]) -> list[Split]:
        """Each step's delta (reasoning, content), None where vLLM sends no chunk."""
        parser = self.parser_cls(self.tokenizer, None)
        out: list[Split] = []
        for i, (text, ids) in enumerate(deltas):
            d = parser.parse_delta(
                text,
                list(ids),
                self.request,
                prompt_token_ids=self.prompt_ids,
                finished=i == len(deltas) - 1,
            )
            out.append(None if d is None else (d.reasoning, d.content))
        return out


def make_oracle(model_dir: Path) -> Oracle:
    """vLLM's qwen3 reasoning parser on the checkpoint's tokenizer, for a request whose
    prompt is the Thinking template's (ending with "<think>\\n")."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest as VllmRequest,
    )
    from vllm.parser import ParserManager
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(model_dir))
    cls = ParserManager.get_parser(reasoning_parser_name="qwen3", tokenizer=tokenizer)
    assert cls is not None and cls.reasoning_parser_cls.__name__ == "Qwen3ParserReasoningAdapter"
    messages = [{"role": "user", "content": "Explain."}]
    # vLLM's renderer lets the parser adjust the request (skip_special_tokens off).
    request = cls(tokenizer, None).adjust_request(VllmRequest(messages=messages, model="m"))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return Oracle(tokenizer, cls, request, ids)


@pytest.fixture(scope="module")
def oracle(thinking_model: Path) -> Oracle:
    return make_oracle(thinking_model)


@pytest.fixture(scope="module")
def parser(thinking_model: Path) -> ReasoningParser:
    return ReasoningParser.load("qwen3", thinking_model)


def ours(parser: ReasoningParser, deltas: Sequence[tuple[str, Sequence[int]]]) -> list[Split]:
    splitter = parser.splitter()
    out: list[Split] = []
    for i, (text, ids) in enumerate(deltas):
        d = splitter.feed(text, ids, finished=i == len(deltas) - 1)
        out.append(None if d is None else (d.reasoning, d.content))
    return out


def token_streams(tokenizer: Any, ids: list[int]) -> list[list[tuple[str, list[int]]]]:
    """The token ids cut in two at every position, and one token per step, each step's
    text as the detokenizer streams it (the text grows by its decoded suffix)."""

    def text(a: int, b: int) -> str:
        before, after = tokenizer.decode(ids[:a]), tokenizer.decode(ids[:b])
        assert after.startswith(before)
        return after[len(before) :]

    streams = [[(text(0, k), ids[:k]), (text(k, len(ids)), ids[k:])] for k in range(len(ids) + 1)]
    streams.append([(text(k, k + 1), ids[k : k + 1]) for k in range(len(ids))] or [("", [])])
    return streams


def text_streams(text: str) -> list[list[tuple[str, list[int]]]]:
    """The text cut in two at every character, and one character per step (no ids)."""
    streams = [[(text[:c], []), (text[c:], [])] for c in range(len(text) + 1)]
    streams.append([(ch, []) for ch in text] or [("", [])])
    return streams


def test_the_parser_reads_the_markers_and_special_tokens_vllm_sees(
    parser: ReasoningParser, oracle: Oracle
) -> None:
    vocab = oracle.tokenizer.get_vocab()
    names = {"THINK_START": "<think>", "THINK_END": "</think>"}
    names |= {"TOOL_START": "<tool_call>", "TOOL_END": "</tool_call>"}
    assert {vocab[text]: name for name, text in names.items()} == dict(parser.marker_ids)
    assert set(parser.special_tokens) == set(oracle.tokenizer.all_special_tokens)


def test_known_answers_split_as_vllm_documents_them(parser: ReasoningParser) -> None:
    """Values that would be wrong if the split were: nothing is stripped, no </think>
    means all reasoning, an empty reasoning is None, <think> is dropped while reasoning."""
    assert parser.split(OUTPUTS[0]) == ("The photo shows a cat.\n", "\n\nA cat on a mat.")
    assert parser.split(OUTPUTS[1]) == ("\nLet me look.\n", "\n\nA cat.")
    assert parser.split(OUTPUTS[2]) == (OUTPUTS[2], None)
    assert parser.split(OUTPUTS[3]) == (None, "\n\nNo reasoning at all.")
    assert parser.split(OUTPUTS[5]) == ("a < b and c > d", "xy <think> z")
    assert parser.split("") == (None, None)


@pytest.mark.parametrize("text", OUTPUTS)
def test_non_streaming_equals_vllm(text: str, parser: ReasoningParser, oracle: Oracle) -> None:
    assert parser.split(text) == oracle.parse(text)


@pytest.mark.parametrize("text", [t for t in OUTPUTS if "<|" not in t])
def test_streams_cut_at_every_token_equal_vllm(
    text: str, parser: ReasoningParser, oracle: Oracle
) -> None:
    """Token-id deltas (the pipeline's events carry them): </think> is its own token id,
    and a step may hold text before and after it. Special tokens are left out here: the
    decoder skips them before the text leaves it (vLLM turns that off and drops them in
    the parser instead), so the splitter never sees their text with their ids."""
    ids = oracle.tokenizer.encode(text, add_special_tokens=False)
    assert oracle.tokenizer.decode(ids) == text
    for deltas in token_streams(oracle.tokenizer, ids):
        assert ours(parser, deltas) == oracle.stream(deltas), deltas


@pytest.mark.parametrize("text", OUTPUTS)
def test_streams_cut_at_every_character_equal_vllm(
    text: str, parser: ReasoningParser, oracle: Oracle
) -> None:
    """Text deltas without ids (the markers are text then): every cut, including those
    inside "</think>", which the parser holds back until it knows."""
    for deltas in text_streams(text):
        assert ours(parser, deltas) == oracle.stream(deltas), deltas


def test_a_marker_spelled_with_ordinary_tokens_is_text_while_streaming(
    parser: ReasoningParser, oracle: Oracle
) -> None:
    """vLLM matches </think> by its token id in a stream and by its text in a whole
    answer: "</" "think" ">" from three ordinary tokens ends the reasoning only there."""
    tok = oracle.tokenizer
    ids = [*tok.encode("Hmm </", add_special_tokens=False)]
    ids += tok.encode("think", add_special_tokens=False)
    ids += tok.encode("> ok", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("</think>") not in ids
    text = tok.decode(ids)
    assert text == "Hmm </think> ok"
    for deltas in token_streams(tok, ids):
        expected = oracle.stream(deltas)
        assert ours(parser, deltas) == expected
        # All of it is reasoning in a stream.
        assert all(step is None or step[1] is None for step in expected)
        assert "".join(step[0] or "" for step in expected if step) == text
    assert parser.split(text) == oracle.parse(text) == ("Hmm ", " ok")


@pytest.mark.parametrize("text", OUTPUTS)
def test_reasoning_tokens_equal_vllms_count(
    text: str, parser: ReasoningParser, oracle: Oracle
) -> None:
    """``usage.completion_tokens_details.reasoning_tokens``: vLLM's count after a whole
    answer (non-streaming, parsed with its token ids) and after every stream cut, with and
    without the end-of-turn token vLLM's output ids end with."""
    tok = oracle.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    for generated in (ids, [*ids, tok.convert_tokens_to_ids("<|im_end|>")]):
        counts = {oracle.reasoning_tokens(text, generated)}
        for deltas in token_streams(tok, generated):
            counts.add(oracle.stream_reasoning_tokens(deltas, generated))
        assert counts == {parser.count_reasoning_tokens(generated)}, (text, generated)


def test_reasoning_tokens_known_values(parser: ReasoningParser, oracle: Oracle) -> None:
    """Values that would be wrong if the count were: the tokens before </think> and not
    it, <think> left out, all of an unended reasoning but the end-of-turn token, none
    when </think> comes first, and a </think> spelled with ordinary tokens is no end."""
    tok = oracle.tokenizer

    def ids(*parts: str) -> list[int]:
        return [i for p in parts for i in tok.encode(p, add_special_tokens=False)]

    end, start, eot = (tok.convert_tokens_to_ids(t) for t in ("</think>", "<think>", "<|im_end|>"))
    reasoning = ids("The photo shows a cat.\n")
    assert len(reasoning) > 3
    count = parser.count_reasoning_tokens
    assert count([*reasoning, end, *ids("\n\nA cat.")]) == len(reasoning)
    assert count([start, *reasoning, end, *ids("A cat.")]) == len(reasoning)
    assert count([*reasoning, eot]) == len(reasoning)
    assert count([end, *reasoning]) == 0
    spelled = ids("Hmm </", "think", "> ok")
    assert end not in spelled and count(spelled) == len(spelled)
    # A </tool_call> token inside the reasoning is no reasoning token (found by an
    # adversarial pass: vLLM counts its terminal as none).
    tool_end = tok.convert_tokens_to_ids("</tool_call>")
    assert count([*reasoning, tool_end, *reasoning]) == 2 * len(reasoning)
    assert count([*reasoning, tool_end, *reasoning]) == oracle.reasoning_tokens(
        tok.decode([*reasoning, tool_end, *reasoning]), [*reasoning, tool_end, *reasoning]
    )


def events(texts: Sequence[str], finish: int = 1) -> list[GenerateEvent]:
    out = [GenerateEvent(token_ids=[i], text=t) for i, t in enumerate(texts)]
    out[-1].finish_reason = finish
    return out


def test_the_answer_is_unchanged_with_the_parser_off(parser: ReasoningParser) -> None:
    off = ChatCompletionRenderer.new("m", include_usage=False)
    message = off.completion(events(["Think", "</think>", "Answer"]))["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Think</think>Answer"}
    on = ChatCompletionRenderer.new("m", include_usage=False, reasoning=parser)
    message = on.completion(events(["Think", "</think>", "Answer"]))["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "Answer",
        "reasoning": "Think",
        "reasoning_content": "Think",
    }
    message = on.completion(events(["Still thinking"]))["choices"][0]["message"]
    assert message["content"] is None and message["reasoning_content"] == "Still thinking"


def test_include_reasoning_false_and_the_usage_reasoning_tokens(parser: ReasoningParser) -> None:
    """vLLM's ``include_reasoning: false``: no reasoning in the message, a streamed step
    that only reasoned is no chunk; its tokens are still counted in the usage, which has
    no ``completion_tokens_details`` without a parser (the answers are unchanged then)."""
    end = next(i for i, name in parser.marker_ids.items() if name == "THINK_END")
    answer = [
        GenerateEvent(token_ids=[11, 12], text="Think"),
        GenerateEvent(token_ids=[end], text="</think>"),
        GenerateEvent(token_ids=[13], text="Answer", finish_reason=1),
    ]
    answer[-1].usage = generation_pb2.Usage(prompt_tokens=7, completion_tokens=4)
    on = ChatCompletionRenderer.new("m", False, parser, include_reasoning=True)
    off = ChatCompletionRenderer.new("m", False, parser, include_reasoning=False)
    shown, hidden = on.completion(answer), off.completion(answer)
    assert shown["choices"][0]["message"]["reasoning"] == "Think"
    assert hidden["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Answer",
        "reasoning": None,
        "reasoning_content": None,
    }
    usage = {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}
    assert (
        shown["usage"]
        == hidden["usage"]
        == usage | {"completion_tokens_details": {"reasoning_tokens": 2}}
    )
    assert ChatCompletionRenderer.new("m", False).completion(answer)["usage"] == usage
    assert off.visible(ReasoningDelta("r", None)) is None
    assert off.visible(ReasoningDelta("r", "c")) == ReasoningDelta(None, "c")
    # A step past the reasoning whose text is empty (a byte of a split character): vLLM
    # sends nothing for it when the reasoning is left out (found by an adversarial pass).
    assert off.visible(ReasoningDelta(None, "")) is None
    assert on.visible(ReasoningDelta(None, "")) == ReasoningDelta(None, "")
    assert on.visible(ReasoningDelta("r", None)) == ReasoningDelta("r", None)
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "include_reasoning": False}
    )
    assert body.include_reasoning is False
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "include_reasoning": "no"}
        )


def test_a_delta_names_what_it_carries() -> None:
    delta = ChatCompletionRenderer.delta
    assert delta(None) == {}
    assert delta(ReasoningDelta("r", None)) == {"reasoning": "r", "reasoning_content": "r"}
    assert delta(ReasoningDelta(None, "")) == {"content": ""}
    assert delta(ReasoningDelta("r", "c")) == {
        "content": "c",
        "reasoning": "r",
        "reasoning_content": "r",
    }


# -- an earlier turn's reasoning, on the way in ----------------------------------------------
def converted(*messages: dict[str, Any]) -> gpb.GenerateRequest:
    body = ChatCompletionRequest.model_validate({"messages": list(messages)})
    return to_generate_request(body, served=("m",)).request


def test_the_openai_front_passes_an_assistant_turns_reasoning_as_vllm_does() -> None:
    user = {"role": "user", "content": "Explain."}
    request = converted(user, {"role": "assistant", "content": "A.", "reasoning_content": "R"})
    assert request.messages[1].reasoning_content == "R"
    assert not request.messages[0].HasField("reasoning_content")
    # vLLM's name wins over the deprecated one when both are sent.
    both = {"role": "assistant", "content": "A.", "reasoning": "new", "reasoning_content": "old"}
    assert converted(user, both).messages[1].reasoning_content == "new"
    # An answer that only reasoned comes back with content null: no parts, its reasoning.
    only = converted(user, {"role": "assistant", "content": None, "reasoning_content": "R"})
    assert list(only.messages[1].parts) == [] and only.messages[1].reasoning_content == "R"
    # vLLM accepts it on other roles and drops it there (chat_utils: assistant only).
    dropped = converted({"role": "user", "content": "Hi", "reasoning_content": "R"})
    assert not dropped.messages[0].HasField("reasoning_content")
    # An empty string is a reasoning (the template's "is string"), not an absent one.
    empty = converted(user, {"role": "assistant", "content": "A.", "reasoning_content": ""})
    assert empty.messages[1].HasField("reasoning_content")


def test_the_openai_front_refuses_a_reasoning_that_is_not_text() -> None:
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "assistant", "content": "A", "reasoning_content": 5}]}
        )
    assert exc.value.errors()[0]["loc"] == ("messages", 0, "reasoning_content")
    with pytest.raises(ServiceError) as err:
        converted({"role": "assistant", "content": "A", "reasoning": "\ud800"})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.reason, err.value.metadata["field"]) == (
        "TEXT_NOT_UTF8",
        "messages[0].reasoning",
    )


@pytest.fixture(scope="module")
def request_parser(thinking_model: Path) -> Any:
    from gateway.fetch import UrlFetcher
    from gateway.request import RequestParser
    from gateway.settings import GatewaySettings
    from vlcommon.model_info import load_vision_spec
    from vlcommon.request_rules import forbidden_tokens

    settings = GatewaySettings(max_text_chars=20)
    return RequestParser(
        settings,
        load_vision_spec(thinking_model),
        forbidden_tokens(thinking_model),
        None,
        UrlFetcher(settings),
        UrlFetcher(settings, noun="videos"),
    )


def grpc_request(*messages: tuple[str, str | None, str | None]) -> gpb.GenerateRequest:
    """(role, text or None, reasoning_content or None) per message."""
    request = gpb.GenerateRequest()
    for role, text, reasoning in messages:
        message = request.messages.add(role=role)
        if text is not None:
            message.parts.add(text=text)
        if reasoning is not None:
            message.reasoning_content = reasoning
    return request


def refused(call: Any, *args: Any) -> ServiceError:
    with pytest.raises(ServiceError) as exc:
        call(*args)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return exc.value


def test_the_gateway_checks_reasoning_as_text_and_passes_it_to_the_decoder(
    request_parser: Any,
) -> None:
    from vlcommon.deadline import Deadline

    def parse(request: gpb.GenerateRequest) -> Any:
        return request_parser.parse(request, Deadline())

    ok = parse(grpc_request(("user", "Hi", None), ("assistant", None, "R"), ("user", "Hm", None)))
    assert ok.messages[1].reasoning_content == "R" and list(ok.messages[1].parts) == []
    err = refused(parse, grpc_request(("user", "Hi", "R")))
    assert (err.reason, err.metadata["field"]) == (
        "REASONING_CONTENT_NOT_ASSISTANT",
        "messages[0].reasoning_content",
    )
    err = refused(parse, grpc_request(("user", "Hi", None), ("assistant", "A", "x<|im_end|>")))
    assert (err.reason, err.metadata["field"]) == (
        "TEXT_CONTAINS_SPECIAL_TOKEN",
        "messages[1].reasoning_content",
    )
    # The reasoning counts in the request's characters (GATEWAY_MAX_TEXT_CHARS=20 here).
    err = refused(parse, grpc_request(("user", "Hi", None), ("assistant", "A", "r" * 18)))
    assert err.reason == "TEXT_TOO_LONG"
    # The OpenAI front names the field as the client sent it.
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "A", "reasoning": "<think>"},
            ]
        }
    )
    converted_ = to_generate_request(body, served=("m",))
    err = refused(parse, converted_.request)
    assert converted_.openai_param(err.metadata["field"]) == "messages[1].reasoning"


def test_the_decoder_hands_the_reasoning_to_the_template_as_vllm_does(
    thinking_model: Path,
) -> None:
    """Under ``reasoning_content`` and ``reasoning`` (vLLM's chat_utils sets both), refused
    on other roles with the gateway's words; the control-token check across parts (which
    compares the prompt with a blank-text rendering) keeps passing with a reasoning."""
    from transformers import AutoTokenizer

    from decoder_service.validation import (
        Limits,
        blank_texts,
        check_control_tokens,
        to_chat_messages,
    )
    from vlcommon.request_rules import forbidden_tokens

    limits = Limits(
        max_images=1, max_tokens_default=8, max_tokens_limit=16, max_text_chars=100,
        max_messages=4, max_parts=4,
    )  # fmt: skip
    forbidden = forbidden_tokens(thinking_model)
    request = dpb.GenerateRequest()
    request.messages.add(role="user").parts.add(text="Explain.")
    request.messages.add(role="assistant", reasoning_content="Because.").parts.add(text="A.")
    messages, _ = to_chat_messages(request, forbidden, limits)
    assert messages[1] == {
        "role": "assistant",
        "content": [{"type": "text", "text": "A."}],
        "reasoning": "Because.",
        "reasoning_content": "Because.",
    }
    tok = AutoTokenizer.from_pretrained(thinking_model)
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The assistant turn is the last after the query: its reasoning is rendered.
    assert "<|im_start|>assistant\n<think>\nBecause.\n</think>\n\nA.<|im_end|>" in prompt
    added = {i: t for t, i in tok.get_added_vocab().items()}

    def control(msgs: list[dict[str, Any]]) -> list[str]:
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return [added[i] for i in tok(text, add_special_tokens=False)["input_ids"] if i in added]

    assert control(messages).count("</think>") == 1
    check_control_tokens(control(messages), control(blank_texts(messages)), forbidden)

    wrong = dpb.GenerateRequest()
    wrong.messages.add(role="system", reasoning_content="R").parts.add(text="S")
    at_decoder = refused(to_chat_messages, wrong, forbidden, limits)
    assert (at_decoder.reason, at_decoder.metadata["field"]) == (
        "REASONING_CONTENT_NOT_ASSISTANT",
        "messages[0].reasoning_content",
    )
    assert at_decoder.message == (
        "messages[0].reasoning_content is set on a 'system' message; only assistant "
        "messages carry the reasoning of an earlier turn"
    )


def test_an_unknown_parser_is_refused_at_start() -> None:
    from gateway.settings import GatewaySettings

    assert GatewaySettings(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    assert GatewaySettings().reasoning_parser == ""
    with pytest.raises(ValidationError, match="'deepseek_r1' is not a reasoning parser"):
        GatewaySettings(reasoning_parser="deepseek_r1")
    with pytest.raises(ValueError, match="splitvl serves qwen3"):
        ReasoningParser.load("deepseek_r1", ".")


def test_up_passes_the_parser_to_the_gateway(thinking_model: Path, tmp_path: Path) -> None:
    """``splitvl up --reasoning-parser qwen3`` reaches the gateway's command line (its
    GATEWAY_REASONING_PARSER); without it the gateway gets no flag (its environment
    decides, off by default)."""
    from splitvl import cli
    from splitvl.home import cluster_from_args
    from splitvl.launcher import Cluster, Ports

    base = next(b for b in range(47100, 48000, 4) if all(_free(b + k) for k in range(4)))
    up = ["up", "--model", str(thinking_model), "--log-dir", str(tmp_path)]
    up += ["--base-port", str(base), "--metrics-base-port", "0", "--http-port", "0"]
    args = cli.build_parser().parse_args([*up, "--reasoning-parser", "qwen3"])
    gateway = cluster_from_args(args)._command("gateway")
    assert gateway[gateway.index("--reasoning-parser") + 1] == "qwen3"
    plain = Cluster(model=str(thinking_model), ports=Ports.free(), log_dir=tmp_path)
    assert "--reasoning-parser" not in plain._command("gateway")
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([*up, "--reasoning-parser", "deepseek_r1"])


def _free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
