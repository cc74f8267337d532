"""Golden tests of the gateway's public contract, recorded from the code before the gateway
became a pipeline with thin gRPC and OpenAI adapters; they must pass unchanged after it.

What is frozen (values recorded from real runs, in ``tests/golden/*.json``):

1. gRPC ``GatewayService/Generate``: for each request of :data:`GRPC_CASES` that the
   gateway refuses, the status code, the ``google.rpc.ErrorInfo`` (reason, domain,
   metadata: field, limit, ...), the message, any ``retry-after-ms``, and that no response
   came before the status. In process (the real servicer, its dependencies on a closed
   port, as ``tests/unit/gateway/test_intake.py`` runs it) and again through the session cluster's
   gateway (e2e), against the same golden answers. For a valid request (a real photo,
   greedy, 8 tokens) the response stream: tokens, text, finish reason, usage, the images'
   info, which fields ride on which chunk, which StageTimings fields are set (not their
   values); a miss, then an exact hit of the same file.
2. The OpenAI front (``/v1/chat/completions`` of the cluster's gateway): for each body of
   :data:`OPENAI_CASES`, the HTTP status, the JSON error and ``Retry-After``; a completion
   (volatile fields normalised), the SSE byte stream of a one-token stream with
   ``stream_options.include_usage`` (ids, ``created`` and timing values normalised) and
   the event structure of a longer one; ``/v1/models``, ``/health``, a 404 path, 405, an
   unparsable body, an oversized body, a compressed one.
3. Operators: every metric name and label that ``deploy/grafana``, ``deploy/prometheus/
   alerts.yml`` and ``docs/observability.md`` name is in the services' ``/metrics``
   scrapes after traffic; the names (and counts) of the spans the gateway emits for a
   text-only request, an image miss, an exact hit, and an OpenAI request.
4. ``test_shared_rules_*``: the rules the gRPC front, the OpenAI front and the decoder all
   apply give the same ErrorInfo reason at each (where they differ today, the difference
   is recorded, see :data:`SHARED_RULE_DIVERGENCES`).

Not repeated here (already frozen elsewhere): the edges of each limit (``test_intake.py``),
the OpenAI conversion and its unit-level refusals (``test_openai_front.py``), the metric
deltas of one request (``test_metrics.py``), the span tree's parents and attributes
(``test_traces.py``), the shared grid rule (``test_request_contract.py``).

Re-recording (only when a change of the contract is intended; review the diff)::

    SPLITVL_RECORD_GOLDEN=1 pytest tests/e2e/test_golden_contract.py

writes the answers of the tests that ran into ``tests/golden/``, entry by entry; every
other run compares and fails on any difference.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
import secrets
import socket
import struct
import time
import urllib.request
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml
from google.protobuf.json_format import MessageToDict
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from qwenvl.common.v1 import tensor_pb2
from qwenvl.decoder.v1 import decoder_service_pb2 as dpb
from qwenvl.decoder.v1 import decoder_service_pb2_grpc as dpb_grpc
from qwenvl.gateway.v1 import gateway_service_pb2 as gpb
from qwenvl.gateway.v1 import gateway_service_pb2_grpc as gpb_grpc

from tests.conftest import LONG_STREAM_TOKENS, case_file, png_bytes, rgb
from vlcommon.errors import ServiceError, error_info

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parents[1] / "golden"
RECORD = os.environ.get("SPLITVL_RECORD_GOLDEN") == "1"
MiB = 1024 * 1024
# Big enough for the 20 MiB image of "image_bytes_too_large" (the default is 4 MiB).
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 * MiB)]


# -- golden files ----------------------------------------------------------------------------
def golden(name: str, key: str, actual: Any, *, record: bool = True) -> None:
    """Compare ``actual`` with entry ``key`` of ``tests/golden/<name>.json``; with
    ``SPLITVL_RECORD_GOLDEN=1`` write it there instead (unless ``record`` is False: a
    second path to answers another test records)."""
    path = GOLDEN / f"{name}.json"
    actual = json.loads(json.dumps(actual))  # tuples -> lists, as the file holds them
    if RECORD and record:
        GOLDEN.mkdir(exist_ok=True)
        data = json.loads(path.read_text()) if path.exists() else {}
        data[key] = actual
        path.write_text(json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
        return
    assert path.exists(), f"{path} is missing: record it with SPLITVL_RECORD_GOLDEN=1"
    data = json.loads(path.read_text())
    assert key in data, f"{name}.json has no entry {key!r}: record it with SPLITVL_RECORD_GOLDEN=1"
    assert actual == data[key], f"{name}.json[{key!r}] changed"


def golden_keys(name: str) -> set[str]:
    path = GOLDEN / f"{name}.json"
    return set(json.loads(path.read_text())) if path.exists() else set()


# -- inputs ----------------------------------------------------------------------------------
TINY_PNG = png_bytes(Image.new("RGB", (40, 40), (90, 20, 200)))


def header_only_png(width: int, height: int) -> bytes:
    """A PNG of ``width`` x ``height`` with no pixel data: its header alone is refused
    (the pixel limits are checked before anything is decoded)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


BIG_HEADER = header_only_png(7000, 6000)  # 42 M pixels: over the 40 M per image


def photo_png(name: str, box: tuple[int, int, int, int]) -> bytes:
    """A crop of one of scikit-image's photos that no other test sends (a cache miss)."""
    return png_bytes(rgb(name).crop(box))


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


# -- gRPC requests ---------------------------------------------------------------------------
def text(t: str) -> gpb.ContentPart:
    return gpb.ContentPart(text=t)


def image(data: bytes) -> gpb.ContentPart:
    return gpb.ContentPart(image=gpb.ImageInput(data=data))


def video(**fields: Any) -> gpb.ContentPart:
    return gpb.ContentPart(video=gpb.VideoInput(**fields))


def frames(n: int) -> list[gpb.ImageInput]:
    return [gpb.ImageInput(data=TINY_PNG)] * n


