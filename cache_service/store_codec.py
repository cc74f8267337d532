"""Entries in a shared store, sealed: AES-256-GCM under keys derived from the store secret.

The store (a Redis that may be managed or shared by someone else) is trusted with nothing:
it holds no image, embedding, descriptor or key in the clear, and an entry it returns is
served only when it opens under this cluster's secret as the entry asked for.

Names. An entry is a Redis hash at ``<prefix>e:<kid>:{<n>}`` beside its embeddings, a
string at ``<prefix>p:<kid>:{<n>}``; an alias a string at ``<prefix>a:<kid>:{<n>}``;
``<kid>`` is the secret's key id (8 hex digits) and ``<n>`` 32 hex digits of HMAC-SHA256 of
the key under a name key derived from the secret, braced as a Redis Cluster hash tag (an
entry and its payload share a slot; the caller's key never picks one), from which nobody
without the secret can tell which image it holds, nor test whether a given image is
cached. A scan matches only its own secret's entries, so entries of another
secret (a rotation) or of an older format are never read, only left to expire.

Keys (RFC 5869 HKDF-SHA256 of the secret, :class:`StoreCodec`): a name key and a master
key, from which come a 4-byte key id, one key per alias (HMAC-SHA256(master, ``alias`` +
alias); a record sealed with a random nonce, written once per alias) and one key per
written entry, HMAC-SHA256(master, ``entry`` + write id) where the write id is 16 random
bytes chosen at each Put. Every encryption under an entry key has its own fixed nonce
(header 0, then ``d``, ``v``, ``p``): keys are never reused across writes, so fixed nonces
are safe (NIST SP 800-38D, 8.2: a nonce must not repeat under one key).

An entry's fields:

* ``h``: version (1 byte), key id (4), write id (16), then the sealed header: a canonical,
  length-prefixed encoding (:func:`encode_header`) of the key, the model revision,
  ``image_grid_thw``, the embeddings' dtype (``DataType`` value) and shape, the write time
  (Unix ms) and the plaintext length of each body field, encrypted with the magic, the
  version, key id and write id as associated data.
* ``d``: the L2-normalised similarity descriptor (float32 little-endian ``[dim]``), sealed.
* ``v``: the verification image (:func:`encode_verification`), sealed.
* ``p``, the payload string beside the hash: the embeddings (raw row-major bytes of
  ``shape`` in ``dtype``), sealed. A string because Redis stores a ``SET``'s 16 MiB as
  they arrive, where ``HSET`` copies them once more (a Put cost 1.4x a raw ``SET``).

Each body field is sealed under its entry's key with its field name as associated data,
so any subset can be read and checked on its own (a replica following the log reads ``h``
and ``d``, a similarity candidate ``h`` and ``v``, a hit ``h`` and ``p``) and a field of
another write (a torn read, a field copied across entries) fails to open. A read is
refused (:class:`IntegrityError`) when the header does not open (tampered, or forged by
someone without the secret: ``mac``), it was written under another secret (``key_id``:
a rotation; it reads as a miss and is replaced by the next Put), it names another key
(``key``), a body field does not open or has another length (``field``), or the bytes do
not parse (``format``).

Rotation: a new secret gives new names, so a cluster on a new secret simply misses the old
entries, which Redis expires (their TTL) or evicts; nothing is read under two secrets.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import struct
from dataclasses import dataclass, field

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from vlcommon.verification import VerificationImage, chroma_shape
from vlcommon.verification_common import JpegLuma

VERSION = 2
ENTRY_MAGIC = b"splitvl.cache.entry\0"
ALIAS_MAGIC = b"splitvl.cache.alias\0"
KEY_ID_BYTES = 4
WRITE_ID_BYTES = 16
NONCE_BYTES = 12
TAG_BYTES = 16
# version, key id, write id: the clear prefix of a sealed header.
PREFIX_BYTES = 1 + KEY_ID_BYTES + WRITE_ID_BYTES
# Body fields of an entry, in the order their lengths appear in the header; each one's
# nonce under its entry's key (the header's is 0).
BODY_FIELDS = ("d", "v", "p")
_NONCES = {name: (i + 1).to_bytes(NONCE_BYTES, "big") for i, name in enumerate(BODY_FIELDS)}
_HEADER_NONCE = bytes(NONCE_BYTES)
# RFC 5869 salt: the secret (also sent as a token on internal calls when it is the
# internal token) never keys anything directly.
HKDF_SALT = b"splitvl cache store"


class IntegrityError(ValueError):
    """A stored entry or alias that must not be served.

    Attributes:
        reason: ``mac``, ``key_id``, ``key``, ``field`` or ``format`` (module docstring).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _hkdf(secret: bytes, info: bytes) -> bytes:
    """HKDF-SHA256 (RFC 5869) of ``secret``, one 32-byte output block."""
    prk = hmac.new(HKDF_SALT, secret, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


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
        lengths: Plaintext bytes of each body field (``d``, ``v``, ``p``).
        write_id: The write's 16 random bytes: two entries of one key with the same
            write id hold the same bytes.
    """

    key: str
    revision: str
    grid: tuple[int, int, int]
    dtype: int
    shape: tuple[int, ...]
    written_ms: int
    lengths: dict[str, int]
    write_id: bytes = b""
    cipher: AESGCM | None = field(default=None, compare=False, repr=False)


def _lp(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def encode_header(header: Header) -> bytes:
    """The canonical bytes of ``header`` (what is sealed)."""
    out = [
        _lp(_utf8(header.key)),
        _lp(_utf8(header.revision)),
        struct.pack(">3I", *header.grid),
        struct.pack(">I", header.dtype),
        struct.pack(">I", len(header.shape)),
        struct.pack(f">{len(header.shape)}Q", *header.shape),
        struct.pack(">Q", header.written_ms),
    ]
    out += [struct.pack(">Q", header.lengths[name]) for name in BODY_FIELDS]
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
    lengths = {name: r.unpack(">Q")[0] for name in BODY_FIELDS}
    r.end()
    return Header(key, revision, (t, h, w), dtype, tuple(shape), written_ms, lengths)


class StoreCodec:
    """Names and seals entries and aliases under one secret and one key prefix.

    Args:
        secret: The store secret (``CACHE_STORE_SECRET``, else the internal token). Empty
            only with the development opt-in: a public key then, which catches torn and
            mixed-up entries but neither forgeries nor readers (docs/security.md).
        prefix: Prefix of every Redis key (several clusters may share one Redis).
    """

    def __init__(self, secret: str, prefix: str = "splitvl:") -> None:
        raw = _utf8(secret)
        self.prefix = prefix
        self._master = _hkdf(raw, b"splitvl cache store master v2")
        self._names = _hkdf(raw, b"splitvl cache store names v2")
        self.key_id = hmac.new(self._master, b"key id", hashlib.sha256).digest()[:KEY_ID_BYTES]

    # -- names ---------------------------------------------------------------------------
    def _name(self, kind: str, key: str, shown: str = "") -> str:
        # ``kind`` is one letter: entry, alias and claim names never collide. The digest is
        # a Redis Cluster hash tag, so an entry and its payload share a slot.
        digest = hmac.new(self._names, kind.encode() + _utf8(key), hashlib.sha256).hexdigest()
        return f"{self.prefix}{shown or kind}:{self.key_id.hex()}:{{{digest[:32]}}}"

    def entry(self, key: str) -> str:
        """The Redis key of ``key``'s entry (a hash: ``h``, ``d``, ``v``)."""
        return self._name("e", key)

    def payload(self, key: str) -> str:
        """The Redis key of ``key``'s embeddings (a string, sealed ``p``; same slot)."""
        return self._name("e", key, shown="p")

    def payload_of(self, entry: str) -> str:
        """The payload's Redis key beside the entry named ``entry``."""
        head, sep, tail = entry.partition(f"{self.prefix}e:")
        assert sep and not head, entry
        return f"{self.prefix}p:{tail}"

    def alias(self, alias: str) -> str:
        """The Redis key of ``alias``'s record."""
        return self._name("a", alias)

    def claim(self, key: str) -> str:
        """The Redis key a gateway's claim on encoding ``key`` lives at."""
        return self._name("c", key)

    @property
    def log(self) -> str:
        """The Redis Stream every replica appends the names of its puts to."""
        return f"{self.prefix}log"

    @property
    def entry_pattern(self) -> str:
        """A SCAN ``MATCH`` pattern for every entry of this secret (the prefix's glob
        characters escaped)."""
        escaped = "".join("\\" + c if c in "*?[]\\" else c for c in self.prefix)
        return f"{escaped}e:{self.key_id.hex()}:*"

    # -- entries -------------------------------------------------------------------------
    def _entry_cipher(self, write_id: bytes) -> AESGCM:
        return AESGCM(hmac.new(self._master, b"entry" + write_id, hashlib.sha256).digest())

    def seal(
        self,
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
        """An entry's header and its sealed hash fields ``h``, ``d``, ``v``, ``p``.

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
        write_id = os.urandom(WRITE_ID_BYTES)
        cipher = self._entry_cipher(write_id)
        header = Header(
            key,
            revision,
            grid,
            dtype,
            tuple(int(n) for n in shape),
            written_ms,
            {n: len(v) for n, v in body.items()},
            write_id,
            cipher,
        )
        prefix = bytes([VERSION]) + self.key_id + write_id
        fields = {
            "h": prefix + cipher.encrypt(_HEADER_NONCE, encode_header(header), ENTRY_MAGIC + prefix)
        }
        for name, data in body.items():
            fields[name] = cipher.encrypt(_NONCES[name], data, ENTRY_MAGIC + name.encode())
        return header, fields

    def open_header(self, sealed: bytes, key: str | None) -> Header:
        """Open a stored ``h`` field; ``key``: the key looked up (None: any, as a scan
        reads entries by their store name; the caller then checks the name).

        Raises:
            IntegrityError: ``format``, ``key_id``, ``mac`` or ``key`` (module docstring).
        """
        if len(sealed) < PREFIX_BYTES + TAG_BYTES or sealed[0] != VERSION:
            raise IntegrityError("format", "a stored header is too short or of another version")
        prefix = sealed[:PREFIX_BYTES]
        if prefix[1 : 1 + KEY_ID_BYTES] != self.key_id:
            raise IntegrityError("key_id", "a stored entry was sealed under another secret")
        write_id = prefix[1 + KEY_ID_BYTES :]
        cipher = self._entry_cipher(write_id)
        try:
            body = cipher.decrypt(_HEADER_NONCE, sealed[PREFIX_BYTES:], ENTRY_MAGIC + prefix)
        except InvalidTag:
            raise IntegrityError("mac", "a stored header does not open under this secret") from None
        h = decode_header(body)
        if key is not None and h.key != key:
            raise IntegrityError("key", "the entry stored under this key's name is another key's")
        return dataclasses.replace(h, write_id=write_id, cipher=cipher)

    def open_field(self, header: Header, name: str, data: bytes | None) -> bytes:
        """The plaintext of body field ``name`` of the entry ``header`` opened.

        Raises:
            IntegrityError: ``field`` when it is missing, does not open under this write's
                key (tampered, or a torn read across two writes) or has another length.
        """
        assert header.cipher is not None, "a header from open_header or seal"
        if data is None or len(data) != header.lengths[name] + TAG_BYTES:
            raise IntegrityError("field", f"stored field {name!r} is missing or has another length")
        try:
            return header.cipher.decrypt(_NONCES[name], data, ENTRY_MAGIC + name.encode())
        except InvalidTag:
            raise IntegrityError("field", f"stored field {name!r} does not open") from None

    def descriptor(self, header: Header, data: bytes | None, dim: int) -> np.ndarray | None:
        """The opened descriptor, float32 ``[dim]``; None when the entry has none or its
        length is not ``dim`` (a replica configured with another descriptor length).

        Raises:
            IntegrityError: as :meth:`open_field`.
        """
        raw = self.open_field(header, "d", data)
        if len(raw) != 4 * dim:
            return None
        return np.frombuffer(raw, dtype="<f4").astype(np.float32)

    def verification(self, header: Header, data: bytes | None) -> VerificationImage | None:
        """The opened verification image; None when the entry has none.

        Raises:
            IntegrityError: as :meth:`open_field`; ``format`` when it does not parse.
        """
        raw = self.open_field(header, "v", data)
        return decode_verification(raw) if raw else None

    # -- aliases -------------------------------------------------------------------------
    def _alias_cipher(self, alias: str) -> AESGCM:
        # A key per alias: a record is written once per alias (SET NX), so its random
        # nonce meets its key a handful of times, never 2^32.
        return AESGCM(hmac.new(self._master, b"alias" + _utf8(alias), hashlib.sha256).digest())

    def seal_alias(self, alias: str, key: str) -> bytes:
        """The stored record saying that ``alias`` finds the entry of ``key``, sealed."""
        nonce = os.urandom(NONCE_BYTES)
        prefix = bytes([VERSION]) + self.key_id + nonce
        body = _lp(_utf8(alias)) + _lp(_utf8(key))
        return prefix + self._alias_cipher(alias).encrypt(nonce, body, ALIAS_MAGIC + prefix)

    def open_alias(self, sealed: bytes, alias: str) -> str:
        """The key an alias record stored under ``alias``'s name points to.

        Raises:
            IntegrityError: ``format``, ``key_id``, or ``mac`` (tampered, or another alias's
                record: each alias has its own key).
        """
        size = 1 + KEY_ID_BYTES + NONCE_BYTES
        if len(sealed) < size + TAG_BYTES or sealed[0] != VERSION:
            raise IntegrityError("format", "a stored alias record is too short")
        prefix = sealed[:size]
        if prefix[1 : 1 + KEY_ID_BYTES] != self.key_id:
            raise IntegrityError("key_id", "a stored alias was sealed under another secret")
        try:
            nonce = prefix[1 + KEY_ID_BYTES :]
            body = self._alias_cipher(alias).decrypt(nonce, sealed[size:], ALIAS_MAGIC + prefix)
        except InvalidTag:
            raise IntegrityError("mac", "a stored alias record does not open") from None
        r = _Reader(body)
        stored_alias, key = r.lp(), r.lp()
        r.end()
        if stored_alias != alias:
            raise IntegrityError("key", "the alias record stored under this name is another's")
        return key


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


def decode_verification(raw: bytes) -> VerificationImage:
    """The inverse of :func:`encode_verification`.

    Raises:
        IntegrityError: ``format`` when ``raw`` does not parse.
    """
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
