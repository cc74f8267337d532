"""Requests of one file waiting for the one that encodes it (the same-file flights)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence


class SameFileFlights:
    """The files (by bytes key) that a request of this gateway is encoding now.

    Without it, requests that send the same bytes while the first of them is still in the
    encoder each decode, preprocess, look up and put the image again (they share only its
    ViT call, in the encoder): at repeat50 with 32 requests in flight, 19 of a run's 84
    misses were such repeats, ~15 ms each of the gateway's core (docs/benchmarks.md). With
    it, such a request waits for the first one's put and is then answered by the file's
    digest, an exact hit, never decoded.

    A request claims every key no other request holds and follows the others; it waits
    only when it claimed none, so no two requests ever wait on each other. (The pipeline
    lets only requests of one image and no video take part, and caps a wait at half the
    time left to the deadline: docs/cache.md.) A claimant
    lands its keys when its put has ended, or when it ends without one (failed,
    cancelled, or its images were hits after all); a follower then looks its files up
    again, and decodes as before if they are still missing (the put failed, or stored the
    entry under its pixel key only).
    """

    def __init__(self) -> None:
        self._flights: dict[str, asyncio.Future[None]] = {}

    def claim_or_follow(
        self, keys: Sequence[str], owned: list[str]
    ) -> dict[int, asyncio.Future[None]]:
        """Claims each of ``keys`` that no request holds (appending it to ``owned``, the
        caller's claims); returns the positions of the others, with the flight each
        follows. A key the caller already holds is neither claimed again nor followed."""
        loop = asyncio.get_running_loop()
        follow: dict[int, asyncio.Future[None]] = {}
        for pos, key in enumerate(keys):
            flight = self._flights.get(key)
            if flight is None:
                self._flights[key] = loop.create_future()
                owned.append(key)
            elif key not in owned:
                follow[pos] = flight
        return follow

    def land(self, keys: Sequence[str]) -> None:
        """Ends the caller's claims on ``keys``: their followers look up again."""
        for key in keys:
            flight = self._flights.pop(key, None)
            if flight is not None and not flight.done():
                flight.set_result(None)

    def __len__(self) -> int:
        return len(self._flights)


class Claims:
    """One request's claims on the files it is encoding (:class:`SameFileFlights`).

    One owner at a time lands them, once: the request (its ``finally``), or the put it
    hands them to (:meth:`hand_over`), which lands them when the entries are stored or the
    put failed, so followers look up only once there is something to find.
    """

    def __init__(self, flights: SameFileFlights) -> None:
        self.flights = flights
        self.keys: list[str] = []

    def claim_or_follow(self, keys: Sequence[str]) -> dict[int, asyncio.Future[None]]:
        """:meth:`SameFileFlights.claim_or_follow`, claiming into this set."""
        return self.flights.claim_or_follow(keys, self.keys)

    def keep(self, keys: set[str]) -> None:
        """Lands the claims not in ``keys`` now (files that were hits after all, or that
        the put will not store under their digest)."""
        self.flights.land([k for k in self.keys if k not in keys])
        self.keys = [k for k in self.keys if k in keys]

    def hand_over(self) -> Claims:
        """Moves every claim to a new set, for the put to land; this one is left empty."""
        taken = Claims(self.flights)
        taken.keys, self.keys = self.keys, []
        return taken

    def land(self) -> None:
        """Ends every claim of this set: their followers look up again."""
        keys, self.keys = self.keys, []
        self.flights.land(keys)

    def __bool__(self) -> bool:
        return bool(self.keys)
