"""The cache's request checks: a ``LookupRequest`` or ``PutRequest`` checked whole into
typed inputs before the store is touched.

- :func:`parse_lookup` returns a :class:`LookupInput`: each query's key, grid, descriptor,
  verification image, alias key and reusable grids (:class:`Query`), the policy with the
  service's default applied, and how the hits are answered (inline, by reference).
- :func:`check_ref_entries` checks the entries of a Put sent by reference before any of
  their bytes are read; :func:`parse_put` then checks every entry, its payload included,
  into a :class:`PutInput`.

Every refusal is INVALID_ARGUMENT naming the field, except the byte budget's
(RESOURCE_EXHAUSTED ``ENTRY_TOO_LARGE``). Grids follow the rule the encoder and the
decoder apply (:func:`vlcommon.request_rules.check_grid`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from qwenvl.cache.v1 import cache_service_pb2 as pb
from qwenvl.common.v1 import generation_pb2, tensor_pb2

from cache_service import metrics
from cache_service.validation_images import verification_image
from vlcommon import tensors
from vlcommon.by_reference import by_reference
from vlcommon.handoff import Holder
from vlcommon.refusals import Refusal
from vlcommon.request_rules import CACHE_POLICIES, check_cache_policy, check_grid
from vlcommon.tensors import EMBEDDING_DTYPES
from vlcommon.verification import VerificationImage

POLICIES = CACHE_POLICIES
OFF = generation_pb2.CACHE_POLICY_OFF


@dataclass(frozen=True)
class Query:
    """One LookupQuery, checked.

    Attributes:
        key: The image's key (a content digest; with ``bytes_keys``, the file's).
        grid: The grid ``(t, h, w)`` its embeddings must have (the exact tier's).
        descriptor: float32 [descriptor_dim], or None (no similarity search).
        verification: The image that verifies a similarity candidate, or None.
        revision: The model revision the embeddings must come from.
        alias_key: A key to make an alias of the entry its own key hits exactly ("").
        reusable: Other grids a similarity hit may be served with.
        video: A video: found by its exact key only, never claimed.
    """

    key: str
    grid: tuple[int, int, int]
    descriptor: np.ndarray | None
    verification: VerificationImage | None
    revision: str
    alias_key: str
    reusable: frozenset[tuple[int, int, int]] = frozenset()
    video: bool = False


@dataclass(frozen=True)
class LookupInput:
    """One LookupRequest, checked.

    Attributes:
        queries: The queries in request order.
        policy: The CachePolicy to match with: the request's, else the service's default;
            EXACT_ONLY in place of SIMILAR for ``bytes_keys`` (a file digest has no
            descriptor).
        include_embeddings: Hits carry their embeddings (and are leased until the call
            is done).
        by_ref: Hits' embeddings are held and sent as refs (a transport named, a holder
            present, embeddings asked for).
        transport: The request's ``Transport``.
        bytes_keys: The keys are digests of encoded files (exact tier only, misses not
            counted).
        claim: Take the claim of each missed image's key (not with ``bytes_keys`` or
            policy OFF).
        wait_claimed_ms: How long to wait for keys others claimed, ms (capped by the
            servicer).
    """

    queries: tuple[Query, ...]
    policy: int
    include_embeddings: bool
    by_ref: bool
    transport: int
    bytes_keys: bool
    claim: bool
    wait_claimed_ms: int

    def claim_keys(self) -> list[str]:
        """The keys to claim: the images' (not the videos'), each once, in order."""
        return list(dict.fromkeys(q.key for q in self.queries if not q.video))


@dataclass(frozen=True)
class CheckedEntry:
    """One PutEntry, checked, its payload read.

    Attributes:
        key: The entry's key.
        alias_key: An alias key stored beside it ("" for none).
        grid: Its grid ``(t, h, w)``.
        descriptor: float32 [descriptor_dim], or None (found by exact key only).
        verification: Its verification image, or None.
        dtype: The embeddings' ``DataType`` (FP32, BF16, FP16).
        shape: ``(t*h*w / merge**2, width)``.
        data: The embeddings' row-major bytes, all finite.
        revision: The model revision that computed them.
    """

    key: str
    alias_key: str
    grid: tuple[int, int, int]
    descriptor: np.ndarray | None
    verification: VerificationImage | None
    dtype: int
    shape: tuple[int, ...]
    data: bytes | bytearray
    revision: str


@dataclass(frozen=True)
class PutInput:
    """One PutRequest, checked: its entries in request order."""

    entries: tuple[CheckedEntry, ...]

    @property
    def keys(self) -> list[str]:
        return [e.key for e in self.entries]


def check_count(n: int, field: str, limit: int) -> None:
    """Refuse more queries (or entries) than ``limit``.

    Raises:
        ServiceError: INVALID_ARGUMENT ``TOO_MANY_ITEMS`` naming ``field`` with the limit.
    """
    if n > limit:
        raise Refusal.TOO_MANY_ITEMS.error(
            f"{field} has {n} entries; the limit is {limit}", field=field, limit=limit
        )


def parse_lookup(
    request: pb.LookupRequest,
    *,
    max_queries: int,
    merge: int,
    dim: int,
    default_policy: int,
    holder: Holder | None,
) -> LookupInput:
    """Check a whole LookupRequest: counts, policy and transport, then every query.

    Args:
        max_queries: Queries per request.
        merge: The model's spatial_merge_size (grids' h and w are multiples of it).
        dim: The descriptors' dimension.
        default_policy: The policy of a request that leaves it unspecified.
        holder: The service's holder; None answers inline whatever the transport.

    Raises:
        ServiceError: INVALID_ARGUMENT: ``TOO_MANY_ITEMS`` (``queries``),
            ``CACHE_POLICY_INVALID`` (``policy``), ``TRANSPORT_UNSUPPORTED``
            (``transport``), and per query (``queries[i]...``): ``VIDEO_NOT_EXACT``,
            ``KEY_MISSING`` / ``KEY_TOO_LONG`` (key or alias key), a grid's refusal,
            a descriptor's (not FP32 [dim]: ``DESCRIPTOR_SHAPE_INVALID``), a verification
            image's (:func:`cache_service.validation_images.verification_image`),
            ``TOO_MANY_REUSABLE_GRIDS`` (over MAX_REUSABLE_GRIDS) or a reusable grid's.
    """
    check_count(len(request.queries), "queries", max_queries)
    check_cache_policy(request.policy, "policy")
    by_ref = by_reference(request.transport, holder) and request.include_embeddings
    policy = request.policy or default_policy
    if request.bytes_keys and policy == generation_pb2.CACHE_POLICY_SIMILAR:
        policy = generation_pb2.CACHE_POLICY_EXACT_ONLY  # a file digest has no descriptor
    queries = tuple(
        _query(query, f"queries[{i}]", merge, dim) for i, query in enumerate(request.queries)
    )
    return LookupInput(
        queries=queries,
        policy=policy,
        include_embeddings=request.include_embeddings,
        by_ref=by_ref,
        transport=request.transport,
        bytes_keys=request.bytes_keys,
        claim=request.claim and not request.bytes_keys and policy != OFF,
        wait_claimed_ms=request.wait_claimed_ms,
    )


def _query(query: pb.LookupQuery, field: str, merge: int, dim: int) -> Query:
    if query.video:
        _check_video(query, field)
    return Query(
        _key(query.key, field),
        _grid(query.grid, f"{field}.grid", merge, video=query.video),
        _descriptor(query.descriptor, dim, f"{field}.descriptor"),
        verification_image(query, field),
        _revision(query.revision, field),
        _key(query.alias_key, field, name="alias_key", optional=True),
        _reusable(query.reusable_grids, f"{field}.reusable_grids", merge),
        query.video,
    )


#: An entry's checked fields that need no payload: key, alias key, grid, descriptor,
#: verification image (:func:`_entry_fields`).
EntryFields = tuple[str, str, tuple[int, int, int], np.ndarray | None, VerificationImage | None]


def check_ref_entries(
    request: pb.PutRequest, *, max_entries: int, merge: int, dim: int, capacity_bytes: int
) -> tuple[list[tuple[int, tensor_pb2.ImageEmbedding]], list[EntryFields] | None]:
    """The entries of a Put sent by reference, checked before any byte is read: every
    entry's fields that need no payload (:func:`parse_put` checks them again with the
    payloads), then each ref's dtype, its rows against the grid, its size against the
    byte budget (a forged 1 GiB ref for a 4-token grid was allocated in full, then
    refused), and all refs' sizes together.

    Returns:
        (entry index, its embedding) of each entry sent by reference, in order; and, when
        there are any, every entry's checked fields, for :func:`parse_put` to take as they
        are (None without refs: nothing was checked yet).

    Raises:
        ServiceError: INVALID_ARGUMENT ``TOO_MANY_ITEMS`` (``entries``), any refusal of
            :func:`parse_put` that needs no payload, ``TENSOR_DTYPE_UNSUPPORTED`` or
            ``EMBEDDING_SHAPE_MISMATCH`` naming the field; RESOURCE_EXHAUSTED
            ``ENTRY_TOO_LARGE`` (``entries[i].embedding.ref``) over ``capacity_bytes``,
            ``PUT_TOO_LARGE`` (``entries``) when the refs together are.
    """
    refs = [(i, e.embedding) for i, e in enumerate(request.entries) if e.embedding.HasField("ref")]
    if not refs:
        return refs, None
    check_count(len(request.entries), "entries", max_entries)
    # Every entry's checks that need no payload come first: a read spends the holder's
    # copy (it releases it), so a request that is refused anyway reads nothing.
    fields = [_entry_fields(e, f"entries[{i}]", merge, dim) for i, e in enumerate(request.entries)]
    for i, emb in refs:
        field = f"entries[{i}]"
        grid = _grid(emb.grid, f"{field}.embedding.grid", merge, video=request.entries[i].video)
        _check_ref_dtype(emb.embeddings, f"{field}.embedding.embeddings")
        _check_rows(emb.embeddings, grid, merge, f"{field}.embedding.embeddings")
        if emb.ref.nbytes > capacity_bytes:
            metrics.PUTS_REFUSED.labels(reason="too_large").inc()
            raise Refusal.ENTRY_TOO_LARGE.error(
                f"{field}.embedding.ref holds {emb.ref.nbytes} bytes; the cache's byte "
                f"budget (capacity_bytes) is {capacity_bytes}",
                field=f"{field}.embedding.ref",
                limit=capacity_bytes,
            )
    # The reader allocates each ref's nbytes before it reads: a small request of many
    # refs would otherwise ask for their sum at once (256 GiB at the defaults).
    total = sum(emb.ref.nbytes for _, emb in refs)
    if total > capacity_bytes:
        metrics.PUTS_REFUSED.labels(reason="too_large").inc()
        raise Refusal.PUT_TOO_LARGE.error(
            f"the {len(refs)} entries sent by reference hold {total} bytes together; the "
            f"cache's byte budget (capacity_bytes) is {capacity_bytes}: put them in smaller "
            "requests",
            field="entries",
            limit=capacity_bytes,
        )
    return refs, fields


def _check_ref_dtype(emb: tensor_pb2.Tensor, field: str) -> None:
    """A ref's dtype, before its bytes are read (the reader names it in its messages)."""
    if emb.dtype not in EMBEDDING_DTYPES:
        allowed = ", ".join(tensors.dtype_name(d) for d in EMBEDDING_DTYPES)
        raise Refusal.TENSOR_DTYPE_UNSUPPORTED.error(
            f"{field}.dtype is {emb.dtype}; allowed: {allowed}",
            field=f"{field}.dtype",
        )


