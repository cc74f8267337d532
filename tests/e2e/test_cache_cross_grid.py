"""Cross-grid similarity hits and budget-independent verification through the four services.

A checkpoint whose processor allows Qwen3-VL's own pixel budget (the tiny model with
``longest_edge`` 16,777,216) is served by the real gateway, encoder, cache and vLLM
decoder; each request sends ``pixel_budget`` 65,536..16,777,216 (Qwen3-VL's) or
4,096..65,536 (the tiny checkpoint's). At Qwen3-VL's budget images keep their size, so a
4% smaller copy of a photo gets another grid: it must be a similarity hit that reports both
grids and decodes with the stored entry's (same tokens as the original's request), while a
half-size copy is a miss. At the tiny budget two photographed invoice pages one digit apart
share a grid and a thumbnail, and must be a miss (docs/cache.md).
"""

from __future__ import annotations

import io
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from splitvl_tools import cache_eval
from tests.conftest import OtlpReceiver, photo

QWEN_BUDGET = (65536, 16777216)
TINY_BUDGET = (4096, 65536)
PROMPT = "Describe this image."


@pytest.fixture(scope="module")
def qwen_budget_cluster(
    tiny_model: Path, otlp_receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[object]:
    """The four services on free ports, with the tiny checkpoint's processor allowing
    Qwen3-VL's 16,777,216-pixel maximum (so the gateway accepts that budget per request)."""
    from splitvl.launcher import Cluster, Ports

    model = tmp_path_factory.mktemp("qwen-budget") / "model"
    shutil.copytree(tiny_model, model)
    config_path = model / "processor_config.json"
    config = json.loads(config_path.read_text())
    config["image_processor"]["size"]["longest_edge"] = QWEN_BUDGET[1]
    config_path.write_text(json.dumps(config, indent=2))
    cluster = Cluster(
        model=str(model),
        ports=Ports.free(),
        log_dir=tmp_path_factory.mktemp("logs"),
        env=otlp_receiver.env(),
        decoder_args=["--max-model-len", "32768", "--max-num-batched-tokens", "4096"],
    )
    with cluster:
        yield cluster


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _ask(cluster: object, data: bytes, budget: tuple[int, int]) -> dict:
    from splitvl.client import build_request, generate

    request = build_request([data], PROMPT, max_tokens=8, ignore_eos=True)
    request.pixel_budget.min_pixels, request.pixel_budget.max_pixels = budget
    address = cluster.ports.address("gateway")  # type: ignore[attr-defined]
    return generate(address, request, timeout_s=180).as_dict()


def _array(value: object) -> list:
    return [v.int_value or v.bool_value for v in value.array_value.values]  # type: ignore[attr-defined]


def test_a_4_percent_resize_is_served_with_the_stored_grid_and_half_size_misses(
    qwen_budget_cluster: object, otlp_receiver: OtlpReceiver
) -> None:
    original = Image.open(io.BytesIO(photo("astronaut.png"))).convert("RGB")  # 512x512
    stored = _ask(qwen_budget_cluster, _png(original), QWEN_BUDGET)
    (info,) = stored["images"]
    assert info["tier"] == "miss" and info["grid"] == [1, 32, 32] == info["requested_grid"]

    w, h = original.size
    smaller = original.resize((round(w * 0.96), round(h * 0.96)), Image.Resampling.BICUBIC)
    hit = _ask(qwen_budget_cluster, _png(smaller), QWEN_BUDGET)
    (info,) = hit["images"]
    # 492x492 plans to 480x480 (grid 30x30); the stored 512x512 entry (32x32) answers.
    assert info["tier"] == "similar" and info["similarity"] > 0.99
    assert info["requested_grid"] == [1, 30, 30]
    assert info["served_grid"] == info["grid"] == [1, 32, 32]
    assert info["tokens"] == 32 * 32 // 4
    # Decoded with the stored embeddings and grid: the original's prompt and tokens.
    assert hit["usage"]["prompt_tokens"] == stored["usage"]["prompt_tokens"]
    assert hit["token_ids"] == stored["token_ids"]

    half = original.resize((w // 2, h // 2), Image.Resampling.BICUBIC)
    miss = _ask(qwen_budget_cluster, _png(half), QWEN_BUDGET)
    (info,) = miss["images"]
    assert info["tier"] == "miss"
    assert info["served_grid"] == info["requested_grid"] == info["grid"] == [1, 16, 16]
    assert miss["usage"]["prompt_tokens"] == stored["usage"]["prompt_tokens"] - (256 - 64)

    # The trace says so: the gateway's cache.lookup span marks the grid change, and the
    # cache's names both grids. Each process exports its spans in its own batches, so the two
    # arrive in either order: wait for both.
    def grid_changed() -> list[dict]:
        return [
            s
            for s in otlp_receiver.snapshot()
            if s["name"] == "cache.lookup"
            and "splitvl.cache.grid_changed" in s["attributes"]
            and True in _array(s["attributes"]["splitvl.cache.grid_changed"])
        ]

    def served() -> list[dict]:
        return [
            s
            for s in otlp_receiver.snapshot()
            if s["service"] == "splitvl-cache" and "splitvl.cache.served_grid" in s["attributes"]
        ]

    deadline = time.monotonic() + 15
    while not grid_changed():
        assert time.monotonic() < deadline, "no cache.lookup span with a grid change"
        time.sleep(0.2)
    while not served():
        assert time.monotonic() < deadline, "the cache's span names the served grid"
        time.sleep(0.2)
    attrs = served()[-1]["attributes"]
    assert _array(attrs["splitvl.cache.served_grid"]) == [1, 32, 32]
    assert _array(attrs["splitvl.cache.requested_grid"]) == [1, 30, 30]


def test_invoice_photos_one_digit_apart_miss_at_the_tiny_budget(
    qwen_budget_cluster: object,
) -> None:
    """28 px type on a 1200x1600 photographed page shrinks to ~5 px in the 192x256 plan:
    one digit of the total is below legibility there, not in the image the client sent,
    which is what the verification compares."""
    a, b = (cache_eval.invoice_photo(t, seed=3) for t in cache_eval.INVOICE_TOTALS[0])
    first = _ask(qwen_budget_cluster, _png(a), TINY_BUDGET)
    second = _ask(qwen_budget_cluster, _png(b), TINY_BUDGET)
    (ia,), (ib,) = first["images"], second["images"]
    assert ia["tier"] == "miss" and ia["grid"] == ib["grid"]
    assert ib["tier"] == "miss" and ib["similarity"] > 0.99  # the thumbnail cannot tell
    # ... while the same page again (a JPEG of it) is a similarity hit.
    jpeg = io.BytesIO()
    a.save(jpeg, format="JPEG", quality=90)
    again = _ask(qwen_budget_cluster, jpeg.getvalue(), TINY_BUDGET)
    (ic,) = again["images"]
    assert ic["tier"] == "similar" and ic["served_grid"] == ic["requested_grid"] == ia["grid"]
