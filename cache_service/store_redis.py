"""A cache store that replicas share through Redis (``CACHE_STORE=redis://...``).

Usage::

    store = RedisStore.from_settings(settings)  # CacheSettings with store = a Redis URL
    store.start()  # connect, rebuild the index from the store, follow the others' puts
    servicer = CacheServicer(store, ...)
    ...
    store.close()

What lives where (docs/scaling.md, "Store"):

* Redis holds the truth, sealed (:mod:`cache_service.store_codec`): every entry (a hash of
  the header, the descriptor and the verification image, and a string of the embeddings
  beside it) with its TTL, the aliases, the claims (:mod:`cache_service.claims`), and the
  log, a Redis Stream of the entries first written (``XADD ... MAXLEN ~``). One key names
  one content while it lives: the first write wins (:meth:`RedisStore.put`).
* This replica holds the similarity index over the store's entries (``catalog``: an
  :class:`EmbeddingStore` of descriptors, grids and revisions, no payloads), kept current
  by :class:`cache_service.store_follow.Follower` (the log within ~0.2 s, a scan at start
  and every ``sync_interval_s``), and copies of the entries it put or served (``local``: an
  :class:`EmbeddingStore` within ``capacity_bytes``, LRU, leases), so a repeat hit here
  reads the entry's header from Redis (a few hundred bytes) but not its embeddings.

A lookup always asks Redis first, so Redis's TTL and eviction decide for every replica:
an entry Redis no longer holds is a miss everywhere, and leaves this replica's index at
its first failed read (or the next scan). A store that cannot be reached answers from
this replica's own copies or misses, one that refuses a write keeps the entry as a local
copy (:class:`cache_service.store_conn.StoreHealth`); an entry that fails its checks is a
miss counted in ``splitvl_cache_store_integrity_failures_total``; none is ever an error.

Modules: this one holds :class:`RedisStore`'s lookups and puts;
:mod:`cache_service.store_redis_state` its connections, local copies and bookkeeping (its
base class); :mod:`cache_service.store_codec` the sealing and key layout;
:mod:`cache_service.store_conn` the URL, the client and the failure handling;
:mod:`cache_service.store_follow` the log and the scan.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import redis
from redis.exceptions import ReadOnlyError

from cache_service import metrics
from cache_service.claims import RedisClaims
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
from cache_service.store_codec import Header, IntegrityError, StoreCodec
from cache_service.store_conn import (
    STORE_FAILURES,
    RedisClient,
    StoreAccess,
    StoreHealth,
    as_bytes,
    parse_store_url,
)
from cache_service.store_follow import Follower
from cache_service.store_redis_state import RedisStoreState
from vlcommon.errors import ConfigError
from vlcommon.verification import VerificationImage, verify

if TYPE_CHECKING:
    from cache_service.settings import CacheSettings

# The shortest store secret taken: keys come from it by HKDF, which does not stretch, so a
# guessable secret could be found offline from a dump (splitvl up makes 43 characters).
MIN_SECRET_CHARS = 16
# Similarity candidates whose header and verification image one round trip reads (up to
# ~3 MB each at 2 MP; search_k is 8 by default).
CANDIDATE_BATCH = 4
# The index of the store's entries holds no payloads: its byte budget never binds.
UNBOUNDED_BYTES = 2**62


class RedisStore(RedisStoreState):
    """The :class:`cache_service.entries.Store` interface over a shared Redis store.

    Args:
        access: The store's URL, credentials, TLS files and timeout.
        secret: The store secret (``CACHE_STORE_SECRET``, else ``CACHE_INTERNAL_TOKEN``):
            entries are sealed and named under keys derived from it
            (:class:`cache_service.store_codec.StoreCodec`).
        allow_no_secret: Development only: start with an empty secret (a public key,
            which keeps neither readers nor forgers out).
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
        claim_ttl_s: Seconds a claim on a missed key lives unless a Put ends it
            (:mod:`cache_service.claims`).
    """

    def __init__(
        self,
        access: StoreAccess,
        *,
        secret: str,
        allow_no_secret: bool = False,
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
        claim_ttl_s: float = 5.0,
    ) -> None:
        self.access = access
        self.dim = descriptor_dim
        self.capacity_bytes = capacity_bytes
        self.threshold = threshold
        self.ttl_s = ttl_s
        if len(secret.strip()) < MIN_SECRET_CHARS and not allow_no_secret:
            raise ConfigError(
                "a shared cache store needs a secret of at least "
                f"{MIN_SECRET_CHARS} random characters: set CACHE_STORE_SECRET (or "
                "CACHE_STORE_SECRET_FILE, or CACHE_INTERNAL_TOKEN); entries are sealed "
                "under it, and without one anyone who can reach the store reads every image "
                "and can forge embeddings (CACHE_STORE_ALLOW_NO_SECRET=true: development only)"
            )
        self.codec = StoreCodec(secret, prefix)
        self.log_maxlen = log_maxlen
        self.secret_set = bool(secret.strip())
        self.health = StoreHealth()
        # Local copies: key -> the write id of the store's entry they are a copy of (b"": a
        # copy the store refused to take, served while the store has no entry of its own).
        self._copies: dict[str, bytes] = {}
        # Guards _copies with the local copies they describe (lookups, puts and the
        # follower run on several threads).
        self._copies_lock = threading.RLock()
        self._aliases: OrderedDict[str, tuple[bytes, str]] = OrderedDict()
        self.policy_checked = False
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
        self.claims = RedisClaims(self, claim_ttl_s)
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
            secret=settings.secret(),
            allow_no_secret=settings.store_allow_no_secret,
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
            claim_ttl_s=settings.claim_ttl_s,
        )

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

        Never raises for the store: down or slow (``timeout_s`` per command), the query is
        answered from this replica's local copies alone (an exact hit or a miss), counted
        in ``splitvl_cache_store_errors_total{op="lookup"}``.
        """
        if not self.health.allow("lookup"):
            return self._local_only(key, grid, lease)
        try:
            client = self.client()
            exact = self._exact(client, key, grid, lease, alias)
            if exact is None and similar:
                exact = self._similar(
                    client, descriptor, grid, lease, revision, verification, reusable
                )
            self.health.ok()
            return exact if exact is not None else Match("miss", 0.0, None)
        except STORE_FAILURES as err:
            if self.health.failed("lookup", err) == "refused":
                return Match("miss", 0.0, None)
            return self._local_only(key, grid, lease)

    def _exact(
        self, client: RedisClient, key: str, grid: tuple[int, int, int], lease: bool, alias: str
    ) -> Match | None:
        """The exact hit; a final miss (the key held with another grid, or refused); None
        when the key is not in the store (the similarity tier may answer)."""
        codec = self.codec
        known = self._aliases.get(key)  # (record, target) of an alias read or written here
        pipe = client.pipeline(transaction=False)
        pipe.hget(codec.entry(key), "h")
        pipe.get(codec.alias(key))
        if known is not None:  # its target's header in the same round trip
            pipe.hget(codec.entry(known[1]), "h")
        # An alias the store refuses to read (WRONGTYPE, an ACL without GET) is no alias.
        replies = [_reply(x) for x in pipe.execute(raise_on_error=False)]
        sealed, alias_record = replies[0], replies[1]
        if isinstance(sealed, Exception):
            raise sealed
        target = key
        if sealed is None and isinstance(alias_record, bytes):
            if known is not None and alias_record == known[0]:
                target, sealed = known[1], replies[2]  # the record written once, unchanged
                if isinstance(sealed, Exception):
                    raise sealed
            else:
                try:
                    target = codec.open_alias(alias_record, key)
                except IntegrityError as err:
                    self.refused(err, key)
                    return None
                self._remember_alias(key, alias_record, target)
                sealed = as_bytes(client.hget(codec.entry(target), "h"))
        if sealed is None:
            held = self._unshared_copy(target, grid, lease)
            if held is not None:
                return Match("exact", 1.0, held)
            if target in self.catalog or target in self._copies:
                self.forget(target, "read")  # expired or evicted in the store
            return None
        assert isinstance(sealed, bytes)
        try:
            header = codec.open_header(sealed, target)
        except IntegrityError as err:
            self.refused(err, target)
            held = self._unshared_copy(target, grid, lease)  # what the store would not take
            return Match("miss", 0.0, None) if held is None else Match("exact", 1.0, held)
        if header.grid != grid:  # not this image's plan: never answer with another grid
            return Match("miss", 0.0, None)
        entry = self._payload(client, header, lease)
        if entry is None:
            return Match("miss", 0.0, None)
        if alias and target == key and self._aliases.get(alias, (b"", ""))[1] != key:
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
        """The best candidate of the index whose stored header and verification image open
        and whose verification image passes against the query's."""
        found, candidates = self.catalog.candidates(
            descriptor, grid, revision=revision, reusable=reusable
        )
        rejected = found.rejected
        for score, cand, (sealed, raw) in self._read_candidates(client, candidates):
            if sealed is None:
                self.forget(cand.key, "read")
                continue
            try:
                header = self.codec.open_header(sealed, cand.key)
                image = self.codec.verification(header, raw)
            except IntegrityError as err:
                self.refused(err, cand.key, client, sealed)
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

    def _read_candidates(
        self, client: RedisClient, candidates: list[tuple[float, Entry]]
    ) -> Iterator[tuple[float, Entry, tuple[bytes | None, bytes | None]]]:
        """Each candidate with its stored ``h`` and ``v``, read ``CANDIDATE_BATCH`` at a
        time in one pipelined round trip (not one round trip each: with many near
        neighbours the lookup's time grew with the store); the caller stops at the first
        that passes."""
        for start in range(0, len(candidates), CANDIDATE_BATCH):
            batch = candidates[start : start + CANDIDATE_BATCH]
            pipe = client.pipeline(transaction=False)
            for _, cand in batch:
                pipe.hmget(self.codec.entry(cand.key), ["h", "v"])
            for (score, cand), reply in zip(batch, pipe.execute(), strict=True):
                yield score, cand, (as_bytes(reply[0]), as_bytes(reply[1]))

    def _payload(self, client: RedisClient, header: Header, lease: bool) -> Entry | None:
        """The embeddings of the write ``header`` describes (already checked against the
        query): the local copy when it is a copy of that very write, else header and
        payload read together (``MULTI``, ``HGET h``, ``GET`` payload, ``EXEC``: a write
        sets both in one transaction, so the two are never of two writes), opened, and
        kept as a local copy (leased when ``lease``). None (a miss) when the store no
        longer holds it (or Redis evicted its payload: the rest is dropped so that a Put
        writes it again), when it was replaced by another write since ``header`` was read
        (that write was not checked against the query), or when its payload does not open
        (then it is counted, and deleted if unchanged)."""
        key = header.key
        with self._copies_lock:
            if self._copies.get(key) == header.write_id:
                held = self.local.lookup(key, None, header.grid, similar=False, lease=lease)
                if held.entry is not None:
                    return held.entry
        name = self.codec.entry(key)
        pipe = client.pipeline(transaction=True)  # MULTI/EXEC: one write's parts together
        pipe.hget(name, "h")
        pipe.get(self.codec.payload_of(name))
        sealed, data = (as_bytes(x) for x in pipe.execute())
        if sealed is None:
            self.forget(key, "read")
            return None
        if data is None:  # Redis evicted the payload and not the hash: drop the rest
            self.forget(key, "read")
            self._drop(client, key, sealed)
            return None
        try:
            now = self.codec.open_header(sealed, key)
            if now.write_id != header.write_id:
                return None  # replaced meanwhile: the next lookup checks the new one
            payload = self.codec.open_field(now, "p", data)
        except IntegrityError as err:
            self.refused(err, key, client, sealed)
            return None
        metrics.STORE_BYTES.labels(direction="read").inc(len(sealed) + len(data))
        return self._keep(now, payload, lease)

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

        The first write of a key wins: when the store already holds an entry of the key
        that opens, with the same grid, this Put only refreshes its TTL (``PEXPIRE``) and
        keeps no copy of its own bytes (a re-encode differs in the last bits; readers get
        the first write's). A command the store refuses (``OOM``, ``READONLY``,
        ``NOPERM``, ...) keeps the entry as this replica's local copy, which it serves
        (exact tier) while the store has no entry of its own; counted in
        ``splitvl_cache_store_refused_total``.

        Raises:
            KeyGridConflictError: the store holds the key with another grid (INVALID_ARGUMENT).
            EntryTooLargeError: larger than ``capacity_bytes`` (RESOURCE_EXHAUSTED).
            StoreUnavailableError: the store is unreachable or skipped; nothing was kept.
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
        header, fields = self.codec.seal(
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
            written = self._write(self.client(), header, fields, alias)
            self.health.ok()
        except STORE_FAILURES as err:
            if self.health.failed("put", err) != "refused":
                raise StoreUnavailableError(f"the cache store failed: {err}") from err
            if isinstance(err, ReadOnlyError):  # a failed-over primary: reconnect
                _disconnect(self._client)
            with self._copies_lock:
                try:
                    return self._put_local(_unshared(header), data)
                except CacheFullError:
                    return 0
        self.index(header, vec)
        if not written:
            return 0  # the first write's bytes are the store's; read them when asked
        with self._copies_lock:
            try:
                return self._put_local(header, data)
            except CacheFullError:
                return 0  # the store has it; this replica reads it back when asked

    def _write(
        self, client: RedisClient, header: Header, fields: dict[str, bytes], alias: str
    ) -> bool:
        """The store's side of :meth:`put`: True when this write is the key's entry now,
        False when an entry of the key was there first (its TTL refreshed). Raises
        KeyGridConflictError and redis errors.

        One optimistic transaction (redis-py's ``transaction``: ``WATCH`` the entry, read
        its header, then ``MULTI``/``EXEC`` with the hash and the payload string), retried
        when another write of the key lands in between: so the first write wins, no reader
        sees parts of two writes, and the 16 MiB travel once, into a ``SET`` that keeps
        them as they arrive (a Lua script taking them as arguments copied them twice more:
        78 ms against ``HSET``'s 32 ms; ``HSET`` itself copies once more than ``SET``).
        Each queued write is checked against ``maxmemory``, so a full store refuses it
        (``OOM``)."""
        name = self.codec.entry(header.key)
        payload = self.codec.payload_of(name)
        ttl_ms = max(1, round(self.ttl_s * 1000)) if self.ttl_s > 0 else 0

        def attempt(pipe: Any) -> bool:
            sealed = as_bytes(pipe.hget(name, "h")) or b""
            if sealed == fields["h"]:
                return True  # this write, whose reply a dropped connection lost
            if sealed:
                try:
                    old = self.codec.open_header(sealed, header.key)
                except IntegrityError as err:
                    self.refused(err, header.key)  # replaced below
                else:
                    if old.grid != header.grid:
                        raise KeyGridConflictError(old.grid)
                    if not ttl_ms or (pipe.pexpire(name, ttl_ms) and pipe.pexpire(payload, ttl_ms)):
                        return False  # the first write stays; its TTL refreshed
                    # it expired since the read: this write takes its place
            pipe.multi()
            pipe.hset(name, mapping={k: fields[k] for k in ("h", "d", "v")})
            # A memoryview goes out as it is; bytes, hiredis's packer would copy 16 MiB
            # into the command first (~7 ms here).
            pipe.set(payload, memoryview(fields["p"]), px=ttl_ms or None)
            if ttl_ms:
                pipe.pexpire(name, ttl_ms)
            else:
                pipe.persist(name)
            return True

        run: Any = client.transaction  # typed for callables returning None; ours says which
        written = bool(run(attempt, name, value_from_callable=True))
        if alias:
            self.add_alias(client, alias, header.key)
        if written:
            metrics.STORE_BYTES.labels(direction="write").inc(sum(len(v) for v in fields.values()))
            client.xadd(self.codec.log, {"n": name}, maxlen=self.log_maxlen, approximate=True)
        return written

    def add_alias(self, client: RedisClient, alias: str, key: str) -> None:
        """Make ``alias`` find ``key``'s entry (with the entry's TTL): written once
        (``SET NX``; a Put of the key refreshes its TTL). A failure is counted
        (``op="alias"``) and otherwise ignored: the alias only saves a later lookup."""
        if alias == key:
            return
        try:
            name = self.codec.alias(alias)
            ttl = max(1, round(self.ttl_s * 1000)) if self.ttl_s > 0 else None
            record = self.codec.seal_alias(alias, key)
            if client.set(name, record, px=ttl, nx=True):
                self._remember_alias(alias, record, key)
            elif ttl:
                client.pexpire(name, ttl)
        except STORE_FAILURES as err:
            self.health.failed("alias", err)


def _reply(value: object) -> bytes | Exception | None:
    """A pipelined reply read with ``raise_on_error=False``: bytes, None, or the error."""
    return value if isinstance(value, Exception) else as_bytes(value)


def _disconnect(client: RedisClient | None) -> None:
    """Drop a standalone client's pooled connections (after READONLY: a managed Redis's
    endpoint now names another node, which new connections reach)."""
    if isinstance(client, redis.Redis):
        client.connection_pool.disconnect()


def _unshared(header: Header) -> Header:
    """``header`` as the header of a local copy the store refused (write id b"")."""
    return dataclasses.replace(header, write_id=b"", cipher=None)