def parse_put(
    request: pb.PutRequest,
    payloads: Mapping[int, bytes],
    *,
    max_entries: int,
    merge: int,
    dim: int,
    capacity_bytes: int,
    fields: Sequence[EntryFields] | None = None,
) -> PutInput:
    """Check a whole PutRequest, every entry's payload included (its copy out of the
    request and its finiteness check: ~0.25 s together at the 256 MiB message limit, so
    the caller runs this on a worker thread).

    Args:
        payloads: The bytes of entries sent by reference, by entry index, already read.
        fields: Every entry's fields as :func:`check_ref_entries` checked them (not
            checked again), or None.
        max_entries: Entries per request.
        merge: The model's spatial_merge_size.
        dim: The descriptors' dimension.
        capacity_bytes: The store's byte budget.

    Raises:
        ServiceError: INVALID_ARGUMENT: ``TOO_MANY_ITEMS`` (``entries``), and per entry
            (``entries[i]...``) ``KEY_MISSING`` / ``KEY_TOO_LONG``, ``VIDEO_NOT_EXACT``, a
            grid's, descriptor's or verification image's refusal, a tensor's (not FP32,
            BF16 or FP16 [rows, width]), ``EMBEDDING_SHAPE_MISMATCH``,
            ``EMBEDDING_NOT_FINITE``; RESOURCE_EXHAUSTED ``ENTRY_TOO_LARGE``
            (``entries[i].embedding.embeddings``) when the entry with its verification
            image exceeds ``capacity_bytes``.
    """
    check_count(len(request.entries), "entries", max_entries)
    return PutInput(
        tuple(
            _entry(
                entry,
                f"entries[{i}]",
                payloads.get(i),
                merge,
                capacity_bytes,
                fields[i] if fields else _entry_fields(entry, f"entries[{i}]", merge, dim),
            )
            for i, entry in enumerate(request.entries)
        )
    )


