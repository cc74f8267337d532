"""Scheduling priority (gateway/priority.py): the caller's floor, short-first, aging, and
what the decoder is sent.

Unit level: the rules, a simulation of vLLM's waiting queue (ordered by ``(priority,
arrival)``, as ``vllm.v1.request.Request.__lt__``) that starves a long request under plain
class priorities and serves it within the aging bound under the gateway's aged ones, the
pipeline's decoder request with a fake decoder, and the OpenAI field. The engine honouring
the order is tests/e2e/test_priority_e2e.py.
"""

from __future__ import annotations

import heapq
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from pydantic import SecretStr
from qwenvl.decoder.v1 import decoder_service_pb2 as dpb
from qwenvl.encoder.v1 import encoder_service_pb2_grpc
from qwenvl.gateway.v1 import gateway_service_pb2 as gpb

from gateway.priority import (
    DEFAULT_MAX_TOKENS,
    EPOCH_S,
    PriorityRules,
    parse_grants,
    short_first_class,
)
from vlcommon.deadline import Deadline
from vlcommon.errors import ConfigError, ServiceError

T0 = EPOCH_S + 12_345_678.0  # some wall-clock time in 2026


def test_grants_parse_to_token_digests_and_bad_entries_do_not_echo_the_token() -> None:
    grants = parse_grants(" alpha=-10 , beta=5,, ")
    assert [floor for _, floor in grants] == [-10, 5]
    assert all(len(digest) == 32 for digest, _ in grants)  # SHA-256, never the token
    with pytest.raises(ValueError, match="entry 0: not TOKEN=FLOOR") as no_sep:
        parse_grants("s3cret-token")
    assert "s3cret" not in str(no_sep.value)
    with pytest.raises(ValueError, match="entry 1: the floor 'high' is not an integer"):
        parse_grants("a=1,s3cret=high")


def test_a_caller_is_raised_to_its_floor_and_a_grant_lowers_it() -> None:
    rules = PriorityRules(floor=0, grants=parse_grants("ops-token=-20,batch-token=3"))
    assert rules.asked(-5, None) == (0, True)
    assert rules.asked(-5, "someone-else") == (0, True)
    assert rules.asked(7, None) == (7, False)
    assert rules.asked(-5, "ops-token") == (-5, False)
    assert rules.asked(-30, "ops-token") == (-20, True)
    # A grant above the default floor does not raise anyone: the lower of the two holds.
    assert rules.floor_for("batch-token") == 0


def test_short_first_classes_order_by_expected_cost() -> None:
    short = short_first_class(16, 300)  # 16 + 37.5 -> log2 5.7
    long = short_first_class(512, 300)  # 512 + 37.5 -> log2 9.1
    assert (short, long) == (5, 9)
    assert short_first_class(0, 300) == short_first_class(DEFAULT_MAX_TOKENS, 300) == 8
    assert short_first_class(1, 0) == 0 and short_first_class(10**9, 10**9) == 24
    assert PriorityRules(policy="fcfs").default_class(16, 300) == 0
    assert PriorityRules(policy="short-first").default_class(16, 300) == 5


def test_aging_bounds_how_long_a_better_class_may_overtake() -> None:
    rules = PriorityRules(aging_s=2.0)
    long = rules.aged(9, T0)
    # Class 5 is 4 classes better: it goes first only if it arrived < 8 s after.
    assert rules.aged(5, T0 + 7.9) < long < rules.aged(5, T0 + 8.1)
    # Within a class: first come, first served, to the 10 ms tick.
    assert rules.aged(3, T0) < rules.aged(3, T0 + 0.02)
    assert rules.aged(-2, T0) < rules.aged(0, T0)


def _served_at(priority_of: Any, horizon_s: float = 120.0) -> float | None:
    """One server, 0.5 s per request; a short (class 5) arrives every 0.25 s (twice what
    it can serve) and one long (class 9) at t = 1 s. vLLM's waiting queue: a heap of
    (priority, arrival). Returns when the long one starts, None if it never does."""
    waiting: list[tuple[int, float, str]] = []
    t, next_short, long_sent = 0.0, 0.0, False
    while t < horizon_s:
        while next_short <= t:
            heapq.heappush(waiting, (priority_of(5, next_short), next_short, "short"))
            next_short += 0.25
        if not long_sent and t >= 1.0:
            heapq.heappush(waiting, (priority_of(9, 1.0), 1.0, "long"))
            long_sent = True
        _, _, kind = heapq.heappop(waiting)
        if kind == "long":
            return t
        t += 0.5
    return None


