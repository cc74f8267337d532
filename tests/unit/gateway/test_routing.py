"""Decoder routing: consistent hashing with bounded loads, failover, endpoints by DNS.

The ring and the bounded load are checked as a unit; the failover and the affinity header
through real gRPC servers on loopback (scripted decoders: a servicer unit test's
stand-in) behind the real decode stage.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import socket
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from qwenvl.decoder.v1 import decoder_service_pb2 as dpb
from qwenvl.decoder.v1 import decoder_service_pb2_grpc

from gateway.pipeline.core import affinity_key
from gateway.pipeline.decode import DecodeStage
from gateway.pipeline.endpoints import DecoderEndpoints, static_addresses
from gateway.pipeline.route import AFFINITY_HEADER, DecoderRouter, Endpoint
from tests.conftest import in_process_server
from vlcommon.deadline import NO_DEADLINE, Deadline
from vlcommon.errors import ServiceError, abort, invalid_argument

KEYS = [f"key-{i}" for i in range(3000)]


def router_of(names: list[str], epsilon: float = 0.25) -> DecoderRouter:
    router = DecoderRouter(epsilon=epsilon)
    router.set_endpoints([Endpoint(name, stub=None) for name in names])
    return router


def home(router: DecoderRouter, key: str) -> str:
    return router.candidates(key)[0][0].address


def test_each_key_has_one_home_and_the_keys_spread_over_every_endpoint() -> None:
    router = router_of(["a:1", "b:1", "c:1"])
    homes = {key: home(router, key) for key in KEYS}
    assert {key: home(router, key) for key in KEYS} == homes  # stable
    assert all(router.candidates(k)[1] == "home" for k in KEYS[:50])
    counts = collections.Counter(homes.values())
    assert set(counts) == {"a:1", "b:1", "c:1"}
    assert all(abs(n - 1000) < 200 for n in counts.values()), counts
    # Another gateway (another process) builds the same ring: the same homes.
    assert {key: home(router_of(["c:1", "a:1", "b:1"]), key) for key in KEYS} == homes


def test_a_replica_joining_or_leaving_moves_only_its_share_of_keys() -> None:
    router = router_of(["a:1", "b:1", "c:1"])
    before = {key: home(router, key) for key in KEYS}
    router.set_endpoints([*router.endpoints, Endpoint("d:1", stub=None)])
    joined = {key: home(router, key) for key in KEYS}
    moved = [k for k in KEYS if joined[k] != before[k]]
    assert all(joined[k] == "d:1" for k in moved)
    assert 0.15 < len(moved) / len(KEYS) < 0.35  # about a quarter
    router.set_endpoints([e for e in router.endpoints if e.address != "b:1"])
    left = {key: home(router, key) for key in KEYS}
    assert all(left[k] == joined[k] for k in KEYS if joined[k] != "b:1")
    assert all(left[k] != "b:1" for k in KEYS)


def test_a_hot_key_spills_past_its_home_within_the_bounded_load() -> None:
    """30 calls in flight for one key over 3 replicas: the home takes it until it carries
    ceil(1.25 * (m + 1) / 3), then the next on the ring, never more than that bound."""
    router = router_of(["a:1", "b:1", "c:1"])
    hot = "a-hot-image"
    hot_home = home(router, hot)
    held = []
    hows = []
    for _ in range(30):
        (first, *_), how = router.candidates(hot)
        m = sum(e.inflight for e in router.endpoints)
        assert first.inflight + 1 <= math.ceil(1.25 * (m + 1) / 3)
        hows.append(how)
        first.inflight += 1
        held.append(first)
    loads = {e.address: e.inflight for e in router.endpoints}
    assert max(loads.values()) == loads[hot_home] == math.ceil(1.25 * 30 / 3)  # 13
    assert sum(loads.values()) == 30 and min(loads.values()) > 0
    assert hows[0] == "home" and "spilled" in hows


def test_epsilon_zero_balances_exactly_and_a_large_one_keeps_the_home() -> None:
    tight, loose = router_of(["a:1", "b:1"], 0.0), router_of(["a:1", "b:1"], 10.0)
    for router in (tight, loose):
        for _ in range(20):
            router.candidates("k")[0][0].inflight += 1
    assert sorted(e.inflight for e in tight.endpoints) == [10, 10]
    assert sorted(e.inflight for e in loose.endpoints) == [0, 20]


def test_without_a_key_the_least_loaded_endpoint_takes_the_request() -> None:
    router = router_of(["a:1", "b:1", "c:1"])
    router.endpoints[0].inflight, router.endpoints[1].inflight = 3, 1
    (first, *_), how = router.candidates(None)
    assert (first.address, how) == ("c:1", "least_loaded")


def test_a_down_endpoint_is_passed_over_until_its_time_is_up(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    router = router_of(["a:1", "b:1", "c:1"])
    key = KEYS[0]
    (home_endpoint, *rest), _ = router.candidates(key)
    router.mark_down(home_endpoint)
    order, how = router.candidates(key)
    assert order[0] is rest[0] and how == "spilled"
    assert order[-1] is home_endpoint  # tried last, only if every other one failed
    import gateway.pipeline.route as route

    clock = route.time.monotonic() + route.DOWN_S + 1
    monkeypatch.setattr(route.time, "monotonic", lambda: clock)
    assert router.candidates(key)[0][0] is home_endpoint


def test_static_targets_and_the_affinity_key_of_a_request() -> None:
    assert static_addresses("ipv4:10.0.0.1:5,10.0.0.2:5") == ["10.0.0.1:5", "10.0.0.2:5"]
    assert static_addresses("decoder:50054") == ["decoder:50054"]
    assert static_addresses("dns:///decoder-headless:50054") is None
    request = dpb.GenerateRequest()
    request.messages.add(role="user").parts.add(text="hi")
    assert affinity_key(request) is None
    request.images.add(key="first-image")
    request.images.add(key="second-image")
    request.videos.add().embedding.key = "a-video"
    parts = request.messages[0].parts
    parts.add(video_index=0)
    parts.add(image_index=1)
    assert affinity_key(request) == "a-video"  # the first in prompt order


async def test_dns_targets_resolve_to_one_endpoint_per_address() -> None:
    router = DecoderRouter()
    opened: list[str] = []
    names: set[str | None] = set()

    def make_channel(address: str, name: str | None) -> Any:
        opened.append(address)
        names.add(name)
        return grpc.aio.insecure_channel(address)

    endpoints = DecoderEndpoints("dns:///localhost:50999", make_channel, router)
    expected = sorted(
        {
            f"[{a[4][0]}]:50999" if a[0] == socket.AF_INET6 else f"{a[4][0]}:50999"
            for a in socket.getaddrinfo("localhost", 50999, type=socket.SOCK_STREAM)
        }
    )
    await endpoints.start()
    try:
        assert sorted(e.address for e in router.endpoints) == expected == sorted(opened)
        await endpoints.refresh()  # the same records: nothing reopened
        assert sorted(opened) == expected
        assert names == {"localhost"}  # TLS checks the name, not the IP dialled
    finally:
        await endpoints.close()


# -- failover through real servers ------------------------------------------------------


class _Decoder(decoder_service_pb2_grpc.DecoderServiceServicer):
    """A scripted decoder: records the affinity header it received, streams ``tokens``
    chunks, then (``die_after``) aborts with ``die_code`` as a dying replica's call ends
    (UNAVAILABLE; CANCELLED as a stopping server cancels what is left)."""

    def __init__(
        self,
        name: int,
        tokens: int = 3,
        die_after: int | None = None,
        die_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
        die_with: ServiceError | None = None,
    ) -> None:
        self.name, self.tokens, self.die_after, self.die_code = name, tokens, die_after, die_code
        self.die_with = die_with  # a status of the decoder's own (with ErrorInfo)
        self.headers: list[str | None] = []
        self.requests: list[dpb.GenerateRequest] = []
        self.die_calls = 0  # the first this many calls fail before their first chunk
        self.confirms = True  # confirms a continuation (continued_tokens), as decoders do
        self.die_at_end = False

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        self.headers.append(dict(context.invocation_metadata()).get(AFFINITY_HEADER))
        self.requests.append(request)
        if len(self.requests) <= self.die_calls:
            if self.die_with is not None:
                await abort(context, self.die_with)
            await context.abort(self.die_code, "Socket closed")
        for i in range(self.tokens):
            if self.die_after is not None and i == self.die_after:
                if self.die_with is not None:
                    await abort(context, self.die_with)
                await context.abort(self.die_code, "Socket closed")
            chunk = dpb.GenerateResponse(token_ids=[self.name * 100 + i], text=f"t{i}é")
            if i == 0 and self.confirms and request.HasField("continuation"):
                chunk.continued_tokens = len(request.continuation.token_ids)
            if i == self.tokens - 1:
                chunk.finish_reason = 1
            yield chunk
        if self.die_at_end:  # the last chunk went out, then the connection was lost
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")


def homed_on_first(endpoints: list[Endpoint]) -> tuple[DecoderRouter, str]:
    """A router over ``endpoints`` and a key whose home is the first of them."""
    router = DecoderRouter()
    router.set_endpoints(endpoints)
    return router, next(k for k in KEYS if home(router, k) == endpoints[0].address)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def decoders(*servicers: _Decoder) -> AsyncIterator[list[Endpoint]]:
    async with contextlib.AsyncExitStack() as stack:
        endpoints = []
        for servicer in servicers:
            ports: list[int] = []
            channel = await stack.enter_async_context(
                in_process_server(
                    decoder_service_pb2_grpc.add_DecoderServiceServicer_to_server,
                    servicer,
                    "qwenvl.decoder.v1.DecoderService",
                    on_port=ports.append,
                )
            )
            stub = decoder_service_pb2_grpc.DecoderServiceStub(channel)
            endpoints.append(Endpoint(f"127.0.0.1:{ports[0]}", stub, channel))
        yield endpoints


async def test_a_dead_home_replica_is_replayed_on_the_next_and_then_skipped() -> None:
    dead_address = f"127.0.0.1:{closed_port()}"
    async with decoders(_Decoder(1)) as (live,):
        dead_channel = grpc.aio.insecure_channel(dead_address)
        dead = Endpoint(dead_address, decoder_service_pb2_grpc.DecoderServiceStub(dead_channel))
        router = DecoderRouter()
        router.set_endpoints([dead, live])
        key = next(k for k in KEYS if home(router, k) == dead_address)
        stage = DecodeStage(router)
        deadline = Deadline.after(10)
        got = [c.token_ids[0] async for c in stage.stream(dpb.GenerateRequest(), deadline, key)]
        assert got == [100, 101, 102]
        assert router.candidates(key)[0][0] is live  # the dead one is passed over now
        got = [c.token_ids[0] async for c in stage.stream(dpb.GenerateRequest(), deadline, key)]
        assert got == [100, 101, 102]
        assert dead.inflight == 0 and live.inflight == 0
        await dead_channel.close()


async def test_the_affinity_key_reaches_the_decoder_as_a_header() -> None:
    servicer = _Decoder(1)
    async with decoders(servicer) as endpoints:
        router = DecoderRouter()
        router.set_endpoints(endpoints)
        stage = DecodeStage(router)
        [c async for c in stage.stream(dpb.GenerateRequest(), NO_DEADLINE, "image-key")]
        [c async for c in stage.stream(dpb.GenerateRequest(), NO_DEADLINE, None)]
    assert servicer.headers == ["image-key", None]


async def test_a_replica_lost_after_the_first_token_is_unavailable_and_not_replayed() -> None:
    dying, other = _Decoder(1, tokens=5, die_after=2), _Decoder(2)
    async with decoders(dying, other) as endpoints:
        router, key = homed_on_first(endpoints)
        got = []
        with pytest.raises(ServiceError) as err:
            async for chunk in DecodeStage(router).stream(dpb.GenerateRequest(), NO_DEADLINE, key):
                got.append(chunk.token_ids[0])
    assert got == [100, 101]
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.reason == "DECODER_LOST_MID_STREAM"
    assert endpoints[0].address in err.value.message
    assert other.headers == []  # never replayed: tokens had reached the client


async def _renewed(request: dpb.GenerateRequest) -> dpb.GenerateRequest:
    """A renew as the pipeline's: the same request with new refs (here, a marked id)."""
    fresh = dpb.GenerateRequest()
    fresh.CopyFrom(request)
    fresh.request_id = "renewed"
    return fresh