def _entry(
    entry: pb.PutEntry,
    field: str,
    payload: bytes | None,
    merge: int,
    capacity_bytes: int,
    fields: EntryFields,
) -> CheckedEntry:
    key, alias_key, grid, descriptor, verification = fields
    emb = entry.embedding.embeddings
    emb_field = f"{field}.embedding.embeddings"
    data = tensors.validate(emb, field=emb_field, ndim=2, dtypes=EMBEDDING_DTYPES, data=payload)
    _check_rows(emb, grid, merge, emb_field)
    tensors.check_finite(emb, data, emb_field)
    size = len(data) + (0 if verification is None else verification.nbytes)
    if size > capacity_bytes:
        metrics.PUTS_REFUSED.labels(reason="too_large").inc()
        raise Refusal.ENTRY_TOO_LARGE.error(
            f"{emb_field} holds {len(data)} bytes; the cache's byte budget (capacity_bytes) "
            f"is {capacity_bytes}; with its verification image the entry needs {size} bytes",
            field=emb_field,
            limit=capacity_bytes,
        )
    return CheckedEntry(
        key,
        alias_key,
        grid,
        descriptor,
        verification,
        emb.dtype,
        tuple(emb.shape),
        data,
        entry.revision,
    )


def _entry_fields(entry: pb.PutEntry, field: str, merge: int, dim: int) -> EntryFields:
    """An entry's checks that need no payload: key, alias key, video rule, grid,
    descriptor, verification image, revision."""
    key = _key(entry.key, field)
    alias_key = _key(entry.alias_key, field, name="alias_key", optional=True)
    if entry.video:
        _check_video(entry, field)
    grid = _grid(entry.embedding.grid, f"{field}.embedding.grid", merge, video=entry.video)
    descriptor = _descriptor(entry.descriptor, dim, f"{field}.descriptor")
    verification = verification_image(entry, field)
    _revision(entry.revision, field)
    return key, alias_key, grid, descriptor, verification


