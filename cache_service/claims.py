"""Each new image encoded once across the fleet: claims on missed keys.

The first caller (a gateway) whose Lookup misses a key with ``LookupRequest.claim`` takes
the key's claim and encodes the image; a caller that misses it while the claim lives gets
``CLAIM_STATE_ELSEWHERE`` and asks again with ``wait_claimed_ms``: the cache then waits
for the claimant's Put (polling the store for the entry every ``POLL_S``) instead of the
caller encoding the image a second time. A Put of the key ends its claim. A claimant that
dies, or whose encode fails, leaves a claim that expires after ``CACHE_CLAIM_TTL_S``; a
waiter then claims the key itself and encodes it.

Where claims live: in the shared store (``SET <prefix>c:<name> 1 NX PX ttl``, under the
same HMAC'd names as the entries), so every gateway, encoder and cache replica of the
fleet sees one claim per key (NVIDIA Dynamo has this "cold-key convergence" only as a
design draft, DEP #10563); with the in-process store, in this cache process, which every
gateway in front of it asks. A store that cannot be reached grants every claim: each
caller encodes, as without claims (the store is an optimisation).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from cache_service.store_codec import StoreCodec
from cache_service.store_conn import STORE_FAILURES, RedisClient, StoreHealth

# How often a waiting Lookup looks for the claimant's entry, seconds.
POLL_S = 0.02


class Claims(Protocol):
    """Claims on keys being encoded (module docstring)."""

    def claim(self, key: str) -> bool:
        """Take ``key``'s claim; True when this caller holds it now (it encodes)."""
        ...

    def held(self, key: str) -> bool:
        """Whether some caller's claim on ``key`` lives."""
        ...

    def end(self, keys: Iterable[str]) -> None:
        """End the claims on ``keys`` (their entries were put, or dropped)."""
        ...


class ClaimingStore(Protocol):
    """What claims use of a replica's store (:class:`cache_service.store_redis.RedisStore`)."""

    codec: StoreCodec
    health: StoreHealth

    def client(self) -> RedisClient: ...


class MemoryClaims:
    """Claims within one cache process (the in-process store).

    Args:
        ttl_s: Seconds a claim lives unless a Put ends it.
        clock: Monotonic clock, seconds.
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def claim(self, key: str) -> bool:
        with self._lock:
            now = self.clock()
            if self._until.get(key, 0.0) > now:
                return False
            if len(self._until) > 4096:  # drop the expired ones now and then
                self._until = {k: t for k, t in self._until.items() if t > now}
            self._until[key] = now + self.ttl_s
            return True

    def held(self, key: str) -> bool:
        with self._lock:
            return self._until.get(key, 0.0) > self.clock()

    def end(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                self._until.pop(key, None)


class RedisClaims:
    """Claims in the shared store, fleet-wide (module docstring).

    Args:
        store: The replica's Redis store (client, names, health).
        ttl_s: Seconds a claim lives unless a Put ends it (Redis ``PX``).
    """

    def __init__(self, store: ClaimingStore, ttl_s: float) -> None:
        self.store = store
        self.ttl_ms = max(1, round(ttl_s * 1000))

    def claim(self, key: str) -> bool:
        if not self.store.health.allow("claim"):
            return True
        try:
            taken = self.store.client().set(
                self.store.codec.claim(key), b"1", nx=True, px=self.ttl_ms
            )
        except STORE_FAILURES as err:
            self.store.health.failed("claim", err)
            return True
        return bool(taken)

    def held(self, key: str) -> bool:
        if not self.store.health.allow("claim"):
            return False  # the store is skipped: its claims are as good as gone
        try:
            return bool(self.store.client().exists(self.store.codec.claim(key)))
        except STORE_FAILURES as err:
            self.store.health.failed("claim", err)
            return False

    def end(self, keys: Iterable[str]) -> None:
        names = [self.store.codec.claim(k) for k in keys]
        if not names:
            return
        try:
            client = self.store.client()
            pipe = client.pipeline(transaction=False)  # one slot per key on a Cluster
            for name in names:
                pipe.delete(name)
            pipe.execute()
        except STORE_FAILURES as err:
            self.store.health.failed("claim", err)  # they expire by themselves