@pytest.mark.parametrize(
    ("die_with", "reason"),
    [
        (None, "lost"),
        (ServiceError(grpc.StatusCode.UNAVAILABLE, "DECODER_DRAINING", "stopping"), "draining"),
        (ServiceError(grpc.StatusCode.UNAVAILABLE, "ENGINE_DEAD", "engine died"), "engine_dead"),
    ],
)
async def test_an_answer_whose_replica_is_lost_continues_on_the_next(
    die_with: ServiceError | None, reason: str
) -> None:
    from gateway import metrics

    dying = _Decoder(1, tokens=5, die_after=2, die_with=die_with)
    other = _Decoder(2, tokens=2)
    moved = metrics.MIGRATIONS.labels(reason=reason)
    before = moved._value.get()
    async with decoders(dying, other) as endpoints:
        router, key = homed_on_first(endpoints)
        stage = DecodeStage(router, migration_limit=1)
        stream = stage.stream(dpb.GenerateRequest(), Deadline.after(10), key, renew=_renewed)
        got = [c.token_ids[0] async for c in stream]
    assert got == [100, 101, 200, 201]
    [continued] = other.requests
    assert continued.request_id == "renewed"  # fresh refs, never the ones read
    assert list(continued.continuation.token_ids) == [100, 101]
    assert continued.continuation.text_chars == len("t0ét1é")  # characters, not bytes
    assert other.headers == [key]  # the affinity key still routes the continuation
    assert moved._value.get() == before + 1


