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
from tests.e2e.test_e2e import ask, metric

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


def _ref_request(holder: str, ticket: str, transport: int):
    """A decoder request whose one image is a ref (64 x 384 fp32, grid 1x16x16)."""
    from qwenvl.common.v1 import tensor_pb2
    from qwenvl.decoder.v1 import decoder_service_pb2 as dpb

    request = dpb.GenerateRequest(request_id="ref-gone")
    message = request.messages.add(role="user")
    message.parts.add(image_index=0)
    message.parts.add(text="Describe this image.")
    request.sampling.max_tokens = 2
    image = request.images.add(key="ref-gone", grid=tensor_pb2.GridTHW(t=1, h=16, w=16))
    image.embeddings.dtype = tensor_pb2.DATA_TYPE_FP32
    image.embeddings.shape[:] = [64, 384]
    image.ref.holder, image.ref.ticket, image.ref.transport = holder, ticket, transport
    image.ref.nbytes, image.ref.service = 64 * 384 * 4, "encoder"
    if transport == tensor_pb2.TRANSPORT_SHM:
        image.ref.shm_name = f"splitvl-encoder-1-{ticket}"
    return request


@pytest.mark.parametrize("case", ["released", "holder_dead"])
def test_the_decoder_names_the_image_and_the_hop_when_a_ref_cannot_be_read(cluster, case) -> None:
    """Entry gone (released or expired; its segment unlinked) or its holder gone (nothing
    listens where the ref points): UNAVAILABLE naming images[0] and the holder, at once,
    and the decoder serves the next request."""
    import grpc
    from qwenvl.common.v1 import tensor_pb2
    from qwenvl.decoder.v1 import decoder_service_pb2_grpc as dpb_grpc

    from vlcommon.errors import error_info

    if case == "released":  # the encoder is up, but holds no such ticket
        holder, transport = cluster.ports.address("encoder"), tensor_pb2.TRANSPORT_SHM
    else:
        from splitvl.launcher import free_ports

        holder, transport = f"127.0.0.1:{free_ports(1)[0]}", tensor_pb2.TRANSPORT_GRPC
    with grpc.insecure_channel(cluster.ports.address("decoder")) as channel:
        stub = dpb_grpc.DecoderServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(_ref_request(holder, "ab" * 16, transport), timeout=30))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    reason = "EMBEDDING_REF_GONE" if case == "released" else "EMBEDDING_HOLDER_UNAVAILABLE"
    assert error_info(err.value).reason == reason
    assert f"images[0].ref: the encoder at {holder}" in err.value.details()
    again = ask(cluster, [png_bytes(rgb("coffee.png").crop((9, 9, 329, 249)))], max_tokens=2)
    assert len(again.token_ids) == 2


@pytest.fixture(scope="module")
def expiring_cache(cluster, tmp_path_factory):
    """A cache whose held hits expire at once (CACHE_HANDOFF_TTL_S=0.001), and a gateway
    (gRPC transport) that uses it with the session cluster's encoder and decoder: every
    hit's ref is gone by the time the decoder reads it, as after a cache restart."""
    import types

    from tests.conftest import extra_service

    logs = tmp_path_factory.mktemp("expiring")
    with extra_service(cluster, "cache", {"CACHE_HANDOFF_TTL_S": "0.001"}, logs) as cache:
        env = {"GATEWAY_EMBEDDING_TRANSPORT": "grpc"}
        address = cache.address("cache")
        with extra_service(cluster, "gateway", env, logs, cache=address) as gateway:
            yield types.SimpleNamespace(ports=gateway)


def test_a_hit_whose_held_entry_is_gone_is_encoded_again_with_the_same_tokens(
    expiring_cache,
) -> None:
    image = png_bytes(rgb("rocket.jpg").crop((13, 11, 373, 291)))
    first = ask(expiring_cache, [image])
    assert first.images[0]["tier"] == "miss"
    name = "splitvl_gateway_reencoded_requests_total"
    before = metric(expiring_cache, "gateway", name)
    # The cache stores the miss by reading the encoder's ref (after the stream): wait for it.
    import time

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        second = ask(expiring_cache, [image])
        if metric(expiring_cache, "gateway", name) > before:
            break
        time.sleep(0.5)
    # The exact hit's ref had expired: the decoder said so, the gateway encoded again.
    assert metric(expiring_cache, "gateway", name) == before + 1
    assert second.images[0]["tier"] == "miss"  # reported as what the model got
    assert second.token_ids == first.token_ids
    assert second.timings["encode_ms"] > 0


