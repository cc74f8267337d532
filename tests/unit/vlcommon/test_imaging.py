"""The shared image pipeline on the shared cases C01-C04 and real photos (no services)."""

from __future__ import annotations

import io
import json

import grpc
import numpy as np
import pytest
from PIL import Image

from tests.conftest import case_file, photo, png_bytes, rgb
from vlcommon.errors import ServiceError
from vlcommon.imaging import (
    cosine_similarity,
    decode_image,
    exact_key,
    plan_resize,
    resize_to_plan,
    similarity_descriptor,
)
from vlcommon.model_info import VisionSpec, load_vision_spec

MAX_PIXELS = 40_000_000


@pytest.fixture(scope="module")
def spec(tiny_model) -> VisionSpec:
    return load_vision_spec(tiny_model)


def decode(data: bytes, index: int = 0) -> Image.Image:
    return decode_image(data, index=index, max_decoded_pixels=MAX_PIXELS)


def processor_grid(tiny_model, image: Image.Image) -> tuple[int, int, int]:
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(tiny_model)
    return tuple(proc(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist())


def test_vision_spec_matches_the_checkpoint(spec: VisionSpec, tiny_model) -> None:
    config = json.loads((tiny_model / "config.json").read_text())["vision_config"]
    assert spec.factor == 32
    assert spec.embedding_width == config["out_hidden_size"] * 3  # two deepstack levels
    assert (spec.min_pixels, spec.max_pixels) == (4096, 65536)


@pytest.mark.parametrize("name", ["b01_tiny_26x28.png", "b01_tiny_side_30x305.png"])
def test_c01_small_sides_are_resized_up_like_the_processor(name, spec, tiny_model) -> None:
    image = decode(case_file(name).read_bytes())
    plan = plan_resize(image.height, image.width, spec, index=0)
    assert plan.resized_height % 32 == 0 and plan.resized_width % 32 == 0
    assert plan.resized_height * plan.resized_width >= spec.min_pixels
    # The grid is the checkpoint processor's own: vLLM on the raw image would agree.
    assert plan.grid == processor_grid(tiny_model, image)
    assert plan.tokens == plan.grid_h * plan.grid_w // 4


def test_c01_tiny_image_grid_value(spec) -> None:
    image = decode(case_file("b01_tiny_26x28.png").read_bytes())
    assert image.size == (26, 28)  # width 26, height 28
    # smart_resize: 28x26 rounds to 32x32 = 1,024 px < min_pixels 4,096, so it is scaled by
    # sqrt(4096 / 728) = 2.372 and rounded up to multiples of 32: 96 x 64 pixels.
    plan = plan_resize(28, 26, spec, index=0)
    assert (plan.resized_height, plan.resized_width) == (96, 64)
    assert plan.grid == (1, 6, 4) and plan.tokens == 6


def test_c02_aspect_ratio_over_200_is_rejected_with_the_limit(spec) -> None:
    image = decode(case_file("b03_aspect_218_1093x5.png").read_bytes())
    with pytest.raises(ServiceError) as exc:
        plan_resize(image.height, image.width, spec, index=2)
    err = exc.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "images[2]" in err.message and "218.6" in err.message and "200" in err.message
    assert err.metadata["limit"] == "200"


def test_c02_aspect_ratio_of_exactly_200_is_accepted(spec, tiny_model) -> None:
    image = decode(case_file("b03_aspect_200_exact_1000x5.png").read_bytes())
    assert image.size == (1000, 5)
    plan = plan_resize(image.height, image.width, spec, index=0)
    assert plan.grid == processor_grid(tiny_model, image)
    assert plan.grid_h >= 2 and plan.grid_w > plan.grid_h


def test_c03_exif_orientation_is_applied_before_everything(spec) -> None:
    data = case_file("b04_exif_orientation6_stored48x32.jpg").read_bytes()
    with Image.open(io.BytesIO(data)) as stored:
        assert stored.size == (48, 32)
    image = decode(data)
    assert image.size == (32, 48)  # upright: width 32, height 48
    arr = np.asarray(image, dtype=np.int32)
    top, bottom = arr[:24].mean(axis=(0, 1)), arr[24:].mean(axis=(0, 1))
    assert top[0] > 180 and top[1] < 80 and top[2] < 80  # red half on top
    assert not (bottom[0] > 180 and bottom[1] < 80)
    plan = plan_resize(image.height, image.width, spec, index=0)
    assert plan.grid == (1, 6, 4)  # taller than wide; the stored orientation gives (1, 4, 6)
    rotated = Image.open(io.BytesIO(data)).convert("RGB")
    assert exact_key(image, plan, "r") != exact_key(rotated, plan, "r")


@pytest.mark.parametrize(
    ("name", "index"),
    [("b07_truncated.jpg", 0), ("b07_not_an_image.jpg", 3), ("b07_empty.png", 1)],
)
def test_c04_undecodable_images_name_their_index(name, index) -> None:
    with pytest.raises(ServiceError) as exc:
        decode(case_file(name).read_bytes(), index=index)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.reason == "IMAGE_DECODE_FAILED"
    assert f"images[{index}] could not be decoded" in exc.value.message
    assert "object at 0x" not in exc.value.message and "the data" not in exc.value.message
    if name == "b07_not_an_image.jpg":
        assert exc.value.message.endswith("not a recognised image format")
    # Truncated loading stays off globally.
    from PIL import ImageFile

    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_alpha_is_composited_on_white() -> None:
    rgba = Image.new("RGBA", (40, 40), (255, 0, 0, 0))
    rgba.paste((0, 0, 255, 255), (0, 0, 20, 40))
    image = decode(png_bytes(rgba))
    assert image.mode == "RGB"
    assert image.getpixel((30, 5)) == (255, 255, 255)  # transparent -> white background
    assert image.getpixel((5, 5)) == (0, 0, 255)


def test_decompression_bomb_is_refused_before_decoding() -> None:
    big = png_bytes(Image.new("L", (3000, 3000)))
    with pytest.raises(ServiceError) as exc:
        decode_image(big, index=0, max_decoded_pixels=1_000_000)
    assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "9000000" in exc.value.message and "1000000" in exc.value.message


def test_exact_key_separates_same_bytes_with_other_shapes(spec) -> None:
    pixels = np.arange(64 * 64 * 3, dtype=np.uint8).reshape(64, 64, 3)
    a = Image.fromarray(pixels)
    b = Image.fromarray(pixels.reshape(32, 128, 3))
    assert a.tobytes() == b.tobytes()
    pa = plan_resize(64, 64, spec, index=0)
    pb = plan_resize(32, 128, spec, index=0)
    assert exact_key(a, pa, "rev") != exact_key(b, pb, "rev")
    assert exact_key(a, pa, "rev") != exact_key(a, pa, "other-revision")
    assert exact_key(a, pa, "rev") == exact_key(Image.fromarray(pixels.copy()), pa, "rev")
    assert len(exact_key(a, pa, "rev")) == 64  # full SHA-256


def test_descriptor_finds_reencodes_and_separates_photos() -> None:
    astronaut = rgb("astronaut.png")
    buf = io.BytesIO()
    astronaut.save(buf, format="JPEG", quality=95)
    jpeg = decode(buf.getvalue())
    resized = astronaut.resize((502, 502), Image.Resampling.BICUBIC)
    d = similarity_descriptor(astronaut)
    assert d.shape == (3072,) and d.dtype == np.float32
    assert abs(float(np.linalg.norm(d)) - 1.0) < 1e-5
    assert cosine_similarity(d, similarity_descriptor(jpeg)) > 0.98
    assert cosine_similarity(d, similarity_descriptor(resized)) > 0.95
    for other in ("chelsea.png", "coffee.png", "rocket.jpg"):
        assert cosine_similarity(d, similarity_descriptor(rgb(other))) < 0.85, other
    flat = Image.new("RGB", (64, 64), (10, 20, 30))
    assert not similarity_descriptor(flat).any()


def test_resize_to_plan_equals_the_processor_pixels(spec, tiny_model) -> None:
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(tiny_model)
    for name in ("chelsea.png", "coffee.png"):
        image = rgb(name)
        plan = plan_resize(image.height, image.width, spec, index=0)
        ours = proc(
            images=[resize_to_plan(np.asarray(image), plan)], do_resize=False, return_tensors="pt"
        )["pixel_values"]
        theirs = proc(images=[image], return_tensors="pt")["pixel_values"]
        assert ours.shape == theirs.shape
        assert bool((ours == theirs).all()), name


def test_photo_bytes_decode_to_the_same_pixels_as_pil() -> None:
    image = decode(photo("chelsea.png"))
    assert np.array_equal(np.asarray(image), np.asarray(rgb("chelsea.png")))


def _encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_every_image_mode_becomes_8bit_rgb() -> None:
    gradient = np.linspace(0, 65535, 32 * 32).reshape(32, 32).astype(np.uint16)
    sixteen = decode(_encode(Image.fromarray(gradient), "PNG"))
    assert sixteen.mode == "RGB" and sixteen.getpixel((31, 31)) == (255, 255, 255)
    assert sixteen.getpixel((0, 0)) == (0, 0, 0)

    palette = Image.new("P", (8, 8), 0)
    palette.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    palette.paste(1, (0, 0, 4, 8))
    transparent = decode(_encode(palette, "PNG", transparency=0))
    assert transparent.getpixel((6, 1)) == (255, 255, 255)  # index 0 is transparent
    assert transparent.getpixel((1, 1)) == (0, 255, 0)

    la = Image.new("LA", (8, 8), (0, 0))
    assert decode(_encode(la, "PNG")).getpixel((0, 0)) == (255, 255, 255)

    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # red in CMYK
    r, g, b = decode(_encode(cmyk, "JPEG", quality=95)).getpixel((4, 4))
    assert r > 200 and g < 60 and b < 60


def test_animated_gif_uses_its_first_frame() -> None:
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=100)
    r, g, b = decode(buf.getvalue()).getpixel((8, 8))
    assert r > 200 and b < 60


