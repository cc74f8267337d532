"""Data URLs held to a byte limit before any base64 is decoded (gateway/media.py)."""

from __future__ import annotations

import base64

import grpc
import pytest
from qwenvl.gateway.v1 import gateway_service_pb2 as gpb

from gateway.media import image_bytes
from vlcommon.errors import ServiceError


def test_a_long_data_url_is_refused_in_bytes_before_decoding() -> None:
    """The refusal compared characters with a byte limit; it now says both."""
    payload = base64.b64encode(b"\x89PNG" + b"\0" * 60_000).decode()
    url = f"data:image/png;base64,{payload}"
    with pytest.raises(ServiceError) as info:
        image_bytes(gpb.ImageInput(data_url=url), index=3, max_bytes=10_000)
    err = info.value
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.reason == "IMAGE_BYTES_TOO_LARGE"
    assert err.metadata == {"field": "images[3].data_url", "limit": "10000"}
    assert (
        f"images[3].data_url is {len(url)} characters, about {len(payload) * 3 // 4} bytes "
        "once base64-decoded; the image limit is 10000 bytes"
    ) in str(err)
    # Within the limit's base64 size, it is decoded and held to the byte limit exactly.
    small = base64.b64encode(b"x" * 9_000).decode()
    assert (
        image_bytes(
            gpb.ImageInput(data_url=f"data:image/png;base64,{small}"), index=0, max_bytes=10_000
        )
        == b"x" * 9_000
    )
