"""The end-to-end tests of tests/unit/gateway/test_cache_keys.py
(the services started); the rest of that file runs without them."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from tests.conftest import case_file, png_bytes
from tests.unit.gateway.test_cache_keys import _rgba_sample, decode


@pytest.mark.e2e
def test_keys_and_document_rule_through_the_services(cluster) -> None:
    """The gateway's own keys over gRPC: the EXIF-rotated C03 JPEG and its upright PNG are
    one entry (exact hit, same key); an RGBA image and its white composite are one entry;
    rendered text one digit apart, or re-encoded, is never a similarity hit."""
    from splitvl.client import build_request, generate
    from splitvl_tools.cache_eval import render_text

    def ask(data: bytes) -> dict:
        request = build_request([data], "Describe this image.", max_tokens=2, ignore_eos=True)
        return generate(cluster.ports.address("gateway"), request, timeout_s=120).images[0]

    rotated = case_file("b04_exif_orientation6_stored48x32.jpg").read_bytes()
    first = ask(rotated)
    upright = ask(png_bytes(decode(rotated)))
    assert upright["key"] == first["key"] and upright["tier"] == "exact"
    assert upright["grid"] == first["grid"] == [1, 6, 4]  # 48 tall, 32 wide (C03)

    rgba = _rgba_sample()
    first = ask(png_bytes(rgba))
    white = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    composite = ask(png_bytes(white.convert("RGB")))
    assert composite["key"] == first["key"] and composite["tier"] == "exact"

    a = render_text("Cache key test\nRoom 4711, level 3", "note")
    b = render_text("Cache key test\nRoom 4712, level 3", "note")
    first = ask(png_bytes(a))
    assert first["tier"] == "miss"
    other = ask(png_bytes(b))  # same grid, thumbnail cosine ~1: the tier that would hit
    assert other["grid"] == first["grid"] and other["tier"] == "miss"
    jpeg = io.BytesIO()
    a.save(jpeg, format="JPEG", quality=95)
    assert ask(jpeg.getvalue())["tier"] == "miss"  # documents: exact tier only
    assert ask(png_bytes(a))["tier"] == "exact"
