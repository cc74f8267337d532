"""One Put's work, after its request is checked (:mod:`cache_service.validation`):
reading the entries sent by reference from their holder, and storing the checked entries
in order.
"""

from __future__ import annotations

import asyncio

import grpc
from opentelemetry import trace
from qwenvl.common.v1 import tensor_pb2

from cache_service import metrics
from cache_service.entries import (
    CacheFullError,
    KeyGridConflictError,
    Store,
    StoreUnavailableError,
)
from cache_service.validation import CheckedEntry
from vlcommon.errors import ServiceError
from vlcommon.handoff import Reader
from vlcommon.refusals import Refusal


async def read_refs(
    reader: Reader, refs: list[tuple[int, tensor_pb2.ImageEmbedding]], timeout: float | None
) -> dict[int, bytes]:
    """The bytes of each entry sent by reference, by entry index, read concurrently.

    Raises:
        ServiceError: FAILED_PRECONDITION with the reason of a reader's UNAVAILABLE
            (``EMBEDDING_REF_GONE``, ``EMBEDDING_HOLDER_UNAVAILABLE``); the reader's
            other refusals as they are (INVALID_ARGUMENT ``EMBEDDING_REF_INVALID``...).
    """
    fetched = await asyncio.gather(
        *(reader.fetch(emb, field=f"entries[{i}].embedding", timeout=timeout) for i, emb in refs),
        return_exceptions=True,
    )
    payloads: dict[int, bytes] = {}
    for (i, _), got in zip(refs, fetched, strict=True):
        if isinstance(got, BaseException):
            if isinstance(got, ServiceError) and got.code == grpc.StatusCode.UNAVAILABLE:
                raise ServiceError(
                    grpc.StatusCode.FAILED_PRECONDITION, got.reason, got.message, got.metadata
                ) from got
            raise got
        # Entries are immutable bytes; the copy runs once, off the critical path.
        payloads[i] = bytes(got.data)
    trace.get_current_span().set_attribute(
        "splitvl.embedding.fetched_bytes", sum(len(p) for p in payloads.values())
    )
    return payloads


def store_all(store: Store, entries: tuple[CheckedEntry, ...]) -> tuple[int, int, int]:
    """Store checked entries in order; (stored, evicted, dropped).

    Raises:
        ServiceError: INVALID_ARGUMENT ``KEY_GRID_CONFLICT`` for a key stored with
            another grid; RESOURCE_EXHAUSTED ``CACHE_FULL_LEASED`` (retry in 100 ms)
            when leased entries hold the budget. Both say how many entries before it
            were stored.
    """
    stored = evicted = dropped = 0
    for i, e in enumerate(entries):
        try:
            data = e.data if isinstance(e.data, bytes) else bytes(e.data)
            evicted += store.put(
                e.key,
                e.descriptor,
                e.grid,
                e.dtype,
                e.shape,
                data,
                verification=e.verification,
                revision=e.revision,
                alias=e.alias_key,
            )
        except KeyGridConflictError as err:
            raise Refusal.KEY_GRID_CONFLICT.error(
                f"entries[{i}].embedding.grid is {list(e.grid)} but entries[{i}].key is "
                f"already stored with grid {list(err.stored_grid)} (a key is a digest "
                f"over the pixels and the resize plan); the {i} entries before it "
                "were stored",
                field=f"entries[{i}].embedding.grid",
            ) from err
        except StoreUnavailableError:
            dropped += 1  # a shared store down: not stored, never an error (counted)
            continue
        except CacheFullError as err:
            metrics.PUTS_REFUSED.labels(reason="leased").inc()
            raise Refusal.CACHE_FULL_LEASED.error(
                f"entries[{i}] needs {err.needed} bytes but {err.leased_bytes} of the "
                f"{err.capacity_bytes}-byte budget (capacity_bytes) are leased by "
                f"lookups in flight; the {i} entries before it were stored; retry later",
                field=f"entries[{i}]",
                limit=err.capacity_bytes,
                retry_after_ms=100,
            ) from err
        stored += 1
        metrics.PUTS.inc()
    return stored, evicted, dropped