def request(
    *parts: gpb.ContentPart, max_tokens: int | None = 4, **fields: Any
) -> gpb.GenerateRequest:
    r = gpb.GenerateRequest(**fields)
    r.messages.add(role="user").parts.extend(parts or [text("hi")])
    if max_tokens is not None:
        r.sampling.max_tokens = max_tokens
    return r


def with_sampling(**fields: Any) -> gpb.GenerateRequest:
    r = request(image(TINY_PNG), text("hi"))
    for name, value in fields.items():
        if name == "stop":
            r.sampling.stop.extend(value)
        else:
            setattr(r.sampling, name, value)
    return r


def with_messages(n: int) -> gpb.GenerateRequest:
    r = gpb.GenerateRequest()
    for _ in range(n):
        r.messages.add(role="user").parts.add(text="x")
    r.sampling.max_tokens = 4
    return r


def with_role(role: str) -> gpb.GenerateRequest:
    r = request()
    r.messages[0].role = role
    return r


def with_budget(lo: int, hi: int) -> gpb.GenerateRequest:
    r = request(image(TINY_PNG))
    r.pixel_budget.min_pixels, r.pixel_budget.max_pixels = lo, hi
    return r


def no_parts() -> gpb.GenerateRequest:
    r = request()
    r.messages.add(role="user")
    return r


def from_case(name: str) -> bytes:
    return case_file(name).read_bytes()


# Each request the gateway refuses, by the rule it breaks (gateway/servicer.py, media.py,
# video.py, fetch.py; vlcommon/request_rules.py, sampling.py, imaging.py). The limits are
# the defaults, as the session cluster's gateway has them (but max_tokens_limit, which the
# cluster raises to LONG_STREAM_TOKENS).
GRPC_CASES: dict[str, Callable[[], gpb.GenerateRequest]] = {
    "messages_empty": lambda: gpb.GenerateRequest(),
    "too_many_messages": lambda: with_messages(65),
    "too_many_parts": lambda: request(*[text("x")] * 257),
    "too_many_images": lambda: request(*[image(TINY_PNG)] * 9),
    "too_many_videos": lambda: request(*[video(frames=frames(2))] * 3),
    "text_too_long": lambda: request(text("x" * 65537)),
    "role_invalid": lambda: with_role("tool"),
    "role_empty": lambda: with_role(""),
    "parts_empty": no_parts,
    "part_empty": lambda: request(gpb.ContentPart()),
    "control_token_c05": lambda: request(text("Describe <|image_pad|> this.")),
    "control_token_across_parts": lambda: request(text("a <|vision"), text("_start|> b")),
    "max_tokens_zero": lambda: request(max_tokens=0),
    "max_tokens_over_limit": lambda: request(max_tokens=LONG_STREAM_TOKENS + 1),
    "temperature_over": lambda: with_sampling(temperature=2.5),
    "temperature_nan": lambda: with_sampling(temperature=float("nan")),
    "top_p_over": lambda: with_sampling(top_p=1.5),
    "top_p_negative": lambda: with_sampling(top_p=-0.5),
    "stop_empty_string": lambda: with_sampling(stop=[""]),
    "stop_too_many": lambda: with_sampling(stop=["x"] * 17),
    "stop_too_long": lambda: with_sampling(stop=["x" * 257]),
    "cache_policy_invalid": lambda: request(cache_policy=99),
    "pixel_budget_below_floor": lambda: with_budget(1, 0),
    "pixel_budget_inverted": lambda: with_budget(8192, 4096),
    "pixel_budget_over_model": lambda: with_budget(0, 10**9),
    "image_source_missing": lambda: request(gpb.ContentPart(image=gpb.ImageInput())),
    "image_data_url_not_base64": lambda: request(
        gpb.ContentPart(image=gpb.ImageInput(data_url="data:image/png,abc"))
    ),
    "image_data_url_media_type": lambda: request(
        gpb.ContentPart(image=gpb.ImageInput(data_url="data:text/plain;base64,aGk="))
    ),
    "image_data_url_bad_base64": lambda: request(
        gpb.ContentPart(image=gpb.ImageInput(data_url="data:image/png;base64,@@@@"))
    ),
    "image_bytes_too_large": lambda: request(image(TINY_PNG + b"\0" * (20 * MiB))),
    "image_not_an_image_b07": lambda: request(image(from_case("b07_not_an_image.jpg"))),
    "image_empty_b07": lambda: request(image(from_case("b07_empty.png"))),
    "image_truncated_b07": lambda: request(image(from_case("b07_truncated.jpg"))),
    "image_aspect_218_b03": lambda: request(image(from_case("b03_aspect_218_1093x5.png"))),
    "image_too_many_pixels": lambda: request(image(BIG_HEADER)),
    "request_too_many_pixels": lambda: request(image(BIG_HEADER), image(BIG_HEADER)),
    "image_url_disabled": lambda: request(
        gpb.ContentPart(image=gpb.ImageInput(url="http://example.com/a.png"))
    ),
    "video_source_ambiguous": lambda: request(
        video(file=gpb.VideoFile(data=b"x"), frames=frames(2))
    ),
    "video_too_few_frames": lambda: request(video()),
    "video_fps_negative": lambda: request(video(frames=frames(2), fps=-1.0)),
    "video_sample_fps_over": lambda: request(video(frames=frames(2), sample_fps=9.0)),
    "video_max_frames_over": lambda: request(video(frames=frames(2), max_frames=769)),
    "video_max_pixels_out_of_range": lambda: request(video(frames=frames(2), max_pixels=1)),
    "video_source_missing": lambda: request(video(file=gpb.VideoFile())),
    "video_frame_url": lambda: request(
        video(frames=[gpb.ImageInput(url="http://example.com/f.png")] * 2)
    ),
    "video_too_many_frames": lambda: request(video(frames=frames(769))),
    "video_url_disabled": lambda: request(
        video(file=gpb.VideoFile(url="http://example.com/v.mp4"))
    ),
    "video_data_url_media_type": lambda: request(
        video(file=gpb.VideoFile(data_url="data:text/plain;base64,aGk="))
    ),
    "video_truncated_c17": lambda: request(
        video(file=gpb.VideoFile(data=from_case("c17_truncated.mp4")))
    ),
    "video_audio_only_c18": lambda: request(
        video(file=gpb.VideoFile(data=from_case("c18_audio_only.mp4")))
    ),
    "video_frame_not_an_image": lambda: request(
        video(frames=[gpb.ImageInput(data=b"not an image")] * 2)
    ),
}