DATA = __import__("pathlib").Path(__file__).resolve().parents[2] / "data"


@pytest.mark.parametrize(
    "data",
    [
        b"DDS " + b"\x7c\x00\x00\x00" + b"\x00" * 120,  # Pillow: NotImplementedError
        (DATA / "fuzzed_gif_indexerror.gif").read_bytes(),  # Pillow: IndexError
        (DATA / "fuzzed_spider_attrerror.bin").read_bytes(),  # Pillow: AttributeError
    ],
    ids=["dds", "fuzzed-gif", "fuzzed-spider"],
)
def test_any_decoder_failure_is_invalid_argument_without_addresses(data) -> None:
    with pytest.raises(ServiceError) as exc:
        decode(data, index=2)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.message.startswith("images[2] could not be decoded")
    assert " at 0x" not in exc.value.message


def test_pillow_bomb_guard_reports_our_limit() -> None:
    # A real 8x8 PNG whose header is rewritten to claim 100000 x 100000 (CRC fixed): Pillow's
    # own guard fires inside Image.open, before our size check can run.
    import struct
    import zlib

    png = bytearray(png_bytes(Image.new("RGB", (8, 8))))
    png[16:24] = struct.pack(">II", 100_000, 100_000)
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))
    with pytest.raises(ServiceError) as exc:
        decode(bytes(png))
    assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert exc.value.metadata["limit"] == str(MAX_PIXELS)
    # One limit in the message, ours; Pillow's own ("exceeds limit of ...") is not quoted.
    assert f"is 10000000000 pixels; the limit is {MAX_PIXELS} decoded pixels" in str(exc.value)
    assert "exceeds limit" not in str(exc.value)


