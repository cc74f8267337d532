"""A continued answer's text and checks (decoder_service.continuation), on the tiny
checkpoint's byte-level BPE tokenizer: what the client gets over two replicas must be what
one replica would have sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from qwenvl.decoder.v1 import decoder_service_pb2 as pb

from decoder_service.continuation import ContinuedText, check_continuation
from vlcommon.errors import ServiceError

PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _first_replica(tokenizer: Any, prompt: list[int], answer: list[int], hold: int) -> str:
    """The text one replica streamed for ``answer``: vLLM's detokeniser (DecodeStream
    primed with the prompt), holding back the last ``hold`` characters as vLLM does for
    stop strings."""
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(ids=prompt, skip_special_tokens=True)
    text = "".join(p for t in answer if (p := stream.step(tokenizer._tokenizer, t)))
    return text[: len(text) - hold] if hold else text


def test_a_character_split_between_replicas_is_sent_once_whole(tokenizer: Any) -> None:
    prompt = _ids(tokenizer, PROMPT)
    answer = _ids(tokenizer, "héllo 😀 wörld")
    whole = tokenizer.decode(answer, skip_special_tokens=True)
    assert whole == "héllo 😀 wörld"
    # Each cut inside the emoji's four byte tokens (and everywhere else).
    for k in range(1, len(answer)):
        sent = _first_replica(tokenizer, prompt, answer[:k], hold=0)
        text = ContinuedText(tokenizer, prompt, answer[:k], len(sent))
        piece, stopped = text.step(answer[k:], finished=True)
        assert (sent + piece, stopped) == (whole, False), k
        assert (sent + piece).count("😀") == 1


def test_text_held_back_by_the_first_replica_comes_first(tokenizer: Any) -> None:
    prompt = _ids(tokenizer, PROMPT)
    answer = _ids(tokenizer, "The end of it all")
    k = len(answer) // 2
    sent = _first_replica(tokenizer, prompt, answer[:k], hold=3)
    text = ContinuedText(tokenizer, prompt, answer[:k], len(sent), stop=["XYZW"])
    got = sent
    for t in answer[k:-1]:
        piece, stopped = text.step([t], finished=False)
        assert not stopped
        got += piece
    # Until the answer ends, the last 3 characters (a 4-character stop string's possible
    # start) are held back, as vLLM holds them.
    assert got == "The end of it all"[: len(tokenizer.decode(answer[:-1])) - 3]
    piece, stopped = text.step(answer[-1:], finished=True)
    assert (got + piece, stopped) == ("The end of it all", False)


def test_a_stop_string_across_the_boundary_ends_the_answer(tokenizer: Any) -> None:
    prompt = _ids(tokenizer, PROMPT)
    answer = _ids(tokenizer, "Go on STOP here")
    st = answer.index(_ids(tokenizer, "Go on ST")[-1])  # "ST" is the first replica's last
    sent = _first_replica(tokenizer, prompt, answer[: st + 1], hold=3)  # held: "ST" and before
    assert "ST" not in sent
    text = ContinuedText(tokenizer, prompt, answer[: st + 1], len(sent), stop=["STOP"])
    piece, stopped = text.step(answer[st + 1 :], finished=False)
    assert stopped
    assert sent + piece == "Go on "  # the stop string and what follows never sent


def test_text_chars_beyond_the_tokens_text_is_refused(tokenizer: Any) -> None:
    prompt = _ids(tokenizer, PROMPT)
    answer = _ids(tokenizer, "abc")
    with pytest.raises(ServiceError) as err:
        ContinuedText(tokenizer, prompt, answer, 4)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.reason, err.value.metadata["field"]) == (
        "CONTINUATION_INVALID",
        "continuation.text_chars",
    )


@pytest.mark.parametrize(
    ("ids", "max_tokens", "field"),
    [
        ([], 10, "continuation.token_ids"),
        ([1, 2, 3], 3, "continuation.token_ids"),
        ([1, 5000, 3], 10, "continuation.token_ids[1]"),
        ([1, -1], 10, "continuation.token_ids[1]"),
        ([7, 2012], 10, "continuation.token_ids[1]"),  # <|image_pad|>, images carried
    ],
)
def test_bad_continuations_are_refused_naming_the_field(
    ids: list[int], max_tokens: int, field: str
) -> None:
    request = pb.GenerateRequest()
    request.continuation.token_ids.extend(ids)
    request.continuation.SetInParent()
    with pytest.raises(ServiceError) as err:
        check_continuation(request, max_tokens, 2026, frozenset({2009, 2010, 2012, 2013}))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.reason, err.value.metadata["field"]) == ("CONTINUATION_INVALID", field)


def test_no_continuation_is_a_new_answer() -> None:
    assert check_continuation(pb.GenerateRequest(), 10, 2026, frozenset()) == []
    request = pb.GenerateRequest()
    request.continuation.token_ids.extend([1, 2])
    assert check_continuation(request, 3, 2026, frozenset()) == [1, 2]
    # The model's own <|video_pad|> in an answer about an image: text, not a placeholder.
    request.continuation.token_ids.append(2013)
    assert check_continuation(request, 10, 2026, frozenset({2012})) == [1, 2, 2013]
