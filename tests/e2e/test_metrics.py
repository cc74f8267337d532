"""Prometheus metrics: the shared RPC interceptor (in process) and every service's /metrics
scraped from the running cluster around one real Generate.

The names are the ones in docs/observability.md; the deltas are what one request with one
unseen image and ``MAX_TOKENS`` greedy tokens (ignore_eos) must add.
"""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from splitvl.client import build_request, generate
from tests.conftest import png_bytes, rgb
from vlcommon.errors import abort, invalid_argument
from vlcommon.model_info import load_vision_spec

MAX_TOKENS = 6
FP32_BYTES = 4  # the tiny checkpoint's encoder and decoder run float32


# -- the interceptor, in process -------------------------------------------------------------
def _sample(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def bytes_service(service: str, unary: dict, streams: dict):  # type: ignore[no-untyped-def,type-arg]
    """An ``in_process_server`` registration of raw-bytes handlers under ``service``."""
    handlers = {
        **{
            name: grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=bytes, response_serializer=bytes
            )
            for name, fn in unary.items()
        },
        **{
            name: grpc.unary_stream_rpc_method_handler(
                fn, request_deserializer=bytes, response_serializer=bytes
            )
            for name, fn in streams.items()
        },
    }

    def add(_servicer, server) -> None:  # type: ignore[no-untyped-def]
        server.add_registered_method_handlers(service, handlers)

    return add