def _check_rows(emb: tensor_pb2.Tensor, grid: tuple[int, int, int], merge: int, field: str) -> None:
    """Refuse embeddings whose rows are not the grid's tokens, or whose width is 0.

    Raises:
        ServiceError: INVALID_ARGUMENT ``EMBEDDING_SHAPE_MISMATCH`` naming ``field``.
    """
    rows = grid[0] * grid[1] * grid[2] // (merge * merge)
    shape = list(emb.shape)
    if len(shape) != 2 or shape[0] != rows:
        raise Refusal.EMBEDDING_SHAPE_MISMATCH.error(
            f"{field} has shape {shape}; grid {list(grid)} needs {rows} rows (t*h*w/{merge}**2)",
            field=field,
        )
    if shape[1] <= 0:
        raise Refusal.EMBEDDING_SHAPE_MISMATCH.error(
            f"{field} has shape {shape}; its width must be > 0", field=field
        )


def _grid(
    msg: tensor_pb2.GridTHW, field: str, merge: int, *, video: bool = False
) -> tuple[int, int, int]:
    """A grid by the rule the encoder and the decoder apply: t = 1 for an image, t >= 1
    for a video (``video``)."""
    return check_grid(msg, field, merge, video=video)


def _check_video(msg: pb.LookupQuery | pb.PutEntry, field: str) -> None:
    """Refuse a video query or entry that brings a similarity descriptor, a verification
    image or reusable grids: a video is found only by its exact key.

    Raises:
        ServiceError: INVALID_ARGUMENT ``VIDEO_NOT_EXACT`` naming the field.
    """
    names = ["descriptor", "verification", "verification_chroma"]
    lists = [
        "verification_jpeg_quantization",
        "verification_jpeg_clipped_index",
        "verification_jpeg_clipped_luma",
    ]
    if isinstance(msg, pb.LookupQuery):
        lists.append("reusable_grids")
    for name in names + lists:
        value = getattr(msg, name)
        if len(value) if name in lists else (value.shape or value.data):
            raise Refusal.VIDEO_NOT_EXACT.error(
                f"{field}.{name} is set on a video ({field}.video); a video is found only "
                "by its exact key",
                field=f"{field}.{name}",
            )