# -- every mode and container, with the composited values -------------------------------
# Half-transparent colour c over white: a * c + (1 - a) * 255 with a = 128 / 255.
HALF = 128 / 255


def over_white(c: int, alpha: float = HALF) -> int:
    return round(alpha * c + (1 - alpha) * 255)


def close(got: tuple, want: tuple, tol: int = 1) -> bool:
    return all(abs(int(g) - int(w)) <= tol for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("fmt", ["PNG", "WEBP", "TIFF"])
def test_half_transparent_rgba_is_composited_on_white(fmt) -> None:
    rgba = Image.new("RGBA", (8, 8), (255, 0, 0, 128))
    rgba.paste((0, 0, 255, 255), (0, 0, 4, 8))
    kw = {"lossless": True} if fmt == "WEBP" else {}
    image = decode(_encode(rgba, fmt, **kw))
    assert image.mode == "RGB"
    assert close(image.getpixel((6, 2)), (255, over_white(0), over_white(0)))  # (255,127,127)
    assert image.getpixel((1, 2)) == (0, 0, 255)


def test_palette_with_per_index_alpha_and_grey_and_rgb_trns() -> None:
    # P + tRNS with partial alpha: index 0 is red at alpha 128, index 1 opaque green.
    pal = Image.new("P", (8, 8), 0)
    pal.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    pal.paste(1, (0, 0, 4, 8))
    image = decode(_encode(pal, "PNG", transparency=bytes([128, 255])))
    assert close(image.getpixel((6, 1)), (255, over_white(0), over_white(0)))
    assert image.getpixel((1, 1)) == (0, 255, 0)
    # Greyscale PNG with a tRNS grey value: that grey is transparent (white), others stay.
    grey = Image.new("L", (8, 8), 100)
    grey.paste(50, (0, 0, 4, 8))
    image = decode(_encode(grey, "PNG", transparency=100))
    assert image.getpixel((6, 1)) == (255, 255, 255) and image.getpixel((1, 1)) == (50, 50, 50)
    # RGB PNG with a tRNS colour.
    rgb_im = Image.new("RGB", (8, 8), (1, 2, 3))
    rgb_im.paste((9, 8, 7), (0, 0, 4, 8))
    image = decode(_encode(rgb_im, "PNG", transparency=(1, 2, 3)))
    assert image.getpixel((6, 1)) == (255, 255, 255) and image.getpixel((1, 1)) == (9, 8, 7)
    # GIF with a transparent index.
    gif = Image.new("P", (8, 8), 0)
    gif.putpalette([0, 0, 0, 200, 10, 10] + [0] * 762)
    gif.paste(1, (0, 0, 4, 8))
    image = decode(_encode(gif, "GIF", transparency=0))
    assert image.getpixel((6, 1)) == (255, 255, 255) and image.getpixel((1, 1)) == (200, 10, 10)


def test_la_and_pa_are_composited() -> None:
    from vlcommon.imaging import _to_rgb

    la = Image.new("LA", (4, 4), (0, 128))  # black at half alpha -> mid grey
    g = over_white(0)
    assert close(decode(_encode(la, "PNG")).getpixel((1, 1)), (g, g, g))
    assert close(decode(_encode(la, "TIFF")).getpixel((1, 1)), (g, g, g))
    # No Pillow encoder writes PA; it appears in memory (e.g. a converted palette image).
    pa = Image.new("P", (4, 4), 0)
    pa.putpalette([0, 0, 255] * 256)
    pa = pa.convert("PA")
    pa.putalpha(128)
    assert pa.mode == "PA"
    assert close(_to_rgb(pa).getpixel((1, 1)), (over_white(0), over_white(0), 255))


def test_high_bit_depth_grey_follows_the_documented_scaling() -> None:
    from vlcommon.imaging import _to_rgb

    sixteen = np.array([[0, 65535], [256, 32768]], dtype=np.uint16)
    little = Image.fromarray(sixteen)
    big = Image.frombytes("I;16B", (2, 2), sixteen.astype(">u2").tobytes())
    for source, fmt in ((little, "PNG"), (little, "TIFF"), (big, "TIFF")):
        with Image.open(io.BytesIO(_encode(source, fmt))) as stored:
            assert stored.mode == source.mode, (source.mode, fmt)
        decoded = decode(_encode(source, fmt))
        assert np.asarray(decoded)[..., 0].tolist() == [[0, 255], [1, 128]], (source.mode, fmt)
    # 32-bit signed: negatives clip; 8-bit range kept; 16-bit range >> 8; wider by bit length.
    wide = Image.fromarray(np.array([[0, 70000], [-5, 255]], dtype=np.int32))
    assert np.asarray(decode(_encode(wide, "TIFF")))[..., 0].tolist() == [[0, 70000 >> 9], [0, 0]]
    small = Image.fromarray(np.array([[0, 200], [-1, 255]], dtype=np.int32))
    assert np.asarray(_to_rgb(small))[..., 1].tolist() == [[0, 200], [0, 255]]
    mid = Image.fromarray(np.array([[0, 1000], [512, 65535]], dtype=np.int32))
    assert np.asarray(_to_rgb(mid))[..., 2].tolist() == [[0, 3], [2, 255]]
    # Float: [0, 1] scales by 255; any other range clips; NaN is 0.
    unit = Image.fromarray(np.array([[0.0, 0.5], [1.0, 0.25]], dtype=np.float32))
    assert np.asarray(decode(_encode(unit, "TIFF")))[..., 0].tolist() == [[0, 128], [255, 64]]
    other = Image.fromarray(np.array([[-3.0, 300.0], [12.4, np.nan]], dtype=np.float32))
    assert np.asarray(_to_rgb(other))[..., 0].tolist() == [[0, 255], [12, 0]]


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "TIFF"])
def test_bilevel_images_are_black_and_white(fmt) -> None:
    bits = Image.new("1", (8, 8), 0)
    bits.paste(1, (0, 0, 4, 8))
    image = decode(_encode(bits, fmt))
    assert image.getpixel((1, 1)) == (255, 255, 255) and image.getpixel((6, 1)) == (0, 0, 0)


