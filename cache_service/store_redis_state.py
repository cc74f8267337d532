"""What one replica holds of a shared Redis store, and the bookkeeping that keeps it in step.

:class:`RedisStoreState` is the base class of
:class:`cache_service.store_redis.RedisStore`, whose ``__init__`` sets the attributes
declared here and which adds the store's lookups and puts. This module holds:

* the connections (:meth:`RedisStoreState.client`, and the log follower's own) and the
  lifecycle: :meth:`RedisStoreState.start` (connect, check the eviction policy, rebuild the
  index from a scan, follow the log) and :meth:`RedisStoreState.close`;
* the local copies (``local``, an :class:`EmbeddingStore` within the replica's budget;
  ``_copies`` names the write each is a copy of) and the memo of alias records;
* the bookkeeping for entries the store no longer holds (:meth:`RedisStoreState.forget`)
  or that fail their checks (:meth:`RedisStoreState.refused`), the index of the store's
  entries (``catalog``, :meth:`RedisStoreState.index`), leases and statistics.

What lives where, and why: :mod:`cache_service.store_redis`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from cache_service import metrics
from cache_service.entries import CacheFullError, Entry, KeyGridConflictError, Match
from cache_service.store import EmbeddingStore
from cache_service.store_codec import Header, IntegrityError, StoreCodec
from cache_service.store_conn import (
    STORE_FAILURES,
    RedisClient,
    StoreAccess,
    StoreHealth,
    as_bytes,
    classify,
    config_error,
    eviction_policy,
    is_config_error,
    log,
)
from cache_service.store_follow import Follower

# Alias records remembered per replica (a few hundred bytes each), LRU.
ALIAS_MEMO = 65_536


class RedisStoreState:
    """A replica's connections to a shared Redis store, its index of the store's entries,
    its local copies, and their bookkeeping (module docstring); the base class of
    :class:`cache_service.store_redis.RedisStore`, which sets these attributes.

    Attributes:
        access: The store's URL, credentials, TLS files and timeout.
        dim: Length of similarity descriptors.
        capacity_bytes: The budget of the local copies, bytes.
        ttl_s: Seconds an entry lives in the store after its last Put; 0 = no TTL.
        codec: Seals and names entries (:class:`cache_service.store_codec.StoreCodec`).
        secret_set: Whether the store secret is not empty.
        health: Whether the store is skipped after failures.
        policy_checked: Whether the store's eviction policy was read.
        local: The local copies (payloads), LRU within ``capacity_bytes``.
        catalog: The similarity index of the store's entries (no payloads).
        follower: Follows the store's log and scans it into ``catalog``.
        dropped: Entries found dropped by the store.
    """

    access: StoreAccess
    dim: int
    capacity_bytes: int
    ttl_s: float
    codec: StoreCodec
    secret_set: bool
    health: StoreHealth
    policy_checked: bool
    local: EmbeddingStore
    catalog: EmbeddingStore
    follower: Follower
    dropped: int
    # The local copies' write ids, their lock, the alias memo, the clients: what each
    # holds is said where RedisStore.__init__ sets it.
    _copies: dict[str, bytes]
    _copies_lock: threading.RLock
    _aliases: OrderedDict[str, tuple[bytes, str]]
    _client: RedisClient | None
    _follow_client: RedisClient | None
    _client_lock: threading.Lock

    # -- lifecycle ------------------------------------------------------------------------
    def client(self) -> RedisClient:
        """The Redis client, made at the first call that succeeds (a cluster client reads
        the slot map when made, so it cannot be made while the cluster is down).

        Raises:
            redis.RedisError: it could not be made.
        """
        with self._client_lock:
            if self._client is None:
                self._client = self.access.connect()
            return self._client

    def follow_client(self, blocking_s: float) -> RedisClient:
        """The log follower's own client, whose socket timeout allows for its blocking
        reads of up to ``blocking_s`` (a connection of its own, so a blocked read never
        holds one a lookup needs)."""
        with self._client_lock:
            if self._follow_client is None:
                self._follow_client = self.access.connect(blocking_s)
            return self._follow_client

    def start(self, follow: bool = True) -> None:
        """Connect, check the store's eviction settings, rebuild the similarity index from
        a scan of the store, then (``follow``) follow the log in a thread. The service
        calls it before it reports SERVING. A store that cannot be reached is not fatal:
        the index stays empty until the follower's first successful scan.

        Raises:
            ConfigError: the store refused the password, user or certificate, or its
                maxmemory-policy can never make room (:func:`store_conn.eviction_policy`).
        """
        shown = self.access.url.shown
        if not self.secret_set:
            log.warning(
                "CACHE_STORE_ALLOW_NO_SECRET: entries in %s are sealed under a public key: "
                "whoever can reach the store reads every image and can forge embeddings "
                "(development only; docs/security.md)",
                shown,
            )
        try:
            client = self.client()
            client.ping()
            self.check_policy(client)
            t0 = time.perf_counter()
            found = self.follower.sync(client)
            log.info(
                "cache store %s: %d entries indexed from a scan in %.2f s",
                shown,
                found,
                time.perf_counter() - t0,
            )
        except STORE_FAILURES as err:
            # A command refused at start (an ACL without it) is a setting to fix too.
            if is_config_error(err) or classify(err)[0] == "refused":
                raise config_error(err, shown) from err
            self.health.failed("start", err)
            self.follower.resync_due = True
            log.warning("cache store %s unreachable at start: SERVING with an empty index", shown)
        if follow:
            self.follower.start()

    def check_policy(self, client: RedisClient) -> None:
        """Read the store's eviction policy (:func:`store_conn.eviction_policy`), once: at
        start, or at the follower's first scan when the store was down at start (then a
        policy that can never make room is logged as an error instead of refused).

        Raises:
            ConfigError: at start, a policy that can never make room.
        """
        if self.policy_checked:
            return
        shown = self.access.url.shown
        self.ttl_s, warnings = eviction_policy(client, self.ttl_s, shown)
        self.policy_checked = True
        for line in warnings:
            log.warning("cache store %s: %s", shown, line)

    def close(self) -> None:
        """Stop following the log and close the connections."""
        self.follower.stop()
        with self._client_lock:
            for client in (self._client, self._follow_client):
                if client is not None:
                    client.close()
            self._client = self._follow_client = None

    # -- local copies ---------------------------------------------------------------------
    def _local_only(self, key: str, grid: tuple[int, int, int], lease: bool) -> Match:
        """The answer while the store cannot be asked: this replica's own copy of ``key``
        (its bytes are the ones it put or served; no other replica is asked)."""
        held = self.local.lookup(key, None, grid, similar=False, lease=lease)
        return held if held.entry is not None else Match("miss", 0.0, None)

    def _remember_alias(self, alias: str, record: bytes, key: str) -> None:
        """Keep an alias's record (written once, so its bytes stay while it lives): the
        next lookup by the alias reads its target's header in the same round trip."""
        with self._copies_lock:
            self._aliases[alias] = (record, key)
            self._aliases.move_to_end(alias)
            while len(self._aliases) > ALIAS_MEMO:
                self._aliases.popitem(last=False)

    def _unshared_copy(self, key: str, grid: tuple[int, int, int], lease: bool) -> Entry | None:
        """This replica's copy of an entry the store refused to take (served while the
        store has no entry of its own for the key)."""
        with self._copies_lock:
            if self._copies.get(key) != b"":
                return None
            return self.local.lookup(key, None, grid, similar=False, lease=lease).entry

    def _keep(self, header: Header, data: bytes, lease: bool) -> Entry:
        """A local copy of an entry (or, when leased copies hold the whole budget, an entry
        held by nobody but its caller)."""
        with self._copies_lock:
            try:
                self._put_local(header, data)
            except CacheFullError:
                pass
            else:
                held = self.local.lookup(header.key, None, header.grid, similar=False, lease=lease)
                if held.entry is not None:
                    return held.entry
        return Entry(
            header.key,
            header.grid,
            header.dtype,
            header.shape,
            data,
            -1,
            revision=header.revision,
        )

    def _put_local(self, header: Header, data: bytes) -> int:
        """Keep a local copy of the write ``header`` names (``write_id`` b"": one the store
        refused); returns local copies evicted for it. The caller holds _copies_lock.

        Raises:
            CacheFullError: leased copies hold the budget, or a leased copy of another
                write of the key is still read (its readers keep it; this one is not kept).
        """
        if not self.local.discard(header.key) and header.key in self.local:
            self._copies.pop(header.key, None)
            raise CacheFullError(len(data), len(data), self.capacity_bytes)
        evicted = self.local.put(
            header.key, None, header.grid, header.dtype, header.shape, data,
            revision=header.revision,
        )  # fmt: skip
        self._copies[header.key] = header.write_id
        if len(self._copies) > 2 * len(self.local) + 1024:  # copies the LRU evicted
            self._copies = {k: w for k, w in self._copies.items() if k in self.local}
        return evicted

    # -- bookkeeping ----------------------------------------------------------------------
    def refused(
        self,
        err: IntegrityError,
        key: str,
        client: RedisClient | None = None,
        sealed: bytes = b"",
    ) -> None:
        """Count and log an entry that failed its checks; it leaves the index. One whose
        header opened but a body field did not (``client`` and the ``sealed`` header
        given) is deleted from the store if still the same, so a Put writes it again."""
        metrics.STORE_INTEGRITY_FAILURES.labels(reason=err.reason).inc()
        self.health.warn(
            f"integrity:{err.reason}",
            f"cache store entry refused ({err.reason}: {err}); served as a miss",
        )
        self.catalog.discard(key)
        with self._copies_lock:
            if self._copies.get(key) != b"":  # a copy the store refused is not its entry's
                self.local.discard(key)
                self._copies.pop(key, None)
        if client is not None and sealed and err.reason == "field":
            self._drop(client, key, sealed)

    def _drop(self, client: RedisClient, key: str, sealed: bytes) -> None:
        """Delete ``key``'s entry and payload if its header is still ``sealed`` (a newer
        Put stays), so that the next Put of the key writes it again."""
        name = self.codec.entry(key)

        def drop(pipe: Any) -> None:
            if as_bytes(pipe.hget(name, "h")) == sealed:
                pipe.multi()
                pipe.delete(name, self.codec.payload_of(name))

        run: Any = client.transaction
        run(drop, name)

    def forget(self, key: str, found: str) -> None:
        """The store no longer holds ``key``: it leaves the index and the local copies
        (except a copy the store refused to take, which it never held)."""
        if self.catalog.discard(key):
            self.dropped += 1
            metrics.STORE_DROPPED.labels(found=found).inc()
        with self._copies_lock:
            if self._copies.get(key) == b"":
                return
            self.local.discard(key)
            self._copies.pop(key, None)

    def index(self, header: Header, vector: np.ndarray | None, source: str = "") -> None:
        """Add an entry to the similarity index (a key already there is left as it is)."""
        for _ in range(2):
            try:
                self.catalog.put(
                    header.key, vector, header.grid, header.dtype, header.shape, b"",
                    revision=header.revision,
                )  # fmt: skip
                break
            except KeyGridConflictError:
                self.catalog.discard(header.key)
        if source:
            metrics.STORE_FOLLOWED.labels(source=source).inc()

    # -- leases and statistics ------------------------------------------------------------
    def lease(self, entry: Entry) -> bool:
        """One more lease on a local copy; False for an entry this replica does not hold."""
        return self.local.lease(entry)

    def release(self, entry: Entry) -> None:
        """End a lease on a local copy (an entry held by nobody has none to end)."""
        if self.local.holds(entry):
            self.local.release(entry)

    def stats(self) -> tuple[int, int, int]:
        """(entries in this replica's index of the store, bytes of its local copies, local
        copies evicted plus entries found dropped by the store)."""
        _, nbytes, evictions = self.local.stats()
        return len(self.catalog), nbytes, evictions + self.dropped

    def expire(self) -> int:
        """Nothing to reclaim here: Redis expires entries (their TTL) itself."""
        return 0

    def check_invariants(self) -> None:
        """Raise AssertionError when the local copies' or the index's bookkeeping is off."""
        self.local.check_invariants()
        self.catalog.check_invariants()
