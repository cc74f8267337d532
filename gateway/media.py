"""Media intake: encoded image bytes or RFC 2397 data URLs, with size limits.

URL fetching (with its SSRF guard) is not offered yet: ``ImageInput`` has no url field.
"""

from __future__ import annotations

import base64
import binascii
import re

from qwenvl.gateway.v1 import gateway_service_pb2 as pb

from vlcommon.errors import invalid_argument, resource_exhausted

_DATA_URL = re.compile(
    r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?),(?P<data>.*)$", re.DOTALL
)


def image_bytes(image: pb.ImageInput, *, index: int, max_bytes: int) -> bytes:
    """The encoded bytes of one image input.

    Raises:
        ServiceError: INVALID_ARGUMENT for a missing source or malformed data URL;
            RESOURCE_EXHAUSTED when the bytes exceed ``max_bytes``; both name ``images[index]``.
    """
    field = f"images[{index}]"
    kind = image.WhichOneof("source")
    if kind == "data":
        data = image.data
    elif kind == "data_url":
        url = image.data_url
        # base64 inflates by 4/3: refuse before decoding when the result must be too large.
        if len(url) > max_bytes * 4 // 3 + 1024:
            raise resource_exhausted(
                "IMAGE_BYTES_TOO_LARGE",
                f"{field}.data_url is {len(url)} characters; the image limit is {max_bytes} bytes",
                field=f"{field}.data_url",
                limit=max_bytes,
            )
        match = _DATA_URL.match(url)
        if match is None or ";base64" not in (match.group("params") or ""):
            raise invalid_argument(
                "DATA_URL_INVALID",
                f"{field}.data_url is not a base64 data URL (expected 'data:image/...;base64,...')",
                field=f"{field}.data_url",
            )
        mime = match.group("mime") or ""
        if mime and not mime.startswith("image/"):
            raise invalid_argument(
                "DATA_URL_INVALID",
                f"{field}.data_url has media type {mime!r}; expected image/*",
                field=f"{field}.data_url",
            )
        try:
            data = base64.b64decode(match.group("data"), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise invalid_argument(
                "DATA_URL_INVALID",
                f"{field}.data_url has invalid base64: {exc}",
                field=f"{field}.data_url",
            ) from exc
    else:
        raise invalid_argument(
            "IMAGE_SOURCE_MISSING", f"{field} has neither data nor data_url", field=field
        )
    if len(data) > max_bytes:
        raise resource_exhausted(
            "IMAGE_BYTES_TOO_LARGE",
            f"{field} is {len(data)} bytes; the limit is {max_bytes}",
            field=field,
            limit=max_bytes,
        )
    return data