def test_cmyk_tiff_and_plain_containers_keep_exact_pixels() -> None:
    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))
    assert decode(_encode(cmyk, "TIFF")).getpixel((4, 4)) == (255, 0, 0)
    source = rgb("chelsea.png").crop((0, 0, 64, 48))
    for fmt, kw in (("BMP", {}), ("TIFF", {}), ("WEBP", {"lossless": True}), ("PNG", {})):
        assert np.array_equal(np.asarray(decode(_encode(source, fmt, **kw))), np.asarray(source))
    lossy = np.asarray(decode(_encode(source, "WEBP", quality=90)), dtype=np.int32)
    assert np.abs(lossy - np.asarray(source, dtype=np.int32)).mean() < 6


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_animated_images_use_their_first_frame(fmt) -> None:
    frames = [Image.new("RGBA", (16, 16), c) for c in ((255, 0, 0, 128), (0, 0, 255, 255))]
    if fmt == "GIF":  # GIF has no partial alpha: an opaque first frame
        frames = [f.convert("RGB") for f in frames]
    kw = {"lossless": True} if fmt == "WEBP" else {}
    data = _encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, **kw)
    with Image.open(io.BytesIO(data)) as im:
        assert im.n_frames == 2
    got = decode(data).getpixel((8, 8))
    want = (255, 0, 0) if fmt == "GIF" else (255, over_white(0), over_white(0))
    assert close(got, want, tol=2), (fmt, got)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "TIFF", "BMP"])
