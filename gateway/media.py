"""Media intake: encoded image bytes, RFC 2397 data URLs, image URLs, video files.

Bytes and data URLs are resolved here, synchronously; a URL comes back as
:class:`ImageUrl` for :class:`gateway.fetch.UrlFetcher` to fetch (asynchronously, with
its SSRF guard) before the images are decoded. A video file's source is resolved the same
way (:func:`video_file_bytes`); its decoding is gateway.video's.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

from qwenvl.gateway.v1 import gateway_service_pb2 as pb

from vlcommon.errors import ServiceError
from vlcommon.refusals import Refusal

# RFC 2397 / RFC 2045: the scheme, the media type and the "base64" token are
# case-insensitive (``DATA:IMAGE/PNG;BASE64,...`` is the same URL).
_DATA_URL = re.compile(
    r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?),(?P<data>.*)$",
    re.DOTALL | re.IGNORECASE,
)


@dataclass(frozen=True)
class ImageUrl:
    """An image or a video file still to be fetched (``ImageInput.url``,
    ``VideoFile.url``), by :class:`gateway.fetch.UrlFetcher`."""

    url: str


_BYTES_TOO_LARGE = {"image": Refusal.IMAGE_BYTES_TOO_LARGE, "video": Refusal.VIDEO_BYTES_TOO_LARGE}


def bytes_too_large(
    item: str, message: str, *, field: str, limit: int, host: str | None = None
) -> ServiceError:
    """RESOURCE_EXHAUSTED ``IMAGE_BYTES_TOO_LARGE`` / ``VIDEO_BYTES_TOO_LARGE`` (``item``:
    ``image`` or ``video``): the one rule of GATEWAY_MAX_IMAGE_BYTES /
    GATEWAY_MAX_VIDEO_BYTES, whose ``message`` says where the bytes were measured (a data
    URL's length, the bytes sent, a URL's body as it streams in: gateway.fetch, which
    names the ``host``)."""
    refusal = _BYTES_TOO_LARGE[item]
    if host is None:
        return refusal.error(message, field=field, limit=limit)
    return refusal.error(message, field=field, limit=limit, host=host)


def check_bytes(data: bytes, *, item: str, field: str, limit: int, where: str = "") -> bytes:
    """``data``, if it holds at most ``limit`` bytes (``where``: the setting to name).

    Raises:
        ServiceError: as :func:`bytes_too_large`, naming ``field`` and ``limit``.
    """
    if len(data) > limit:
        raise bytes_too_large(
            item,
            f"{field} is {len(data)} bytes; the limit is {limit}{where}",
            field=field,
            limit=limit,
        )
    return data


def _data_url_bytes(
    url: str, field: str, noun: str, max_bytes: int, mimes: tuple[str, ...], expected: str
) -> bytes:
    """The bytes of a base64 data URL (``<field>.data_url``) of an image or a video.

    Raises:
        ServiceError: RESOURCE_EXHAUSTED :func:`bytes_too_large` when the URL alone is
            too long for ``max_bytes`` (checked before decoding); INVALID_ARGUMENT
            ``DATA_URL_INVALID`` for a malformed URL, a media type not starting with one of
            ``mimes``, or invalid base64.
    """
    # base64 inflates by 4/3: refuse before decoding when the result must be too large.
    if len(url) > max_bytes * 4 // 3 + 1024:
        raise bytes_too_large(
            noun,
            f"{field}.data_url is {len(url)} characters, about "
            f"{(len(url) - url.find(',') - 1) * 3 // 4} bytes once base64-decoded; the "
            f"{noun} limit is {max_bytes} bytes",
            field=f"{field}.data_url",
            limit=max_bytes,
        )
    match = _DATA_URL.match(url)
    if match is None or ";base64" not in (match.group("params") or "").lower():
        raise Refusal.DATA_URL_INVALID.error(
            f"{field}.data_url is not a base64 data URL (expected 'data:{noun}/...;base64,...')",
            field=f"{field}.data_url",
        )
    mime = (match.group("mime") or "").lower()
    if mime and not mime.startswith(mimes):
        raise Refusal.DATA_URL_INVALID.error(
            f"{field}.data_url has media type {mime!r}; expected {expected}",
            field=f"{field}.data_url",
        )
    try:
        return base64.b64decode(match.group("data"), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise Refusal.DATA_URL_INVALID.error(
            f"{field}.data_url has invalid base64: {exc}", field=f"{field}.data_url"
        ) from exc


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
        data = _data_url_bytes(image.data_url, field, "image", max_bytes, ("image/",), "image/*")
    else:
        raise Refusal.IMAGE_SOURCE_MISSING.error(
            f"{field} has none of data, data_url, url", field=field
        )
    return check_bytes(data, item="image", field=field, limit=max_bytes)


def video_file_bytes(video: pb.VideoFile, *, index: int, max_bytes: int) -> bytes | ImageUrl:
    """The encoded bytes of one video file, or the URL to fetch them from.

    Raises:
        ServiceError: INVALID_ARGUMENT for a missing source or malformed data URL (its
            media type, when given, must be video/* or image/*: an animated GIF is a
            video too); RESOURCE_EXHAUSTED past ``max_bytes``; both name ``videos[index]``.
    """
    field = f"videos[{index}]"
    kind = video.WhichOneof("source")
    if kind == "url":
        return ImageUrl(video.url)  # fetched by the gateway's video UrlFetcher
    if kind == "data":
        data = video.data
    elif kind == "data_url":
        # An animated GIF is a video too; octet-stream is what many uploaders send.
        data = _data_url_bytes(
            video.data_url,
            field,
            "video",
            max_bytes,
            ("video/", "image/", "application/octet-stream"),
            "video/*",
        )
    else:
        raise Refusal.VIDEO_SOURCE_MISSING.error(
            f"{field}.file has none of data, data_url, url", field=field
        )
    return check_bytes(
        data, item="video", field=field, limit=max_bytes, where=" (GATEWAY_MAX_VIDEO_BYTES)"
    )
