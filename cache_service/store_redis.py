"""A cache store that replicas share through Redis (``CACHE_STORE=redis://...``).

Usage::

    store = RedisStore.from_settings(settings)  # CacheSettings with store = a Redis URL
    store.start()  # connect, rebuild the index from the store, follow the others' puts
    servicer = CacheServicer(store, ...)
    ...
    store.close()

What lives where (docs/scaling.md, "Store"):

* Redis holds the truth: every entry (:mod:`cache_service.store_codec`: a tagged header,
  the descriptor, the verification image, the embeddings) with its TTL, the aliases, and
  the log, a Redis Stream of the keys put (``XADD ... MAXLEN ~``).
* This replica holds the similarity index over the store's entries (``catalog``: an
  :class:`EmbeddingStore` of descriptors, grids and revisions, no payloads), kept current
  by :class:`cache_service.store_follow.Follower` (the log within ~0.2 s, a scan at start
  and every ``sync_interval_s``), and copies of the entries it put or served (``local``: an
  :class:`EmbeddingStore` within ``capacity_bytes``, LRU, leases), so a repeat hit here
  reads the entry's header from Redis (a few hundred bytes) but not its embeddings.

A lookup always asks Redis first, so Redis's TTL and eviction decide for every replica:
an entry Redis no longer holds is a miss everywhere, and leaves this replica's index at
its first failed read (or the next scan). A store that fails or is slow is a miss
(:class:`cache_service.store_conn.StoreHealth`); an entry that fails its checks is a miss
counted in ``splitvl_cache_store_integrity_failures_total``; neither is ever an error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np

from cache_service import metrics
from cache_service.entries import (
    CacheFullError,
    Entry,
    EntryTooLargeError,
    KeyGridConflictError,
    Match,
    StoreUnavailableError,
)
from cache_service.index import IndexParams
from cache_service.store import EmbeddingStore
from cache_service.store_codec import (
    Header,
    IntegrityError,
    StoreKeys,
    check_field,
    derive_mac_key,
    open_alias,
    open_header,
    seal,
    seal_alias,
    verification_of,
)
from cache_service.store_conn import (
    STORE_FAILURES,
    RedisClient,
    StoreAccess,
    StoreHealth,
    as_bytes,
    config_error,
    eviction_warnings,
    is_config_error,
    log,
    parse_store_url,
)
from cache_service.store_follow import Follower
from vlcommon.verification import VerificationImage, verify

if TYPE_CHECKING:
    from cache_service.settings import CacheSettings

# The index of the store's entries holds no payloads: its byte budget never binds.
UNBOUNDED_BYTES = 2**62


class RedisStore:
    """The :class:`cache_service.entries.Store` interface over a shared Redis store.

    Args:
        access: The store's URL, credentials, TLS files and timeout.
        secret: The cluster's internal token (``CACHE_INTERNAL_TOKEN``); entry tags are
            keyed with a key derived from it (:func:`store_codec.derive_mac_key`).
        descriptor_dim: Length of similarity descriptors.
        capacity_bytes: This replica's budget for its local copies, bytes; also the
            largest entry it takes (ENTRY_TOO_LARGE above it).
        threshold, search_k, index_threshold, index_params, use_gpu, rebuild_fraction: The
            similarity index, as for :class:`EmbeddingStore`.
        ttl_s: Seconds an entry lives in the store after its last Put (Redis ``PEXPIRE``);
            0 = until Redis evicts it.
        prefix: Prefix of every Redis key.
        log_maxlen: Approximate length the log is trimmed to (``XADD MAXLEN ~``).
        sync_interval_s: Seconds between two scans of the store (entries other replicas
            put while this one missed the log; entries Redis dropped).
        background_rebuild: Rebuild the index in a thread (the service) or inline.
    """

    def __init__(
        self,
        access: StoreAccess,
        *,
        secret: str,
        descriptor_dim: int,
        capacity_bytes: int,
        threshold: float = 0.85,
        search_k: int = 8,
        ttl_s: float = 0.0,
        index_threshold: int = 2048,
        index_params: IndexParams | None = None,
        use_gpu: bool | None = None,
        rebuild_fraction: float = 0.25,
        prefix: str = "splitvl:",
        log_maxlen: int = 100_000,
        sync_interval_s: float = 30.0,
        background_rebuild: bool = False,
    ) -> None:
        self.access = access
        self.dim = descriptor_dim
        self.capacity_bytes = capacity_bytes
        self.threshold = threshold
        self.ttl_s = ttl_s
        self.keys = StoreKeys(prefix)
        self.log_maxlen = log_maxlen
        self.mac_key = derive_mac_key(secret)
        self.secret_set = bool(secret)
        self.health = StoreHealth()
        self.local = EmbeddingStore(
            descriptor_dim=descriptor_dim,
            capacity_bytes=capacity_bytes,
            use_gpu=False,
            publish="payloads",
        )
        self.catalog = EmbeddingStore(
            descriptor_dim=descriptor_dim,
            capacity_bytes=UNBOUNDED_BYTES,
            threshold=threshold,
            search_k=search_k,
            index_threshold=index_threshold,
            index_params=index_params,
            use_gpu=use_gpu,
            rebuild_fraction=rebuild_fraction,
            background_rebuild=background_rebuild,
            publish="index",
        )
        self.follower = Follower(self, sync_interval_s=sync_interval_s)
        self.dropped = 0
        self._client: RedisClient | None = None
        self._follow_client: RedisClient | None = None
        self._client_lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: CacheSettings, *, use_gpu: bool | None = None) -> RedisStore:
        """The store ``settings.store`` names (a Redis URL), with the service's settings."""
        url = parse_store_url(settings.store)
        assert url is not None, "from_settings needs a Redis URL, not memory"
        access = StoreAccess(
            url,
            password=settings.store_password.get_secret_value(),
            timeout_s=settings.store_timeout_s,
            tls_ca_file=settings.store_tls_ca_file,
            tls_cert_file=settings.store_tls_cert_file,
            tls_key_file=settings.store_tls_key_file,
        )
        return cls(
            access,
            secret=settings.internal_token.get_secret_value(),
            descriptor_dim=settings.descriptor_dim,
            capacity_bytes=settings.capacity_bytes,
            threshold=settings.threshold,
            search_k=settings.search_k,
            ttl_s=settings.ttl_s,
            index_threshold=settings.index_threshold,
            index_params=settings.index_params(),
            use_gpu=use_gpu,
            rebuild_fraction=settings.rebuild_fraction,
            prefix=settings.store_prefix,
            log_maxlen=settings.store_log_maxlen,
            sync_interval_s=settings.store_sync_interval_s,
            background_rebuild=True,
        )

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
            ConfigError: the store refused the password, user or certificate.
        """
        shown = self.access.url.shown
        if not self.secret_set:
            log.warning(
                "CACHE_INTERNAL_TOKEN is empty: the store's entry tags are keyed with a "
                "public constant, so they catch torn and mixed-up entries but not entries "
                "forged by whoever can write to %s (docs/scaling.md)",
                shown,
            )
        try:
            client = self.client()
            client.ping()
            for line in eviction_warnings(client, self.ttl_s):
                log.warning("cache store %s: %s", shown, line)
            self.follower.last_id = self.follower.log_tail(client)
            t0 = time.perf_counter()
            found = self.follower.sync(client)
            log.info(
                "cache store %s: %d entries indexed from a scan in %.2f s",
                shown,
                found,
                time.perf_counter() - t0,
            )
        except STORE_FAILURES as err:
            if is_config_error(err):
                raise config_error(err, shown) from err
            self.health.failed("start", err)
            self.follower.resync_due = True
            log.warning("cache store %s unreachable at start: SERVING with an empty index", shown)
        if follow:
            self.follower.start()

    def close(self) -> None:
        """Stop following the log and close the connections."""
        self.follower.stop()
        with self._client_lock:
            for client in (self._client, self._follow_client):
                if client is not None:
                    client.close()
            self._client = self._follow_client = None

    # -- reading --------------------------------------------------------------------------
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
        """As :meth:`EmbeddingStore.lookup`, answered from the store (module docstring).

        Never raises for the store: down, slow (``timeout_s`` per command) or refusing, the
        query is a miss, counted in ``splitvl_cache_store_errors_total{op="lookup"}``.
        """
        if not self.health.allow("lookup"):
            return Match("miss", 0.0, None)
        try:
            client = self.client()
            exact = self._exact(client, key, grid, lease, alias)
            if exact is not None:
                self.health.ok()
                return exact
            if not similar:
                self.health.ok()
                return Match("miss", 0.0, None)
            match = self._similar(client, descriptor, grid, lease, revision, verification, reusable)
            self.health.ok()
            return match
        except STORE_FAILURES as err:
            self.health.failed("lookup", err)
            return Match("miss", 0.0, None)

    def _exact(
        self, client: RedisClient, key: str, grid: tuple[int, int, int], lease: bool, alias: str
    ) -> Match | None:
        """The exact hit; a final miss (the key held with another grid, or refused); None
        when the key is not in the store (the similarity tier may answer)."""
        pipe = client.pipeline(transaction=False)
        pipe.hget(self.keys.entry(key), "h")
        pipe.get(self.keys.alias(key))
        sealed, alias_record = (as_bytes(x) for x in pipe.execute())
        target = key
        if sealed is None and alias_record is not None:
            try:
                target = open_alias(self.mac_key, alias_record, key)
            except IntegrityError as err:
                self.refused(err, key)
                return None
            sealed = as_bytes(client.hget(self.keys.entry(target), "h"))
        if sealed is None:
            if target in self.catalog:
                self.forget(target, "read")  # expired or evicted in the store
            return None
        try:
            header = open_header(self.mac_key, sealed, target)
        except IntegrityError as err:
            self.refused(err, target)
            return Match("miss", 0.0, None)
        if header.grid != grid:  # not this image's plan: never answer with another grid
            return Match("miss", 0.0, None)
        entry = self._payload(client, header, lease)
        if entry is None:
            return Match("miss", 0.0, None)
        if alias and target == key:
            self.add_alias(client, alias, key)
        return Match("exact", 1.0, entry)

    def _similar(
        self,
        client: RedisClient,
        descriptor: np.ndarray | None,
        grid: tuple[int, int, int],
        lease: bool,
        revision: str,
        verification: VerificationImage | None,
        reusable: Collection[tuple[int, int, int]],
    ) -> Match:
        """The best candidate of the index whose stored header and verification image pass
        their checks and whose verification image passes against the query's."""
        found, candidates = self.catalog.candidates(
            descriptor, grid, revision=revision, reusable=reusable
        )
        rejected = found.rejected
        for score, cand in candidates:
            sealed, raw = (as_bytes(x) for x in client.hmget(self.keys.entry(cand.key), ["h", "v"]))
            if sealed is None:
                self.forget(cand.key, "read")
                continue
            try:
                header = open_header(self.mac_key, sealed, cand.key)
                image = verification_of(header, raw)
            except IntegrityError as err:
                self.refused(err, cand.key)
                continue
            metrics.STORE_BYTES.labels(direction="read").inc(len(sealed) + len(raw or b""))
            if header.grid != cand.grid or header.revision != cand.revision:
                self.forget(cand.key, "read")  # replaced in the store; the scan re-adds it
                continue
            if not verify(verification, image):
                rejected += 1  # another picture that merely shares the thumbnail
                continue
            entry = self._payload(client, header, lease)
            if entry is not None:
                return Match("similar", score, entry, consulted_similar=True, rejected=rejected)
        consulted = found.consulted_similar
        return Match("miss", found.similarity, None, consulted_similar=consulted, rejected=rejected)

    def _payload(self, client: RedisClient, header: Header, lease: bool) -> Entry | None:
        """The entry ``header`` describes, with its embeddings: the local copy when it
        matches the header, else read from the store, checked, and kept as a local copy
        (leased when ``lease``). None when the store no longer holds it or it is refused."""
        held = self.local.lookup(header.key, None, header.grid, similar=False, lease=lease)
        if held.entry is not None:
            if _matches(held.entry, header):
                return held.entry
            if lease:
                self.local.release(held.entry)
            self.local.discard(header.key)
        data = as_bytes(client.hget(self.keys.entry(header.key), "p"))
        if data is None:
            self.forget(header.key, "read")
            return None
        try:
            check_field(header, "p", data)
        except IntegrityError as err:
            self.refused(err, header.key)
            return None
        metrics.STORE_BYTES.labels(direction="read").inc(len(data))
        return self._keep(header, data, lease)

    def _keep(self, header: Header, data: bytes, lease: bool) -> Entry:
        """A local copy of an entry (or, when leased copies hold the whole budget, an entry
        held by nobody but its caller)."""
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
        """Keep a local copy; returns local copies evicted for it.

        Raises:
            CacheFullError: leased copies hold the budget.
        """
        for _ in range(2):
            try:
                return self.local.put(
                    header.key, None, header.grid, header.dtype, header.shape, data,
                    revision=header.revision,
                )  # fmt: skip
            except KeyGridConflictError:
                self.local.discard(header.key)  # a stale copy; the store's header wins
        return 0

    def refused(self, err: IntegrityError, key: str) -> None:
        """Count and log an entry that failed its checks; it leaves the index."""
        metrics.STORE_INTEGRITY_FAILURES.labels(reason=err.reason).inc()
        self.health.warn(
            f"integrity:{err.reason}",
            f"cache store entry refused ({err.reason}: {err}); served as a miss",
        )
        self.catalog.discard(key)
        self.local.discard(key)

    def forget(self, key: str, found: str) -> None:
        """The store no longer holds ``key``: it leaves the index and the local copies."""
        if self.catalog.discard(key):
            self.dropped += 1
            metrics.STORE_DROPPED.labels(found=found).inc()
        self.local.discard(key)

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
        """Write an entry to the store (with its TTL), log it for the other replicas, index
        it and keep a local copy. Returns local copies evicted for it.

        A key the store holds with the same grid is written again (the key is a digest of
        the content and revision, so this refreshes its TTL, and repairs a refused entry).

        Raises:
            KeyGridConflictError: the store holds the key with another grid (INVALID_ARGUMENT).
            EntryTooLargeError: larger than ``capacity_bytes`` (RESOURCE_EXHAUSTED).
            StoreUnavailableError: the store failed or is skipped; nothing was kept.
        """
        size = len(data) + (0 if verification is None else int(verification.nbytes))
        if size > self.capacity_bytes:
            raise EntryTooLargeError(
                f"entry of {size} bytes exceeds the budget of {self.capacity_bytes} bytes"
            )
        vec = EmbeddingStore.normalise(descriptor) if descriptor is not None else None
        if vec is not None and vec.shape[0] != self.dim:
            vec = None
        if not self.health.allow("put"):
            raise StoreUnavailableError("the cache store is down; the entry was dropped")
        header, fields = seal(
            self.mac_key,
            key=key,
            revision=revision,
            grid=grid,
            dtype=dtype,
            shape=shape,
            payload=data,
            descriptor=vec,
            verification=verification,
            written_ms=int(time.time() * 1000),
        )
        try:
            self._write(self.client(), header, fields, alias)
            self.health.ok()
        except STORE_FAILURES as err:
            self.health.failed("put", err)
            raise StoreUnavailableError(f"the cache store failed: {err}") from err
        self.index(header, vec)
        try:
            return self._put_local(header, data)
        except CacheFullError:
            return 0  # the store has it; this replica reads it back when asked

    def _write(
        self, client: RedisClient, header: Header, fields: dict[str, bytes], alias: str
    ) -> None:
        """The store's side of :meth:`put` (raises KeyGridConflictError, redis errors)."""
        name = self.keys.entry(header.key)
        fresh = True
        sealed = as_bytes(client.hget(name, "h"))
        if sealed is not None:
            try:
                old = open_header(self.mac_key, sealed, header.key)
            except IntegrityError as err:
                self.refused(err, header.key)  # written again below
            else:
                if old.grid != header.grid:
                    raise KeyGridConflictError(old.grid)
                fresh = False
        # One transaction (same key, so one Redis Cluster slot): no reader sees a hash
        # with some fields of this write and some of an earlier one, or without its TTL.
        pipe = client.pipeline(transaction=True)
        pipe.delete(name)
        pipe.hset(name, mapping=fields)  # type: ignore[arg-type]
        if self.ttl_s > 0:
            pipe.pexpire(name, max(1, round(self.ttl_s * 1000)))
        pipe.execute()
        metrics.STORE_BYTES.labels(direction="write").inc(sum(len(v) for v in fields.values()))
        if alias:
            self.add_alias(client, alias, header.key)
        if fresh:
            client.xadd(self.keys.log, {"k": header.key}, maxlen=self.log_maxlen, approximate=True)

    def add_alias(self, client: RedisClient, alias: str, key: str) -> None:
        """Make ``alias`` find ``key``'s entry (with the entry's TTL). A failure is counted
        (``op="alias"``) and otherwise ignored: the alias only saves a later lookup."""
        if alias == key:
            return
        try:
            ttl = max(1, round(self.ttl_s * 1000)) if self.ttl_s > 0 else None
            client.set(self.keys.alias(alias), seal_alias(self.mac_key, alias, key), px=ttl)
        except STORE_FAILURES as err:
            self.health.failed("alias", err)

    # -- leases and bookkeeping -----------------------------------------------------------
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


def _matches(entry: Entry, header: Header) -> bool:
    """A local copy answers for the store's entry: same grid, dtype, shape, revision and
    length (the key is a digest of the content and revision, so the embeddings are those
    of the same image, as with the in-process store)."""
    return (
        entry.grid == header.grid
        and entry.dtype == header.dtype
        and entry.shape == header.shape
        and entry.revision == header.revision
        and len(entry.data) == header.lengths["p"]
    )