def test_decoded_pixel_limit_at_its_edge_before_any_pixel_is_decoded(fmt, monkeypatch) -> None:
    from PIL import ImageFile

    # 3000 x 2000 = 6,000,000 pixels, flat so every container stays small.
    data = _encode(Image.new("RGB", (3000, 2000), (10, 200, 30)), fmt)
    assert decode_image(data, index=0, max_decoded_pixels=6_000_000).size == (3000, 2000)

    def no_decode(self):  # type: ignore[no-untyped-def]
        raise AssertionError("pixel data was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    with pytest.raises(ServiceError) as exc:
        decode_image(data, index=4, max_decoded_pixels=5_999_999)
    assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.value.message
    assert "images[4] is 3000x2000 = 6000000 pixels" in exc.value.message
    assert exc.value.metadata["limit"] == "5999999"


@pytest.mark.parametrize(
    ("height", "width", "budget"),
    [
        (32, 3200, None),  # short side clamped to the factor: smart_resize gives 32x2560
        (3200, 32, None),
        (32, 6400, None),  # aspect ratio exactly 200
        (96, 128, (65536, 65536)),  # scaled up with both sides rounded up: 320x224
        (5, 1000, None),
        (1000, 999, (4096, 8192)),
    ],
)
def test_plan_never_exceeds_max_pixels(spec: VisionSpec, height, width, budget) -> None:
    """The encoder refuses more than max_pixels / patch_size**2 patches, so a plan over the
    budget would be accepted by the gateway and then refused (adversarial finding 4)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    lo, hi = budget or (spec.min_pixels, spec.max_pixels)
    plan = plan_resize(height, width, spec, index=0, min_pixels=lo, max_pixels=hi)
    assert plan.resized_height * plan.resized_width <= hi
    assert plan.resized_height % spec.factor == 0 and plan.resized_width % spec.factor == 0
    assert plan.grid_h * plan.grid_w <= hi // spec.patch_size**2
    rh, rw = smart_resize(height, width, factor=spec.factor, min_pixels=lo, max_pixels=hi)
    if rh * rw <= hi:  # within budget: exactly the checkpoint processor's size
        assert (plan.resized_height, plan.resized_width) == (rh, rw)
    else:  # only the longer side shrinks
        assert min(plan.resized_height, plan.resized_width) == min(rh, rw)
        assert max(plan.resized_height, plan.resized_width) < max(rh, rw)


def test_plan_equals_smart_resize_for_ordinary_sizes(spec: VisionSpec) -> None:
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    for h in range(17, 1200, 37):
        for w in range(17, 1200, 41):
            rh, rw = smart_resize(
                h, w, factor=spec.factor, min_pixels=spec.min_pixels, max_pixels=spec.max_pixels
            )
            if rh * rw > spec.max_pixels:
                continue
            plan = plan_resize(h, w, spec, index=0)
            assert (plan.resized_height, plan.resized_width) == (rh, rw), (h, w)
