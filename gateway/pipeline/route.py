"""Routing of decoder calls: image affinity by consistent hashing with bounded loads.

vLLM's prefix cache is per decoder replica: a repeated image (its ``multi_modal_uuids``)
reuses KV blocks only on the replica that already prefilled it. Round robin over N
decoders divides that hit rate by N; hashing the image's identity to one replica keeps it,
and a bound on each replica's load keeps a hot image from piling onto one replica.

The rule is consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam,
"Consistent Hashing with Bounded Loads", SODA 2018): each endpoint owns ``VNODES`` points
on a 64-bit ring; a key K goes to the first endpoint clockwise from ``hash(K)`` whose load
(this gateway's in-flight decoder calls) is below the capacity
``ceil((1 + epsilon) * (m + 1) / n)``, with ``m`` the calls in flight and ``n`` the
endpoints in service; else to the next on the ring. So no endpoint carries more than
about ``(1 + epsilon)`` times the mean, and an endpoint joining or leaving moves only its
own share of keys. A request without images or videos goes to the least loaded endpoint.

An endpoint that failed a call before its first token (UNAVAILABLE: killed, unreachable)
is passed over for :data:`DOWN_S` seconds, so no request is sent twice to a dead one; the
request is replayed on the next endpoint of its ring order (``gateway.pipeline.decode``).

The key also travels to the decoder as the ``x-splitvl-affinity`` header, so a proxy or a
mesh (HAProxy ``balance hdr(x-splitvl-affinity)`` with ``hash-balance-factor``, Istio
``consistentHash``) can route instead: ``GATEWAY_DECODER_ROUTING=proxy`` dials one
address and leaves the choice to it (deploy/haproxy, deploy/istio).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

#: Metadata key carrying a request's affinity key to the decoder (and any proxy before it).
AFFINITY_HEADER = "x-splitvl-affinity"
#: Points per endpoint on the ring: with 160, each of 2-16 endpoints owns its share of keys
#: within a few percent (the figure ketama and Envoy's ring hash default to, 100-160).
VNODES = 160
#: How long an endpoint that failed a call before its first token is passed over, seconds.
DOWN_S = 5.0


def ring_hash(text: str) -> int:
    """A 64-bit point on the ring (BLAKE2b, stable across processes and hosts)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass(eq=False)
class Endpoint:
    """One decoder replica as this gateway sees it.

    Attributes:
        address: ``host:port`` (or the whole target, for one proxy).
        stub: Its ``DecoderServiceStub`` on a channel of its own.
        inflight: This gateway's decoder calls to it now.
        down_until: ``time.monotonic()`` until which it is passed over (0: in service).
    """

    address: str
    stub: Any
    channel: Any = None
    inflight: int = 0
    down_until: float = 0.0
    retired: bool = False

    def up(self, now: float) -> bool:
        return not self.retired and self.down_until <= now


@dataclass
class DecoderRouter:
    """Picks the decoder endpoint for each request (see the module docstring).

    Args:
        epsilon: The bounded load's slack: an endpoint takes a key's request while its
            in-flight count is below ``ceil((1 + epsilon) * (m + 1) / n)``;
            ``GATEWAY_AFFINITY_EPSILON``, default 0.25 (HAProxy's ``hash-balance-factor
            125``).
    """

    epsilon: float = 0.25
    endpoints: list[Endpoint] = field(default_factory=list)
    _ring: list[tuple[int, Endpoint]] = field(default_factory=list)
    _points: list[int] = field(default_factory=list)
    _turn: Iterator[int] = field(default_factory=itertools.count)

    @classmethod
    def single(cls, stub: Any, address: str = "decoder") -> DecoderRouter:
        """A router over one stub (one address, or one proxy in front of many)."""
        router = cls()
        router.set_endpoints([Endpoint(address, stub)])
        return router

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        """Replace the endpoints in service; returns those that left (their calls in
        flight finish; their channels are the caller's to close once idle)."""
        kept = {e.address for e in endpoints}
        gone = [e for e in self.endpoints if e.address not in kept]
        for e in gone:
            e.retired = True
        self.endpoints = list(endpoints)
        ring = [(ring_hash(f"{e.address}#{i}"), e) for e in self.endpoints for i in range(VNODES)]
        ring.sort(key=lambda point: point[0])
        self._ring = ring
        self._points = [p for p, _ in ring]
        return gone

    def _ring_order(self, key: str) -> list[Endpoint]:
        """Every endpoint once, clockwise from ``hash(key)``."""
        start = bisect.bisect(self._points, ring_hash(key))
        order: list[Endpoint] = []
        for i in range(len(self._ring)):
            endpoint = self._ring[(start + i) % len(self._ring)][1]
            if endpoint not in order:
                order.append(endpoint)
                if len(order) == len(self.endpoints):
                    break
        return order

    def capacity(self) -> int:
        """The bounded load: calls one endpoint may carry when one more arrives."""
        now = time.monotonic()
        n = sum(1 for e in self.endpoints if e.up(now)) or 1
        m = sum(e.inflight for e in self.endpoints)
        return math.ceil((1 + self.epsilon) * (m + 1) / n)

    def candidates(self, key: str | None) -> tuple[list[Endpoint], str]:
        """The endpoints to try for a request, in order, and how the first was chosen
        (``home``: the key's own endpoint; ``spilled``: a later one on the ring, the home
        one being over capacity or down; ``least_loaded``: no key).

        Endpoints that are down come last (tried only when every other one failed).
        """
        now = time.monotonic()
        if not self.endpoints:
            return [], "none"
        if key is None:
            turn = next(self._turn)
            n = len(self.endpoints)
            rotated = [self.endpoints[(turn + i) % n] for i in range(n)]
            order = sorted(rotated, key=lambda e: e.inflight)  # stable: ties rotate
            how = "least_loaded"
        else:
            ring = self._ring_order(key)
            cap = self.capacity()
            fits = [e for e in ring if e.up(now) and e.inflight < cap]
            order = fits + [e for e in ring if e not in fits]
            how = "home" if order[0] is ring[0] else "spilled"
        up = [e for e in order if e.up(now)]
        return up + [e for e in order if not e.up(now)], how

    @contextmanager
    def track(self, endpoint: Endpoint) -> Iterator[None]:
        """Count a call to ``endpoint`` in flight while the block runs."""
        endpoint.inflight += 1
        try:
            yield
        finally:
            endpoint.inflight -= 1

    @staticmethod
    def mark_down(endpoint: Endpoint) -> None:
        """Pass ``endpoint`` over for :data:`DOWN_S` seconds (it failed before a token)."""
        endpoint.down_until = time.monotonic() + DOWN_S
