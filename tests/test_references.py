"""Issue 14, must-show 1 and 4: embeddings by reference through the four services.

The gateway moves keys, grids and refs; the decoder reads each image's embeddings from
the encoder (a miss) or the cache (a hit), by shared memory (the session cluster, as
``splitvl up`` runs it) or by the holders' gRPC stream (``grpc_gateway``). The gateway's
embedding byte counters stay at 0, scraped from its metrics port.
"""

from __future__ import annotations

import io
import os

import pytest
from qwenvl.common.v1 import generation_pb2

from tests.conftest import png_bytes, rgb
from tests.test_e2e import ask, metric

pytestmark = pytest.mark.e2e

GATEWAY_COUNTERS = (
    "splitvl_gateway_embedding_received_bytes_total",
    "splitvl_gateway_embedding_sent_bytes_total",
)
DECODER_BYTES = "splitvl_decoder_embedding_received_bytes_total"


def shm_segments(service: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"splitvl-{service}-")]


def decoder_bytes(cluster, transport: str, holder: str) -> float:
    return metric(cluster, "decoder", DECODER_BYTES, {"transport": transport, "holder": holder})


@pytest.mark.parametrize("which", ["shm", "grpc"])
def test_a_miss_an_exact_and_a_similar_hit_move_no_embedding_byte_through_the_gateway(
    cluster, grpc_gateway, which
) -> None:
    front = cluster if which == "shm" else grpc_gateway
    # An image of its own per transport, so the first request is a miss in either order.
    crop = (11, 9, 411, 289) if which == "shm" else (23, 17, 423, 297)
    original = rgb("chelsea.png").crop(crop)
    before = {h: decoder_bytes(cluster, which, h) for h in ("encoder", "cache")}

    miss = ask(front, [png_bytes(original)])
    after_miss = {h: decoder_bytes(cluster, which, h) for h in ("encoder", "cache")}
    exact = ask(front, [png_bytes(original)])
    after_exact = {h: decoder_bytes(cluster, which, h) for h in ("encoder", "cache")}
    buf = io.BytesIO()
    original.save(buf, format="JPEG", quality=95)
    similar = ask(front, [buf.getvalue()])
    after_similar = {h: decoder_bytes(cluster, which, h) for h in ("encoder", "cache")}

    assert [r.images[0]["tier"] for r in (miss, exact, similar)] == ["miss", "exact", "similar"]
    assert exact.token_ids == miss.token_ids and similar.token_ids == miss.token_ids
    for name in GATEWAY_COUNTERS:
        assert metric(front, "gateway", name) == 0, name
    # The decoder read the image's bytes by this transport: from the encoder for the miss,
    # from the cache for each hit (the same grid: the same bytes).
    read_miss = after_miss["encoder"] - before["encoder"]
    assert read_miss > 0 and after_miss["cache"] == before["cache"]
    assert after_exact["cache"] - after_miss["cache"] == read_miss
    assert after_similar["cache"] - after_exact["cache"] == read_miss
    assert after_similar["encoder"] == after_miss["encoder"]


def test_held_embeddings_are_freed_once_read(cluster) -> None:
    """After a miss is read by the decoder and stored by the cache, and a hit is read,
    nothing stays held: no segment is left in /dev/shm by either holder."""
    image = png_bytes(rgb("coffee.png").crop((5, 5, 405, 305)))
    first = ask(cluster, [image])
    second = ask(cluster, [image])
    assert (first.images[0]["tier"], second.images[0]["tier"]) == ("miss", "exact")
    import time

    deadline = time.monotonic() + 10  # releases travel after the stream, in the background
    while (shm_segments("encoder") or shm_segments("cache")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert shm_segments("encoder") == [] and shm_segments("cache") == []


def test_cache_policy_off_holds_for_the_decoder_alone(cluster) -> None:
    image = png_bytes(rgb("astronaut.png").crop((3, 3, 403, 303)))
    off = generation_pb2.CACHE_POLICY_OFF
    result = ask(cluster, [image], cache_policy=off)
    assert result.images[0]["tier"] == "miss"
    again = ask(cluster, [image])
    assert again.images[0]["tier"] == "miss"  # nothing was stored by the first
    assert again.token_ids == result.token_ids