# With GATEWAY_ALLOW_URLS on (in process only: the cluster's gateway has URLs off): the
# checks that run on the URL itself, before any network work (gateway/fetch.py).
URL_CASES: dict[str, Callable[[], gpb.GenerateRequest]] = {
    "url_scheme_ftp": lambda: request(gpb.ContentPart(image=gpb.ImageInput(url="ftp://x.test/a"))),
    "url_no_host": lambda: request(gpb.ContentPart(image=gpb.ImageInput(url="http:///a.png"))),
    "url_loopback": lambda: request(
        gpb.ContentPart(image=gpb.ImageInput(url="http://127.0.0.1:1/a.png"))
    ),
    "url_cloud_metadata": lambda: request(
        gpb.ContentPart(image=gpb.ImageInput(url="http://169.254.169.254/latest"))
    ),
    "url_too_long": lambda: request(
        gpb.ContentPart(image=gpb.ImageInput(url="http://x.test/" + "a" * 8200))
    ),
    "video_url_loopback": lambda: request(
        video(file=gpb.VideoFile(url="http://127.0.0.1:1/v.mp4"))
    ),
}


def refusal_record(err: grpc.RpcError, responses: int) -> dict[str, Any]:
    """What a client sees of a refused call (``responses``: how many came before it)."""
    info = error_info(err)  # type: ignore[arg-type]
    trailers = dict(err.trailing_metadata() or ())  # type: ignore[attr-defined]
    return {
        "code": err.code().name,  # type: ignore[attr-defined]
        "message": err.details(),  # type: ignore[attr-defined]
        "reason": info.reason if info is not None else None,
        "domain": info.domain if info is not None else None,
        "metadata": dict(sorted(info.metadata.items())) if info is not None else None,
        "retry_after_ms": trailers.get("retry-after-ms"),
        "responses_before": responses,
    }


async def refuse_async(stub: gpb_grpc.GatewayServiceStub, r: gpb.GenerateRequest) -> dict[str, Any]:
    n = 0
    try:
        async for _ in stub.Generate(r, timeout=60):
            n += 1
    except grpc.aio.AioRpcError as err:
        return refusal_record(err, n)
    raise AssertionError(f"accepted, {n} responses")


def refuse_sync(stub: gpb_grpc.GatewayServiceStub, r: gpb.GenerateRequest) -> dict[str, Any]:
    n = 0
    try:
        for _ in stub.Generate(r, timeout=60):
            n += 1
    except grpc.RpcError as err:
        return refusal_record(err, n)
    raise AssertionError(f"accepted, {n} responses")


# -- 1. gRPC refusals --------------------------------------------------------------------------
def cluster_like() -> dict[str, Any]:
    """Overrides of ``tests.unit.gateway.test_intake.gateway`` for the session cluster's gateway
    settings:
    its small LIMITS dropped (the defaults apply), max_tokens_limit as the cluster sets it."""
    from tests.unit.gateway.test_intake import LIMITS

    return {**dict.fromkeys(LIMITS), "max_tokens_limit": LONG_STREAM_TOKENS}


@pytest.fixture(scope="module")
async def in_process(tiny_model: Path) -> AsyncIterator[gpb_grpc.GatewayServiceStub]:
    """The real gateway servicer on loopback, its encoder and decoder on a closed port and
    no cache (``tests/unit/gateway/test_intake.py``'s harness): every refusal here comes before any
    downstream call."""
    from tests.unit.gateway.test_intake import gateway

    async with gateway(tiny_model, **cluster_like()) as stub:
        yield stub


@pytest.fixture(scope="module")
async def in_process_urls(tiny_model: Path) -> AsyncIterator[gpb_grpc.GatewayServiceStub]:
    from tests.unit.gateway.test_intake import gateway

    async with gateway(tiny_model, **cluster_like(), allow_urls=True) as stub:
        yield stub


@pytest.fixture(scope="module")
def gateway_stub(cluster: Any) -> Iterator[gpb_grpc.GatewayServiceStub]:
    with grpc.insecure_channel(cluster.ports.address("gateway"), options=CHANNEL_OPTIONS) as ch:
        yield gpb_grpc.GatewayServiceStub(ch)


@pytest.mark.parametrize("case", sorted(GRPC_CASES))
async def test_grpc_refusal_in_process(in_process: gpb_grpc.GatewayServiceStub, case: str) -> None:
    golden("grpc_refusals", case, await refuse_async(in_process, GRPC_CASES[case]()))


@pytest.mark.parametrize("case", sorted(URL_CASES))
async def test_grpc_url_refusal_in_process(
    in_process_urls: gpb_grpc.GatewayServiceStub, case: str
) -> None:
    golden("grpc_url_refusals", case, await refuse_async(in_process_urls, URL_CASES[case]()))


@pytest.mark.parametrize("case", sorted(GRPC_CASES))
def test_grpc_refusal_through_the_cluster(
    gateway_stub: gpb_grpc.GatewayServiceStub, case: str
) -> None:
    """The same answers end to end (a cache in front, the launcher's settings): compared
    with the in-process recording, never recorded itself."""
    golden("grpc_refusals", case, refuse_sync(gateway_stub, GRPC_CASES[case]()), record=False)


# -- 1. gRPC: a valid stream -------------------------------------------------------------------
CHUNK_BODY = {"token_ids", "text"}


