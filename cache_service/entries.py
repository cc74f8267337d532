"""What a cache store holds and answers, and the interface both stores serve.

:class:`Entry` and :class:`Match` are what a store hands the servicer; :class:`Store` is the
interface of :class:`cache_service.store.EmbeddingStore` (the in-process store, ``memory``)
and :class:`cache_service.store_redis.RedisStore` (a shared Redis store), so
:class:`cache_service.servicer.CacheServicer` serves either.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from vlcommon.verification import VerificationImage

# Alias keys per entry, newest kept. Aliases sit outside the byte budget (like keys, at most
# 256 characters each: cache_service.servicer.MAX_KEY_CHARS), so they are bounded per entry;
# one is the usual case (the one file the pixels came from), a few cover the same pixels
# sent as a few files (a JPEG and its lossless PNG copy).
MAX_ALIASES_PER_ENTRY = 4


class EntryTooLargeError(ValueError):
    """An entry alone is larger than the byte budget (RESOURCE_EXHAUSTED)."""


class KeyGridConflictError(ValueError):
    """A key already held with another ``image_grid_thw`` (INVALID_ARGUMENT).

    The exact key is a digest over the pixels and the resize plan, so one key has one grid;
    another grid under the same key is a client's bug, and the stored entry is kept.

    Attributes:
        stored_grid: The grid stored under the key.
    """

    def __init__(self, stored_grid: tuple[int, int, int]) -> None:
        super().__init__(f"the key is already stored with grid {list(stored_grid)}")
        self.stored_grid = stored_grid


class CacheFullError(RuntimeError):
    """Leased entries hold so many bytes that an entry cannot fit (RESOURCE_EXHAUSTED).

    Attributes:
        needed: Bytes of the refused entry.
        leased_bytes: Bytes held by leased entries.
        capacity_bytes: The budget.
    """

    def __init__(self, needed: int, leased_bytes: int, capacity_bytes: int) -> None:
        super().__init__(
            f"an entry of {needed} bytes does not fit: {leased_bytes} of the "
            f"{capacity_bytes}-byte budget are leased by lookups in flight"
        )
        self.needed = needed
        self.leased_bytes = leased_bytes
        self.capacity_bytes = capacity_bytes


@dataclass(eq=False)
class Entry:
    """One stored image.

    Attributes:
        key: Exact key (hex digest).
        grid: (t, h, w).
        dtype: DataType enum value of ``data``.
        shape: ``[tokens, width]``.
        data: Raw embedding bytes.
        index_id: The entry's id in the FAISS index (-1 when it has no descriptor).
        verification: the verification image (luma and chroma), or None (never a
            similarity hit).
        revision: Model revision of the embeddings ("" when the writer sent none).
        expires_at: Clock time (seconds) after which it is never served; inf without TTL.
        leases: Lookups in flight that hold it (never evicted while > 0).
        aliases: Other keys that find it, oldest first (at most MAX_ALIASES_PER_ENTRY).
    """

    key: str
    grid: tuple[int, int, int]
    dtype: int
    shape: tuple[int, ...]
    data: bytes
    index_id: int
    expires_at: float = math.inf
    leases: int = 0
    verification: VerificationImage | None = None
    revision: str = ""
    aliases: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes counted in the budget: embeddings plus the verification image."""
        extra = 0 if self.verification is None else int(self.verification.nbytes)
        return len(self.data) + extra


@dataclass(frozen=True)
class Match:
    """Result of one lookup: tier is ``exact``, ``similar`` or ``miss``.

    ``consulted_similar`` says whether the similarity tier was searched (for metrics);
    ``rejected`` counts candidates at or above the threshold with an equal grid that were
    refused for another revision or a failed verification.
    """

    tier: str
    similarity: float
    entry: Entry | None
    consulted_similar: bool = False
    rejected: int = 0


class StoreUnavailableError(RuntimeError):
    """A shared store could not take a Put (down, slow or refusing): the entry is dropped.

    The cache is an optimisation: the servicer counts the entry as not stored and answers
    the Put without an error (the caller already has the embeddings).
    """


class Store(Protocol):
    """What the servicer calls on a store (every method is safe from any thread).

    Attributes:
        dim: Length of similarity descriptors.
        capacity_bytes: Byte budget of the entries this process holds (with a shared store:
            its local copies; docs/scaling.md, "Store").
    """

    dim: int
    capacity_bytes: int

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
        """The exact or similar entry for a query, or a miss (a store down is a miss)."""
        ...

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
        """Store an entry; returns entries evicted to make room.

        Raises:
            KeyGridConflictError: the key is held with another grid.
            EntryTooLargeError: the entry is larger than ``capacity_bytes``.
            CacheFullError: leased entries hold the budget (in-process store).
            StoreUnavailableError: a shared store did not take it (dropped).
        """
        ...

    def lease(self, entry: Entry) -> bool:
        """One more lease on a returned entry; False when this process no longer holds it."""
        ...

    def release(self, entry: Entry) -> None:
        """End one lease taken by ``lookup(..., lease=True)`` or :meth:`lease`."""
        ...

    def stats(self) -> tuple[int, int, int]:
        """(entries, bytes, evictions) read together."""
        ...

    def expire(self) -> int:
        """Reclaim expired entries now; returns how many were removed."""
        ...
