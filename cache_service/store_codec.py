"""Entries in a shared store: canonical encoding, HMAC-SHA256 tags, and the checks on read.

One entry is a Redis hash at ``<prefix>e:<h>``, where ``<h>`` is the first 32 hex digits of
SHA-256 over the UTF-8 key (keys are up to 256 characters of any text; a fixed-length,
brace-free name keeps Redis Cluster's hash tags out of the caller's hands). Its fields:

* ``h``: the header followed by its 32-byte tag. The header is a canonical, length-prefixed
  encoding (:func:`seal`) of the key, the model revision, ``image_grid_thw``, the
  embeddings' dtype (``DataType`` value) and shape, the write time (Unix ms), and the length
  and SHA-256 of each other field. The tag is HMAC-SHA256 over the header (RFC 2104) under
  a key derived from the cluster's internal token (:func:`derive_mac_key`).
* ``d``: the L2-normalised similarity descriptor, float32 little-endian ``[dim]``, or empty.
* ``v``: the verification image (:func:`encode_verification`), or empty.
* ``p``: the embeddings, raw row-major bytes of ``shape`` in ``dtype``.

So one tag covers every field (the others through their digests in the header), and any
subset can be read and checked on its own: a replica following the log reads ``h`` and
``d`` (a few KiB), a similarity candidate ``h`` and ``v``, a hit ``h`` and ``p``. A read is
refused (:class:`IntegrityError`) when the tag does not match (tampered, or written under
another secret: ``mac``), the header names another key than the one looked up (a key
collision, or an entry copied under another name: ``key``), a field does not match its
digest (tampered, or a torn read across two writes of the key: ``digest``), or the bytes do
not parse (``format``).

An alias (another key for the same image, ``PutEntry.alias_key``) is a string at
``<prefix>a:<h(alias)>``: a canonical record of (alias, key) and its tag. Tags of entries
and aliases are computed over different magic prefixes, so neither passes for the other.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

import numpy as np

from vlcommon.verification import JpegLuma, VerificationImage, chroma_shape

ENTRY_MAGIC = b"splitvl.cache.entry.v1\0"
ALIAS_MAGIC = b"splitvl.cache.alias.v1\0"
TAG_BYTES = 32
# Body fields of an entry, in the order their lengths and digests appear in the header.
BODY_FIELDS = ("d", "v", "p")
# RFC 5869 (HKDF-SHA256) salt and info: the MAC key is derived from the internal token, so
# the token itself (sent as metadata on every internal call) never keys the MAC directly.
HKDF_SALT = b"splitvl cache store"
HKDF_INFO = b"entry and alias tags, v1"


class IntegrityError(ValueError):
    """A stored entry or alias that must not be served.

    Attributes:
        reason: ``mac`` (tag mismatch), ``key`` (another key's entry), ``digest`` (a field
            does not match its digest) or ``format`` (unparseable).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def derive_mac_key(secret: str) -> bytes:
    """HKDF-SHA256 (RFC 5869, one output block) of the internal token: the 32-byte key of
    entry and alias tags. An empty token gives a fixed, public key: tags still catch torn
    and mixed-up entries, but not forgeries by whoever can write to the store."""
    prk = hmac.new(HKDF_SALT, secret.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()
    return hmac.new(prk, HKDF_INFO + b"\x01", hashlib.sha256).digest()


def key_digest(key: str) -> str:
    """The 32 hex digits naming ``key`` in the store (SHA-256 of its UTF-8 bytes)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@dataclass(frozen=True)
class StoreKeys:
    """Redis key names under one ``prefix`` (several clusters may share one Redis)."""

    prefix: str = "splitvl:"

    def entry(self, key: str) -> str:
        return f"{self.prefix}e:{key_digest(key)}"

    def alias(self, alias: str) -> str:
        return f"{self.prefix}a:{key_digest(alias)}"

    @property
    def log(self) -> str:
        """The Redis Stream every replica appends its puts to."""
        return f"{self.prefix}log"

    @property
    def entry_pattern(self) -> str:
        """A SCAN ``MATCH`` pattern for every entry (the prefix's glob characters escaped)."""
        escaped = "".join("\\" + c if c in "*?[]\\" else c for c in self.prefix)
        return f"{escaped}e:*"


@dataclass(frozen=True)
class Header:
    """An entry's authenticated header.

    Attributes:
        key: The exact key it was stored under.
        revision: Model revision of the embeddings.
        grid: ``image_grid_thw`` (t, h, w).
        dtype: ``DataType`` value of the embeddings.
        shape: ``[tokens, width]``.
        written_ms: Unix time of the write, ms (informational).
        lengths: Bytes of each body field (``d``, ``v``, ``p``).
        digests: SHA-256 of each body field.
    """

    key: str
    revision: str
    grid: tuple[int, int, int]
    dtype: int
    shape: tuple[int, ...]
    written_ms: int
    lengths: dict[str, int]
    digests: dict[str, bytes]


def _lp(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _tag(mac_key: bytes, magic: bytes, body: bytes) -> bytes:
    return hmac.new(mac_key, magic + body, hashlib.sha256).digest()


def encode_header(header: Header) -> bytes:
    """The canonical bytes of ``header`` (without the magic and the tag)."""
    out = [
        _lp(header.key.encode("utf-8", "surrogatepass")),
        _lp(header.revision.encode("utf-8", "surrogatepass")),
        struct.pack(">3I", *header.grid),
        struct.pack(">I", header.dtype),
        struct.pack(">I", len(header.shape)),
        struct.pack(f">{len(header.shape)}Q", *header.shape),
        struct.pack(">Q", header.written_ms),
    ]
    for name in BODY_FIELDS:
        out.append(struct.pack(">Q", header.lengths[name]) + header.digests[name])
    return b"".join(out)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise IntegrityError("format", "a stored record ends early")
        out = self.data[self.at : self.at + n]
        self.at += n
        return out

    def unpack(self, fmt: str) -> tuple[int, ...]:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def lp(self) -> str:
        (n,) = self.unpack(">I")
        try:
            return self.take(n).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            raise IntegrityError("format", "a stored string is not UTF-8") from exc

    def end(self) -> None:
        if self.at != len(self.data):
            raise IntegrityError("format", "a stored record has trailing bytes")


def decode_header(body: bytes) -> Header:
    """The header encoded in ``body`` (the inverse of :func:`encode_header`).

    Raises:
        IntegrityError: ``format`` when ``body`` is not exactly one header.
    """
    r = _Reader(body)
    key, revision = r.lp(), r.lp()
    t, h, w = r.unpack(">3I")
    (dtype,) = r.unpack(">I")
    (ndim,) = r.unpack(">I")
    if ndim > 8:
        raise IntegrityError("format", f"a stored shape has {ndim} dimensions")
    shape = r.unpack(f">{ndim}Q")
    (written_ms,) = r.unpack(">Q")
    lengths, digests = {}, {}
    for name in BODY_FIELDS:
        (lengths[name],) = r.unpack(">Q")
        digests[name] = r.take(32)
    r.end()
    return Header(key, revision, (t, h, w), dtype, tuple(shape), written_ms, lengths, digests)


def seal(
    mac_key: bytes,
    *,
    key: str,
    revision: str,
    grid: tuple[int, int, int],
    dtype: int,
    shape: tuple[int, ...],
    payload: bytes,
    descriptor: np.ndarray | None,
    verification: VerificationImage | None,
    written_ms: int,
) -> tuple[Header, dict[str, bytes]]:
    """An entry's header and its hash fields ``h`` (header + tag), ``d``, ``v``, ``p``.

    Args:
        descriptor: L2-normalised float32 ``[dim]``, or None (never a similarity hit).
        verification: The verification image, or None.
        payload: The embeddings' raw bytes.
    """
    body = {
        "d": b"" if descriptor is None else np.asarray(descriptor, "<f4").tobytes(),
        "v": b"" if verification is None else encode_verification(verification),
        "p": payload,
    }
    header = Header(
        key,
        revision,
        grid,
        dtype,
        tuple(int(n) for n in shape),
        written_ms,
        {n: len(v) for n, v in body.items()},
        {n: hashlib.sha256(v).digest() for n, v in body.items()},
    )
    encoded = encode_header(header)
    return header, {"h": encoded + _tag(mac_key, ENTRY_MAGIC, encoded), **body}


def open_header(mac_key: bytes, sealed: bytes, key: str | None) -> Header:
    """Check and decode a stored ``h`` field; ``key``: the key looked up (None: any, as a
    scan reads entries by their store name; the caller then checks the name).

    Raises:
        IntegrityError: ``mac``, ``format`` or ``key`` (see the module docstring).
    """
    if len(sealed) <= TAG_BYTES:
        raise IntegrityError("format", "a stored header is too short")
    body, tag = sealed[:-TAG_BYTES], sealed[-TAG_BYTES:]
    if not hmac.compare_digest(tag, _tag(mac_key, ENTRY_MAGIC, body)):
        raise IntegrityError("mac", "a stored header's tag does not match")
    header = decode_header(body)
    if key is not None and header.key != key:
        raise IntegrityError("key", "the entry stored under this key's name is another key's")
    return header


def check_field(header: Header, name: str, data: bytes | None) -> bytes:
    """``data`` when it is the body field ``name`` the header describes.

    Raises:
        IntegrityError: ``digest`` when its length or SHA-256 differ (or it is missing).
    """
    if data is None or len(data) != header.lengths[name]:
        raise IntegrityError("digest", f"stored field {name!r} has another length")
    if not hmac.compare_digest(hashlib.sha256(data).digest(), header.digests[name]):
        raise IntegrityError("digest", f"stored field {name!r} does not match its digest")
    return data


def descriptor_of(header: Header, data: bytes | None, dim: int) -> np.ndarray | None:
    """The checked descriptor, float32 ``[dim]``; None when the entry has none or its
    length is not ``dim`` (a replica configured with another descriptor length).

    Raises:
        IntegrityError: as :func:`check_field`.
    """
    raw = check_field(header, "d", data)
    if len(raw) != 4 * dim:
        return None
    return np.frombuffer(raw, dtype="<f4").astype(np.float32)


def encode_verification(image: VerificationImage) -> bytes:
    """Canonical bytes of a verification image: luma ``[h, w]`` (u32 h, w, then the bytes),
    chroma ``[ceil(h/2), ceil(w/2), 2]`` bytes, then a flag and, for a JPEG, its 64 u16
    quantization values and the clipped indices (u32) and luma (u8), little-endian."""
    h, w = (int(n) for n in image.luma.shape)
    parts = [
        struct.pack(">II", h, w),
        np.ascontiguousarray(image.luma, np.uint8).tobytes(),
        np.ascontiguousarray(image.chroma, np.uint8).tobytes(),
    ]
    jpeg = image.jpeg
    if jpeg is None:
        parts.append(b"\0")
    else:
        parts += [
            b"\1",
            np.asarray(jpeg.quantization, "<u2").tobytes(),
            struct.pack(">I", len(jpeg.clipped_index)),
            np.asarray(jpeg.clipped_index, "<u4").tobytes(),
            np.asarray(jpeg.clipped_luma, np.uint8).tobytes(),
        ]
    return b"".join(parts)


def verification_of(header: Header, data: bytes | None) -> VerificationImage | None:
    """The checked verification image; None when the entry has none.

    Raises:
        IntegrityError: as :func:`check_field`; ``format`` when it does not parse.
    """
    raw = check_field(header, "v", data)
    if not raw:
        return None
    r = _Reader(raw)
    h, w = r.unpack(">II")
    luma = np.frombuffer(r.take(h * w), np.uint8).reshape(h, w).copy()
    ch = chroma_shape(h, w)
    chroma = np.frombuffer(r.take(ch[0] * ch[1] * ch[2]), np.uint8).reshape(ch).copy()
    jpeg = None
    if r.take(1) == b"\1":
        quantization = np.frombuffer(r.take(128), "<u2").astype(np.uint16)
        (n,) = r.unpack(">I")
        index = np.frombuffer(r.take(4 * n), "<u4").astype(np.uint32)
        clipped = np.frombuffer(r.take(n), np.uint8).copy()
        jpeg = JpegLuma(quantization, index, clipped)
    r.end()
    return VerificationImage(luma, chroma, jpeg)


def seal_alias(mac_key: bytes, alias: str, key: str) -> bytes:
    """The stored record saying that ``alias`` finds the entry of ``key``, with its tag."""
    body = _lp(alias.encode("utf-8", "surrogatepass")) + _lp(key.encode("utf-8", "surrogatepass"))
    return body + _tag(mac_key, ALIAS_MAGIC, body)


def open_alias(mac_key: bytes, sealed: bytes, alias: str) -> str:
    """The key an alias record stored under ``alias``'s name points to.

    Raises:
        IntegrityError: ``mac``, ``format``, or ``key`` when it is another alias's record.
    """
    if len(sealed) <= TAG_BYTES:
        raise IntegrityError("format", "a stored alias record is too short")
    body, tag = sealed[:-TAG_BYTES], sealed[-TAG_BYTES:]
    if not hmac.compare_digest(tag, _tag(mac_key, ALIAS_MAGIC, body)):
        raise IntegrityError("mac", "a stored alias record's tag does not match")
    r = _Reader(body)
    stored_alias, key = r.lp(), r.lp()
    r.end()
    if stored_alias != alias:
        raise IntegrityError("key", "the alias record stored under this name is another's")
    return key
