"""The embedding store: exact tier + similarity tier, byte budget, LRU + TTL, leases.

* Exact tier: a dict from the full content digest to the entry, and a dict of alias keys
  (other digests of the same image, e.g. the gateway's digest of the encoded file) to the
  key of the entry they find. An entry's own key always wins over an alias; an alias
  goes with its entry, and an entry keeps its newest :data:`MAX_ALIASES_PER_ENTRY`.
* Similarity tier: a FAISS index over L2-normalised descriptors (inner product = cosine
  similarity); exact (``IndexFlatIP``) below ``index_threshold`` entries, approximate HNSW
  with exact re-scoring above it, exact on a GPU when FAISS sees one (``cache_service.index``).
  A similarity hit needs cosine >= threshold (with a small tolerance for float rounding),
  a stored ``image_grid_thw`` equal to the query's or one of the query's reusable grids
  (its aspect class, :mod:`vlcommon.grid_reuse`: the hit then serves the stored grid, and
  the caller binds that grid's placeholder count), an equal model revision, AND a passing
  verification (:func:`vlcommon.verification.verify`: the two decoded images compared
  block by block at their own resolution, whatever the plan, so a changed digit, word or
  bar, or an image built to share another's thumbnail, is refused). The ``search_k``
  nearest candidates are tried, equal grids first, then in order of score; the first that
  passes every check answers.

Capacity rules (``check_invariants`` verifies the bookkeeping they rely on):

* Byte budget: stored embedding bytes never exceed ``capacity_bytes``, not even for a
  moment. An entry larger than the whole budget is refused (:class:`EntryTooLargeError`).
* LRU: to make room, the least recently used (looked up or stored) entries are evicted.
* TTL: with ``ttl_s > 0`` an entry expires ``ttl_s`` seconds after it was last stored (a
  Put of its key refreshes it; lookups do not, so stale embeddings cannot live forever
  through popularity). Expired entries are never served; they are reclaimed on every Put
  and by :meth:`EmbeddingStore.expire` (the service calls it periodically).
* Leases: a lookup made with ``lease=True`` leases the entry it returns until
  :meth:`EmbeddingStore.release`; the service holds the lease until the Lookup RPC is done
  (response sent or the call ended). Eviction and TTL reclaim skip leased entries. When
  the unleased entries cannot free enough bytes, the Put is refused
  (:class:`CacheFullError`, RESOURCE_EXHAUSTED) rather than exceeding the budget or
  waiting: the cache is an optimisation, and the caller (the gateway) already has the
  embeddings, so a refused Put costs one future encode, while waiting would hold a
  request. A leased entry that expires is not served again and is reclaimed once released.
* No orphans: an entry's index vector is removed (or tombstoned) with its payload, and an
  entry is only stored after its vector is indexed.

Thread safety: every public method takes one lock, so concurrent adds and searches from
threads or asyncio tasks are safe (case C13; FAISS indexes are not safe for an add during a
search). Index rebuilds (a migration across ``index_threshold`` or a tombstone purge) build
the new index outside the lock, in a background thread when ``background_rebuild`` is set,
from a snapshot of the live vectors; adds and removals made meanwhile are replayed onto the
new index before it is swapped in under the lock, so lookups pause only for the snapshot
copy and the swap (one vectorised gather: ~0.1 s per 20k x 3,072 vectors), not the build.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Literal

import numpy as np

from cache_service import metrics
from cache_service.entries import (
    MAX_ALIASES_PER_ENTRY,
    CacheFullError,
    Entry,
    EntryTooLargeError,
    KeyGridConflictError,
    Match,
)
from cache_service.index import IndexParams, VectorIndex, choose_kind, gpu_count
from cache_service.invariants import store_problems
from cache_service.rebuild import IndexRebuilds, Rebuild
from vlcommon.verification import VerificationImage, verify

__all__ = [
    "MAX_ALIASES_PER_ENTRY",
    "SCORE_TOLERANCE",
    "CacheFullError",
    "EmbeddingStore",
    "Entry",
    "EntryTooLargeError",
    "KeyGridConflictError",
    "Match",
]

log = logging.getLogger(__name__)

# Cosine similarities are float32 inner products; accept a score this far below the threshold.
SCORE_TOLERANCE = 1e-5
# A rebuild swaps its new index in once at most this many adds remain to replay under the lock.
CATCH_UP_UNDER_LOCK = 64


class EmbeddingStore(IndexRebuilds):
    """Exact + similarity cache of vision embeddings with a byte budget, LRU, TTL, leases.

    Args:
        descriptor_dim: Length of similarity descriptors.
        capacity_bytes: Budget over stored embedding bytes.
        threshold: Cosine similarity at or above which a similar entry is reused.
        search_k: Nearest neighbours examined for an equal grid.
        ttl_s: Seconds an entry lives after its last Put; 0 = no expiry.
        clock: Monotonic clock in seconds (injectable for tests).
        index_threshold: Live vectors at which the exact index migrates to HNSW (and below
            half of which it migrates back).
        index_params: Shape of the HNSW index.
        use_gpu: FAISS GPU index; None = when ``faiss.get_num_gpus() > 0``.
        rebuild_fraction: Tombstones / indexed vectors that trigger a rebuild.
        min_rebuild_tombstones: Do not rebuild for fewer tombstones than this.
        background_rebuild: Build new indexes in a thread (the service) or inline (tests).
        publish: Which metrics this store sets: ``all`` (the in-process store); with a
            shared store (:mod:`cache_service.store_redis`) the local copies publish
            ``payloads`` (entries, bytes, leases, budget, evictions) and the index of the
            store's entries ``index`` (index vectors and tombstones).
    """

    def __init__(
        self,
        *,
        descriptor_dim: int,
        capacity_bytes: int,
        threshold: float = 0.85,
        search_k: int = 8,
        ttl_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        index_threshold: int = 2048,
        index_params: IndexParams | None = None,
        use_gpu: bool | None = None,
        rebuild_fraction: float = 0.25,
        min_rebuild_tombstones: int = 64,
        background_rebuild: bool = False,
        publish: Literal["all", "payloads", "index"] = "all",
    ) -> None:
        self.dim = descriptor_dim
        self.capacity_bytes = capacity_bytes
        self.threshold = threshold
        self.search_k = search_k
        self.ttl_s = ttl_s
        self.clock = clock
        self.index_threshold = index_threshold
        self.index_params = index_params or IndexParams()
        self.gpu = gpu_count() > 0 if use_gpu is None else use_gpu
        self.rebuild_fraction = rebuild_fraction
        self.min_rebuild_tombstones = min_rebuild_tombstones
        self.background_rebuild = background_rebuild
        self._lock = threading.RLock()
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # LRU order, oldest first
        self._by_put: OrderedDict[str, None] = OrderedDict()  # last-Put order = expiry order
        self._by_id: dict[int, Entry] = {}
        self._aliases: dict[str, str] = {}  # alias key -> key of the entry it finds
        self._ids = itertools.count()
        self._index = VectorIndex(
            choose_kind(0, index_threshold, self.gpu), descriptor_dim, self.index_params
        )
        self._rebuild: Rebuild | None = None
        self._rebuild_done = threading.Condition(self._lock)
        self.bytes = 0
        self._leased = 0
        self.evictions = {"lru": 0, "ttl": 0}
        self.rebuilds = 0
        self.publish = publish
        if publish != "index":
            metrics.CAPACITY_BYTES.set(capacity_bytes)

    # -- reading --------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> tuple[int, int, int]:
        """(entries, bytes, evictions) read together under the lock.

        Read one by one, they could be torn: an eviction releases the GIL in the index
        removal between dropping the entry and lowering ``bytes`` (about 1% of GetStats
        calls during evicting Puts answered 9 entries with the bytes of 10).
        """
        with self._lock:
            return len(self._entries), self.bytes, sum(self.evictions.values())

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    @property
    def index_kind(self) -> str:
        return self._index.kind

    @property
    def index_size(self) -> int:
        """Vectors in the FAISS index, tombstones included."""
        return self._index.ntotal

    @property
    def tombstones(self) -> int:
        return len(self._index.tombstones)

    @property
    def leased(self) -> int:
        """Entries held by at least one lease."""
        return self._leased

    @staticmethod
    def normalise(descriptor: np.ndarray) -> np.ndarray | None:
        """L2-normalise; None for a zero or non-finite vector (never similar to anything)."""
        vec = np.asarray(descriptor, dtype=np.float32).reshape(-1)
        if not np.all(np.isfinite(vec)):
            return None
        norm = float(np.linalg.norm(vec))
        if norm < 1e-6:
            return None
        return vec / norm

    def lookup(
        self,
        key: str,
        descriptor: np.ndarray | None,
        grid: tuple[int, int, int],
        *,
        similar: bool,
        lease: bool = False,
        revision: str = "",
        verification: VerificationImage | None = None,
        alias: str = "",
        reusable: Collection[tuple[int, int, int]] = (),
    ) -> Match:
        """Find ``key`` exactly (an entry's own key or one of its aliases, stored with an
        equal ``grid``: a key held with another grid is a miss; on an exact hit by the
        entry's own key, a non-empty ``alias`` becomes one of its aliases), else (when
        ``similar``) the most similar entry with an equal grid or one in ``reusable`` (the
        query's aspect class, :mod:`vlcommon.grid_reuse`; equal grids are tried first), an
        equal ``revision`` and a passing verification against ``verification``
        (:func:`vlcommon.verification.verification_image`; without one no
        similarity hit is possible). Scores are clamped to [-1, 1]; ``similarity`` reports
        the best candidate seen. Expired entries are never returned. With ``lease``, a
        returned entry stays leased (not evictable) until :meth:`release`."""
        with self._lock:
            match, candidates = self._lookup(
                key, descriptor, grid, similar, self.clock(), revision, reusable
            )
            if match.entry is not None and alias and match.entry.key == key:
                self._add_alias(match.entry, alias)
            if match.entry is not None or not candidates:
                return self._answer(match, lease)
        # The verification (~90 ms per candidate for 2 MP images, up to ~350 ms with the
        # JPEG checks' worst case: vlcommon.verification.verify) runs outside the
        # lock, so other lookups and puts are not held up; entries are immutable, and the
        # chosen one is checked again under the lock before it is returned.
        rejected = match.rejected
        for score, cand in candidates:
            if not verify(verification, cand.verification):
                rejected += 1  # another picture that merely shares the thumbnail
                continue
            with self._lock:
                if self._entries.get(cand.key) is cand and not self._expired(cand, self.clock()):
                    hit = Match("similar", score, cand, consulted_similar=True, rejected=rejected)
                    return self._answer(hit, lease)
        with self._lock:
            miss = Match("miss", match.similarity, None, consulted_similar=True, rejected=rejected)
            return self._answer(miss, lease)

    def _answer(self, match: Match, lease: bool) -> Match:
        """Refresh (and lease) the entry that answers; called under the lock."""
        if match.entry is not None:
            self._entries.move_to_end(match.entry.key)
            if lease:
                match.entry.leases += 1
                self._leased += match.entry.leases == 1
        self._publish()
        return match

    def _lookup(
        self,
        key: str,
        descriptor: np.ndarray | None,
        grid: tuple[int, int, int],
        similar: bool,
        now: float,
        revision: str,
        reusable: Collection[tuple[int, int, int]] = (),
    ) -> tuple[Match, list[tuple[float, Entry]]]:
        """The exact hit, or a miss with the similarity candidates still to verify: score
        >= threshold, an equal grid or one in ``reusable``, equal revision; equal grids
        first, then best score first (``rejected`` counts those refused for another
        revision)."""
        entry = self._entries.get(key)
        if entry is None and key in self._aliases:
            entry = self._entries[self._aliases[key]]
        if entry is not None and self._expired(entry, now):
            entry = None
        if entry is not None:
            if entry.grid != grid:  # not this image's plan: never answer with another grid
                return Match("miss", 0.0, None), []
            return Match("exact", 1.0, entry), []
        return self._candidates(descriptor, grid, similar, now, revision, reusable)

    def _candidates(
        self,
        descriptor: np.ndarray | None,
        grid: tuple[int, int, int],
        similar: bool,
        now: float,
        revision: str,
        reusable: Collection[tuple[int, int, int]],
    ) -> tuple[Match, list[tuple[float, Entry]]]:
        """The similarity tier's miss with its candidates still to verify (see _lookup)."""
        if not similar or descriptor is None or self._index.live == 0:
            return Match("miss", 0.0, None), []
        vec = self.normalise(descriptor)
        if vec is None or vec.shape[0] != self.dim:
            return Match("miss", 0.0, None, consulted_similar=True), []
        scores, ids = self._index.search(vec, self.search_k)
        best = 0.0
        rejected = 0
        candidates: list[tuple[float, Entry]] = []
        for score, idx in zip(scores, ids, strict=True):
            cand = self._by_id.get(int(idx))
            if cand is None or self._expired(cand, now):
                continue
            s = float(np.clip(score, -1.0, 1.0))
            best = max(best, s)
            if s < self.threshold - SCORE_TOLERANCE:
                continue
            if cand.grid != grid and cand.grid not in reusable:
                continue
            if cand.revision != revision:  # another checkpoint's embeddings
                rejected += 1
                continue
            candidates.append((s, cand))
        candidates.sort(key=lambda c: (c[1].grid != grid, -c[0]))
        return Match("miss", best, None, consulted_similar=True, rejected=rejected), candidates

    def candidates(
        self,
        descriptor: np.ndarray | None,
        grid: tuple[int, int, int],
        *,
        revision: str = "",
        reusable: Collection[tuple[int, int, int]] = (),
    ) -> tuple[Match, list[tuple[float, Entry]]]:
        """The similarity tier alone, without verification: a miss carrying the best score
        seen and the candidates at or above the threshold with an equal grid (first) or
        one in ``reusable``, and an equal ``revision``, best score first; the caller
        verifies them (:mod:`cache_service.store_redis` reads their verification images
        from the shared store). Nothing is leased or refreshed."""
        with self._lock:
            return self._candidates(descriptor, grid, True, self.clock(), revision, reusable)

    def holds(self, entry: Entry) -> bool:
        """True when ``entry`` is the one stored under its key (not evicted or replaced)."""
        with self._lock:
            return self._entries.get(entry.key) is entry

    def keys(self) -> list[str]:
        """The keys held now, least recently used first."""
        with self._lock:
            return list(self._entries)

    def discard(self, key: str, reason: str = "lru") -> bool:
        """Remove the entry stored under ``key`` (with its aliases and index vector) unless
        it is leased; True when it was removed. ``reason`` labels the eviction metric."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.leases:
                return False
            self._remove(entry, reason)
            self._maybe_rebuild()
            self._publish()
            return True

    def _expired(self, entry: Entry, now: float) -> bool:
        """True when past its TTL; reclaims it at once unless it is leased."""
        if entry.expires_at > now:
            return False
        if entry.leases == 0:
            self._remove(entry, "ttl")
        return True

    def lease(self, entry: Entry) -> bool:
        """Take one more lease on ``entry`` if it is still the stored one (a hit handed
        out by reference keeps its own lease until its reader releases it); False when it
        was evicted or replaced meanwhile."""
        with self._lock:
            if self._entries.get(entry.key) is not entry:
                return False
            entry.leases += 1
            self._leased += entry.leases == 1
            self._publish()
            return True

    def release(self, entry: Entry) -> None:
        """End one lease taken by ``lookup(..., lease=True)``."""
        with self._lock:
            if entry.leases <= 0:
                raise RuntimeError(f"entry {entry.key[:16]} released more often than leased")
            entry.leases -= 1
            self._leased -= entry.leases == 0
            if entry.leases == 0 and entry.expires_at <= self.clock():
                if self._entries.get(entry.key) is entry:
                    self._remove(entry, "ttl")
            self._publish()

    # -- writing --------------------------------------------------------------------------
    def put(
        self,
        key: str,
        descriptor: np.ndarray | None,
        grid: tuple[int, int, int],
        dtype: int,
        shape: tuple[int, ...],
        data: bytes,
        *,
        verification: VerificationImage | None = None,
        revision: str = "",
        alias: str = "",
    ) -> int:
        """Store an entry, evicting unleased LRU entries to fit. Returns evictions.

        ``verification`` (luma and chroma) and ``revision`` are what a later similarity
        lookup is checked against; the verification image's bytes count in the budget. A key
        already held is refreshed (LRU position and TTL) and not replaced: the key is a
        digest of the content and model revision, so its embeddings are the same. A
        non-empty ``alias`` (another key for the same content) then finds the entry too,
        whether it was new or refreshed; an alias that pointed at another entry moves to
        this one (the newest Put wins), and one that is an entry's own key is ignored.

        Raises:
            KeyGridConflictError: the key is held with another grid; nothing changed.
            EntryTooLargeError: the entry alone is larger than the byte budget.
            CacheFullError: leased entries hold too many bytes for it to fit; nothing was
                evicted.
        """
        if verification is not None:
            verification = verification.copy()  # own it
        size = len(data) + (0 if verification is None else int(verification.nbytes))
        if size > self.capacity_bytes:
            raise EntryTooLargeError(
                f"entry of {size} bytes exceeds the budget of {self.capacity_bytes} bytes"
            )
        with self._lock:
            now = self.clock()
            self._expire(now)
            old = self._entries.get(key)
            if old is not None:
                self._refresh(old, grid, now, alias)
                return 0
            evicted = self._make_room(size)
            index_id = self._index_descriptor(descriptor)
            entry = Entry(
                key,
                grid,
                dtype,
                tuple(shape),
                data,
                index_id,
                expires_at=now + self.ttl_s if self.ttl_s > 0 else math.inf,
                verification=verification,
                revision=revision,
            )
            self._insert(entry, size, alias)
            return evicted

    def _refresh(self, old: Entry, grid: tuple[int, int, int], now: float, alias: str) -> None:
        """:meth:`put` of a key already held (under the lock): LRU position and TTL
        refreshed, ``alias`` added; KeyGridConflictError, nothing changed, for another grid."""
        if old.grid != grid:
            raise KeyGridConflictError(old.grid)
        old.expires_at = now + self.ttl_s if self.ttl_s > 0 else math.inf
        self._entries.move_to_end(old.key)
        self._by_put.move_to_end(old.key)
        if alias:
            self._add_alias(old, alias)

    def _make_room(self, size: int) -> int:
        """Evict unleased entries, least recently used first, until ``size`` more bytes fit
        (under the lock); returns how many. CacheFullError, nothing evicted, when leased
        entries hold too many bytes for it to fit."""
        victims: list[Entry] = []
        free = self.capacity_bytes - self.bytes
        if free < size:
            for entry in self._entries.values():  # oldest first
                if entry.leases:
                    continue
                victims.append(entry)
                free += entry.nbytes
                if free >= size:
                    break
            if free < size:
                leased = sum(e.nbytes for e in self._entries.values() if e.leases)
                raise CacheFullError(size, leased, self.capacity_bytes)
        for victim in victims:
            self._remove(victim, "lru")
        return len(victims)

    def _index_descriptor(self, descriptor: np.ndarray | None) -> int:
        """Index a new entry's descriptor (under the lock, before the entry is stored); its
        index id, or -1 for none (missing, zero, non-finite or of another length)."""
        vec = self.normalise(descriptor) if descriptor is not None else None
        if vec is None or vec.shape[0] != self.dim:
            return -1
        index_id = next(self._ids)
        self._index.add(np.array([index_id], np.int64), vec.reshape(1, -1))
        if self._rebuild is not None:
            self._rebuild.adds.append(index_id)
        return index_id

    def _insert(self, entry: Entry, size: int, alias: str) -> None:
        """Store a new ``entry`` of ``size`` bytes (room made, its vector indexed) and its
        ``alias``, under the lock."""
        key = entry.key
        self._entries[key] = entry
        self._by_put[key] = None
        if key in self._aliases:  # the key itself now finds its own entry
            self._drop_alias(key)
        if alias:
            self._add_alias(entry, alias)
        if entry.index_id >= 0:
            self._by_id[entry.index_id] = entry
        self.bytes += size
        self._maybe_rebuild()
        self._publish()

    def _add_alias(self, entry: Entry, alias: str) -> None:
        """Make ``alias`` find ``entry`` (called under the lock)."""
        if alias in self._entries or self._aliases.get(alias) == entry.key:
            return  # an entry's own key wins; already this entry's alias
        if alias in self._aliases:
            self._drop_alias(alias)  # it moves here: the newest Put or exact hit wins
        self._aliases[alias] = entry.key
        entry.aliases.append(alias)
        if len(entry.aliases) > MAX_ALIASES_PER_ENTRY:
            self._drop_alias(entry.aliases[0])

    def _drop_alias(self, alias: str) -> None:
        """Forget ``alias`` (called under the lock)."""
        target = self._aliases.pop(alias)
        self._entries[target].aliases.remove(alias)

    def expire(self) -> int:
        """Reclaim every expired, unleased entry now. Returns how many were removed."""
        with self._lock:
            n = self._expire(self.clock())
            if n:
                self._maybe_rebuild()
            self._publish()
            return n

    def _expire(self, now: float) -> int:
        if self.ttl_s <= 0:
            return 0
        removed = 0
        # Uniform TTL: last-Put order is expiry order, so stop at the first live entry.
        for key in list(self._by_put):
            entry = self._entries[key]
            if entry.expires_at > now:
                break
            if entry.leases == 0:
                self._remove(entry, "ttl")
                removed += 1
        return removed

    def _remove(self, entry: Entry, reason: str) -> None:
        if entry.leases:
            raise RuntimeError(f"entry {entry.key[:16]} is leased and cannot be removed")
        del self._entries[entry.key]
        del self._by_put[entry.key]
        for alias in entry.aliases:
            del self._aliases[alias]
        entry.aliases = []
        if entry.index_id >= 0:
            del self._by_id[entry.index_id]
            self._index.remove(entry.index_id)
            if self._rebuild is not None:
                self._rebuild.removes.add(entry.index_id)
        self.bytes -= entry.nbytes
        self.evictions[reason] = self.evictions.get(reason, 0) + 1
        if self.publish != "index":
            metrics.EVICTIONS.labels(reason=reason).inc()

    # -- bookkeeping ----------------------------------------------------------------------
    def _catch_up_under_lock(self) -> int:
        return CATCH_UP_UNDER_LOCK

    def _publish(self) -> None:
        if self.publish != "index":
            metrics.ENTRIES.set(len(self._entries))
            metrics.LEASED.set(self._leased)
            metrics.BYTES.set(self.bytes)
        if self.publish != "payloads":
            metrics.INDEX_VECTORS.set(self._index.ntotal)
            metrics.INDEX_TOMBSTONES.set(len(self._index.tombstones))

    def check_invariants(self) -> None:
        """Raise AssertionError when the store's bookkeeping is inconsistent
        (:func:`cache_service.invariants.store_problems` lists what is checked)."""
        with self._lock:
            problems = store_problems(self)
        if problems:
            raise AssertionError("; ".join(problems))
