"""Similarity index maintenance: migrations between index kinds and tombstone purges.

:class:`IndexRebuilds` is the part of :class:`cache_service.store.EmbeddingStore` that
rebuilds its FAISS index (:mod:`cache_service.index`) from a snapshot of the live vectors,
outside the store's lock (in a background thread when ``background_rebuild`` is set), and
replays the adds and removals made meanwhile before the swap (the store's docstring).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np

from cache_service import metrics
from cache_service.entries import Entry
from cache_service.index import IndexParams, VectorIndex, build_index

log = logging.getLogger("cache_service.store")


@dataclass
class Rebuild:
    kind: str
    snapshot: set[int]
    adds: list[int] = field(default_factory=list)
    removes: set[int] = field(default_factory=set)


class IndexRebuilds:
    """Rebuilds of the owner's ``_index`` over the vectors of ``_by_id``.

    A mixin of :class:`cache_service.store.EmbeddingStore`, which sets every attribute
    declared here; :meth:`_maybe_rebuild` is called under ``_lock``, :meth:`_build_and_swap`
    takes it itself.
    """

    dim: int
    gpu: bool
    index_threshold: int
    index_params: IndexParams
    rebuild_fraction: float
    min_rebuild_tombstones: int
    background_rebuild: bool
    rebuilds: int
    _lock: threading.RLock
    _index: VectorIndex
    _by_id: dict[int, Entry]
    _rebuild: Rebuild | None
    _rebuild_done: threading.Condition

    def _publish(self) -> None:
        raise NotImplementedError

    def _catch_up_under_lock(self) -> int:
        """A rebuild swaps its new index in once at most this many adds remain to replay
        under the lock (the owner's module constant, read at each rebuild)."""
        raise NotImplementedError

    def _rebuild_due(self) -> str | None:
        """The kind to rebuild into, or None when the index is fine as it is."""
        index = self._index
        live = len(self._by_id)
        kind = index.kind
        if not self.gpu:
            if kind == "flat" and live >= self.index_threshold:
                return "hnsw"
            if kind == "hnsw" and live < self.index_threshold // 2:
                return "flat"
        dead = len(index.tombstones)
        if dead >= self.min_rebuild_tombstones and dead > self.rebuild_fraction * index.ntotal:
            return kind  # a purge: same kind, only the live vectors
        return None

    def _maybe_rebuild(self) -> None:
        if self._rebuild is not None:
            return
        kind = self._rebuild_due()
        if kind is None:
            return
        ids = np.fromiter(self._by_id, dtype=np.int64, count=len(self._by_id))
        vectors = self._index.reconstruct(ids)
        state = Rebuild(kind, set(ids.tolist()))
        self._rebuild = state
        log.info(
            "rebuilding the similarity index: %s -> %s, %d vectors, %d tombstones",
            self._index.kind,
            kind,
            len(ids),
            len(self._index.tombstones),
        )
        if self.background_rebuild:
            threading.Thread(
                target=self._build_and_swap,
                args=(state, ids, vectors),
                name="cache-index-rebuild",
                daemon=True,
            ).start()
        else:
            self._build_and_swap(state, ids, vectors)

    def _build_and_swap(self, state: Rebuild, ids: np.ndarray, vectors: np.ndarray) -> None:
        try:
            new = build_index(state.kind, self.dim, self.index_params, ids, vectors)
            # Catch up with the adds made meanwhile outside the lock, in rounds, so the swap
            # below replays only a few (an HNSW insert is ~1 ms; thousands under the lock
            # would stall every lookup).
            while True:
                with self._lock:
                    if len(state.adds) <= self._catch_up_under_lock():
                        break
                    batch = np.array([i for i in state.adds if i in self._by_id], np.int64)
                    state.adds = []
                    batch_vectors = self._index.reconstruct(batch)
                new.add(batch, batch_vectors)
                state.snapshot.update(batch.tolist())
        except Exception:
            log.exception("similarity index rebuild failed; keeping the current index")
            with self._lock:
                self._rebuild = None
                self._rebuild_done.notify_all()
            return
        with self._lock:
            # Replay what changed since: the last few adds, and every removal of an id the
            # new index holds.
            adds = np.array([i for i in state.adds if i in self._by_id], dtype=np.int64)
            new.add(adds, self._index.reconstruct(adds))
            for index_id in state.removes & state.snapshot:
                new.remove(index_id)
            self._index = new
            self._rebuild = None
            self.rebuilds += 1
            metrics.INDEX_REBUILDS.labels(kind=new.kind).inc()
            self._rebuild_done.notify_all()
            self._maybe_rebuild()
            self._publish()

    def wait_for_rebuild(self, timeout: float | None = None) -> bool:
        """Block until no rebuild is running; False on timeout."""
        with self._lock:
            return self._rebuild_done.wait_for(lambda: self._rebuild is None, timeout)
