"""Request migration: a decoder lost mid-answer, or drained, costs the client nothing.

The package's cluster (tests/e2e/replicated/conftest.py: two replicas of each service
behind one gateway, decoders die here, shared with test_replica_faults), greedy answers
with an image. Each test first runs the request undisturbed, then again with the
decoder serving it killed (SIGKILL) or stopped (SIGTERM, its streams handed back) after the
client has received its 5th token: the second stream must be the first, token for token,
with usage counting every token once. The killed decoder is started again after each test
(``_decoders_back``).
"""

from __future__ import annotations

import base64
import dataclasses
import os
import signal
import threading
import time
import types
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from qwenvl.gateway.v1 import gateway_service_pb2 as pb
from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

from splitvl.client import build_request
from splitvl.launcher import Cluster
from splitvl.ports import Ports
from tests.conftest import OtlpReceiver, extra_service, photo
from tests.unit.deploy.test_haproxy_affinity import HAPROXY, Proxy
from vlcommon.errors import error_info

MAX_TOKENS = 600
KILL_AFTER = 5  # tokens the client has received when its decoder goes
DECODERS = ("decoder-1", "decoder-2")


@pytest.fixture(autouse=True)
def _decoders_back(replicated: Cluster) -> Iterator[None]:
    """Each test kills or stops a decoder: it is started again after the test."""
    yield
    for name in DECODERS:
        if not replicated.serving(name):
            replicated.restart(name)


def _serving_decoder(c: Cluster) -> str:
    """The decoder replica whose vLLM engine has the request (the only one running)."""
    busy = [n for n in DECODERS if _metric(c, n, "splitvl_decoder_engine_unfinished_requests") > 0]
    assert len(busy) == 1, busy
    return busy[0]


def _metric(c: Cluster | Ports, name: str, series: str) -> float:
    ports = c.ports if isinstance(c, Cluster) else c
    url = f"http://127.0.0.1:{ports.metrics[name]}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    values = [
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " ")
    ]
    return sum(values)


@dataclasses.dataclass
class Answer:
    token_ids: list[int]
    text: str
    usage: tuple[int, int]
    disturbed: str = ""  # the decoder that went mid-answer
    tokens_before: int = 0  # tokens the client had then


def _request() -> pb.GenerateRequest:
    return build_request(
        [photo("astronaut.png")], "Describe this image.", max_tokens=MAX_TOKENS, ignore_eos=True
    )


def _grpc_answer(
    address: str, disturb: Callable[[str], None] | None = None, c: Cluster | None = None
) -> Answer:
    """Stream one answer; with ``disturb``, call it on the serving decoder once the client
    has ``KILL_AFTER`` tokens."""
    answer = Answer([], "", (0, 0))
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GatewayServiceStub(channel)
        for chunk in stub.Generate(_request(), timeout=120):
            answer.token_ids += chunk.token_ids
            answer.text += chunk.text
            if chunk.HasField("usage"):
                answer.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            if disturb and not answer.disturbed and len(answer.token_ids) >= KILL_AFTER:
                assert c is not None
                answer.disturbed = _serving_decoder(c)
                answer.tokens_before = len(answer.token_ids)
                disturb(answer.disturbed)
    return answer


def _migrations(c: Cluster, reason: str) -> float:
    return _metric(c, "gateway", f'splitvl_gateway_migrations_total{{reason="{reason}"}}')


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_decoder_killed_mid_answer_costs_the_grpc_client_nothing(
    replicated: Cluster, otlp_receiver: OtlpReceiver
) -> None:
    address = replicated.ports.gateway_address()
    undisturbed = _grpc_answer(address)
    assert len(undisturbed.token_ids) == MAX_TOKENS
    before = _migrations(replicated, "lost")
    moved = _grpc_answer(address, disturb=replicated.kill, c=replicated)
    assert moved.disturbed and moved.tokens_before < MAX_TOKENS
    assert moved.token_ids == undisturbed.token_ids
    assert moved.text == undisturbed.text
    assert moved.usage == undisturbed.usage == (undisturbed.usage[0], MAX_TOKENS)
    assert _migrations(replicated, "lost") == before + 1
    # The trace says where it went: both replicas and the tokens moved.
    lost = str(replicated.ports.grpc[moved.disturbed])
    other = next(n for n in DECODERS if n != moved.disturbed)
    events = _migration_events(otlp_receiver)
    assert any(
        lost in e["splitvl.migration.from"].string_value
        and str(replicated.ports.grpc[other]) in e["splitvl.migration.to"].string_value
        and e["splitvl.migration.reason"].string_value == "lost"
        and e["splitvl.migration.tokens"].int_value >= KILL_AFTER
        for e in events
    ), events


