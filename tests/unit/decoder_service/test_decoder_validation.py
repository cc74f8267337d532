"""The decoder's request checks before anything is rendered (pure functions; the e2e
tests cover them through the running decoder)."""

from __future__ import annotations

import grpc
import pytest
from qwenvl.decoder.v1 import decoder_service_pb2 as pb

from decoder_service.validation import Limits, to_chat_messages
from vlcommon.errors import ServiceError

LIMITS = Limits(
    max_images=2, max_tokens_default=8, max_tokens_limit=16, max_text_chars=1000,
    max_messages=4, max_parts=6,
)  # fmt: skip


def request(messages: int, parts_each: int) -> pb.GenerateRequest:
    r = pb.GenerateRequest()
    for _ in range(messages):
        m = r.messages.add(role="user")
        for _ in range(parts_each):
            m.parts.add(text="x")
    return r


def refusal(r: pb.GenerateRequest) -> ServiceError:
    with pytest.raises(ServiceError) as exc:
        to_chat_messages(r, (), LIMITS)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return exc.value


def test_messages_and_parts_are_bounded_before_rendering() -> None:
    """600,000 empty messages (4.8 MB) held the decoder's event loop for 28 s while the chat
    template rendered them; the counts are now bounded like the gateway's."""
    messages, _ = to_chat_messages(request(4, 1), (), LIMITS)
    assert len(messages) == 4
    to_chat_messages(request(2, 3), (), LIMITS)  # 6 parts: at the limit
    err = refusal(request(5, 1))
    assert (err.reason, err.metadata) == ("TOO_MANY_MESSAGES", {"field": "messages", "limit": "4"})
    assert err.message == "messages has 5 entries; the limit is 4"
    err = refusal(request(1, 7))
    assert (err.reason, err.metadata) == ("TOO_MANY_PARTS", {"field": "messages", "limit": "6"})
    assert err.message == "messages hold 7 parts; the limit is 6"


def test_a_message_without_parts_is_refused_as_the_gateway_does() -> None:
    r = request(2, 1)
    r.messages.add(role="user")
    err = refusal(r)
    assert (err.reason, err.metadata["field"]) == ("PARTS_EMPTY", "messages[2].parts")