def stream_record(chunks: list[gpb.GenerateResponse]) -> dict[str, Any]:
    """The contract of one answered stream: its tokens and text, which fields ride on the
    first and the last chunk, the images' info (the key by its form, not its digest) and
    which StageTimings fields are set.

    Not recorded: a miss's similarity (the score of the nearest entry stored, whatever
    other tests sent), how many chunks (vLLM merges the deltas of a consumer that lags:
    8 tokens came in 6 to 8 chunks over 30 calls on a loaded host), the timing values,
    and whether ``put_ms`` is set (the put runs beside the decode: set only if it ended
    before the last token).
    """
    dicts = [MessageToDict(c, preserving_proto_field_name=True) for c in chunks]
    first, last = dicts[0], dicts[-1]
    images = []
    for info in first.get("images", []):
        info = dict(info)
        info["key"] = re.sub(r"[0-9a-f]", "x", info.get("key", ""))
        if info["tier"] == "CACHE_TIER_MISS":
            # A miss reports its nearest entry's score: whatever other tests stored.
            info["similarity"] = "<nearest score>"
        images.append(info)
    middle: set[str] = set().union(*(set(d) for d in dicts[1:-1]))
    return {
        "token_ids": [t for d in dicts for t in d.get("token_ids", [])],
        "text": "".join(d.get("text", "") for d in dicts),
        "finish_reason": last.get("finish_reason"),
        "usage": last.get("usage"),
        "images": images,
        "videos": first.get("videos", []),
        "first_chunk_fields": sorted(set(first) - CHUNK_BODY),
        "last_chunk_fields": sorted(set(last) - CHUNK_BODY),
        "middle_chunk_fields": sorted(middle - CHUNK_BODY),
        "timings_set": sorted(set(last.get("timings", {})) - {"put_ms"}),
        "every_chunk_has_tokens": all(d.get("token_ids") for d in dicts),
    }


def test_grpc_stream_of_a_miss_then_an_exact_hit(gateway_stub: gpb_grpc.GatewayServiceStub) -> None:
    photo = photo_png("retina.jpg", (120, 90, 344, 258))  # 224x168, sent by no other test
    r = request(image(photo), text("Describe this image."), max_tokens=8)
    r.sampling.temperature, r.sampling.ignore_eos = 0.0, True
    for key in ("miss", "exact_hit"):
        chunks = list(gateway_stub.Generate(r, timeout=120))
        assert 2 <= len(chunks) <= 8, len(chunks)
        golden("grpc_stream", key, stream_record(chunks))


# -- 2. the OpenAI front -----------------------------------------------------------------------
def user(content: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4}