def _migration_events(receiver: OtlpReceiver) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 15
    while True:
        events = [
            attrs
            for span in receiver.snapshot()
            if span["name"] == "gateway.decode"
            for name, attrs in span["event_attributes"]  # type: ignore[union-attr]
            if name == "decoder.migrated"
        ]
        if events or time.monotonic() > deadline:
            return events
        time.sleep(0.3)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_drained_decoder_hands_its_answers_to_the_other(replicated: Cluster) -> None:
    address = replicated.ports.gateway_address()
    undisturbed = _grpc_answer(address)
    before = _migrations(replicated, "draining")
    codes: dict[str, int | None] = {}

    def drain(name: str) -> None:
        # SIGTERM as a rolling restart sends it; the answer keeps streaming meanwhile.
        thread = threading.Thread(target=lambda: codes.update({name: replicated.terminate(name)}))
        thread.start()

    moved = _grpc_answer(address, disturb=drain, c=replicated)
    assert moved.token_ids == undisturbed.token_ids
    assert moved.text == undisturbed.text
    assert moved.usage == undisturbed.usage
    assert _migrations(replicated, "draining") == before + 1
    deadline = time.monotonic() + 60
    while moved.disturbed not in codes and time.monotonic() < deadline:
        time.sleep(0.2)
    assert codes[moved.disturbed] == 0  # a clean drain: the stream moved, not cut


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_decoder_killed_mid_answer_costs_the_openai_client_nothing(replicated: Cluster) -> None:
    import openai

    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{replicated.ports.http}/v1",
        api_key="none",
        max_retries=0,
        timeout=120,
    )
    url = "data:image/png;base64," + base64.b64encode(photo("astronaut.png")).decode()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "Describe this image."},
            ],
        }
    ]

    def stream(disturb: bool) -> tuple[str, tuple[int, int], str]:
        text, usage, killed, chunks = "", (0, 0), "", 0
        for event in client.chat.completions.create(
            model=replicated.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        ):
            if event.usage is not None:
                usage = (event.usage.prompt_tokens, event.usage.completion_tokens)
            if event.choices and event.choices[0].delta.content:
                text += event.choices[0].delta.content
                chunks += 1
                if disturb and not killed and chunks >= KILL_AFTER:
                    killed = _serving_decoder(replicated)
                    replicated.kill(killed)
        return text, usage, killed

    text, usage, _ = stream(disturb=False)
    moved_text, moved_usage, killed = stream(disturb=True)
    assert killed
    assert moved_text == text
    assert moved_usage == usage == (usage[0], MAX_TOKENS)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_with_migration_off_a_lost_decoder_ends_the_answer_as_before(
    replicated: Cluster, tmp_path: Path
) -> None:
    env = {"GATEWAY_MIGRATION_LIMIT": "0"}
    with extra_service(replicated, "gateway", env, tmp_path) as ports:
        with pytest.raises(grpc.RpcError) as err:
            _grpc_answer(ports.address("gateway"), disturb=replicated.kill, c=replicated)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        info = error_info(err.value)
        assert info is not None and info.reason == "DECODER_LOST_MID_STREAM"
        off = 'splitvl_gateway_migration_failures_total{reason="off"}'
        assert _metric(ports, "gateway", off) == 1


def _generate_ok(c: Cluster, name: str) -> float:
    return _metric(c, name, 'splitvl_decoder_requests_total{code="OK",method="Generate"}')


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (make system-deps)")
def test_through_haproxy_a_replay_and_a_migration_reach_the_other_decoder(
    replicated: Cluster, tmp_path: Path
) -> None:
    """The shipped deploy/haproxy/haproxy.cfg between a gateway (GATEWAY_DECODER_ROUTING=
    proxy) and the two real decoders: an answer whose decoder is killed mid-stream
    continues (HAProxy ends its stream without trailers: "Stream removed", UNKNOWN), and a
    call whose decoder dies before its first token is answered by the other, both through
    the one proxy endpoint, which sends the second try to the live decoder (a call with no byte
    of its answer back HAProxy re-dispatches itself)."""
    backends = [types.SimpleNamespace(port=replicated.ports.grpc[n]) for n in DECODERS]
    proxy = Proxy(backends, tmp_path)
    env = {"GATEWAY_DECODER_ROUTING": "proxy"}
    try:
        with extra_service(
            replicated, "gateway", env, tmp_path, decoder=f"127.0.0.1:{proxy.port}"
        ) as ports:
            address = ports.address("gateway")
            undisturbed = _grpc_answer(address)
            moved = _grpc_answer(address, disturb=replicated.kill, c=replicated)
            assert (moved.token_ids, moved.text, moved.usage) == (
                undisturbed.token_ids,
                undisturbed.text,
                undisturbed.usage,
            )
            assert _metric(ports, "gateway", 'splitvl_gateway_migrations_total{reason="lost"}') == 1
            replicated.restart(moved.disturbed)
            proxy.wait_for(dict.fromkeys(proxy.servers[:2], "UP"))

            # Which decoder HAProxy sends this image to, then that one frozen (SIGSTOP:
            # the call reaches it and waits) and killed before its first token.
            before = {n: _generate_ok(replicated, n) for n in DECODERS}
            _grpc_answer(address)
            [home] = [n for n in DECODERS if _generate_ok(replicated, n) > before[n]]
            pid = replicated.pids()[home]
            os.killpg(pid, signal.SIGSTOP)
            result: dict[str, Any] = {}

            def call() -> None:
                try:
                    result["answer"] = _grpc_answer(address)
                except grpc.RpcError as err:
                    result["error"] = err

            other = next(n for n in DECODERS if n != home)
            served = _generate_ok(replicated, other)
            thread = threading.Thread(target=call)
            thread.start()
            time.sleep(1.0)
            assert "answer" not in result  # held by the frozen decoder
            replicated.kill(home)
            thread.join(120)
            assert "error" not in result, result
            replayed = result["answer"]
            assert (replayed.token_ids, replayed.text, replayed.usage) == (
                undisturbed.token_ids,
                undisturbed.text,
                undisturbed.usage,
            )
            # HAProxy itself sent it on (retry-on empty-response: no byte of an answer had
            # come back), or the gateway's second try through it did.
            assert _generate_ok(replicated, other) == served + 1
    finally:
        proxy.close()