async def test_an_answer_moves_at_most_the_limit_and_fails_as_before_past_it() -> None:
    from gateway import metrics

    first, second = _Decoder(1, tokens=5, die_after=1), _Decoder(2, tokens=5, die_after=1)
    limit = metrics.MIGRATION_FAILURES.labels(reason="limit")
    before = limit._value.get()
    async with decoders(first, second) as endpoints:
        router, key = homed_on_first(endpoints)
        got = []
        with pytest.raises(ServiceError) as err:
            stage = DecodeStage(router, migration_limit=1)
            async for c in stage.stream(dpb.GenerateRequest(), NO_DEADLINE, key, renew=_renewed):
                got.append(c.token_ids[0])
    assert got == [100, 200]
    assert (err.value.code, err.value.reason) == (
        grpc.StatusCode.UNAVAILABLE,
        "DECODER_LOST_MID_STREAM",
    )
    assert limit._value.get() == before + 1


async def test_a_decoder_that_does_not_confirm_the_continuation_ends_the_answer() -> None:
    """A decoder from before request migration ignores ``continuation`` and would start
    the answer over: without ``continued_tokens`` on its first chunk the answer ends as
    lost, none of its tokens forwarded."""
    dying, old = _Decoder(1, tokens=5, die_after=2), _Decoder(2, tokens=3)
    old.confirms = False
    async with decoders(dying, old) as endpoints:
        router, key = homed_on_first(endpoints)
        stage = DecodeStage(router, migration_limit=3)
        got = []
        with pytest.raises(ServiceError) as err:
            async for c in stage.stream(dpb.GenerateRequest(), NO_DEADLINE, key, renew=_renewed):
                got.append(c.token_ids[0])
    assert got == [100, 101]
    assert err.value.reason == "DECODER_LOST_MID_STREAM"


