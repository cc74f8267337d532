"""The in-process store's bookkeeping checks (``EmbeddingStore.check_invariants``, tests)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from cache_service.entries import MAX_ALIASES_PER_ENTRY, Entry
from cache_service.index import VectorIndex


class Bookkept(Protocol):
    """What the checks read of :class:`cache_service.store.EmbeddingStore`."""

    bytes: int
    capacity_bytes: int
    _entries: OrderedDict[str, Entry]
    _by_put: OrderedDict[str, None]
    _by_id: dict[int, Entry]
    _aliases: dict[str, str]
    _index: VectorIndex

    @property
    def leased(self) -> int: ...


def store_problems(store: Bookkept) -> list[str]:
    """What is inconsistent in ``store``'s bookkeeping (call it under the store's lock).

    Checks: bytes equal the sum of entry sizes and stay within the budget; the LRU and
    expiry orders hold the same keys; every alias finds a held entry that lists it, no
    alias is an entry's own key, and no entry lists more than MAX_ALIASES_PER_ENTRY;
    every indexed entry's vector is in the index and every live index id belongs to an
    entry (no orphans either way); tombstones are index ids no entry holds; lease counts
    are not negative.

    Returns:
        One line per problem; empty when the bookkeeping is consistent.
    """
    problems: list[str] = []
    entries = store._entries
    total = sum(e.nbytes for e in entries.values())
    if total != store.bytes:
        problems.append(f"bytes {store.bytes} != sum of entries {total}")
    if store.bytes > store.capacity_bytes:
        problems.append(f"bytes {store.bytes} exceed the budget {store.capacity_bytes}")
    if set(entries) != set(store._by_put):
        problems.append("LRU and expiry orders hold different keys")
    for key, entry in entries.items():
        if entry.key != key:
            problems.append(f"entry under {key[:16]} has key {entry.key[:16]}")
        if entry.leases < 0:
            problems.append(f"entry {key[:16]} has {entry.leases} leases")
        if entry.index_id >= 0 and store._by_id.get(entry.index_id) is not entry:
            problems.append(f"entry {key[:16]} id {entry.index_id} not mapped back")
    listed = {a: e.key for e in entries.values() for a in e.aliases}
    if listed != store._aliases:
        problems.append("alias map and the entries' alias lists disagree")
    if set(store._aliases) & set(entries):
        problems.append("an alias is also an entry's own key")
    if any(len(e.aliases) > MAX_ALIASES_PER_ENTRY for e in entries.values()):
        problems.append(f"an entry holds more than {MAX_ALIASES_PER_ENTRY} aliases")
    leased = sum(1 for e in entries.values() if e.leases)
    if leased != store.leased:
        problems.append(f"{store.leased} leased entries counted, {leased} held")
    indexed = {e.index_id for e in entries.values() if e.index_id >= 0}
    if set(store._by_id) != indexed:
        problems.append("id map holds ids of no entry")
    in_index = set(store._index.ids().tolist())
    tomb = store._index.tombstones
    if in_index - tomb != indexed:
        problems.append(
            f"index ids without entries: {sorted(in_index - tomb - indexed)[:5]}, "
            f"entries without index ids: {sorted(indexed - (in_index - tomb))[:5]}"
        )
    if not tomb <= in_index or tomb & indexed:
        problems.append("tombstones are not dead index ids")
    return problems