def test_a_request_the_decoder_refuses_before_reading_releases_its_refs(cluster) -> None:
    """Held embeddings of a request that fails before its reads (here: a bad role, refused
    before any fetch starts) are released at once, not kept until their TTL (120 s)."""
    import time

    import grpc
    import numpy as np
    from qwenvl.common.v1 import tensor_pb2
    from qwenvl.decoder.v1 import decoder_service_pb2 as dpb
    from qwenvl.decoder.v1 import decoder_service_pb2_grpc as dpb_grpc
    from qwenvl.encoder.v1 import encoder_service_pb2 as epb
    from qwenvl.encoder.v1 import encoder_service_pb2_grpc as epb_grpc

    from vlcommon import tensors

    held = {"service": "encoder"}
    request = epb.EncodeRequest(transport=tensor_pb2.TRANSPORT_SHM, readers=1)
    image = request.images.add(key="refused-before-read")
    pixels = np.random.default_rng(11).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    image.pixels.CopyFrom(tensors.from_numpy(pixels))
    image.plan.resized_height = image.plan.resized_width = 64
    image.plan.grid.t, image.plan.grid.h, image.plan.grid.w = 1, 4, 4
    with grpc.insecure_channel(cluster.ports.address("encoder")) as channel:
        emb = epb_grpc.EncoderServiceStub(channel).Encode(request, timeout=60).embeddings[0]
    assert (
        emb.HasField("ref") and metric(cluster, "encoder", "splitvl_handoff_held_bytes", held) > 0
    )
    bad = dpb.GenerateRequest(request_id="refused")
    message = bad.messages.add(role="intruder")
    message.parts.add(image_index=0)
    bad.images.append(emb)
    with grpc.insecure_channel(cluster.ports.address("decoder")) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(dpb_grpc.DecoderServiceStub(channel).Generate(bad, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    deadline = time.monotonic() + 10
    while metric(cluster, "encoder", "splitvl_handoff_held_bytes", held) > 0:
        assert time.monotonic() < deadline, "the refused request's ref is still held"
        time.sleep(0.2)
    assert emb.ref.shm_name not in os.listdir("/dev/shm")


def test_a_request_that_never_reaches_the_decoder_leaves_nothing_held(
    cluster, tmp_path_factory
) -> None:
    """A gateway whose decoder cannot be reached: the miss's ref (the encoder holds it for
    the decoder and the cache) and then the hit's (the cache holds it for the decoder)
    are released by the gateway when the decode fails, not kept until their TTL (120 s)."""
    import time

    import grpc

    from splitvl.client import build_request, generate
    from tests.conftest import extra_service

    def held(service: str) -> float:
        return metric(cluster, service, "splitvl_handoff_held_bytes", {"service": service})

    def settles(service: str, to: float) -> bool:
        deadline = time.monotonic() + 10
        while held(service) > to and time.monotonic() < deadline:
            time.sleep(0.2)
        return held(service) <= to

    image = png_bytes(rgb("chelsea.png").crop((7, 9, 331, 271)))
    request = build_request([image], "Describe this image.", max_tokens=2)
    logs = tmp_path_factory.mktemp("no-decoder")
    env = {"GATEWAY_EMBEDDING_TRANSPORT": "shm"}
    with extra_service(cluster, "gateway", env, logs, decoder="127.0.0.1:9") as gateway:
        before = {s: held(s) for s in ("encoder", "cache")}
        puts = metric(cluster, "cache", "splitvl_cache_puts_total")
        exact = metric(cluster, "cache", "splitvl_cache_hits_total", {"tier": "exact"})
        for tier in ("miss", "exact"):
            with pytest.raises(grpc.RpcError) as err:
                generate(gateway.address("gateway"), request, timeout_s=60)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "decoder" in (err.value.details() or "")
            assert settles("encoder", before["encoder"]), tier
            assert settles("cache", before["cache"]), tier
            if tier == "miss":  # the cache stored it, reading its share of the encoder's ref
                deadline = time.monotonic() + 10
                while metric(cluster, "cache", "splitvl_cache_puts_total") == puts:
                    assert time.monotonic() < deadline, "the miss was never stored"
                    time.sleep(0.2)
    assert metric(cluster, "cache", "splitvl_cache_hits_total", {"tier": "exact"}) == exact + 1


def test_a_ref_whose_shape_does_not_fit_its_grid_is_refused_before_it_is_read(cluster) -> None:
    """A forged ref of exactly 1 GiB (the largest allowed) for a 1x4x4 grid, which needs 4
    rows: the decoder and the cache refuse it by its shape, before allocating or reading
    anything (found by an adversarial probe: each such ref grew the decoder's and the
    cache's memory by 1 GiB, then failed UNAVAILABLE at its unreachable holder)."""
    import secrets

    import grpc
    from qwenvl.cache.v1 import cache_service_pb2 as cpb
    from qwenvl.cache.v1 import cache_service_pb2_grpc as cpb_grpc
    from qwenvl.common.v1 import tensor_pb2
    from qwenvl.decoder.v1 import decoder_service_pb2 as dpb
    from qwenvl.decoder.v1 import decoder_service_pb2_grpc as dpb_grpc

    shape = [2**18, 1024]  # float32: 1 GiB
    forged = tensor_pb2.ImageEmbedding(grid=tensor_pb2.GridTHW(t=1, h=4, w=4))
    forged.embeddings.dtype, forged.embeddings.shape[:] = tensor_pb2.DATA_TYPE_FP32, shape
    forged.ref.CopyFrom(
        tensor_pb2.EmbeddingRef(
            holder="127.0.0.1:9", ticket=secrets.token_hex(16), nbytes=2**30,
            transport=tensor_pb2.TRANSPORT_GRPC, service="cache",
        )
    )  # fmt: skip
    request = dpb.GenerateRequest(request_id="forged", images=[forged])
    request.messages.add(role="user").parts.add(image_index=0)
    with grpc.insecure_channel(cluster.ports.address("decoder")) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(dpb_grpc.DecoderServiceStub(channel).Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"images[0].embeddings has shape {shape}; grid [1, 4, 4]")
    put = cpb.PutRequest(entries=[cpb.PutEntry(key="forged-1gib", embedding=forged)])
    with grpc.insecure_channel(cluster.ports.address("cache")) as channel:
        with pytest.raises(grpc.RpcError) as err:
            cpb_grpc.CacheServiceStub(channel).Put(put, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(
        f"entries[0].embedding.embeddings has shape {shape}; grid [1, 4, 4] needs 4 rows"
    )
