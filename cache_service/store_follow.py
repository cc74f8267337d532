"""How a replica's similarity index follows the shared store: the log and the scan.

* The log: every first write of a key appends the entry's store name (never the key: the
  store learns nothing of which image it is) to a Redis Stream (``<prefix>log``, trimmed
  to about ``CACHE_STORE_LOG_MAXLEN`` entries). :class:`Follower` reads it in a thread
  with a blocking ``XREAD`` of at most ``BLOCK_MS``, reads the new entries' headers and
  descriptors (``HMGET h d``, one pipelined round trip per batch), opens them and adds
  them to the index: an entry put through another replica is found by similarity here
  within about ``BLOCK_MS`` plus a round trip.
* The scan (:meth:`Follower.sync`): ``SCAN`` over every entry key (on every primary of a
  cluster). At start, before the service reports SERVING, it rebuilds the index from the
  store itself, not from the trimmed log; then every ``sync_interval_s`` and after the log
  could not be read, it adds what the log missed and removes entries the store no longer
  holds (expired or evicted), so the index tracks the store within one interval. Each
  scan first moves the follower to the log's tail: a log trimmed past the last message
  read, or replaced by an empty one whose ids start lower (a store restarted empty), is
  never waited on.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import numpy as np

from cache_service.store import EmbeddingStore
from cache_service.store_codec import Header, IntegrityError, StoreCodec
from cache_service.store_conn import STORE_FAILURES, RedisClient, StoreHealth, as_bytes
from vlcommon.errors import ConfigError

log = logging.getLogger("cache_service.store")

# Longest blocking XREAD: how late another replica's put may be seen (plus a round trip).
BLOCK_MS = 200
# Log messages read per XREAD, and entries read per pipelined HMGET.
BATCH = 256
# Keys asked per SCAN step.
SCAN_COUNT = 1000
# Pause after the log could not be read, seconds (the store is down or restarting).
RETRY_S = 0.5
# Pause after the store refused a read of the log (an ACL without XREAD, a log key of
# another type): no resync, which would fail alike, seconds.
REFUSED_RETRY_S = 5.0


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _batches(items: Iterable[object], n: int) -> Iterator[list[str]]:
    it = iter(items)
    while batch := [_text(x) for x in itertools.islice(it, n)]:
        yield batch


class FollowedStore(Protocol):
    """What the follower uses of its replica's store
    (:class:`cache_service.store_redis.RedisStore`)."""

    codec: StoreCodec
    dim: int
    policy_checked: bool
    catalog: EmbeddingStore
    health: StoreHealth

    def follow_client(self, blocking_s: float) -> RedisClient: ...

    def check_policy(self, client: RedisClient) -> None: ...

    def index(self, header: Header, vector: np.ndarray | None, source: str = "") -> None: ...

    def forget(self, key: str, found: str) -> None: ...

    def refused(self, err: IntegrityError, key: str) -> None: ...


class Follower:
    """Keeps one replica's index of the store current (module docstring).

    Args:
        store: The replica's store (its client, key names, MAC key, index).
        sync_interval_s: Seconds between two scans; ``inf`` = only at start and after
            the log could not be read.
    """

    def __init__(self, store: FollowedStore, *, sync_interval_s: float = 30.0) -> None:
        self.store = store
        self.sync_interval_s = sync_interval_s
        self.last_id = "0-0"
        self.resync_due = False
        self.syncs = 0
        self._next_sync = math.inf
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Follow the log from ``last_id`` in a daemon thread."""
        self._next_sync = time.monotonic() + self.sync_interval_s
        self._thread = threading.Thread(target=self._run, name="cache-store-follow", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def log_tail(self, client: RedisClient) -> str:
        """The id of the log's newest message ("0-0" when empty): following from it skips
        what a scan made now already sees."""
        newest: Any = client.xrevrange(self.store.codec.log, count=1)
        return _text(newest[0][0]) if newest else "0-0"

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                client = self.store.follow_client(BLOCK_MS / 1000)
                self._check_policy(client)
                if self.resync_due or time.monotonic() >= self._next_sync:
                    self.sync(client)
                    self.resync_due = False
                    self._next_sync = time.monotonic() + self.sync_interval_s
                self.follow_once(client)
            except STORE_FAILURES as err:
                if self.store.health.failed("follow", err, skip=False) == "refused":
                    self._stop.wait(REFUSED_RETRY_S)  # an ACL or a key that is not ours
                    continue
                self.resync_due = True
                self._stop.wait(RETRY_S)
            except Exception:  # a bug here must not end following for good
                log.exception("following the cache store's log failed; retrying")
                self._stop.wait(RETRY_S)

    def _check_policy(self, client: RedisClient) -> None:
        """The store's eviction policy, read once (the store was down at start)."""
        if self.store.policy_checked:
            return
        try:
            self.store.check_policy(client)
        except ConfigError as err:
            self.store.policy_checked = True
            log.error("%s (found after start: serving on, fix it)", err)

    def follow_once(self, client: RedisClient, block_ms: int = BLOCK_MS) -> int:
        """Read the log after ``last_id`` (waiting up to ``block_ms``) and index the entries
        it names; returns how many were added."""
        got: Any = client.xread({self.store.codec.log: self.last_id}, count=BATCH, block=block_ms)
        names = []
        for _stream, messages in got or []:
            for message_id, fields in messages:
                self.last_id = _text(message_id)
                name = fields.get(b"n")
                if isinstance(name, bytes) and name.isascii():  # else not a replica's
                    names.append(name.decode())
        return self.index_names(client, names, "log") if names else 0

    def index_names(self, client: RedisClient, names: list[str], source: str) -> int:
        """Read, open and index the entries stored under ``names`` (one pipelined
        ``HMGET h d`` per batch); returns how many were added (an entry gone already,
        indexed already, or refused is skipped)."""
        added = 0
        for batch in _batches(dict.fromkeys(names), BATCH):
            pipe = client.pipeline(transaction=False)
            for name in batch:
                pipe.hmget(name, ["h", "d"])
            # A key of another type under an entry's name (WRONGTYPE) is skipped alone.
            for name, reply in zip(batch, pipe.execute(raise_on_error=False), strict=True):
                if isinstance(reply, Exception):
                    continue
                sealed, raw = reply
                added += self._index_one(as_bytes(sealed), as_bytes(raw), name, source)
        return added

    def _index_one(self, sealed: bytes | None, raw: bytes | None, name: str, source: str) -> int:
        """Index one entry read as (``h``, ``d``) from store name ``name``; 1 when added."""
        store = self.store
        if sealed is None:
            return 0
        try:
            header = store.codec.open_header(sealed, None)
            if store.codec.entry(header.key) != name:
                raise IntegrityError("key", "an entry is stored under another key's name")
            if header.key in store.catalog:
                return 0
            vector = store.codec.descriptor(header, raw, store.dim)
        except IntegrityError as err:
            if err.reason != "key_id":  # another secret's entry (a rotation): not ours
                store.refused(err, "")
            return 0
        store.index(header, vector, source)
        return 1

    def sync(self, client: RedisClient) -> int:
        """Move to the log's tail, then scan the store: index every entry this replica has
        not indexed, and remove the indexed ones it no longer holds (known before the scan
        began and not seen by it: SCAN returns every key present for the whole scan).
        Returns entries added."""
        store = self.store
        self.last_id = self.log_tail(client)  # what the log held until now, the scan sees
        known = {store.codec.entry(k): k for k in store.catalog.keys()}
        seen: set[str] = set()
        added = 0
        pattern = store.codec.entry_pattern
        for batch in _batches(client.scan_iter(match=pattern, count=SCAN_COUNT), BATCH):
            seen.update(batch)
            new = [name for name in batch if name not in known]
            if new:
                added += self.index_names(client, new, "scan")
        for name, key in known.items():
            if name not in seen:
                store.forget(key, "sync")
        self.syncs += 1
        return added
