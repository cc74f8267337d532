"""The embedding store: exact tier + similarity tier, byte-budgeted LRU.

* Exact tier: a dict from the full content digest to the entry.
* Similarity tier: a FAISS ``IndexIDMap2(IndexFlatIP)`` over L2-normalised descriptors, so
  the inner product is the cosine similarity. A similarity hit needs cosine >= threshold
  (with a small tolerance for float rounding) AND a stored ``image_grid_thw`` equal to the
  query's: embeddings of another grid would bind the wrong number of placeholder tokens.
* Capacity: stored embedding bytes never exceed ``capacity_bytes``; the least recently
  used entries are evicted, and their index vectors are removed with them (no orphans).

All methods run on the service's event loop thread, so no lock is needed; FAISS calls are
short at this issue's sizes (an approximate index and sharding come with issue 4).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import faiss
import numpy as np

# Cosine similarities are float32 inner products; accept a score this far below the threshold.
SCORE_TOLERANCE = 1e-5


@dataclass
class Entry:
    """One stored image.

    Attributes:
        key: Exact key (hex digest).
        grid: (t, h, w).
        dtype: DataType enum value of ``data``.
        shape: ``[tokens, width]``.
        data: Raw embedding bytes.
        index_id: The entry's id in the FAISS index (-1 when it has no descriptor).
    """

    key: str
    grid: tuple[int, int, int]
    dtype: int
    shape: tuple[int, ...]
    data: bytes
    index_id: int

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class Match:
    """Result of one lookup: tier is ``exact``, ``similar`` or ``miss``."""

    tier: str
    similarity: float
    entry: Entry | None


class EmbeddingStore:
    """Exact + similarity cache of vision embeddings with a byte budget.

    Args:
        descriptor_dim: Length of similarity descriptors.
        capacity_bytes: Budget over stored embedding bytes.
        threshold: Cosine similarity at or above which a similar entry is reused.
        search_k: Nearest neighbours examined for an equal grid.
    """

    def __init__(
        self,
        *,
        descriptor_dim: int,
        capacity_bytes: int,
        threshold: float = 0.85,
        search_k: int = 8,
    ) -> None:
        self.dim = descriptor_dim
        self.capacity_bytes = capacity_bytes
        self.threshold = threshold
        self.search_k = search_k
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._by_id: dict[int, Entry] = {}
        self._index = faiss.IndexIDMap2(faiss.IndexFlatIP(descriptor_dim))
        self._ids = itertools.count()
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

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

    def get_exact(self, key: str) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def lookup(
        self, key: str, descriptor: np.ndarray | None, grid: tuple[int, int, int], *, similar: bool
    ) -> Match:
        """Find ``key`` exactly, else (when ``similar``) the most similar entry with an equal
        grid. Scores are clamped to [-1, 1]; ``similarity`` reports the best candidate seen."""
        entry = self.get_exact(key)
        if entry is not None:
            return Match("exact", 1.0, entry)
        if not similar or descriptor is None or self._index.ntotal == 0:
            return Match("miss", 0.0, None)
        vec = self.normalise(descriptor)
        if vec is None:
            return Match("miss", 0.0, None)
        k = min(self.search_k, self._index.ntotal)
        scores, ids = self._index.search(vec.reshape(1, -1), k)
        best = 0.0
        for score, idx in zip(scores[0], ids[0], strict=True):
            if idx < 0:
                continue
            s = float(np.clip(score, -1.0, 1.0))
            cand = self._by_id.get(int(idx))
            if cand is None:
                continue
            best = max(best, s)
            if cand.grid == grid and s >= self.threshold - SCORE_TOLERANCE:
                self._entries.move_to_end(cand.key)
                return Match("similar", s, cand)
        return Match("miss", best, None)

    def put(
        self,
        key: str,
        descriptor: np.ndarray | None,
        grid: tuple[int, int, int],
        dtype: int,
        shape: tuple[int, ...],
        data: bytes,
    ) -> int:
        """Store (or refresh) an entry, evicting LRU entries to fit. Returns evictions.

        Raises:
            ValueError: the entry alone is larger than the byte budget.
        """
        if len(data) > self.capacity_bytes:
            raise ValueError(
                f"entry of {len(data)} bytes exceeds the budget of {self.capacity_bytes} bytes"
            )
        if key in self._entries:
            self._remove(self._entries[key])
        evicted = 0
        while self._entries and self.bytes + len(data) > self.capacity_bytes:
            _, oldest = next(iter(self._entries.items()))
            self._remove(oldest)
            evicted += 1
        vec = self.normalise(descriptor) if descriptor is not None else None
        index_id = -1
        if vec is not None and vec.shape[0] == self.dim:
            index_id = next(self._ids)
            self._index.add_with_ids(vec.reshape(1, -1), np.array([index_id], dtype=np.int64))
        entry = Entry(key, grid, dtype, tuple(shape), data, index_id)
        self._entries[key] = entry
        if index_id >= 0:
            self._by_id[index_id] = entry
        self.bytes += entry.nbytes
        self.evictions += evicted
        return evicted

    def _remove(self, entry: Entry) -> None:
        del self._entries[entry.key]
        if entry.index_id >= 0:
            self._by_id.pop(entry.index_id, None)
            self._index.remove_ids(np.array([entry.index_id], dtype=np.int64))  # type: ignore[arg-type]
        self.bytes -= entry.nbytes

    @property
    def index_size(self) -> int:
        """Vectors in the FAISS index (equals entries with a descriptor)."""
        return int(self._index.ntotal)
