"""The engine honours the gateway's priorities: a real vLLM decoder (``--scheduling-policy
priority``, the decoder's default) that runs one request at a time (``--max-num-seqs 1``),
so later requests wait in its queue.

One long request holds the engine; meanwhile A (class 5) arrives, then B (class 0). Under
first come, first served A would start first; with priorities B does. A caller asking for
a class below the default floor is raised to it (0): it then waits behind an earlier
class-0 request, as first come, first served within the class.

Each ordering holds only if A and B were both queued while the long request still ran:
had it ended first, A would start on arrival and the order would say nothing about
priorities. The decoder's own gauges show it: B is sent once the engine reports A
waiting, and the test then requires one request running with two waiting, which with
``--max-num-seqs 1`` and three requests can only be the long one running with A and B
queued behind it.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from qwenvl.gateway.v1 import gateway_service_pb2 as gpb
from qwenvl.gateway.v1 import gateway_service_pb2_grpc as gpb_grpc

from splitvl.launcher import Cluster, Ports
from vlcommon.tls import ClientSecurity, sync_channel

pytestmark = pytest.mark.e2e
LONG_TOKENS = 120


@pytest.fixture(scope="module")
def one_at_a_time(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(
        model=str(tiny_model),
        ports=Ports.free(),
        log_dir=tmp_path_factory.mktemp("priority"),
        decoder_args=["--max-num-seqs", "1"],
    ) as cluster:
        yield cluster


def _request(text: str, max_tokens: int, priority: int | None) -> gpb.GenerateRequest:
    request = gpb.GenerateRequest()
    request.messages.add(role="user").parts.add(text=text)
    request.sampling.max_tokens = max_tokens
    request.sampling.ignore_eos = True
    if priority is not None:
        request.priority = priority
    return request


class _Stream(threading.Thread):
    """One Generate call on its own thread; records when its first token came."""

    def __init__(self, address: str, request: gpb.GenerateRequest) -> None:
        super().__init__(daemon=True)
        self.address, self.request = address, request
        self.first_token: float | None = None
        self.done = False
        self.tokens = 0
        self.error: Any = None

    def run(self) -> None:
        try:
            with sync_channel(self.address, ClientSecurity.from_env()) as channel:
                for chunk in gpb_grpc.GatewayServiceStub(channel).Generate(
                    self.request, timeout=300
                ):
                    if chunk.token_ids and self.first_token is None:
                        self.first_token = time.monotonic()
                    self.tokens += len(chunk.token_ids)
        except Exception as err:  # noqa: BLE001 - reported by the test
            self.error = err
        self.done = True


def _engine(cluster: Cluster) -> tuple[int, int]:
    """(running, waiting) requests in the decoder's vLLM scheduler, from its own gauges
    (set from vLLM's scheduler stats at every engine step)."""
    url = f"http://127.0.0.1:{cluster.ports.metrics['decoder']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        lines = r.read().decode().splitlines()
    value = {
        name: int(float(ln.split()[1]))
        for ln in lines
        for name in ("running", "waiting")
        if ln.startswith(f"splitvl_decoder_engine_{name}_requests ")
    }
    return value["running"], value["waiting"]


def _until_waiting(cluster: Cluster, n: int, hold: _Stream) -> tuple[int, int]:
    """Poll the engine until ``n`` requests wait, or the holding stream ends; the last
    (running, waiting) seen."""
    seen = _engine(cluster)
    while seen[1] < n and not hold.done:
        time.sleep(0.01)
        seen = _engine(cluster)
    return seen


def _order(cluster: Cluster, first: gpb.GenerateRequest, second: gpb.GenerateRequest) -> str:
    """Hold the engine with a long request, send ``first`` then ``second`` while it runs;
    which of the two got its first token first."""
    address = cluster.ports.address("gateway")
    hold = _Stream(address, _request("Count to a hundred.", LONG_TOKENS, None))
    hold.start()
    deadline = time.monotonic() + 120
    while hold.first_token is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hold.first_token is not None, hold.error
    a, b = _Stream(address, first), _Stream(address, second)
    a.start()
    # a is queued in the engine before b is sent, and both while the long one runs.
    queued = _until_waiting(cluster, 1, hold)
    assert queued == (1, 1), f"(running, waiting) {queued}: the hold ended first ({a.error})"
    b.start()
    queued = _until_waiting(cluster, 2, hold)
    assert queued == (1, 2), f"(running, waiting) {queued}: the hold ended first ({b.error})"
    for t in (hold, a, b):
        t.join(timeout=300)
    assert not (hold.error or a.error or b.error), (hold.error, a.error, b.error)
    assert hold.tokens == LONG_TOKENS and a.tokens == b.tokens == 4
    assert a.first_token is not None and b.first_token is not None
    return "first" if a.first_token < b.first_token else "second"


def test_a_better_class_that_arrives_later_starts_first(one_at_a_time: Cluster) -> None:
    a = _request("Say A.", 4, priority=5)
    b = _request("Say B.", 4, priority=0)
    assert _order(one_at_a_time, a, b) == "second"


def test_a_class_below_the_floor_is_raised_and_waits_its_turn(one_at_a_time: Cluster) -> None:
    a = _request("Say A.", 4, priority=0)
    b = _request("Say B.", 4, priority=-100)  # raised to 0: no grant
    assert _order(one_at_a_time, a, b) == "first"