# Most grids one query may list as reusable (LookupQuery.reusable_grids): the gateway sends
# a 10% size class, under 60 grids even for a 12 MP image at Qwen3-VL's budget.
MAX_REUSABLE_GRIDS = 256


def _reusable(
    msgs: Sequence[tensor_pb2.GridTHW], field: str, merge: int
) -> frozenset[tuple[int, int, int]]:
    """The grids of ``LookupQuery.reusable_grids``, each checked like ``grid``."""
    if len(msgs) > MAX_REUSABLE_GRIDS:
        raise Refusal.TOO_MANY_REUSABLE_GRIDS.error(
            f"{field} has {len(msgs)} grids; at most {MAX_REUSABLE_GRIDS}",
            field=field,
            limit=MAX_REUSABLE_GRIDS,
        )
    return frozenset(_grid(g, f"{field}[{j}]", merge) for j, g in enumerate(msgs))


# A key is a content digest (64 hex characters from the gateway); the store holds it beside
# the entry outside the byte budget, so its length is bounded here (4 MiB keys were accepted).
MAX_KEY_CHARS = 256


# A model revision is a commit hash or a short name; the store keeps it beside each entry,
# outside the byte budget, so it is bounded like a key (128 MiB revisions were stored).
MAX_REVISION_CHARS = 256


def _revision(revision: str, field: str) -> str:
    if len(revision) > MAX_REVISION_CHARS:
        raise Refusal.REVISION_TOO_LONG.error(
            f"{field}.revision has {len(revision)} characters; at most {MAX_REVISION_CHARS}",
            field=f"{field}.revision",
            limit=MAX_REVISION_CHARS,
        )
    return revision


def _key(key: str, field: str, *, name: str = "key", optional: bool = False) -> str:
    """A key (or, with ``name="alias_key"`` and ``optional``, an alias key; empty allowed)."""
    if not key and not optional:
        raise Refusal.KEY_MISSING.error(f"{field}.{name} is empty", field=f"{field}.{name}")
    if len(key) > MAX_KEY_CHARS:
        raise Refusal.KEY_TOO_LONG.error(
            f"{field}.{name} has {len(key)} characters; at most {MAX_KEY_CHARS} are allowed",
            field=f"{field}.{name}",
            limit=MAX_KEY_CHARS,
        )
    return key


# Unset (None) when both shape and data are empty; shape is tested first, since reading
# ``data`` copies it.
def _descriptor(msg: tensor_pb2.Tensor, dim: int, field: str) -> np.ndarray | None:
    if not msg.shape and not msg.data:
        return None
    data = tensors.validate(msg, field=field, dtypes=(tensor_pb2.DATA_TYPE_FP32,), ndim=1)
    if msg.shape[0] != dim:
        raise Refusal.DESCRIPTOR_SHAPE_INVALID.error(
            f"{field}.shape is {list(msg.shape)}; expected [{dim}]",
            field=f"{field}.shape",
            expected=dim,
        )
    return tensors.to_numpy(msg, data)
