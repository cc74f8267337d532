"""The span tree of one real request, as the OTLP receiver got it from the four services;
and the encoder's ViT batch span linked to every request it served.

One Generate with one unseen image (so it is looked up, missed, encoded, stored and
decoded): every work span is where it belongs (its parent chain reaches the gateway's
Generate server span), named for its work, with the attributes an operator reads (grid,
tier and similarity, batch id/size and its link, bytes, tokens).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from splitvl.client import build_request, generate
from tests.conftest import png_bytes, rgb
from vlcommon.model_info import load_vision_spec

ROOT_NAME = "/qwenvl.gateway.v1.GatewayService/Generate"
MAX_TOKENS = 5
FP32_BYTES = 4


def value(v: Any) -> Any:
    """An OTLP AnyValue as Python."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def attrs(span: dict[str, Any]) -> dict[str, Any]:
    return {k: value(v) for k, v in span["attributes"].items()}


def collect_trace(receiver, trace_id: str, until, timeout_s: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        spans = [s for s in receiver.snapshot() if s["trace_id"] == trace_id]
        if until(spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.3)


def one(spans: list[dict], name: str, service: str) -> dict:
    found = [s for s in spans if s["name"] == name and s["service"] == f"splitvl-{service}"]
    assert len(found) == 1, (name, service, [(s["name"], s["service"]) for s in spans])
    return found[0]


def chain(span: dict, by_id: dict[str, dict]) -> list[str]:
    """Names (service:name) from ``span`` up to its root."""
    out = []
    while span is not None:
        out.append(f"{span['service'].removeprefix('splitvl-')}:{span['name']}")
        span = by_id.get(span["parent"])
    return out


@pytest.mark.e2e
def test_span_tree_of_one_request(cluster, otlp_receiver, tiny_model, tmp_path) -> None:
    width = load_vision_spec(tiny_model).embedding_width
    source = rgb("astronaut.png").crop((17, 9, 417, 309))  # 400x300, unseen
    request = build_request(
        [png_bytes(source)], "Describe it.", max_tokens=MAX_TOKENS, ignore_eos=True
    )
    seen = {s["span_id"] for s in otlp_receiver.snapshot() if s["name"] == ROOT_NAME}
    result = generate(cluster.ports.address("gateway"), request, timeout_s=120)
    image = result.images[0]
    assert image["tier"] == "miss"

    deadline = time.monotonic() + 15
    roots: list[dict] = []
    while not roots and time.monotonic() < deadline:
        roots = [
            s
            for s in otlp_receiver.snapshot()
            if s["name"] == ROOT_NAME
            and s["service"] == "splitvl-gateway"
            and s["span_id"] not in seen
        ]
        time.sleep(0.2)
    assert len(roots) == 1
    root = roots[0]
    wanted = {
        "vit.batch",
        "decoder.generation",
        "gateway.cache_put",
        "cache.lookup",
        "cache.lookup_bytes",
    }
    spans = collect_trace(
        otlp_receiver,
        root["trace_id"],
        # Two reads of the held embeddings: the decoder's, and the cache's (storing them).
        lambda ss: (
            wanted <= {s["name"] for s in ss}
            and sum(s["name"] == "embedding.fetch" for s in ss) >= 2
        ),
    )
    by_id = {s["span_id"]: s for s in spans}
    if out := os.environ.get("SPLITVL_TRACE_JSON"):  # for scripts/render_trace.py
        Path(out).write_text(json.dumps(_jsonable(spans), indent=1))

    # the request span: model, image count, tokens
    a = attrs(root)
    assert root["parent"] == ""
    assert a["splitvl.request.images"] == 1
    assert a["splitvl.request.model"] == str(tiny_model)
    assert a["splitvl.usage.prompt_tokens"] == result.usage["prompt_tokens"]
    assert a["splitvl.usage.completion_tokens"] == MAX_TOKENS

    # gateway: decode and resize of the one image, under gateway.preprocess
    pre = one(spans, "gateway.preprocess", "gateway")
    assert pre["parent"] == root["span_id"]
    decode, resize = one(spans, "image.decode", "gateway"), one(spans, "image.resize", "gateway")
    assert decode["parent"] == resize["parent"] == pre["span_id"]
    assert (attrs(decode)["splitvl.image.width"], attrs(decode)["splitvl.image.height"]) == (
        400,
        300,
    )
    r = attrs(resize)
    assert r["splitvl.image.grid_thw"] == image["grid"]
    assert r["splitvl.image.tokens"] == image["tokens"]
    assert r["splitvl.image.resized_height"] == image["grid"][1] * 16
    assert decode["end_ns"] <= resize["start_ns"]
    # before the decode: the header read and the lookup by the file's digest (a miss)
    header = one(spans, "image.header", "gateway")
    assert header["parent"] == pre["span_id"]
    h = attrs(header)
    assert (h["splitvl.image.width"], h["splitvl.image.height"]) == (400, 300)
    assert h["splitvl.image.format"] == "PNG" and h["splitvl.image.exif_orientation"] == 1
    by_bytes = one(spans, "cache.lookup_bytes", "gateway")
    assert by_bytes["parent"] == pre["span_id"]
    assert attrs(by_bytes)["splitvl.cache.tiers"] == ["miss"]
    assert header["end_ns"] <= by_bytes["start_ns"] and by_bytes["end_ns"] <= decode["start_ns"]
    assert attrs(one(spans, "cache.lookup_bytes", "cache"))["splitvl.cache.tier"] == "miss"
    assert attrs(pre)["splitvl.decoded"] == [True]

    # cache lookup: the gateway's span says tier and score; the cache's span agrees
    lookup = one(spans, "cache.lookup", "gateway")
    assert lookup["parent"] == root["span_id"]
    assert attrs(lookup)["splitvl.cache.tiers"] == ["miss"]
    assert len(attrs(lookup)["splitvl.cache.similarities"]) == 1
    cache_side = one(spans, "cache.lookup", "cache")
    assert attrs(cache_side)["splitvl.cache.tier"] == "miss"
    assert chain(cache_side, by_id)[1:] == [
        "cache:/qwenvl.cache.v1.CacheService/Lookup",
        "gateway:/qwenvl.cache.v1.CacheService/Lookup",
        "gateway:cache.lookup",
        f"gateway:{ROOT_NAME}",
    ]

    # encoder: the per-request span with its queue wait, and the linked ViT batch span
    emb_bytes = image["tokens"] * width * FP32_BYTES
    enc = one(spans, "encoder.encode", "encoder")
    assert chain(enc, by_id)[1:] == [
        "encoder:/qwenvl.encoder.v1.EncoderService/Encode",
        "gateway:/qwenvl.encoder.v1.EncoderService/Encode",
        "gateway:gateway.encode",
        f"gateway:{ROOT_NAME}",
    ]
    e = attrs(enc)
    assert e["splitvl.request.images"] == 1
    assert e["splitvl.tokens"] == image["tokens"]
    assert e["splitvl.encoder.queue_wait_ms"] >= 0
    batch = one(spans, "vit.batch", "encoder")
    b = attrs(batch)
    assert e["splitvl.batch.ids"] == [b["splitvl.batch.id"]]
    assert e["splitvl.batch.sizes"] == [b["splitvl.batch.size"]] == [1]
    grid = image["grid"]
    assert b["splitvl.batch.patches"] == grid[0] * grid[1] * grid[2]
    assert (root["trace_id"], enc["span_id"]) in batch["links"]
    assert batch["parent"] == enc["span_id"]
    assert enc["start_ns"] <= batch["start_ns"] <= batch["end_ns"] <= enc["end_ns"]
    # By reference: the encoder holds the bytes (in /dev/shm under the launcher), and the
    # gateway's spans say which transport, which holder and how many bytes, moving none.
    held = {
        "splitvl.embedding.bytes": 0,
        "splitvl.embedding.transports": ["shm"],
        "splitvl.embedding.holders": ["encoder"],
        "splitvl.embedding.ref_bytes": [emb_bytes],
    }
    for name in ("gateway.encode", "embedding.transfer", "gateway.cache_put"):
        a = attrs(one(spans, name, "gateway"))
        assert {k: a[k] for k in held} == held, name
    transfer = one(spans, "embedding.transfer", "gateway")
    assert transfer["parent"] == root["span_id"]
    # The one crossing: the decoder reads them from the encoder, while it renders the prompt.
    fetch_all = one(spans, "decoder.fetch_embeddings", "decoder")
    fa = attrs(fetch_all)
    assert fa["splitvl.embedding.bytes"] == emb_bytes
    assert fa["splitvl.embedding.transports"] == ["shm"]
    fetches = [
        s for s in spans if s["name"] == "embedding.fetch" and s["service"] == "splitvl-decoder"
    ]
    assert len(fetches) == 1 and fetches[0]["parent"] == fetch_all["span_id"]
    f = attrs(fetches[0])
    assert (f["splitvl.embedding.holder"], f["splitvl.embedding.transport"]) == ("encoder", "shm")
    # ...and so does the cache, storing the miss (its Put carried the ref, not the bytes).
    put_side = [
        s for s in spans if s["name"] == "embedding.fetch" and s["service"] == "splitvl-cache"
    ]
    assert [attrs(s)["splitvl.embedding.bytes"] for s in put_side] == [emb_bytes]

    # decoder: queue -> prefill (first token) -> generation, under decoder.generate
    gen = one(spans, "decoder.generate", "decoder")
    assert chain(gen, by_id)[1:] == [
        "decoder:/qwenvl.decoder.v1.DecoderService/Generate",
        "gateway:/qwenvl.decoder.v1.DecoderService/Generate",
        "gateway:gateway.decode",
        f"gateway:{ROOT_NAME}",
    ]
    g = attrs(gen)
    assert g["splitvl.usage.prompt_tokens"] == result.usage["prompt_tokens"]
    assert g["splitvl.usage.completion_tokens"] == MAX_TOKENS
    assert g["splitvl.request.images"] == 1
    assert g["splitvl.embedding.bytes"] == emb_bytes
    queue = one(spans, "decoder.queue", "decoder")
    prefill = one(spans, "decoder.prefill", "decoder")
    generation = one(spans, "decoder.generation", "decoder")
    assert queue["parent"] == prefill["parent"] == generation["parent"] == gen["span_id"]
    assert [name for name, _ in prefill["events"]] == ["first_token"]
    assert queue["end_ns"] <= prefill["start_ns"] + 1000  # ns rounding of one clock
    assert prefill["end_ns"] <= generation["start_ns"] + 5_000_000
    assert attrs(generation)["splitvl.usage.completion_tokens"] == MAX_TOKENS
    assert [name for name, _ in gen["events"]] == ["first_token"]

    # and the picture of it renders
    from scripts.render_trace import render

    png = tmp_path / "trace.png"
    render(_jsonable(spans), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _jsonable(spans: list[dict]) -> list[dict]:
    return [{**s, "attributes": attrs(s)} for s in spans]


async def test_one_vit_batch_links_every_request_it_served(tiny_model, monkeypatch) -> None:
    """Three requests' images (one an in-flight duplicate) share one packed ViT call: its
    ``vit.batch`` span links all three request spans and says the batch's size and patches;
    each request learns the batch id and size and its queue wait."""
    import asyncio

    import numpy as np
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from encoder_service import batcher as batcher_module
    from encoder_service.batcher import Batcher
    from encoder_service.engine import VisionEngine
    from vlcommon.imaging import plan_resize

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    monkeypatch.setattr(batcher_module, "tracer", provider.get_tracer("splitvl.encoder"))

    engine = VisionEngine.load(str(tiny_model), device="cpu")
    images = []
    for name, box in (("chelsea.png", (0, 0, 320, 240)), ("coffee.png", (0, 0, 256, 256))):
        im = rgb(name).crop(box)
        plan = plan_resize(im.height, im.width, engine.spec, index=0)
        images.append(engine.preprocess(np.asarray(im), plan))
    b = Batcher(
        engine.encode, max_batch_images=8, max_batch_patches=100_000, max_wait_ms=200, max_queue=8
    )
    b.start()

    async def request(name: str, key: str, image):  # type: ignore[no-untyped-def]
        with tracer.start_as_current_span(name) as span:
            out, info = await b.submit_timed(key, image)
            return span.get_span_context(), out, info

    try:
        results = await asyncio.gather(
            request("r0", "a", images[0]),
            request("r1", "b", images[1]),
            request("r2", "a", images[0]),  # same key in flight: shares r0's image
        )
    finally:
        await b.stop()
    (batch,) = [s for s in exporter.get_finished_spans() if s.name == "vit.batch"]
    linked = {link.context.span_id for link in batch.links}
    assert linked == {ctx.span_id for ctx, _, _ in results}
    assert batch.attributes["splitvl.batch.size"] == 2  # two distinct images
    patches = sum(int(im.pixel_values.shape[0]) for im in images)
    assert batch.attributes["splitvl.batch.patches"] == patches
    assert batch.parent is not None and batch.parent.span_id == results[0][0].span_id
    ids = {info.batch_id for _, _, info in results}
    assert ids == {batch.attributes["splitvl.batch.id"]}
    assert all(info.batch_size == 2 and info.queue_wait_s >= 0 for _, _, info in results)
    assert results[0][1] is results[2][1]  # the duplicate got the very same tensor
    assert results[0][1].shape[0] == images[0].tokens


async def test_a_duplicate_joining_a_running_batch_is_linked_too(monkeypatch) -> None:
    """An identical image submitted while its ViT call runs shares the result, and the
    running ``vit.batch`` span gains a link to the late request."""
    import asyncio

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from encoder_service import batcher as batcher_module
    from tests.unit.encoder_service.test_batcher import FakeViT, batcher, image

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    monkeypatch.setattr(batcher_module, "tracer", provider.get_tracer("splitvl.encoder"))
    vit = FakeViT()
    vit.gate.clear()  # the ViT call blocks until released
    b = batcher(vit, max_wait_ms=1)

    async def request(name: str):  # type: ignore[no-untyped-def]
        with tracer.start_as_current_span(name) as span:
            out, info = await b.submit_timed("same", image(3.0))
            return span.get_span_context(), out, info

    try:
        first = asyncio.ensure_future(request("early"))
        while not any(it.span for it in b._inflight.values()):  # the call has started
            await asyncio.sleep(0.005)
        late = asyncio.ensure_future(request("late"))
        await asyncio.sleep(0.05)
        vit.gate.set()
        results = await asyncio.gather(first, late)
    finally:
        vit.gate.set()
        await b.stop()
    (batch,) = [s for s in exporter.get_finished_spans() if s.name == "vit.batch"]
    assert {link.context.span_id for link in batch.links} == {c.span_id for c, _, _ in results}
    assert len(vit.calls) == 1 and results[0][1] is results[1][1]
    assert results[1][2].batch_id == results[0][2].batch_id
    assert results[1][2].queue_wait_s == 0.0  # it joined a call already running