async def test_interceptor_counts_methods_and_status_codes() -> None:
    """Each RPC is counted once under its short method name and the status the client saw."""
    from tests.conftest import in_process_server

    async def ok(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await abort(context, invalid_argument("BAD", "bad input", field="x"))
        return b""

    async def crash(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise RuntimeError("boom")

    async def stream(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        for _ in range(3):
            yield request

    add = bytes_service(
        "t.v1.TestService", {"Ok": ok, "Refuse": refuse, "Crash": crash}, {"Stream": stream}
    )

    name = "splitvl_test_requests_total"
    before = {
        (m, c): _sample(name, {"method": m, "code": c})
        for m, c in [("Ok", "OK"), ("Refuse", "INVALID_ARGUMENT"), ("Crash", "INTERNAL")]
        + [("Stream", "OK")]
    }
    async with in_process_server(add, None, "t.v1.TestService") as channel:
        for _ in range(2):
            assert await channel.unary_unary("/t.v1.TestService/Ok")(b"x") == b"x"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await channel.unary_unary("/t.v1.TestService/Refuse")(b"x")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as crashed:
            await channel.unary_unary("/t.v1.TestService/Crash")(b"x")
        # An unexpected exception is mapped (vlcommon.interceptors.ErrorInterceptor): INTERNAL
        # naming the method, never grpc-python's bare UNKNOWN "Unexpected <class ...>".
        assert crashed.value.code() == grpc.StatusCode.INTERNAL
        assert crashed.value.details() == "internal error in Crash (see the service's log)"
        got = [r async for r in channel.unary_stream("/t.v1.TestService/Stream")(b"y")]
        assert got == [b"y"] * 3
        # health checks are not counted
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    expected = {("Ok", "OK"): 2, ("Refuse", "INVALID_ARGUMENT"): 1, ("Crash", "INTERNAL"): 1}
    expected[("Stream", "OK")] = 1
    for (m, c), n in expected.items():
        assert _sample(name, {"method": m, "code": c}) - before[(m, c)] == n, (m, c)
    assert _sample(name, {"method": "Check", "code": "OK"}) == 0
    assert _sample("splitvl_test_request_duration_seconds_count", {"method": "Stream"}) >= 1
    assert _sample("splitvl_test_in_flight_requests", {"method": "Ok"}) == 0


async def test_interceptor_counts_cancels_and_passed_deadlines_as_the_client_saw_them() -> None:
    """A stream cancelled while its handler waits at a ``yield`` (its write blocked: the
    client stopped reading) ends the handler with GeneratorExit: counted CANCELLED, not
    UNKNOWN. A call whose deadline passes is counted DEADLINE_EXCEEDED, not CANCELLED."""
    import asyncio

    from tests.conftest import in_process_server

    big = b"x" * (1 << 20)

    async def endless(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        while True:
            yield big

    async def slow(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(30)
        return request

    async def slow_stream(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        yield request
        await asyncio.sleep(30)
        yield request

    add = bytes_service(
        "t.v1.EndService", {"Slow": slow}, {"Endless": endless, "SlowStream": slow_stream}
    )

    name = "splitvl_test_requests_total"
    cases = [("Endless", "CANCELLED"), ("Slow", "DEADLINE_EXCEEDED")]
    cases += [("SlowStream", "DEADLINE_EXCEEDED")]
    wrong = [(m, c) for m, _ in cases for c in ("UNKNOWN", "CANCELLED", "DEADLINE_EXCEEDED")]
    before = {k: _sample(name, {"method": k[0], "code": k[1]}) for k in wrong}
    async with in_process_server(add, None, "t.v1.EndService") as channel:
        call = channel.unary_stream("/t.v1.EndService/Endless")(b"")
        assert await call.read() == big
        await asyncio.sleep(0.5)  # the server fills the flow-control window and blocks
        call.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await channel.unary_unary("/t.v1.EndService/Slow")(b"x", timeout=0.2)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        stream = channel.unary_stream("/t.v1.EndService/SlowStream")(b"y", timeout=0.3)
        with pytest.raises(grpc.aio.AioRpcError) as late:
            async for _ in stream:
                pass
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        def counted() -> dict[tuple[str, str], float]:
            return {k: _sample(name, {"method": k[0], "code": k[1]}) - before[k] for k in wrong}

        for _ in range(50):  # the server finishes the handlers just after the client is told
            if sum(counted().values()) == len(cases):
                break
            await asyncio.sleep(0.05)
    got = counted()
    assert {k for k, n in got.items() if n} == set(cases), got
    assert all(got[k] == 1 for k in cases), got


# -- the cluster -----------------------------------------------------------------------------
def scrape(cluster, service: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """All samples of one service's /metrics, keyed by (name, sorted labels)."""
    url = f"http://127.0.0.1:{cluster.ports.metrics[service]}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class Delta:
    """Differences of one service's samples between two scrapes."""

    def __init__(self, before: dict, after: dict) -> None:
        self.before, self.after = before, after

    def names(self) -> set[str]:
        return {name for name, _ in self.after}

    def value(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        assert key in self.after, f"{name}{labels} is not exported"
        return self.after[key]

    def get(self, name: str, **labels: str) -> float:
        """Like calling it, but 0 for a sample not (yet) exported."""
        key = (name, tuple(sorted(labels.items())))
        return self.after.get(key, 0.0) - self.before.get(key, 0.0)

    def __call__(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        assert key in self.after, f"{name}{labels} is not exported"
        return self.after[key] - self.before.get(key, 0.0)


SERVICES = ("gateway", "encoder", "cache", "decoder")


@pytest.mark.e2e
def test_one_generate_moves_every_service_metric(cluster, tiny_model) -> None:
    width = load_vision_spec(tiny_model).embedding_width
    before = {s: scrape(cluster, s) for s in SERVICES}
    image = png_bytes(rgb("coffee.png").crop((11, 3, 331, 243)))  # unseen: a miss
    request = build_request([image], "What is this?", max_tokens=MAX_TOKENS, ignore_eos=True)
    result = generate(cluster.ports.address("gateway"), request, timeout_s=120)
    assert result.images[0]["tier"] == "miss" and len(result.token_ids) == MAX_TOKENS
    tokens = result.images[0]["tokens"]
    emb_bytes = tokens * width * FP32_BYTES

    # The cache Put runs beside the decode, and a server counts an RPC as its handler
    # returns, which can be just after the client has its status: wait for the counts.
    deadline = time.monotonic() + 15
    while True:
        after = {s: scrape(cluster, s) for s in SERVICES}
        gw, enc, cache, dec = (Delta(before[s], after[s]) for s in SERVICES)
        counted = [
            gw.get("splitvl_gateway_requests_total", method="Generate", code="OK"),
            dec.get("splitvl_decoder_requests_total", method="Generate", code="OK"),
            cache.get("splitvl_cache_requests_total", method="Put", code="OK"),
        ]
        if min(counted) >= 1:
            break
        assert time.monotonic() < deadline, f"requests not counted: {counted}"
        time.sleep(0.3)

    # gateway
    assert gw("splitvl_gateway_requests_total", method="Generate", code="OK") == 1
    assert gw("splitvl_gateway_request_duration_seconds_count", method="Generate") == 1
    assert gw.value("splitvl_gateway_in_flight_requests", method="Generate") == 0
    assert gw("splitvl_gateway_images_total") == 1
    assert gw("splitvl_gateway_cache_lookups_total", tier="miss") == 1
    assert gw("splitvl_gateway_time_to_first_token_seconds_count") == 1
    itl = gw("splitvl_gateway_inter_token_latency_seconds_count")
    assert 1 <= itl <= MAX_TOKENS - 1
    # References, not payloads: not one embedding byte through the gateway.
    for source in ("encoder", "cache"):
        assert gw.get("splitvl_gateway_embedding_received_bytes_total", source=source) == 0
    for destination in ("decoder", "cache"):
        sent = "splitvl_gateway_embedding_sent_bytes_total"
        assert gw.get(sent, destination=destination) == 0
    for stage in ("preprocess", "lookup", "encode", "decode"):
        assert gw("splitvl_gateway_stage_duration_seconds_count", stage=stage) == 1

    # encoder: one image, one batch of one
    assert enc("splitvl_encoder_requests_total", method="Encode", code="OK") == 1
    assert enc("splitvl_encoder_images_total") == 1
    assert enc("splitvl_encoder_batch_images_count") == 1
    assert enc("splitvl_encoder_batch_images_sum") == 1
    t, h, w = result.images[0]["grid"]
    patches = t * h * w
    assert enc("splitvl_encoder_batch_patches_sum") == patches
    assert enc("splitvl_encoder_queue_wait_seconds_count") == 1
    assert enc("splitvl_encoder_batch_duration_seconds_count") == 1
    assert enc.value("splitvl_encoder_queued_images") == 0
    assert enc("splitvl_encoder_embedding_sent_bytes_total") == 0  # held, not sent

    # cache: two Lookup calls (by the file's digest, then by pixel key after the decode),
    # one image counted once (a miss by file digest is not counted), one put
    assert cache("splitvl_cache_requests_total", method="Lookup", code="OK") == 2
    assert cache("splitvl_cache_lookups_total", tier="miss") == 1
    assert cache("splitvl_cache_lookups_total", tier="exact") == 0
    assert cache("splitvl_cache_puts_total") == 1
    # Stored: the embeddings plus the verification image (uint8 luma of the decoded 320x240
    # image at its own size and its Cb, Cr at 160x120, vlcommon.verification); 2 GiB budget,
    # nothing evicted.
    verify_bytes = 320 * 240 + 160 * 120 * 2
    assert cache("splitvl_cache_stored_bytes") == emb_bytes + verify_bytes

    # decoder
    assert dec("splitvl_decoder_requests_total", method="Generate", code="OK") == 1
    assert dec("splitvl_decoder_output_tokens_total") == MAX_TOKENS
    assert dec("splitvl_decoder_prompt_tokens_total") == result.usage["prompt_tokens"]
    received = "splitvl_decoder_embedding_received_bytes_total"
    assert dec(received, transport="shm", holder="encoder") == emb_bytes
    assert dec("splitvl_decoder_time_to_first_token_seconds_count") == 1
    assert 1 <= dec("splitvl_decoder_inter_token_latency_seconds_count") <= MAX_TOKENS - 1
    assert dec("splitvl_decoder_queue_wait_seconds_count") == 1
    assert dec("splitvl_decoder_prefill_duration_seconds_count") == 1
    # vLLM's scheduler stats reached our gauges (updated each engine step).
    assert 0.0 <= dec.value("splitvl_decoder_engine_kv_cache_usage_ratio") <= 1.0
    assert dec.value("splitvl_decoder_engine_running_requests") == 0
    assert dec.value("splitvl_decoder_engine_waiting_requests") == 0
    assert dec.value("splitvl_decoder_engine_unfinished_requests") == 0
    queried = dec("splitvl_decoder_engine_prefix_cache_queried_tokens_total")
    assert queried >= result.usage["prompt_tokens"]
    assert "vllm:kv_cache_usage_perc" in dec.names()


@pytest.mark.e2e
def test_refused_request_is_counted_with_its_status(cluster) -> None:
    before = scrape(cluster, "gateway")
    request = build_request([b"not an image"], "hi", max_tokens=2)
    with pytest.raises(grpc.RpcError) as err:
        generate(cluster.ports.address("gateway"), request, timeout_s=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    deadline = time.monotonic() + 10
    while True:  # counted as the handler returns, possibly just after the client's status
        gw = Delta(before, scrape(cluster, "gateway"))
        refused = {"method": "Generate", "code": "INVALID_ARGUMENT"}
        if gw.get("splitvl_gateway_requests_total", **refused) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert gw("splitvl_gateway_requests_total", method="Generate", code="INVALID_ARGUMENT") == 1
    assert gw("splitvl_gateway_requests_total", method="Generate", code="OK") == 0


@pytest.mark.e2e
def test_a_cache_hit_with_another_prompt_reuses_its_images_kv_in_the_decoder(cluster) -> None:
    """The decoder's CPU block size (``engine.CPU_BLOCK_SIZE`` = 32) lets vLLM's prefix
    cache reuse all but the last partial block of a repeated image's tokens.

    vLLM reuses whole blocks only: with its CPU default of 128 a prompt of ~100 image
    tokens reused none of them, so a cache hit still paid the image's whole prefill.
    """
    from decoder_service.engine import CPU_BLOCK_SIZE

    image = png_bytes(rgb("chelsea.png").crop((40, 20, 264, 244)))  # unseen 224x224 crop
    first = generate(
        cluster.ports.address("gateway"),
        build_request([image], "What is this?", max_tokens=2, ignore_eos=True),
        timeout_s=120,
    )
    assert first.images[0]["tier"] == "miss"
    tokens = first.images[0]["tokens"]
    assert tokens > CPU_BLOCK_SIZE  # else there is no whole block to reuse
    time.sleep(1.0)  # the first request's engine stats reach the decoder's counters
    before = scrape(cluster, "decoder")
    second = generate(
        cluster.ports.address("gateway"),
        build_request([image], "Describe the animal, please.", max_tokens=2, ignore_eos=True),
        timeout_s=120,
    )
    assert second.images[0]["tier"] == "exact"
    deadline = time.monotonic() + 15
    while True:
        dec = Delta(before, scrape(cluster, "decoder"))
        queried = dec.get("splitvl_decoder_engine_prefix_cache_queried_tokens_total")
        if queried >= second.usage["prompt_tokens"] or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert queried == second.usage["prompt_tokens"]
    hit = dec("splitvl_decoder_engine_prefix_cache_hit_tokens_total")
    # The prompt is the chat header, the image's tokens, then the text that differs:
    # every whole block before the text is reused, so at most one block of the image is
    # prefilled again; and the differing text never is reused.
    assert hit % CPU_BLOCK_SIZE == 0
    assert tokens - CPU_BLOCK_SIZE < hit < second.usage["prompt_tokens"] - 1


async def test_the_services_interceptors_wrap_each_streamed_message_once() -> None:
    """Metrics, readiness, admission and the error mapping run as one chain
    (vlcommon.interceptors.AroundChain): a streamed message passes through one of the
    project's wrapper generators, not one per interceptor, and the contexts still nest in
    order (the outer metrics interceptor sees the status the inner error mapping set)."""
    import inspect

    from tests.conftest import in_process_server

    depth: list[int] = []

    async def stream(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        for _ in range(3):
            frames = [f.function for f in inspect.stack(context=0)]
            depth.append(frames.count("streaming"))
            yield request
        await abort(context, invalid_argument("BAD", "bad input", field="x"))

    add = bytes_service("t.v1.ChainService", {}, {"Stream": stream})
    name = "splitvl_test_requests_total"
    labels = {"method": "Stream", "code": "INVALID_ARGUMENT"}
    before = _sample(name, labels)
    async with in_process_server(add, None, "t.v1.ChainService") as channel:
        call = channel.unary_stream("/t.v1.ChainService/Stream")(b"z")
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for message in call:
                got.append(message)
    assert got == [b"z"] * 3 and refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert depth == [1, 1, 1]  # as three interceptors (metrics, admission, errors): 3
    assert _sample(name, labels) - before == 1
