"""The pure parts of ``splitvl bench --scale`` (the run itself is a command, outside CI)."""

from __future__ import annotations

from splitvl.client import build_request
from splitvl_tools.load import build_requests
from splitvl_tools.scale_bench import digest


def test_digest_names_the_first_image_and_repeats_share_it() -> None:
    """The bench counts a call as a repeat when an earlier call sent the same image bytes:
    the digest reads the first image part of the request's messages."""
    requests = build_requests(40, side=64, repeat_fraction=0.5, max_tokens=2, seed=3)
    digests = [digest(r) for r in requests]
    assert all(len(d) == 16 for d in digests)
    images = [
        next(p.image.data for m in r.messages for p in m.parts if p.HasField("image"))
        for r in requests
    ]
    # Equal digests exactly where the bytes are equal (a repeat sent byte for byte).
    for i in range(len(images)):
        for j in range(i):
            assert (digests[i] == digests[j]) == (images[i] == images[j])
    assert 5 < len(set(digests)) < 40  # some repeats, some distinct images
    assert digest(build_request([], "text only")) == ""