def image_part(data: bytes, mime: str = "image/png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(data, mime)}}


def text_part(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def with_fields(**fields: Any) -> dict[str, Any]:
    return {**user("hi"), **fields}


# The refusals of the gRPC table that a chat completion can express, and the front's own.
OPENAI_CASES: dict[str, Callable[[], Any]] = {
    "messages_empty": lambda: {"messages": []},
    "messages_missing": lambda: {"max_tokens": 4},
    "body_not_an_object": lambda: [],
    "too_many_messages": lambda: {"messages": [{"role": "user", "content": "x"}] * 65},
    "too_many_parts": lambda: user([text_part("x")] * 257),
    "too_many_images": lambda: user([image_part(TINY_PNG)] * 9),
    "too_many_videos": lambda: user(
        [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}] * 3
    ),
    "text_too_long": lambda: user("x" * 65537),
    "role_invalid": lambda: {"messages": [{"role": "tool", "content": "x"}]},
    "parts_empty_list": lambda: user([]),
    "parts_empty_null": lambda: user(None),
    "part_without_text": lambda: user([{"type": "text"}]),
    "part_type_unknown": lambda: user([{"type": "input_audio"}]),
    "control_token_c05": lambda: user("Describe <|image_pad|> this."),
    "max_tokens_zero": lambda: with_fields(max_tokens=0),
    "max_tokens_over_limit": lambda: with_fields(max_tokens=LONG_STREAM_TOKENS + 1),
    "max_completion_tokens_over_limit": lambda: {
        **user("hi"),
        "max_tokens": None,
        "max_completion_tokens": LONG_STREAM_TOKENS + 1,
    },
    "max_tokens_string": lambda: with_fields(max_tokens="5"),
    "temperature_over": lambda: with_fields(temperature=2.5),
    "top_p_over": lambda: with_fields(top_p=1.5),
    "top_p_zero": lambda: with_fields(top_p=0),
    "stop_empty_string": lambda: with_fields(stop=[""]),
    "stop_too_many": lambda: with_fields(stop=["x"] * 17),
    "model_not_found": lambda: with_fields(model="gpt-4o"),
    "n_two": lambda: with_fields(n=2),
    "parameter_unknown": lambda: with_fields(frobnicate=1),
    "image_not_an_image_b07": lambda: user(
        [image_part(from_case("b07_not_an_image.jpg"), "image/jpeg"), text_part("hi")]
    ),
    "image_not_an_image_b07_stream": lambda: {
        **user([image_part(from_case("b07_not_an_image.jpg"), "image/jpeg"), text_part("hi")]),
        "stream": True,
    },
    "image_aspect_218_b03": lambda: user(
        [image_part(from_case("b03_aspect_218_1093x5.png")), text_part("hi")]
    ),
    "image_data_url_media_type": lambda: user([image_part(b"hi", "text/plain")]),
    "image_url_disabled": lambda: user(
        [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]
    ),
    "image_too_many_pixels": lambda: user([image_part(BIG_HEADER)]),
    "request_too_many_pixels": lambda: user([image_part(BIG_HEADER), image_part(BIG_HEADER)]),
    "video_truncated_c17": lambda: user(
        [
            {
                "type": "video_url",
                "video_url": {"url": data_url(from_case("c17_truncated.mp4"), "video/mp4")},
            }
        ]
    ),
}


@pytest.fixture(scope="module")
def http(cluster: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{cluster.ports.http}", timeout=120) as client:
        yield client


def normalise(value: Any, model: str, key: str | None = None) -> Any:
    """An OpenAI JSON body with what changes from call to call replaced: the completion id,
    ``created``, timing values (``*_ms``) and the served model's (temporary) path."""
    if isinstance(value, dict):
        return {k: normalise(v, model, k) for k, v in value.items()}
    if isinstance(value, list):
        return [normalise(v, model) for v in value]
    if isinstance(value, str):
        if key == "id" and re.fullmatch(r"chatcmpl-[0-9a-f]{32}", value):
            return "chatcmpl-<id>"
        return value.replace(model, "<model>")
    if key == "created" and isinstance(value, int):
        assert abs(value - time.time()) < 600, value
        return "<created>"
    if key is not None and key.endswith("_ms") and isinstance(value, int | float):
        return "<ms>"
    return value


def http_record(response: httpx.Response, model: str) -> dict[str, Any]:
    try:
        body: Any = normalise(response.json(), model)
    except ValueError:
        body = response.text
    return {
        "status": response.status_code,
        "content_type": response.headers.get("content-type"),
        "retry_after": response.headers.get("retry-after"),
        "body": body,
    }


@pytest.mark.parametrize("case", sorted(OPENAI_CASES))
def test_openai_refusal(http: httpx.Client, cluster: Any, case: str) -> None:
    response = http.post("/v1/chat/completions", json=OPENAI_CASES[case]())
    assert response.status_code >= 400, response.text
    golden("openai_refusals", case, http_record(response, cluster.model))


def raw_exchange(port: int, head: bytes) -> bytes:
    """``head`` sent on a plain socket; the whole answer (the server closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def outside_the_api(http: httpx.Client, port: int, case: str) -> httpx.Response | bytes:
    chat = "/v1/chat/completions"
    body = json.dumps(user("hi")).encode()
    if case == "models":
        return http.get("/v1/models")
    if case == "health":
        return http.get("/health")
    if case == "path_not_found":
        return http.get("/v1/nope")
    if case == "method_not_allowed":
        return http.get(chat)
    if case == "body_not_json":
        return http.post(
            chat, content=b'{"messages": [', headers={"content-type": "application/json"}
        )
    if case == "body_gzip":
        headers = {"content-type": "application/json", "content-encoding": "gzip"}
        return http.post(chat, content=gzip.compress(body), headers=headers)
    assert case == "body_over_the_limit"
    # Refused by its Content-Length alone, before a byte of it is read: nothing is sent.
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n"
    )
    return raw_exchange(port, head)


OUTSIDE_CASES = (
    "models",
    "health",
    "path_not_found",
    "method_not_allowed",
    "body_not_json",
    "body_gzip",
    "body_over_the_limit",
)


@pytest.mark.parametrize("case", OUTSIDE_CASES)
def test_openai_outside_the_chat_api(http: httpx.Client, cluster: Any, case: str) -> None:
    got = outside_the_api(http, cluster.ports.http, case)
    if isinstance(got, bytes):  # a raw HTTP/1.1 answer
        head, _, body = got.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        record = {
            "status_line": lines[0],
            "content_type": headers.get("content-type"),
            "retry_after": headers.get("retry-after"),
            "body": normalise(json.loads(body), cluster.model),
        }
    else:
        record = http_record(got, cluster.model)
    golden("openai_outside", case, record)


def completion(content: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "ignore_eos": True,
        **fields,
    }


def sse_text(raw: str, model: str) -> str:
    """An SSE answer with its id, ``created``, timing values and model path replaced."""
    ids = set(re.findall(r'"id": "(chatcmpl-[0-9a-f]{32})"', raw))
    assert len(ids) == 1, ids  # one id for every chunk
    assert len(set(re.findall(r'"created": (\d+)', raw))) == 1
    raw = re.sub(r'"id": "chatcmpl-[0-9a-f]{32}"', '"id": "chatcmpl-<id>"', raw)
    raw = re.sub(r'"created": \d+', '"created": "<created>"', raw)
    raw = re.sub(r'"(\w+_ms)": [-0-9.e+]+', r'"\1": "<ms>"', raw)
    return raw.replace(json.dumps(model)[1:-1], "<model>")


def sse_events(raw: str) -> list[str]:
    """The events of an SSE body, each exactly ``data: <payload>\\n\\n``."""
    assert raw.endswith("\n\n"), raw[-80:]
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return events


def test_openai_completion_and_streams(http: httpx.Client, cluster: Any) -> None:
    """A completion of an unseen photo (a miss), then two streams of it (exact hits): one
    of a single token, frozen byte for byte (normalised), and one of 8 tokens, frozen by
    its events' form (how many chunks carry the tokens is vLLM's, see stream_record)."""
    photo = photo_png("ihc.png", (60, 40, 284, 208))  # 224x168, sent by no other test
    content = [image_part(photo), text_part("Describe this image.")]
    answer = http.post("/v1/chat/completions", json=completion(content, max_tokens=8))
    assert answer.status_code == 200, answer.text
    record = http_record(answer, cluster.model)
    for info in record["body"]["splitvl"]["images"]:
        if info["tier"] == "miss":  # the nearest entry's score: whatever other tests stored
            info["similarity"] = "<nearest score>"
    golden("openai_completion", "non_stream_miss", record)
    text_of_8 = answer.json()["choices"][0]["message"]["content"]

    one = completion(content, max_tokens=1, stream=True, stream_options={"include_usage": True})
    with http.stream("POST", "/v1/chat/completions", json=one) as response:
        raw = response.read().decode()
    assert response.status_code == 200
    golden(
        "openai_completion",
        "stream_one_token_exact_hit",
        {
            "status": response.status_code,
            "content_type": response.headers.get("content-type"),
            "events": sse_events(sse_text(raw, cluster.model)),
        },
    )

    eight = completion(content, max_tokens=8, stream=True, stream_options={"include_usage": True})
    with http.stream("POST", "/v1/chat/completions", json=eight) as response:
        raw = response.read().decode()
    events = sse_events(sse_text(raw, cluster.model))
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    content_chunks = chunks[1:-1]
    assert 1 <= len(content_chunks) <= 8, len(content_chunks)
    joined = "".join(c["choices"][0]["delta"]["content"] for c in content_chunks)
    assert joined == text_of_8  # the stream says what the completion said
    for c in content_chunks:  # the one varying thing: the text of each
        c["choices"][0]["delta"]["content"] = "<text>"
    # Every content chunk but the last is the last one without its finish reason.
    form = json.loads(json.dumps(content_chunks[-1]))
    form["choices"][0]["finish_reason"] = None
    assert all(c == form for c in content_chunks[:-1]), content_chunks
    golden(
        "openai_completion",
        "stream_eight_tokens_exact_hit",
        {
            "role_chunk": chunks[0],
            "last_content_chunk": content_chunks[-1],
            "usage_chunk": chunks[-1],
        },
    )


# -- 3. operators: metrics and spans -----------------------------------------------------------
SERVICES = ("gateway", "encoder", "cache", "decoder")
METRIC = re.compile(r"\b(splitvl_[a-z0-9_]+|vllm:[a-z0-9_:]+)")
# Labels Prometheus adds (instance, job) or a histogram's own (le).
NOT_SERVICE_LABELS = {"le", "quantile", "instance", "job", "__name__"}
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("_count", "_sum", "_created"),
}


def scrape(cluster: Any, service: str) -> dict[str, set[str] | None]:
    """Every series name a service's /metrics exposes (sample names included), with the
    label names its samples carry (None: a labelled family with no child yet)."""
    url = f"http://127.0.0.1:{cluster.ports.metrics[service]}/metrics"
    out: dict[str, set[str] | None] = {}
    for family in text_string_to_metric_families(
        urllib.request.urlopen(url, timeout=10).read().decode()
    ):
        labels = {k for s in family.samples for k in s.labels} - NOT_SERVICE_LABELS
        for name in (family.name, *(family.name + s for s in SUFFIXES.get(family.type, ()))):
            out[name] = labels if family.samples else None
    return out


def registry_labels(name: str) -> set[str]:
    """The label names the code declares for ``name`` (this process's registry)."""
    import importlib

    from prometheus_client import REGISTRY

    for module in (
        "gateway.metrics",
        "encoder_service.metrics",
        "cache_service.metrics",
        "decoder_service.metrics",
        "vlcommon.handoff",
    ):
        importlib.import_module(module)
    collector = REGISTRY._names_to_collectors.get(name)  # type: ignore[attr-defined]
    assert collector is not None, f"{name} is declared by no module"
    return set(getattr(collector, "_labelnames", ()))


def promql_references(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and the label names (grouping and matchers) of one expression."""
    names = set(METRIC.findall(expr))
    labels: set[str] = set()
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        labels |= {x.strip() for x in group.split(",") if x.strip()}
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
    return names, labels - NOT_SERVICE_LABELS


def operator_queries() -> dict[str, str]:
    """Every PromQL expression operators run: alert rules, dashboard panels, the guide's
    useful queries; by where it is."""
    out = {}
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            out[f"alerts.yml {rule['alert']}"] = rule["expr"]
    for path in sorted((ROOT / "deploy" / "grafana").rglob("*.json")):
        for panel in json.loads(path.read_text()).get("panels", []):
            for k, target in enumerate(panel.get("targets", [])):
                out[f"{path.name} panel {panel['id']} target {k}"] = target["expr"]
    doc = (ROOT / "docs" / "observability.md").read_text()
    for block in re.findall(r"```promql\n(.*?)```", doc, re.DOTALL):
        current: list[str] = []
        title = ""
        for line in [*block.splitlines(), "# end"]:
            if line.startswith("#"):
                if current:
                    out[f"observability.md {title}"] = "\n".join(current)
                current, title = [], line.lstrip("# ")
            elif line.strip():
                current.append(line)
    return out


def documented_metrics() -> dict[str, set[str]]:
    """The metric tables of docs/observability.md: each name (``<svc>`` expanded, a
    ``..._x`` abbreviation completed from the name before it) with its label names (the
    first backticked word of each comma-separated entry; a parenthesised one, such as
    ``(`reason`)`` of the puts row that only one of its two names has, is left out), and
    the ``vllm:*`` names of the prose."""
    out: dict[str, set[str]] = {}
    doc = (ROOT / "docs" / "observability.md").read_text()
    for row in re.findall(r"^\| `splitvl_.*$", doc, re.MULTILINE):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        names: list[str] = []
        for token in re.findall(r"`([^`]+)`", cells[0]):
            if token.startswith("..._"):
                tail = token.removeprefix("..._").split("_")
                token = "_".join(names[-1].split("_")[: -len(tail)] + tail)
            if "<svc>" in token:
                names.extend(token.replace("<svc>", s) for s in SERVICES)
            else:
                names.append(token)
        labels_cell = re.sub(r"\([^)]*\)", "", cells[2])
        labels = {m for piece in labels_cell.split(",") for m in re.findall(r"`(\w+)`", piece)[:1]}
        for name in names:
            out[name] = labels
    # vLLM's own series, named in the prose: "Those vllm:* series appear on the decoder's port".
    out.update((name, set()) for name in re.findall(r"`(vllm:[a-z0-9_:]+)`", doc))
    return out


def exporting_services(name: str) -> tuple[str, ...]:
    if name.startswith("vllm:"):
        return ("decoder",)
    if name.startswith("splitvl_handoff_"):
        return ("encoder", "cache")  # the holders of embeddings
    service = name.split("_")[1]
    assert service in SERVICES, name
    return (service,)


def test_every_metric_operators_use_is_exported(
    cluster: Any, gateway_stub: gpb_grpc.GatewayServiceStub, http: httpx.Client
) -> None:
    """After traffic (an image through gRPC, a text through the OpenAI front), each metric
    a dashboard panel, an alert or the observability guide names is in the /metrics of
    the service that owns it, with every label the query groups or filters by and every
    label the guide lists. (test_deploy.py checks the names against the modules; this
    against what the running services expose.)"""
    r = request(image(TINY_PNG), text("hi"), max_tokens=2)
    assert list(gateway_stub.Generate(r, timeout=120))
    assert http.post("/v1/chat/completions", json=user("hi")).status_code == 200
    scrapes = {s: scrape(cluster, s) for s in SERVICES}

    def labels_of(name: str, service: str) -> set[str]:
        found = scrapes[service][name]
        return registry_labels(name) if found is None else found

    problems = []
    for where, expr in operator_queries().items():
        names, labels = promql_references(expr)
        carried: set[str] = set()
        for name in names:
            for service in exporting_services(name):
                if name not in scrapes[service]:
                    problems.append(f"{where}: {name} is not in the {service}'s /metrics")
                else:
                    carried |= labels_of(name, service)
        if labels - carried:
            problems.append(f"{where}: no metric of it has labels {sorted(labels - carried)}")
    documented = documented_metrics()
    assert len(documented) >= 60, len(documented)  # the tables were read
    for name, labels in documented.items():
        for service in exporting_services(name):
            if name not in scrapes[service]:
                problems.append(f"observability.md: {name} is not in the {service}'s /metrics")
            elif labels - labels_of(name, service):
                problems.append(
                    f"observability.md: {name} lacks {sorted(labels - labels_of(name, service))}"
                )
    assert not problems, "\n".join(problems)


def traceparent() -> tuple[str, str]:
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-01"


def gateway_span_names(receiver: Any, trace_id: str) -> dict[str, int]:
    """The names (and how many of each) of the gateway's spans of one trace, once no new
    one has arrived for 2 s (the batch processor exports every 200 ms here; the cache put
    ends after the stream)."""
    last: Counter[str] = Counter()
    stable_since = time.monotonic()
    deadline = stable_since + 30
    while time.monotonic() < deadline:
        names = Counter(
            s["name"]
            for s in receiver.snapshot()
            if s["trace_id"] == trace_id and s["service"] == "splitvl-gateway"
        )
        if names != last:
            last, stable_since = names, time.monotonic()
        elif names and time.monotonic() - stable_since > 2.0:
            break
        time.sleep(0.2)
    return dict(sorted(last.items()))


def test_span_names_the_gateway_emits(
    cluster: Any, otlp_receiver: Any, gateway_stub: gpb_grpc.GatewayServiceStub, http: httpx.Client
) -> None:
    photo = photo_png("gravel.png", (30, 50, 254, 218))  # 224x168, sent by no other test
    requests = {
        "grpc_text_only": request(text("hi"), max_tokens=2),
        "grpc_image_miss": request(image(photo), text("hi"), max_tokens=2),
        "grpc_image_exact_hit": request(image(photo), text("hi"), max_tokens=2),
    }
    for key, r in requests.items():
        trace_id, parent = traceparent()
        assert list(gateway_stub.Generate(r, timeout=120, metadata=[("traceparent", parent)]))
        golden("gateway_spans", key, gateway_span_names(otlp_receiver, trace_id))
    trace_id, parent = traceparent()
    answer = http.post("/v1/chat/completions", json=user("hi"), headers={"traceparent": parent})
    assert answer.status_code == 200, answer.text
    golden("gateway_spans", "openai_text_only", gateway_span_names(otlp_receiver, trace_id))


# -- 4. the rules every front applies ----------------------------------------------------------
def decoder_request(
    *parts: dpb.ContentPart, images: int = 0, videos: int = 0, max_tokens: int = 4
) -> dpb.GenerateRequest:
    r = dpb.GenerateRequest(request_id="golden")
    r.messages.add(role="user").parts.extend(parts or [dpb.ContentPart(text="hi")])
    r.images.extend([tensor_pb2.ImageEmbedding()] * images)
    r.videos.extend([dpb.VideoEmbedding()] * videos)
    r.sampling.max_tokens = max_tokens
    return r


def decoder_with(**change: Any) -> Callable[[], dpb.GenerateRequest]:
    def build() -> dpb.GenerateRequest:
        r = decoder_request()
        if "role" in change:
            r.messages[0].role = change["role"]
        if "messages" in change:
            del r.messages[:]
            for _ in range(change["messages"]):
                r.messages.add(role="user").parts.add(text="x")
        if change.get("no_parts"):
            r.messages.add(role="user")
        return r

    return build


# One input per rule, as each front takes it: the gateway's GenerateRequest, an OpenAI
# chat completion body, the decoder's GenerateRequest (sent to the cluster's decoder
# itself: its validation through its public RPC, whatever its internals become).
SHARED_RULES: dict[str, tuple[Callable[[], Any], Callable[[], Any], Callable[[], Any]]] = {
    "MESSAGES_EMPTY": (
        GRPC_CASES["messages_empty"],
        OPENAI_CASES["messages_empty"],
        lambda: dpb.GenerateRequest(request_id="golden"),
    ),
    "TOO_MANY_MESSAGES": (
        GRPC_CASES["too_many_messages"],
        OPENAI_CASES["too_many_messages"],
        decoder_with(messages=65),
    ),
    "TOO_MANY_PARTS": (
        GRPC_CASES["too_many_parts"],
        OPENAI_CASES["too_many_parts"],
        lambda: decoder_request(*[dpb.ContentPart(text="x")] * 257),
    ),
    "TOO_MANY_IMAGES": (
        GRPC_CASES["too_many_images"],
        OPENAI_CASES["too_many_images"],
        lambda: decoder_request(*[dpb.ContentPart(image_index=i) for i in range(9)], images=9),
    ),
    "TOO_MANY_VIDEOS": (
        GRPC_CASES["too_many_videos"],
        OPENAI_CASES["too_many_videos"],
        lambda: decoder_request(*[dpb.ContentPart(video_index=i) for i in range(3)], videos=3),
    ),
    "TEXT_TOO_LONG": (
        GRPC_CASES["text_too_long"],
        OPENAI_CASES["text_too_long"],
        lambda: decoder_request(dpb.ContentPart(text="x" * 65537)),
    ),
    "PARTS_EMPTY": (
        GRPC_CASES["parts_empty"],
        lambda: {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": []}]},
        decoder_with(no_parts=True),
    ),
    "PART_EMPTY": (
        GRPC_CASES["part_empty"],
        OPENAI_CASES["part_without_text"],  # the nearest a chat completion can say
        lambda: decoder_request(dpb.ContentPart()),
    ),
    "ROLE_INVALID": (
        GRPC_CASES["role_invalid"],
        OPENAI_CASES["role_invalid"],
        decoder_with(role="tool"),
    ),
    "TEXT_CONTAINS_SPECIAL_TOKEN": (
        GRPC_CASES["control_token_c05"],
        OPENAI_CASES["control_token_c05"],
        lambda: decoder_request(dpb.ContentPart(text="Describe <|image_pad|> this.")),
    ),
    "MAX_TOKENS_OUT_OF_RANGE": (
        GRPC_CASES["max_tokens_zero"],
        OPENAI_CASES["max_tokens_zero"],
        lambda: decoder_request(max_tokens=0),
    ),
}
# Rules the fronts do not answer alike today (recorded, not endorsed): rule -> the reason
# each of grpc / openai / decoder gives.
SHARED_RULE_DIVERGENCES: dict[str, dict[str, str]] = {
    # A chat completion cannot send a part with nothing in it: the nearest, a text part
    # without its text, is refused by the front's own conversion, as unsupported.
    "PART_EMPTY": {
        "grpc": "PART_EMPTY",
        "openai": "PARAMETER_UNSUPPORTED",
        "decoder": "PART_EMPTY",
    },
}


@pytest.fixture(scope="module")
def decoder_stub(cluster: Any) -> Iterator[dpb_grpc.DecoderServiceStub]:
    with grpc.insecure_channel(cluster.ports.address("decoder"), options=CHANNEL_OPTIONS) as ch:
        yield dpb_grpc.DecoderServiceStub(ch)


def refuse_decoder(stub: dpb_grpc.DecoderServiceStub, r: dpb.GenerateRequest) -> dict[str, Any]:
    n = 0
    try:
        for _ in stub.Generate(r, timeout=60):
            n += 1
    except grpc.RpcError as err:
        return refusal_record(err, n)
    raise AssertionError(f"the decoder accepted it, {n} responses")


@pytest.mark.parametrize("rule", sorted(SHARED_RULES))
def test_shared_rules_give_one_reason_at_every_front(
    rule: str,
    gateway_stub: gpb_grpc.GatewayServiceStub,
    http: httpx.Client,
    decoder_stub: dpb_grpc.DecoderServiceStub,
    cluster: Any,
) -> None:
    grpc_request, openai_body, decoder_input = SHARED_RULES[rule]
    at_grpc = refuse_sync(gateway_stub, grpc_request())
    response = http.post("/v1/chat/completions", json=openai_body())
    at_openai = http_record(response, cluster.model)
    at_decoder = refuse_decoder(decoder_stub, decoder_input())
    golden(
        "shared_rules",
        rule,
        {
            "grpc": {k: at_grpc[k] for k in ("code", "reason", "metadata", "message")},
            "openai": {"status": at_openai["status"], **at_openai["body"]["error"]},
            "decoder": {k: at_decoder[k] for k in ("code", "reason", "metadata", "message")},
        },
    )
    reasons = {
        "grpc": at_grpc["reason"],
        "openai": at_openai["body"]["error"]["code"],
        "decoder": at_decoder["reason"],
    }
    assert reasons == SHARED_RULE_DIVERGENCES.get(rule, dict.fromkeys(reasons, rule))


# -- the golden files themselves ---------------------------------------------------------------
def test_golden_files_hold_exactly_the_tables_cases() -> None:
    """A case dropped from a table must leave its file too (recording only adds)."""
    if RECORD:
        pytest.skip("recording")
    assert golden_keys("grpc_refusals") == set(GRPC_CASES)
    assert golden_keys("grpc_url_refusals") == set(URL_CASES)
    assert golden_keys("openai_refusals") == set(OPENAI_CASES)
    assert golden_keys("openai_outside") == set(OUTSIDE_CASES)
    assert golden_keys("shared_rules") == set(SHARED_RULES)
    assert golden_keys("grpc_stream") == {"miss", "exact_hit"}
    assert golden_keys("openai_completion") == {
        "non_stream_miss",
        "stream_one_token_exact_hit",
        "stream_eight_tokens_exact_hit",
    }
    assert golden_keys("gateway_spans") == {
        "grpc_text_only",
        "grpc_image_miss",
        "grpc_image_exact_hit",
        "openai_text_only",
    }


@pytest.mark.parametrize("rule", sorted(SHARED_RULES))
def test_shared_rules_give_the_same_reason_in_the_decoders_validation(
    rule: str, tiny_model: Any
) -> None:
    """The same rows through the decoder's validation in process (unit level, no engine):
    the checks its servicer runs before any byte is read or the engine is asked
    (``Preparer.check``, then the sampling parameters), with the decoder's default limits
    and the cluster's media limits (8 images, 2 videos per prompt)."""
    from types import SimpleNamespace

    from decoder_service.__main__ import DecoderSettings
    from decoder_service.prepare import Preparer, sampling_params
    from decoder_service.validation import Limits
    from vlcommon.model_info import load_vision_spec
    from vlcommon.request_rules import forbidden_tokens

    settings = DecoderSettings()
    limits = Limits(
        max_images=0,
        max_tokens_default=settings.max_tokens_default,
        max_tokens_limit=settings.max_tokens_limit,
        max_text_chars=settings.max_text_chars,
        max_messages=settings.max_messages,
        max_parts=settings.max_parts,
    )
    engine = SimpleNamespace(
        max_images=8,
        max_videos=2,
        forbidden_tokens=forbidden_tokens(tiny_model),
        max_image_tokens=16384,
        max_video_tokens=16384,
    )
    preparer = Preparer(engine, limits, reader=None)  # type: ignore[arg-type]
    request = SHARED_RULES[rule][2]()
    with pytest.raises(ServiceError) as caught:
        preparer.check(request, load_vision_spec(tiny_model))
        sampling_params(request.sampling, limits)
    expected = SHARED_RULE_DIVERGENCES.get(rule, {}).get("decoder", rule)
    assert caught.value.reason == expected
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
