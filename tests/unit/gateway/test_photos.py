"""The gateway's miss path on real-world photos (issue 19): fewer passes, the same pixels.

- For phone JPEGs stored with EXIF orientations 1, 6 and 8 and an RGBA screenshot-sized
  PNG, the ``pixel_values`` the encoder builds from the gateway's resized pixels equal,
  exactly, those of vLLM's own path on the same file (vLLM's image loader
  ``ImageMediaIO.load_bytes``: Pillow decode, ``exif_transpose``, RGB; then the
  checkpoint's Qwen image processor with the same ``max_pixels``).
- The key is the resized pixels' digest: the EXIF-6 JPEG and the same upright pixels as a
  PNG share it; another plan or one changed resized pixel does not.
- The descriptor's thumbnail from the resized pixels is within cosine 0.999 of the one
  from the full image, and a document stays a document (zero descriptor).
- ``decode_image`` copies an upright RGB file no more: one decode, no second image.
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch
from PIL import Image

from gateway.pipeline import Downstream, Pipeline
from gateway.settings import GatewaySettings
from tests.conftest import png_bytes, rgb
from vlcommon.imaging import (
    cosine_similarity,
    decode_image,
    exact_key,
    plan_resize,
    resize_to_plan,
    similarity_descriptor,
)
from vlcommon.model_info import load_vision_spec

MAX_PIXELS = 1280 * 32 * 32  # the Qwen3-VL deployment guides' budget


def photo(orientation: int, size: tuple[int, int] = (2016, 1512), seed: int = 0) -> bytes:
    """chelsea.png upscaled with grain (compresses like a photo), stored under ``orientation``."""
    big = np.asarray(rgb("chelsea.png").resize(size, Image.Resampling.BICUBIC), np.int16)
    grain = np.random.default_rng(seed).normal(0, 3, big.shape)
    stored = Image.fromarray(np.clip(big + grain, 0, 255).astype(np.uint8))
    exif = Image.Exif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    stored.save(out, format="JPEG", quality=90, exif=exif)
    return out.getvalue()


def screenshot_rgba() -> bytes:
    """A 1920x1080 RGBA PNG: coffee.png upscaled, with an alpha gradient."""
    base = np.asarray(rgb("coffee.png").resize((1920, 1080), Image.Resampling.BICUBIC))
    alpha = np.broadcast_to(np.linspace(40, 255, 1920, dtype=np.uint8)[None, :], (1080, 1920))
    return png_bytes(Image.fromarray(np.dstack([base, alpha]), "RGBA"))


@pytest.fixture(scope="module")
def gateway(tiny_model):  # type: ignore[no-untyped-def]
    import grpc
    from qwenvl.decoder.v1 import decoder_service_pb2_grpc
    from qwenvl.encoder.v1 import encoder_service_pb2_grpc

    spec = dataclasses.replace(load_vision_spec(tiny_model), max_pixels=MAX_PIXELS)
    nowhere = grpc.insecure_channel("127.0.0.1:9")
    servicer = Pipeline(
        GatewaySettings(cache_address="", max_decoded_pixels=40_000_000),
        spec,
        "rev",
        (),
        Downstream(
            encoder=encoder_service_pb2_grpc.EncoderServiceStub(nowhere),
            decoder=decoder_service_pb2_grpc.DecoderServiceStub(nowhere),
            cache=None,
        ),
    )
    yield servicer
    nowhere.close()


@pytest.mark.parametrize(
    "name", ["jpeg-orientation-1", "jpeg-orientation-6", "jpeg-orientation-8", "png-rgba"]
)
def test_the_vit_sees_what_vllm_would_see(gateway, tiny_model, name) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoImageProcessor
    from vllm.multimodal.media.image import ImageMediaIO

    data = screenshot_rgba() if name == "png-rgba" else photo(int(name[-1]))
    (im,) = gateway.preprocessor.prepare_images([data], gateway.spec.min_pixels, MAX_PIXELS)
    assert im.pixels is not None and im.pixels.shape[2] == 3
    processor = AutoImageProcessor.from_pretrained(tiny_model)
    size = {"shortest_edge": gateway.spec.min_pixels, "longest_edge": MAX_PIXELS}
    theirs = processor(
        images=[ImageMediaIO().load_bytes(data).media], size=size, return_tensors="pt"
    )
    assert tuple(theirs["image_grid_thw"][0].tolist()) == im.plan.grid
    # The encoder's step (encoder_service.engine.VisionEngine.preprocess) on our pixels.
    chw = torch.from_numpy(np.ascontiguousarray(im.pixels)).permute(2, 0, 1)
    ours = processor(images=[chw], do_resize=False, return_tensors="pt")
    assert torch.equal(ours["pixel_values"], theirs["pixel_values"])
    # Sideways files are planned upright: portrait for 6 and 8, landscape for 1.
    portrait = name in ("jpeg-orientation-6", "jpeg-orientation-8")
    assert (im.plan.resized_height > im.plan.resized_width) == portrait


def test_the_key_is_the_resized_pixels_digest(gateway) -> None:  # type: ignore[no-untyped-def]
    sideways = photo(6)
    upright = png_bytes(decode_image(sideways, index=0, max_decoded_pixels=40_000_000))
    lo = gateway.spec.min_pixels
    (a,) = gateway.preprocessor.prepare_images([sideways], lo, MAX_PIXELS)
    (b,) = gateway.preprocessor.prepare_images([upright], lo, MAX_PIXELS)
    assert a.key == b.key == exact_key(a.pixels, a.plan, "rev")
    (c,) = gateway.preprocessor.prepare_images([sideways], lo, MAX_PIXELS // 4)
    assert c.plan != a.plan and c.key != a.key
    changed = a.pixels.copy()
    changed[0, 0, 0] ^= 1
    assert exact_key(changed, a.plan, "rev") != a.key
    assert exact_key(Image.fromarray(a.pixels), a.plan, "rev") == a.key


def test_the_descriptor_from_resized_pixels_matches_the_full_image() -> None:
    spec_budget = 200_704  # the bench checkpoint's: the strongest downscale used
    from tests.unit.gateway.test_bytes_key import SPEC

    for name in ("astronaut.png", "chelsea.png", "coffee.png", "hubble_deep_field.jpg"):
        image = rgb(name)
        big = image.resize((image.width * 3, image.height * 3), Image.Resampling.BICUBIC)
        plan = plan_resize(big.height, big.width, SPEC, index=0, max_pixels=spec_budget)
        resized = resize_to_plan(big, plan).permute(1, 2, 0).contiguous().numpy()
        full = similarity_descriptor(big)
        fast = similarity_descriptor(big, resized)
        assert np.linalg.norm(fast) == pytest.approx(1.0, abs=1e-5)
        assert cosine_similarity(full, fast) >= 0.999, name
    # Documents: the document test looks at the full image, so they stay exact-only.
    from splitvl_tools.cache_eval import render_text

    for layout in ("label", "note", "page", "dense"):
        page = render_text("Total: $1,234.56", layout)
        page = page.resize((page.width * 2, page.height * 2), Image.Resampling.BICUBIC)
        plan = plan_resize(page.height, page.width, SPEC, index=0, max_pixels=spec_budget)
        resized = resize_to_plan(page, plan).permute(1, 2, 0).contiguous().numpy()
        assert not similarity_descriptor(page, resized).any(), layout


def test_decode_image_returns_an_upright_rgb_file_without_a_copy(monkeypatch) -> None:
    files = photo(1), photo(6)
    copies = []
    original = Image.Image.copy

    def counting_copy(self):  # type: ignore[no-untyped-def]
        copies.append(self.size)
        return original(self)

    monkeypatch.setattr(Image.Image, "copy", counting_copy)
    upright, sideways = (decode_image(f, index=0, max_decoded_pixels=40_000_000) for f in files)
    assert copies == []
    assert upright.mode == sideways.mode == "RGB"
    assert upright.size == (2016, 1512) and sideways.size == (1512, 2016)
    # Still usable after decode_image returned (its file is not closed under it).
    assert np.asarray(upright).shape == (1512, 2016, 3)


def test_generate_json_says_which_images_were_decoded() -> None:
    """``splitvl generate --json`` (splitvl.client.consume): ``decoded`` per image."""
    from qwenvl.common.v1 import generation_pb2
    from qwenvl.gateway.v1 import gateway_service_pb2 as pb

    from splitvl.client import consume

    first = pb.GenerateResponse()
    first.images.add(index=0, tier=generation_pb2.CACHE_TIER_EXACT, decoded=False, key="a" * 64)
    first.images.add(index=1, tier=generation_pb2.CACHE_TIER_MISS, decoded=True, key="b" * 64)
    last = pb.GenerateResponse(token_ids=[5, 6], text="hi")
    result = consume(iter([first, last])).as_dict()
    assert [(im["tier"], im["decoded"]) for im in result["images"]] == [
        ("exact", False),
        ("miss", True),
    ]
    assert result["token_ids"] == [5, 6]


def test_the_photos_benchmark_sends_phone_files_and_exact_repeats(tiny_model, tmp_path) -> None:
    """splitvl_tools.photos: what `splitvl bench --photos` sends (no engine started)."""
    import json
    import shutil

    from splitvl_tools.photos import PHOTOS_MAX_PIXELS, SCENARIOS, build_workloads, photos_model
    from vlcommon.imaging import read_header

    work, files = build_workloads(requests=4, requests_conc1=2, reps=1, seed=3)
    assert len(files) == 3 + 3  # per scenario: half warm-up files, half new ones
    kinds = [kind for _, kind in files]
    assert kinds[:3] == ["jpeg-o1-q85", "jpeg-o6-q90", "png-1920x1080"]
    for data, kind in files:
        header = read_header(data)
        assert header is not None
        if kind.startswith("jpeg"):
            assert header.format == "JPEG" and header.orientation == int(kind[6])
            assert (header.stored_width, header.stored_height) == (4032, 3024)
            assert len(data) > 500_000  # grain: compresses like a photo, not like a gradient
        else:
            assert header.format == "PNG" and f"{header.width}x{header.height}" in kind
    for scenario in SCENARIOS:
        (w,) = work[scenario]
        warm = {r.images[0] for r in w["warmup"]}
        repeats = [r for r in w["requests"] if r.kinds[0].startswith("exact")]
        assert len(repeats) * 2 == len(w["requests"])
        assert {r.images[0] for r in repeats} == warm  # byte-identical, each once
        new = [r.images[0] for r in w["requests"] if r.kinds[0].startswith("unique")]
        assert not warm & set(new) and len(set(new)) == len(new)
    # The checkpoint copy with the deployment guides' budget.
    base = tmp_path / "bench"
    shutil.copytree(tiny_model, base)
    model = photos_model(base)
    config = json.loads((model / "processor_config.json").read_text())
    assert config["image_processor"]["size"]["longest_edge"] == PHOTOS_MAX_PIXELS
    assert (model / "model.safetensors").stat().st_ino == (base / "model.safetensors").stat().st_ino
    assert photos_model(base) == model  # made once
