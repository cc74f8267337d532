"""Scheduling priority: who may ask for what, short-first, and aging.

vLLM's priority scheduler (``--scheduling-policy priority``, the decoder's default) runs
its waiting requests in order of ``(priority, arrival)``, lower first, and has no aging: a
steady stream of better-priority requests would hold a worse one back forever. The
gateway therefore sends the decoder an *aged* priority::

    priority = class * ticks(GATEWAY_PRIORITY_AGING_S) + ticks(arrival since EPOCH)

with ticks of :data:`TICK_S`. Two requests compare by class only when they arrive close
together: a request of class ``c`` is overtaken by one of class ``c - d`` only if that one
arrives less than ``d * GATEWAY_PRIORITY_AGING_S`` seconds after it. So every request's
wait is bounded by the requests that arrived before it plus those of better classes in
that window: no starvation, with a bound an operator can read off the setting. Within a
class the order is first come, first served. The arrival is the gateway's wall clock, so
several gateways' requests interleave by their arrival too (to within their clocks' skew).

Classes:

* a client's own (``GenerateRequest.priority``, the OpenAI extension field ``priority``):
  lower = sooner, as ``vllm serve`` takes it; raised to the caller's floor
  (``GATEWAY_PRIORITY_FLOOR``, default 0, so by default no one jumps the queue; a bearer
  token in ``GATEWAY_PRIORITY_GRANTS`` may go down to its own floor);
* none given: 0 under ``fcfs``; under ``short-first`` the request's expected cost in
  log2 buckets (:func:`short_first_class`), so short requests go first, as deployment
  guides ask of a load balancer ("prioritise short queries").
"""

from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import dataclass

from vlcommon.errors import ConfigError

#: The aged priority's time origin: 2026-01-01T00:00:00Z, seconds since the Unix epoch.
EPOCH_S = 1_767_225_600
#: Resolution of the arrival term, seconds.
TICK_S = 0.01
#: What a prefill token costs against a decode token under short-first: vLLM computes a
#: prompt in steps of up to max_num_batched_tokens, a new token takes a step of its own;
#: 1/8 keeps a 300-token image from outweighing a few dozen output tokens.
PREFILL_WEIGHT = 1 / 8
#: ``max_tokens`` assumed when a request leaves it to the decoder (its default, 256).
DEFAULT_MAX_TOKENS = 256
#: Short-first's classes: log2 of the expected cost, within [0, MAX_CLASS].
MAX_CLASS = 24


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def parse_grants(text: str) -> tuple[tuple[bytes, int], ...]:
    """``GATEWAY_PRIORITY_GRANTS``: ``TOKEN=FLOOR,...`` as (SHA-256 of the token, floor).

    Raises:
        ValueError: an entry without ``=`` or whose floor is not an integer (the token
            is not repeated in the message).
    """
    grants = []
    for i, item in enumerate(t.strip() for t in text.split(",")):
        if not item:
            continue
        token, sep, floor = item.rpartition("=")
        if not sep or not token.strip():
            raise ValueError(f"GATEWAY_PRIORITY_GRANTS entry {i}: not TOKEN=FLOOR")
        try:
            value = int(floor)
        except ValueError:
            raise ValueError(
                f"GATEWAY_PRIORITY_GRANTS entry {i}: the floor {floor.strip()!r} is not an integer"
            ) from None
        grants.append((_digest(token.strip()), value))
    return tuple(grants)


def short_first_class(max_tokens: int, prompt_tokens: int) -> int:
    """The class short-first gives a request: ``floor(log2(expected cost))`` with cost =
    ``max_tokens`` (the decoder's default when 0) + ``prompt_tokens`` x
    :data:`PREFILL_WEIGHT`, within [0, :data:`MAX_CLASS`]. 16 new tokens after a
    300-token prompt: class 5; 512 after the same: class 9."""
    cost = (max_tokens or DEFAULT_MAX_TOKENS) + prompt_tokens * PREFILL_WEIGHT
    return min(MAX_CLASS, max(0, math.floor(math.log2(max(1.0, cost)))))


@dataclass(frozen=True)
class PriorityRules:
    """The gateway's priority settings (module docstring).

    Args:
        policy: ``fcfs`` or ``short-first`` (``GATEWAY_PRIORITY_POLICY``).
        floor: The lowest class a caller without a grant may ask.
        grants: (SHA-256 of a bearer token, its floor), from :func:`parse_grants`.
        aging_s: Seconds of waiting one class is worth.
    """

    policy: str = "fcfs"
    floor: int = 0
    grants: tuple[tuple[bytes, int], ...] = ()
    aging_s: float = 2.0

    @classmethod
    def from_settings(cls, settings: object) -> PriorityRules:
        """From ``GatewaySettings`` (``priority_*``).

        Raises:
            ConfigError: ``GATEWAY_PRIORITY_GRANTS`` does not parse (the gateway does not
                start).
        """
        grants = getattr(settings, "priority_grants", None)
        try:
            parsed = parse_grants(grants.get_secret_value() if grants is not None else "")
        except ValueError as err:
            raise ConfigError(str(err)) from None
        return cls(
            policy=getattr(settings, "priority_policy", "fcfs"),
            floor=getattr(settings, "priority_floor", 0),
            grants=parsed,
            aging_s=getattr(settings, "priority_aging_s", 2.0),
        )

    def floor_for(self, bearer: str | None) -> int:
        """The lowest class ``bearer`` may ask: its grant's floor, else :attr:`floor`.
        Every grant is compared (constant time, no early exit)."""
        floor = self.floor
        if bearer is None:
            return floor
        digest = _digest(bearer)
        for candidate, granted in self.grants:
            if hmac.compare_digest(digest, candidate):
                floor = min(floor, granted)
        return floor

    def asked(self, priority: int, bearer: str | None) -> tuple[int, bool]:
        """A client's class, raised to its floor; and whether it was raised."""
        floor = self.floor_for(bearer)
        return (floor, True) if priority < floor else (priority, False)

    def default_class(self, max_tokens: int, prompt_tokens: int) -> int:
        """The class of a request that named none."""
        if self.policy == "short-first":
            return short_first_class(max_tokens, prompt_tokens)
        return 0

    def aged(self, klass: int, arrival_s: float) -> int:
        """The priority the decoder gets: ``klass`` weighted by :attr:`aging_s`, plus the
        arrival (wall-clock seconds) in ticks since :data:`EPOCH_S`."""
        per_class = round(self.aging_s / TICK_S)
        return klass * per_class + math.floor((arrival_s - EPOCH_S) / TICK_S)