async def test_an_answer_whose_last_chunk_came_is_not_moved() -> None:
    """The connection lost after the chunk with the finish reason: the answer is whole;
    moving it would generate past its end."""
    done, other = _Decoder(1, tokens=3), _Decoder(2)
    done.die_at_end = True
    async with decoders(done, other) as endpoints:
        router, key = homed_on_first(endpoints)
        stage = DecodeStage(router, migration_limit=3)
        stream = stage.stream(dpb.GenerateRequest(), NO_DEADLINE, key, renew=_renewed)
        got = [c.token_ids[0] async for c in stream]
    assert got == [100, 101, 102]
    assert other.requests == []


async def test_a_move_whose_refs_are_gone_moves_again_with_fresh_ones() -> None:
    """The replica that takes the move finds its refs gone (another that refused the call
    first had read and released them): the stage asks for fresh refs and moves again."""
    dying = _Decoder(1, tokens=5, die_after=2)
    gone = ServiceError(grpc.StatusCode.UNAVAILABLE, "EMBEDDING_REF_GONE", "gone")
    other = _Decoder(2, tokens=2, die_with=gone)
    other.die_calls = 1
    other.die_code = grpc.StatusCode.UNAVAILABLE
    renewals = []

    async def renew(request: dpb.GenerateRequest) -> dpb.GenerateRequest:
        renewals.append(request.request_id)
        fresh = await _renewed(request)
        fresh.request_id = f"renewed-{len(renewals)}"
        return fresh

    async with decoders(dying, other) as endpoints:
        router, key = homed_on_first(endpoints)
        stage = DecodeStage(router, migration_limit=3)
        stream = stage.stream(dpb.GenerateRequest(), Deadline.after(10), key, renew=renew)
        got = [c.token_ids[0] async for c in stream]
    assert got == [100, 101, 200, 201]
    assert [r.request_id for r in other.requests] == ["renewed-1", "renewed-2"]


