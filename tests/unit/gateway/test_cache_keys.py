"""The exact tier's key cases (issue 4): shape, EXIF orientation, alpha; and the
similarity descriptor's document rule. No services: the gateway keys the resized pixels
of what ``decode_image`` returns, so the key cases are cases of decode, resize and
``exact_key``."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from tests.conftest import case_file, photo, png_bytes, rgb
from vlcommon.imaging import (
    ALPHA_BACKGROUND,
    DESCRIPTOR_DIM,
    ResizePlan,
    decode_image,
    exact_key,
    is_document_like,
    plan_resize,
    resize_to_plan,
    similarity_descriptor,
)
from vlcommon.model_info import VisionSpec

REVISION = "rev-test"
# Qwen3-VL geometry with the tiny checkpoint's budget; no checkpoint needed to plan.
SPEC = VisionSpec(
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    min_pixels=4096,
    max_pixels=65536,
    out_hidden_size=128,
    n_deepstack=2,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
)


def decode(data: bytes) -> Image.Image:
    return decode_image(data, index=0, max_decoded_pixels=40_000_000)


def plan(image: Image.Image) -> ResizePlan:
    return plan_resize(image.height, image.width, SPEC, index=0)


def key(data: bytes) -> str:
    """What the gateway computes for one uploaded file: the digest of its resized pixels."""
    image = decode(data)
    p = plan(image)
    return exact_key(resize_to_plan(image, p).permute(1, 2, 0).contiguous().numpy(), p, REVISION)


def test_same_pixel_bytes_with_another_shape_get_another_key() -> None:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    square = png_bytes(Image.fromarray(pixels))
    wide = png_bytes(Image.fromarray(pixels.reshape(32, 128, 3)))
    tall = png_bytes(Image.fromarray(pixels.reshape(128, 32, 3)))
    a, b, c = decode(square), decode(wide), decode(tall)
    assert a.tobytes() == b.tobytes() == c.tobytes()
    assert len({key(square), key(wide), key(tall)}) == 3
    # Same shape too, but as the 64x64 image a plan for another budget: another key.
    small = plan_resize(64, 64, SPEC, index=0, min_pixels=1024, max_pixels=1024)
    assert small != plan(a)
    assert exact_key(a, small, REVISION) != exact_key(a, plan(a), REVISION)
    # Equal pixels and shape (a copy): the same key.
    assert key(square) == key(png_bytes(Image.fromarray(pixels.copy())))
    assert len(key(square)) == 64 and int(key(square), 16) >= 0  # full SHA-256, hex


def test_c03_exif_rotated_jpeg_keys_like_the_upright_png() -> None:
    data = case_file("b04_exif_orientation6_stored48x32.jpg").read_bytes()
    upright = decode(data)
    assert upright.size == (32, 48)
    # The same upright pixels saved losslessly without any EXIF.
    plain = png_bytes(upright)
    with Image.open(io.BytesIO(plain)) as im:
        assert im.getexif().get(0x0112) is None
    assert key(data) == key(plain)
    # Ignoring the tag would give the stored 48x32 pixels: another key.
    with Image.open(io.BytesIO(data)) as stored:
        sideways = stored.convert("RGB")
    assert sideways.size == (48, 32)
    assert exact_key(sideways, plan(sideways), REVISION) != key(data)


# Pillow's ImageOps.exif_transpose: orientation -> the transpose that makes it upright.
UPRIGHTING = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
# Its inverse: how a camera stores an upright scene under that orientation tag.
STORING = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_90,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_270,
}


@pytest.mark.parametrize("orientation", sorted(STORING))
def test_every_exif_orientation_keys_like_the_upright_image(orientation: int) -> None:
    rng = np.random.default_rng(orientation)
    upright = Image.fromarray(rng.integers(0, 256, size=(40, 72, 3), dtype=np.uint8))
    stored = upright.transpose(STORING[orientation])
    assert stored.transpose(UPRIGHTING[orientation]).tobytes() == upright.tobytes()
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    stored.save(buf, format="PNG", exif=exif)  # lossless, so keys can be equal
    assert decode(buf.getvalue()).size == (72, 40)
    assert key(buf.getvalue()) == key(png_bytes(upright))
    assert key(buf.getvalue()) != key(png_bytes(stored))


def _rgba_sample() -> Image.Image:
    rng = np.random.default_rng(3)
    rgba = rng.integers(0, 256, size=(48, 64, 4), dtype=np.uint8)
    rgba[:, :16, 3] = 0  # fully transparent band
    rgba[:, 16:32, 3] = 255  # opaque band
    return Image.fromarray(rgba, "RGBA")


def test_rgba_keys_like_its_composite_on_the_alpha_background() -> None:
    rgba = _rgba_sample()
    assert ALPHA_BACKGROUND == (255, 255, 255)
    on_white = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    on_black = Image.alpha_composite(Image.new("RGBA", rgba.size, (0, 0, 0, 255)), rgba)
    decoded = decode(png_bytes(rgba))
    assert decoded.mode == "RGB"
    assert decoded.getpixel((3, 3)) == (255, 255, 255)  # transparent -> background
    assert key(png_bytes(rgba)) == key(png_bytes(on_white.convert("RGB")))
    assert key(png_bytes(rgba)) != key(png_bytes(on_black.convert("RGB")))
    # Alpha that changes nothing visible (fully opaque) keys like the plain RGB image.
    opaque = rgba.copy()
    opaque.putalpha(255)
    assert key(png_bytes(opaque)) == key(png_bytes(rgba.convert("RGB")))


def test_one_changed_pixel_changes_the_key() -> None:
    # Already of a planned size (320x192), so the pixel reaches the ViT unchanged; in a
    # downscaled image the key changes exactly when the resized pixels do.
    image = rgb("chelsea.png").crop((0, 0, 320, 192))
    assert (plan(image).resized_width, plan(image).resized_height) == image.size
    changed = image.copy()
    r, g, b = changed.getpixel((100, 100))
    changed.putpixel((100, 100), (r ^ 1, g, b))
    assert key(png_bytes(image)) != key(png_bytes(changed))


def test_documents_get_no_similarity_descriptor_photos_do() -> None:
    from splitvl_tools.cache_eval import render_text

    for layout in ("label", "note", "page", "dense"):
        text = render_text("Total: $1,234.56", layout)
        assert is_document_like(text), layout
        assert not similarity_descriptor(text).any(), layout
        jpeg = io.BytesIO()
        text.save(jpeg, format="JPEG", quality=70)
        assert is_document_like(decode(jpeg.getvalue())), layout
    # Dark mode and coloured backgrounds, as JPEG (its chroma smears around glyphs).
    font = ImageFont.load_default(size=28)
    for background, ink in (
        ((18, 18, 24), (230, 230, 230)),
        ((30, 60, 140), (255, 255, 255)),
        ((240, 200, 40), (20, 20, 20)),
    ):
        slide = Image.new("RGB", (900, 500), background)
        ImageDraw.Draw(slide).multiline_text(
            (30, 30), "Revenue 2026: 4,812\nCosts: 3,907", font=font, fill=ink
        )
        jpeg = io.BytesIO()
        slide.save(jpeg, format="JPEG", quality=70)
        assert is_document_like(decode(jpeg.getvalue())), background
    for name in ("astronaut.png", "camera.png", "hubble_deep_field.jpg", "moon.png", "horse.png"):
        image = decode(photo(name))
        assert not is_document_like(image), name
        d = similarity_descriptor(image)
        assert d.shape == (DESCRIPTOR_DIM,) and abs(float(np.linalg.norm(d)) - 1.0) < 1e-5