def test_plain_classes_starve_a_long_request_and_aged_ones_serve_it_in_the_bound() -> None:
    assert _served_at(lambda klass, _arrival: klass) is None  # vLLM alone: never
    rules = PriorityRules(aging_s=2.0)
    started = _served_at(lambda klass, arrival: rules.aged(klass, EPOCH_S + arrival))
    # Overtaken only by shorts that arrived before t = 1 + 4 classes x 2 s = 9 s; those
    # (36 of them) take 18 s at 0.5 s each.
    assert started is not None and 9.0 <= started <= 18.5


def test_bad_grants_stop_the_gateway_at_start() -> None:
    from gateway.settings import GatewaySettings

    settings = GatewaySettings(priority_grants=SecretStr("no-floor-here"))
    with pytest.raises(ConfigError, match="GATEWAY_PRIORITY_GRANTS entry 0"):
        PriorityRules.from_settings(settings)


# -- the pipeline's decoder request ----------------------------------------------------
class _Call:
    """A finished streaming call: one chunk, then the end."""

    def __init__(self) -> None:
        self._done = False

    def __aiter__(self) -> AsyncIterator[dpb.GenerateResponse]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[dpb.GenerateResponse]:
        yield dpb.GenerateResponse(token_ids=[1], text="a", finish_reason=1)
        self._done = True

    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        self._done = True


class _Decoder:
    """Records each ``Generate`` request."""

    def __init__(self) -> None:
        self.requests: list[dpb.GenerateRequest] = []

    def Generate(self, request: dpb.GenerateRequest, **_: Any) -> _Call:  # noqa: N802
        self.requests.append(request)
        return _Call()


def _pipeline(tiny_model: Path, decoder: _Decoder, **settings: Any) -> Any:
    from gateway.__main__ import forbidden_tokens
    from gateway.pipeline import Downstream, Pipeline
    from gateway.settings import GatewaySettings
    from vlcommon.model_info import load_vision_spec

    channel = grpc.aio.insecure_channel("127.0.0.1:9")  # never called: text only
    return Pipeline(
        GatewaySettings(model=str(tiny_model), cache_address="", **settings),
        load_vision_spec(tiny_model),
        "test-revision",
        forbidden_tokens(tiny_model),
        Downstream(
            encoder=encoder_service_pb2_grpc.EncoderServiceStub(channel),
            decoder=decoder,  # type: ignore[arg-type]
            cache=None,
        ),
    )


def _text_request(max_tokens: int, priority: int | None = None) -> gpb.GenerateRequest:
    request = gpb.GenerateRequest()
    request.messages.add(role="user").parts.add(text="x" * 400)  # ~100 tokens
    request.sampling.max_tokens = max_tokens
    if priority is not None:
        request.priority = priority
    return request


async def _sent(pipeline: Any, request: gpb.GenerateRequest, caller: str | None = None) -> Any:
    parsed = pipeline.parse(request, Deadline.after(30), caller=caller)
    async for _ in pipeline.generate(parsed):
        pass
    return parsed


async def test_the_decoder_gets_the_aged_class_of_the_policy_or_the_client(
    tiny_model: Path,
) -> None:
    decoder = _Decoder()
    pipeline = _pipeline(
        tiny_model,
        decoder,
        priority_policy="short-first",
        priority_grants=SecretStr("ops=-8"),
        priority_aging_s=1.5,
    )
    rules = pipeline.parser.priority
    try:
        short = await _sent(pipeline, _text_request(16))
        long = await _sent(pipeline, _text_request(512))
        asked = await _sent(pipeline, _text_request(16, priority=-4))
        granted = await _sent(pipeline, _text_request(16, priority=-4), caller="ops")
    finally:
        pipeline.close()
    # short-first: 16 + ~100/8 -> class 4; 512 + ~12 -> class 9 (text: ~4 chars a token).
    assert [r.priority for r in decoder.requests] == [
        rules.aged(4, short.arrived_wall),
        rules.aged(9, long.arrived_wall),
        rules.aged(0, asked.arrived_wall),  # -4 raised to the default floor, 0
        rules.aged(-4, granted.arrived_wall),
    ]
    assert (asked.priority, asked.priority_raised) == (0, True)
    assert (granted.priority, granted.priority_raised) == (-4, False)
    assert short.priority is None  # the policy's, not the client's


def test_the_openai_priority_field_reaches_the_request_and_is_range_checked() -> None:
    from gateway.openai_protocol import ChatCompletionRequest, to_generate_request

    def convert(**fields: Any) -> gpb.GenerateRequest:
        body = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], **fields}
        )
        return to_generate_request(body, ("m",)).request

    assert convert(priority=-3).priority == -3
    assert not convert().HasField("priority")
    with pytest.raises(ServiceError) as err:
        convert(priority=2**31)
    assert err.value.reason == "PRIORITY_OUT_OF_RANGE"
    assert err.value.metadata == {"field": "priority"}
