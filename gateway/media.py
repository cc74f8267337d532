"""Media intake: encoded image bytes, RFC 2397 data URLs, image URLs, video frames.

Bytes and data URLs are resolved here, synchronously; a URL comes back as
:class:`ImageUrl` for :class:`gateway.fetch.UrlFetcher` to fetch (asynchronously, with
its SSRF guard) before the images are decoded. Videos are refused with a clear status
(:func:`check_video`): the decoder does not take video embeddings yet.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

import grpc
from qwenvl.gateway.v1 import gateway_service_pb2 as pb

from vlcommon.errors import ServiceError, invalid_argument, resource_exhausted

# RFC 2397 / RFC 2045: the scheme, the media type and the "base64" token are
# case-insensitive (``DATA:IMAGE/PNG;BASE64,...`` is the same URL).
_DATA_URL = re.compile(
    r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?),(?P<data>.*)$",
    re.DOTALL | re.IGNORECASE,
)


@dataclass(frozen=True)
class ImageUrl:
    """An image still to be fetched (``ImageInput.url``)."""

    url: str


def image_bytes(image: pb.ImageInput, *, index: int, max_bytes: int) -> bytes | ImageUrl:
    """The encoded bytes of one image input, or the URL to fetch them from.

    Raises:
        ServiceError: INVALID_ARGUMENT for a missing source or malformed data URL;
            RESOURCE_EXHAUSTED when the bytes exceed ``max_bytes``; both name ``images[index]``.
    """
    field = f"images[{index}]"
    kind = image.WhichOneof("source")
    if kind == "url":
        return ImageUrl(image.url)  # checked and fetched by gateway.fetch.UrlFetcher
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
        if match is None or ";base64" not in (match.group("params") or "").lower():
            raise invalid_argument(
                "DATA_URL_INVALID",
                f"{field}.data_url is not a base64 data URL (expected 'data:image/...;base64,...')",
                field=f"{field}.data_url",
            )
        mime = (match.group("mime") or "").lower()
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
            "IMAGE_SOURCE_MISSING", f"{field} has none of data, data_url, url", field=field
        )
    if len(data) > max_bytes:
        raise resource_exhausted(
            "IMAGE_BYTES_TOO_LARGE",
            f"{field} is {len(data)} bytes; the limit is {max_bytes}",
            field=field,
            limit=max_bytes,
        )
    return data


def check_video(video: pb.VideoInput, *, field: str, temporal_patch_size: int) -> None:
    """Refuse a video part with a clear status (case C14); always raises.

    Qwen3-VL patches video in time by ``temporal_patch_size`` (2) frames. The references
    disagree on a clip shorter than that: transformers' Qwen3-VL video processor (5.19)
    refuses it (``smart_resize``: "t:1 must be larger than temporal_factor:2", so vLLM on
    raw frames fails too) and pads only longer odd clips by repeating the last frame;
    qwen-vl-utils pads a frame list by repeating the last frame but refuses a sampled video
    under 2 frames. splitvl follows the refusal, naming the count. It does not serve video
    yet (the decoder refuses grids with t > 1), so every other video is UNIMPLEMENTED.

    Raises:
        ServiceError: INVALID_ARGUMENT ``VIDEO_TOO_FEW_FRAMES`` naming the frame count when
            it is below ``temporal_patch_size``; otherwise UNIMPLEMENTED
            ``VIDEO_NOT_SUPPORTED``.
    """
    frames = len(video.frames)
    if frames < temporal_patch_size:
        raise invalid_argument(
            "VIDEO_TOO_FEW_FRAMES",
            f"{field}.frames has {frames} frame(s); a video needs at least "
            f"{temporal_patch_size} (the model's temporal patch size)",
            field=f"{field}.frames",
            limit=temporal_patch_size,
        )
    raise ServiceError(
        grpc.StatusCode.UNIMPLEMENTED,
        "VIDEO_NOT_SUPPORTED",
        f"{field} is a video of {frames} frames; video input is not served yet: send the "
        "frames as images",
        {"field": field},
    )
