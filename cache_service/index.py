"""The similarity tier's FAISS index: exact below a size threshold, approximate above it.

Kinds (one :class:`VectorIndex` holds one of them; :func:`build_index` picks):

* ``flat``: ``IndexIDMap2(IndexFlatIP(dim))``: exact inner product (= cosine similarity on
  L2-normalised descriptors). Supports ``remove_ids``, so evictions remove vectors at once.
* ``hnsw``: ``IndexIDMap2(IndexRefineFlat(IndexPreTransform([RandomRotationMatrix(dim, r),
  NormalizationTransform(r)], IndexHNSWFlat(r, M, METRIC_INNER_PRODUCT))))``. The HNSW graph
  (Malkov & Yashunin 2018) runs on an ``r``-dimensional random orthonormal projection of the
  descriptor (a Johnson-Lindenstrauss projection: inner products are kept up to noise of
  about ``1/sqrt(r)``), re-normalised, and its ``k * k_factor`` candidates are re-scored
  with the exact inner product on the full descriptor (``IndexRefineFlat``). So every
  score the cache compares with its threshold is exact; only which candidates are seen is
  approximate (recall is measured by ``splitvl cache-bench``). Why the projection: HNSW on
  the full 3,072-dim descriptor took 1.5 ms (p50) per search at 20k entries on this CPU and
  26 s to build 20k entries; on a 256-dim projection 0.3 ms and 6 s (128 dims was cheaper
  still but its recall fell to 0.988 at 10k entries). A PCA projection fitted at each
  rebuild was tried and dropped: recall 0.990 against 0.998 for the random one at 20k on
  the bench data, and seconds of training per rebuild. No training is needed (the rotation
  is seeded), so the index can be rebuilt at any moment from any vectors.
* ``gpu_flat``: ``IndexIDMap2(GpuIndexFlatIP(dim))`` on GPU 0, chosen at startup when
  ``faiss.get_num_gpus() > 0``: exact brute force is faster on a GPU than any CPU graph at
  these sizes, so no approximate index is used there.

Removal: HNSW graphs and GPU indexes cannot ``remove_ids``. Their removed ids become
tombstones: the vector stays in the index, searches over-fetch in proportion to the
tombstone share and drop tombstoned ids (so a removed vector is never answered); when
tombstones exceed a fraction of the index, the owner rebuilds the index from the live
vectors (:meth:`VectorIndex.reconstruct`) and swaps it in (see ``EmbeddingStore``).

A ``VectorIndex`` is not thread-safe (FAISS indexes are not safe for an add concurrent with
a search); its owner serialises every call under one lock.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np

log = logging.getLogger(__name__)

KINDS = ("flat", "hnsw", "gpu_flat")
# Seed of the random projection: fixed so two replicas (or a rebuild) project the same way.
PROJECTION_SEED = 1234
# Never fetch more than this many times k to step over tombstones.
MAX_OVERFETCH = 8
# Exponent of IndexParams.ef_search_for past its reference size.
EF_GROWTH = 0.6


@dataclass(frozen=True)
class IndexParams:
    """Shape of the approximate index.

    Attributes:
        projected_dim: Dimensions of the random projection HNSW searches in.
        hnsw_m: Graph neighbours per node (FAISS ``M``); memory is ~``2*M*4`` bytes/entry.
        ef_construction: Candidate list while inserting (build time vs graph quality).
        ef_search: Candidate list while searching (latency vs recall), up to
            ``ef_reference_entries`` vectors; see :meth:`ef_search_for`.
        k_factor: Candidates re-scored exactly per requested neighbour.
        ef_reference_entries: Index size up to which ``ef_search`` holds; past it the
            candidate list grows as ``(n / ef_reference_entries) ** EF_GROWTH``. 0 keeps
            ``ef_search`` at every size.
    """

    projected_dim: int = 256
    hnsw_m: int = 32
    ef_construction: int = 40
    ef_search: int = 64
    k_factor: int = 8
    ef_reference_entries: int = 100_000

    def ef_search_for(self, n: int) -> int:
        """HNSW ``efSearch`` for an index of ``n`` vectors.

        A fixed candidate list finds a smaller share of the true neighbours as the graph
        grows: with the defaults, recall against the exact index at the default
        threshold is 0.992 at 100k entries but 0.962 at 1M (`splitvl cache-bench`,
        `docs/cache.md`), where ``efSearch`` 256 restores 0.990 at 2.5 ms p99. Growing
        the list as ``n ** 0.6`` past the reference size joins the two measured points
        (64 at 100k, 256 at 1M: 4 = 10 ** 0.6).
        """
        if not self.ef_reference_entries or n <= self.ef_reference_entries:
            return self.ef_search
        grown = self.ef_search * (n / self.ef_reference_entries) ** EF_GROWTH
        return max(self.ef_search, round(grown))


def gpu_count() -> int:
    """GPUs FAISS can use: 0 with faiss-cpu, or when the CUDA build sees no device."""
    get = getattr(faiss, "get_num_gpus", None)
    if get is None or not hasattr(faiss, "StandardGpuResources"):
        return 0
    try:
        return int(get())
    except RuntimeError:  # a CUDA build on a machine without a driver
        return 0


_gpu_resources: Any = None


def _gpu_flat(dim: int) -> faiss.Index:
    # One StandardGpuResources (scratch memory, streams) per process, as FAISS advises.
    global _gpu_resources
    if _gpu_resources is None:
        _gpu_resources = faiss.StandardGpuResources()
    return faiss.GpuIndexFlatIP(_gpu_resources, dim)


def _inner(kind: str, dim: int, params: IndexParams) -> faiss.Index:
    if kind == "flat":
        return faiss.IndexFlatIP(dim)
    if kind == "gpu_flat":
        return _gpu_flat(dim)
    if kind != "hnsw":
        raise ValueError(f"index kind {kind!r} is not one of {KINDS}")
    r = min(params.projected_dim, dim)
    hnsw = faiss.IndexHNSWFlat(r, params.hnsw_m, faiss.METRIC_INNER_PRODUCT)
    hnsw.hnsw.efConstruction = params.ef_construction
    hnsw.hnsw.efSearch = params.ef_search
    if r < dim:
        # Project, then re-normalise: a projected unit vector's norm varies by ~1/sqrt(r),
        # and under an inner-product metric the longer ones become hubs of the graph
        # (recall 0.996 -> 0.998 at 20k entries on the bench data).
        rotation = faiss.RandomRotationMatrix(dim, r)
        rotation.init(PROJECTION_SEED)
        norm = faiss.NormalizationTransform(r, 2.0)
        pre = faiss.IndexPreTransform(hnsw)
        pre.prepend_transform(norm)
        pre.prepend_transform(rotation)
        base: faiss.Index = pre
        hnsw.__dict__["_parts"] = (rotation, norm)  # owned by Python: keep them alive
    else:
        base = hnsw
    refine = faiss.IndexRefineFlat(base)
    refine.k_factor = float(params.k_factor)
    # IndexRefineFlat and IndexPreTransform do not own their parts in Python: keep them alive.
    refine.__dict__["_parts"] = (base, hnsw)
    return refine


class VectorIndex:
    """One FAISS index of one kind with tombstones for kinds that cannot remove ids.

    Args:
        kind: ``flat``, ``hnsw`` or ``gpu_flat``.
        dim: Descriptor length.
        params: Shape of the approximate index.
    """

    def __init__(self, kind: str, dim: int, params: IndexParams) -> None:
        self.kind = kind
        self.dim = dim
        self.params = params
        self._inner: Any = _inner(kind, dim, params)  # IndexRefineFlat for hnsw
        self.index = faiss.IndexIDMap2(self._inner)
        self._hnsw: Any = self._inner.__dict__.get("_parts", (None, None))[1]
        # efSearch by size (IndexParams.ef_search_for), set again only when the size
        # calls for another value, so a value set from outside (cache-bench's sweep)
        # holds until then.
        self._sized_ef = params.ef_search
        self.removable = kind == "flat"
        self.tombstones: set[int] = set()

    @property
    def ntotal(self) -> int:
        """Vectors in the index, tombstones included."""
        return int(self.index.ntotal)

    @property
    def live(self) -> int:
        return self.ntotal - len(self.tombstones)

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Add float32 ``[n, dim]`` L2-normalised vectors under int64 ``ids`` ``[n]``."""
        if len(ids):
            self.index.add_with_ids(
                np.ascontiguousarray(vectors, dtype=np.float32), ids.astype(np.int64)
            )

    def reserve(self, n: int) -> None:
        """Allocate the flat storage for ``n`` vectors now (CPU kinds; no-op on GPU).

        FAISS grows its flat code buffers as ``std::vector``s, whose doubling holds the old
        and the new buffer at once: filling 1M x 3,072 float32 vectors chunk by chunk
        peaked near 19 GB for 12.3 GB of vectors. Resizing to ``n`` and back to 0 keeps the
        capacity (``std::vector::resize`` never shrinks it), so later adds up to ``n``
        vectors never reallocate. It commits the memory at once (zero-filled pages).
        """
        flats: list[Any]  # faiss.IndexFlatCodes
        if self._hnsw is not None:  # the exact vectors it re-scores with, and the graph's
            flats = [
                faiss.downcast_index(x) for x in (self._inner.refine_index, self._hnsw.storage)
            ]
        elif self.kind == "flat":
            flats = [self._inner]
        else:
            return
        for flat in flats:
            wanted = (flat.ntotal + n) * flat.code_size
            if flat.codes.size() < wanted:
                used = flat.codes.size()
                flat.codes.resize(wanted)
                flat.codes.resize(used)

    def tune_search(self, ef_search: int, k_factor: int) -> None:
        """Set an HNSW index's candidate list and its exactly re-scored candidates per
        neighbour (``splitvl cache-bench --sweep``). The ``ef_search`` holds until the
        index's size calls for another value (:meth:`IndexParams.ef_search_for`).

        Raises:
            ValueError: the index is not ``hnsw``.
        """
        if self._hnsw is None:
            raise ValueError(f"a {self.kind} index has no search settings to tune")
        self._inner.k_factor = float(k_factor)
        self._hnsw.hnsw.efSearch = ef_search

    def remove(self, index_id: int) -> None:
        """Remove one id: at once for ``flat``, as a tombstone otherwise."""
        if self.removable:
            self.index.remove_ids(np.array([index_id], dtype=np.int64))  # type: ignore[arg-type]
        else:
            self.tombstones.add(index_id)

    def search(self, vector: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top inner products of float32 ``[dim]`` ``vector``: (scores ``[m]``, ids ``[m]``).

        Over-fetches by twice the expected number of tombstones among ``k`` results (plus
        two; tombstones are at most ``rebuild_fraction`` of the index, so about ``k/2``
        more), then drops tombstoned ids and ids of -1 (fewer vectors than asked). Rarely
        fewer than ``k`` live ids come back; the lookup then sees fewer candidates, never a
        removed one. Fetching ``k + tombstones`` instead would make every search ~8x more
        expensive under steady LRU churn (``k_factor * fetch`` HNSW candidates).
        """
        n = self.ntotal
        if n == 0 or k <= 0:
            return np.empty(0, np.float32), np.empty(0, np.int64)
        if self._hnsw is not None:
            ef = self.params.ef_search_for(n)
            if ef != self._sized_ef:
                self._hnsw.hnsw.efSearch = self._sized_ef = ef
        dead = len(self.tombstones)
        fetch = k if not dead else k + 2 + math.ceil(2 * k * dead / n)
        fetch = min(n, fetch, MAX_OVERFETCH * k)
        scores, ids = self.index.search(vector.reshape(1, -1).astype(np.float32), fetch)
        keep = [j for j, i in enumerate(ids[0]) if i >= 0 and int(i) not in self.tombstones]
        return scores[0][keep][:k], ids[0][keep][:k]

    def ids(self) -> np.ndarray:
        """Every id in the index (tombstones included), int64 ``[ntotal]``."""
        return faiss.vector_to_array(self.index.id_map).astype(np.int64)

    def reconstruct(self, ids: np.ndarray) -> np.ndarray:
        """The stored float32 ``[len(ids), dim]`` vectors of ``ids`` (int64).

        CPU kinds read the exact vectors straight out of the flat storage (one vectorised
        gather): a rebuild snapshots every live vector under the store's lock, and one
        ``reconstruct`` call per id took 0.84 s for 20k x 3,072 on this CPU (~4 s of
        stalled lookups at 100k).
        """
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) == 0:
            return np.empty((0, self.dim), dtype=np.float32)
        if self.kind == "gpu_flat":
            return np.asarray(self.index.reconstruct_batch(ids), dtype=np.float32)
        inner: Any = faiss.downcast_index(self.index.index)
        flat: Any = faiss.downcast_index(inner.refine_index) if self.kind == "hnsw" else inner
        n = self.ntotal
        stored = faiss.rev_swig_ptr(flat.get_xb(), n * self.dim).reshape(n, self.dim)
        positions = self.ids()  # id of each stored row, in storage order
        order = np.argsort(positions)
        rows = order[np.minimum(np.searchsorted(positions, ids, sorter=order), n - 1)]
        if not np.array_equal(positions[rows], ids):
            raise KeyError("reconstruct: an id is not in the index")
        return np.array(stored[rows], dtype=np.float32)


def choose_kind(live: int, threshold: int, gpu: bool) -> str:
    """``gpu_flat`` on a GPU; else ``flat`` below ``threshold`` live vectors, ``hnsw`` at it."""
    if gpu:
        return "gpu_flat"
    return "hnsw" if live >= threshold else "flat"


def build_index(
    kind: str, dim: int, params: IndexParams, ids: np.ndarray, vectors: np.ndarray
) -> VectorIndex:
    """A new index of ``kind`` holding ``vectors`` under ``ids`` (used by rebuilds)."""
    index = VectorIndex(kind, dim, params)
    index.add(ids, vectors)
    return index