@pytest.mark.parametrize("why", ["too_long", "refused", "renew_failed"])
async def test_an_answer_that_cannot_move_ends_lost_mid_stream(why: str) -> None:
    """Past GATEWAY_MIGRATION_MAX_SEQ_LEN, a continuation the next replica refuses, or no
    embeddings to continue with: the caller gets DECODER_LOST_MID_STREAM, never the next
    replica's INVALID_ARGUMENT about a continuation it never sent."""
    refusal = invalid_argument("CONTINUATION_INVALID", "no", field="continuation.token_ids")
    dying = _Decoder(1, tokens=5, die_after=2)
    other = _Decoder(2, tokens=2, die_after=0 if why == "refused" else None, die_with=refusal)

    async def renew(request: dpb.GenerateRequest) -> dpb.GenerateRequest:
        if why == "renew_failed":
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "ENCODER_UNAVAILABLE", "down")
        return await _renewed(request)

    async with decoders(dying, other) as endpoints:
        router, key = homed_on_first(endpoints)
        stage = DecodeStage(
            router, migration_limit=3, migration_max_seq_len=1 if why == "too_long" else 100
        )
        with pytest.raises(ServiceError) as err:
            async for _ in stage.stream(
                dpb.GenerateRequest(), Deadline.after(10), key, renew=renew
            ):
                pass
    assert err.value.reason == "DECODER_LOST_MID_STREAM"
    assert len(other.requests) == (1 if why == "refused" else 0)


async def test_one_endpoint_a_proxy_gets_a_second_try_before_the_first_token() -> None:
    """GATEWAY_DECODER_ROUTING=proxy: one endpoint in front of the replicas. A call that
    fails before its first token (the proxy's server gone) is tried through it once more,
    where the proxy picks a live replica."""
    flaky = _Decoder(1, tokens=2, die_after=0)
    async with decoders(flaky) as (endpoint,):
        router = DecoderRouter()
        router.set_endpoints([endpoint])
        stream = DecodeStage(router).stream(dpb.GenerateRequest(), Deadline.after(10), "k")
        with pytest.raises(ServiceError) as err:
            [c async for c in stream]
        assert len(flaky.requests) == 2  # tried twice through the one endpoint
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        flaky.requests.clear()
        flaky.die_after = None
        flaky.die_calls = 1  # only the first call fails: the second try answers
        stream = DecodeStage(router).stream(dpb.GenerateRequest(), Deadline.after(10), "k")
        assert [c.token_ids[0] async for c in stream] == [100, 101]
        assert len(flaky.requests) == 2


@pytest.mark.parametrize("die_after", [0, 2])
async def test_a_replica_that_cancels_the_call_is_replayed_or_lost_mid_stream(
    die_after: int,
) -> None:
    """A stopping replica cancels what it still runs: before the first token the call is
    replayed on the next replica, after it the answer is UNAVAILABLE
    (DECODER_LOST_MID_STREAM), never a bare CANCELLED the caller reads as its own."""
    dying = _Decoder(1, tokens=5, die_after=die_after, die_code=grpc.StatusCode.CANCELLED)
    other = _Decoder(2)
    async with decoders(dying, other) as endpoints:
        router, key = homed_on_first(endpoints)
        got: list[int] = []
        stream = DecodeStage(router).stream(dpb.GenerateRequest(), Deadline.after(10), key)
        if die_after == 0:
            got = [c.token_ids[0] async for c in stream]
            assert got == [200, 201, 202]
            return
        with pytest.raises(ServiceError) as err:
            async for chunk in stream:
                got.append(chunk.token_ids[0])
    assert got == [100, 101]
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.reason == "DECODER_LOST_MID_STREAM"
    assert other.headers == []


async def test_every_replica_down_is_unavailable_not_a_hang() -> None:
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{closed_port()}") for _ in range(2)]
    router = DecoderRouter()
    router.set_endpoints(
        [
            Endpoint(f"dead-{i}", decoder_service_pb2_grpc.DecoderServiceStub(c))
            for i, c in enumerate(channels)
        ]
    )
    with pytest.raises(ServiceError) as err:
        await asyncio.wait_for(
            anext(DecodeStage(router).stream(dpb.GenerateRequest(), Deadline.after(10), "k")), 15
        )
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.metadata["dependency"] == "decoder"
    for c in channels:
        await c.close()


def test_tls_checks_a_resolved_replica_against_its_dns_name() -> None:
    from vlcommon.tls import ClientSecurity

    tls = ClientSecurity(ca_file="/ca.pem")
    assert tls.named("decoder-headless.ns.svc").server_name == "decoder-headless.ns.svc"
    assert tls.named(None) is tls
    pinned = ClientSecurity(ca_file="/ca.pem", server_name="decoder.internal")
    assert pinned.named("decoder-headless").server_name == "decoder.internal"
