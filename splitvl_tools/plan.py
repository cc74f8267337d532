"""``splitvl plan``: how many encoder, decoder and cache replicas a load needs.

A discrete-event simulation (SimPy) of splitvl's request path, fed with service times
measured on the services themselves::

    splitvl plan --calibrate profile.json               # measure a fresh cluster (~2 min)
    splitvl plan --profile profile.json --rate 6 --p95-ttft-ms 800 --repeat-fraction 0.5
    splitvl plan --validate --rates 0.35,0.65            # predicted vs measured, open loop

The model, stage by stage (what each stage is, in the simulation):

- **arrivals**: Poisson at ``rate`` requests/s, one image each (a side drawn from the
  workload's mix); a fraction ``repeat_fraction`` repeats an earlier image, uniformly
  chosen, as ``splitvl load``'s workload does; a repeat is a cache hit with the probability
  calibrated on that workload (near-copies are similarity hits only above the threshold).
- **gateway preprocessing**: one server per gateway (its work holds Python's GIL), the
  median preprocess time of the image's side and tier (a hit found by file digest skips
  the decode).
- **cache lookup**: one server per cache replica, round robin, its tier's median.
- **encoder** (misses): dynamic batching as the encoder service does it: a batch starts
  with the first queued image, waits ``ENCODER_MAX_WAIT_MS`` for more, takes up to
  ``max_batch`` and lasts ``b0 + sum(b1[side])`` (fitted to the encoder's own
  ``splitvl_encoder_batch_duration_seconds`` at batch 1 and under a burst), plus the
  call's transfer and queueing outside the batch as a fixed delay.
- **decoder**: vLLM's continuous batching as steps: each step serves every running
  sequence one token and the prefills of the newly admitted ones (chunked prefill
  mixes them), lasting ``d0 + d1 x sequences + sum(prefill)``; ``d0, d1`` fitted to the
  inter-token latency at one and at several concurrent streams, ``prefill`` per tier
  (a hit's image is in vLLM's prefix cache when it was served by this decoder before).
  Several decoders: the gateway's image-affinity routing (consistent hashing with
  bounded loads, ``GATEWAY_DECODER_BALANCE_FACTOR`` 1.25) or round robin.
- **client**: the rest of TTFT (the wire, the gateway's own work between stages) as the
  calibration's median per tier.

What it leaves out, on purpose (docs/planner.md): CPU shared between services on one
host (each replica is its own hardware, as across hosts; the calibration on a shared host
bakes the contention of its burst into ``d1``), the cache put (off the critical path),
KV-cache preemption (the planner refuses configurations past ``max_num_seqs``) and the
gateway's admission limit.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import statistics
from collections import deque
from collections.abc import Generator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

TIERS = ("miss", "hit")
#: The bounded-load factor of the gateway's image-affinity routing (1 + epsilon).
BALANCE_FACTOR = 1.25
#: Calibration: requests one at a time per side, and the burst's size and concurrency.
CALIBRATE_REQUESTS = 48
BURST_REQUESTS = 32
BURST_CONCURRENCY = 8


# -- what was measured ----------------------------------------------------------------
#: A service time, ms: one value, or the values calibration observed (each draw of the
#: simulation takes one of them at random: their spread is what makes a p95).
Time = float | list[float]


def draw(rng: random.Random, value: Time) -> float:
    """One service time from ``value`` (itself, or one of the observed values)."""
    return rng.choice(value) if isinstance(value, list) else float(value)


def typical(value: Time) -> float:
    """The median of ``value``'s observations (the value itself if it is one)."""
    return float(statistics.median(value)) if isinstance(value, list) else float(value)


@dataclass
class SideTimes:
    """Service times of one image side, ms; ``*_ms`` dicts are keyed by tier (miss, hit).

    Attributes:
        preprocess_ms: The gateway's preprocess stage.
        lookup_ms: The cache lookup stage.
        encode_image_ms: What one more image of this side adds to an encoder batch (b1).
        prefill_ms: The decoder's prefill step beyond a decode step (a hit: its image's
            tokens from vLLM's prefix cache).
    """

    preprocess_ms: dict[str, Time]
    lookup_ms: dict[str, Time]
    encode_image_ms: float
    prefill_ms: dict[str, Time]


@dataclass
class Profile:
    """Measured service times (ms) of one deployment; :func:`calibrate` makes it.

    Attributes:
        sides: Per image side (pixels), its :class:`SideTimes`.
        encode_batch_ms: Fixed cost of one ViT call (b0).
        encode_delay_ms: The encode stage outside the batch (transfer, queueing).
        encoder_max_batch: Images per ViT call (``ENCODER_MAX_BATCH_IMAGES``).
        encoder_max_wait_ms: How long a batch waits for more images.
        decoder_delay_ms: The decoder's work before vLLM schedules the request (reading
            the embeddings, rendering, tokenizing).
        step_ms: Decode step with no sequence (d0).
        step_per_seq_ms: What each running sequence adds to a step (d1).
        client_delay_ms: Per tier, the client's TTFT beyond the stages.
        hit_of_repeats: Fraction of designed repeats served from the cache.
        relay_ms_per_token: CPU each streamed token costs outside vLLM's engine (the
            decoder's front, the gateway, the client: protobuf, gRPC, detokenizing).
        step_cores: Cores a decoder step keeps busy (vLLM's engine processes use more
            CPU than the wall time of their steps: their CPU time over the steps' time).
        encode_cores: Cores a ViT batch keeps busy, likewise.
        max_num_seqs: vLLM's running-sequence limit.
        conditions: Where and how it was measured (host, date, command).
    """

    sides: dict[int, SideTimes]
    encode_batch_ms: float
    encode_delay_ms: Time
    encoder_max_batch: int
    encoder_max_wait_ms: float
    decoder_delay_ms: float
    step_ms: float
    step_per_seq_ms: float
    client_delay_ms: dict[str, Time]
    hit_of_repeats: float = 1.0
    relay_ms_per_token: float = 0.0
    step_cores: float = 1.0
    encode_cores: float = 1.0
    max_num_seqs: int = 128
    conditions: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        """A profile from :meth:`to_json`'s text.

        Raises:
            ValueError: not JSON, or a field missing, unknown or out of its range (named).
        """
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("sides"), dict):
            raise ValueError("'sides' must be an object: side (pixels) -> its times")
        try:
            data["sides"] = {int(k): SideTimes(**v) for k, v in data["sides"].items()}
            profile = cls(**data)
        except (TypeError, AttributeError) as err:
            raise ValueError(str(err)) from None
        profile.check()
        return profile

    def check(self) -> None:
        """Refuse what the simulation cannot run: every time finite and >= 0 (a list of
        observed ones not empty), both tiers given, counts >= 1, fractions in [0, 1].

        Raises:
            ValueError: naming the field.
        """
        if not self.sides:
            raise ValueError("sides: no image side calibrated")
        for side, t in self.sides.items():
            if side <= 0:
                raise ValueError(f"sides: {side} is not a side in pixels")
            for name in ("preprocess_ms", "lookup_ms", "prefill_ms"):
                _check_tiers(getattr(t, name), f"sides.{side}.{name}")
            _check_time(t.encode_image_ms, f"sides.{side}.encode_image_ms")
        _check_tiers(self.client_delay_ms, "client_delay_ms")
        for name in ("encode_batch_ms", "encode_delay_ms", "encoder_max_wait_ms"):
            _check_time(getattr(self, name), name)
        for name in ("decoder_delay_ms", "step_ms", "step_per_seq_ms", "relay_ms_per_token"):
            _check_time(getattr(self, name), name)
        for name in ("encoder_max_batch", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} is {value!r}; expected an integer >= 1")
        for name in ("step_cores", "encode_cores"):
            value = getattr(self, name)
            if not _finite(value) or value < 1:
                raise ValueError(f"{name} is {value!r}; expected a number >= 1 (cores)")
        if not _finite(self.hit_of_repeats) or not 0 <= self.hit_of_repeats <= 1:
            raise ValueError(f"hit_of_repeats is {self.hit_of_repeats!r}; expected 0..1")


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_time(value: Any, name: str) -> None:
    """A :data:`Time`: a finite number >= 0, or a non-empty list of them (ms)."""
    values = value if isinstance(value, list) else [value]
    if not values or not all(_finite(v) and v >= 0 for v in values):
        raise ValueError(f"{name}: expected a time in ms >= 0 or a non-empty list of them")


def _check_tiers(value: Any, name: str) -> None:
    if not isinstance(value, dict) or set(value) != set(TIERS):
        raise ValueError(f"{name}: expected an object with the tiers {', '.join(TIERS)}")
    for tier in TIERS:
        _check_time(value[tier], f"{name}.{tier}")


@dataclass
class Workload:
    """What the deployment is asked to serve.

    Attributes:
        rate: Poisson arrivals, requests/s.
        sides: Image side (pixels) -> weight; each side must be in the profile.
        repeat_fraction: Fraction of images that repeat an earlier one.
        max_tokens: Output tokens of each request (``ignore_eos``).
    """

    rate: float
    sides: dict[int, float]
    repeat_fraction: float = 0.5
    max_tokens: int = 32


@dataclass(frozen=True)
class Replicas:
    """Instances per service (one gateway), and where they run.

    Attributes:
        routing: The decoders' routing: ``affinity`` or ``round_robin``.
        host_cores: 0: every replica on its own hardware (the planner's question);
            N: every service on one host of N cores, sharing them (:class:`_Host`), as
            ``splitvl up`` runs them (the validation on this host).
    """

    encoder: int = 1
    decoder: int = 1
    cache: int = 1
    routing: str = "affinity"  # or "round_robin"
    host_cores: int = 0

    def total(self) -> int:
        return self.encoder + self.decoder + self.cache


# -- the simulation ---------------------------------------------------------------------
@dataclass
class _Seq:
    prefill_ms: float
    tokens: int
    first: Any
    done: Any
    left: int = 0


class _Host:
    """The CPU that services on one host share: processor sharing over ``cores``. Each job
    (a preprocess, a lookup, a ViT batch, a decoder step, the relay of a step's tokens)
    keeps ``weight`` cores busy at full speed; while the jobs' weights sum past ``cores``,
    every job runs at ``cores / sum`` of its speed. ``cores`` 0: each job at full speed
    (own hardware). Times are ms of work at full speed."""

    def __init__(self, env: Any, cores: int) -> None:
        self.env, self.cores = env, cores
        self.jobs: dict[Any, float] = {}
        self.weights: dict[Any, float] = {}
        self.last = 0.0
        self.version = 0

    def work(self, ms: float, weight: float = 1.0) -> Any:
        """An event that fires once ``ms`` of work got done."""
        if not self.cores or ms <= 0:
            return self.env.timeout(max(ms, 0.0))
        self._advance()
        done = self.env.event()
        self.jobs[done] = ms
        self.weights[done] = weight
        self._schedule()
        return done

    def _rate(self) -> float:
        return min(1.0, self.cores / sum(self.weights.values())) if self.jobs else 1.0

    def _advance(self) -> None:
        now = self.env.now
        if self.jobs and now > self.last:
            done = (now - self.last) * self._rate()
            for job in self.jobs:
                self.jobs[job] -= done
        self.last = now

    def _schedule(self) -> None:
        self.version += 1
        if not self.jobs:
            return
        version = self.version
        tick = self.env.timeout(max(0.0, min(self.jobs.values())) / self._rate())
        tick.callbacks.append(lambda _event: self._tick(version))

    def _tick(self, version: int) -> None:
        if version != self.version:
            return  # a job came or went since: a later tick is scheduled
        self._advance()
        for job, left in list(self.jobs.items()):
            if left <= 1e-9:
                del self.jobs[job], self.weights[job]
                job.succeed()
        self._schedule()


class _Decoder:
    """One vLLM engine as steps (module docstring)."""

    def __init__(self, env: Any, profile: Profile, host: _Host) -> None:
        self.env, self.p, self.host = env, profile, host
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.inflight = 0  # the gateway's count: routed and not finished
        self.held: set[int] = set()  # images in its prefix cache
        self.busy_ms = 0.0
        self._wake = env.event()
        env.process(self._run())

    def submit(self, seq: _Seq) -> None:
        self.waiting.append(seq)
        if not self._wake.triggered:
            self._wake.succeed()

    def _run(self) -> Generator[Any, Any, None]:
        while True:
            if not self.waiting and not self.running:
                self._wake = self.env.event()
                yield self._wake
            new: list[_Seq] = []
            while self.waiting and len(self.running) + len(new) < self.p.max_num_seqs:
                new.append(self.waiting.popleft())
            n = len(self.running) + len(new)
            step = self.p.step_ms + self.p.step_per_seq_ms * n + sum(s.prefill_ms for s in new)
            start = self.env.now
            yield self.host.work(step, self.p.step_cores)
            self.busy_ms += self.env.now - start
            still, ready = [], []
            for s in self.running:
                s.left -= 1
                if s.left <= 0:
                    ready.append(s.done)
                else:
                    still.append(s)
            for s in new:
                ready.append(s.first)
                s.left = s.tokens - 1
                if s.left <= 0:
                    ready.append(s.done)
                else:
                    still.append(s)
            self.running = still
            # The step's tokens reach their clients once relayed (off the engine's path).
            self.env.process(self._relay(n, ready))

    def _relay(self, tokens: int, ready: list[Any]) -> Generator[Any, Any, None]:
        if self.p.relay_ms_per_token > 0:
            yield self.host.work(self.p.relay_ms_per_token * tokens)
        for event in ready:
            event.succeed()


class _Encoder:
    """One encoder replica: dynamic batching (module docstring)."""

    def __init__(self, env: Any, profile: Profile, store: Any, host: _Host) -> None:
        self.env, self.p, self.queue, self.host = env, profile, store, host
        self.busy_ms = 0.0
        env.process(self._run())

    def _run(self) -> Generator[Any, Any, None]:
        while True:
            batch: list[tuple[int, Any]] = [(yield self.queue.get())]
            if self.p.encoder_max_wait_ms > 0:
                yield self.env.timeout(self.p.encoder_max_wait_ms)
            while self.queue.items and len(batch) < self.p.encoder_max_batch:
                batch.append((yield self.queue.get()))
            t = self.p.encode_batch_ms + sum(
                self.p.sides[side].encode_image_ms for side, _ in batch
            )
            start = self.env.now
            yield self.host.work(t, self.p.encode_cores)
            self.busy_ms += self.env.now - start
            for _, done in batch:
                done.succeed()


@dataclass(frozen=True)
class Arrival:
    """One arrival of a given sequence (:func:`simulate`'s ``trace``).

    Attributes:
        after_ms: Time since the previous arrival (the first: since the start), ms.
        side: Its image's side, pixels.
        kind: ``unique``, or a designed repeat (``exact``, ``near``: a cache hit with the
            profile's ``hit_of_repeats``).
        image: The identity of its image (a repeat's is the original's).
    """

    after_ms: float
    side: int
    kind: str
    image: int


@dataclass
class Prediction:
    """What :func:`simulate` predicts (ms, requests/s, fractions)."""

    ttft_p50_ms: float
    ttft_p95_ms: float
    ttft_mean_ms: float
    e2e_p50_ms: float
    req_per_s: float
    utilisation: dict[str, float]
    hit_rate: float
    prefix_hit_rate: float
    requests: int
    ttft_p50_ms_by_tier: dict[str, float] = field(default_factory=dict)
    #: The rate the simulated requests actually arrived at (requests/s over the counted
    #: ones): Poisson draws of a seed run a few percent off the nominal rate either way.
    offered_per_s: float = 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile of ``values`` (non-empty)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def _route(decoders: list[_Decoder], image: int, i: int, routing: str) -> _Decoder:
    """The gateway's choice: round robin, or the consistent-hash home of ``image`` unless
    it holds more than ``BALANCE_FACTOR`` x the mean in-flight count, then the next."""
    if routing == "round_robin" or len(decoders) == 1:
        return decoders[i % len(decoders)]
    bound = math.ceil(BALANCE_FACTOR * (sum(d.inflight for d in decoders) + 1) / len(decoders))
    start = int(hashlib.blake2b(str(image).encode(), digest_size=4).hexdigest(), 16)
    for k in range(len(decoders)):
        d = decoders[(start + k) % len(decoders)]
        if d.inflight + 1 <= bound:
            return d
    return min(decoders, key=lambda d: d.inflight)


def simulate(
    profile: Profile,
    workload: Workload,
    replicas: Replicas = Replicas(),
    *,
    requests: int = 2000,
    seed: int = 0,
    warmup: int = 50,
    trace: Sequence[Arrival] | None = None,
) -> Prediction:
    """Simulate ``requests`` arrivals of ``workload`` on ``replicas``.

    Args:
        profile: Measured service times.
        trace: The arrivals themselves instead of drawn ones (a real run's, to compare
            with it: ``requests``, ``warmup`` and the workload's rate and repeats are then
            not used).
        workload: Rate, image sides, repeats, output length.
        replicas: Instances per service, and the decoders' routing.
        requests: Arrivals simulated (the first ``warmup`` are not counted).
        seed: Seed of the arrivals, sides and repeats.

    Returns:
        TTFT (arrival -> first token, plus the client delay) percentiles, end-to-end p50,
        req/s (counted requests over first arrival -> last completion), each service's
        utilisation (busy time over the run, per replica), the cache hit rate and the
        decoders' prefix-cache hit rate of hits.

    Raises:
        ValueError: a workload side the profile has no times for.
    """
    import simpy

    missing = set(workload.sides) - set(profile.sides)
    if missing:
        raise ValueError(f"no calibrated times for image sides {sorted(missing)}")
    rng = random.Random(seed)  # arrivals, sides, repeats
    service = random.Random(seed + 1)  # service times drawn from the observed ones
    env = simpy.Environment()
    gateway = simpy.Resource(env, capacity=1)
    caches = [simpy.Resource(env, capacity=1) for _ in range(replicas.cache)]
    host = _Host(env, replicas.host_cores)
    encoders = [_Encoder(env, profile, simpy.Store(env), host) for _ in range(replicas.encoder)]
    decoders = [_Decoder(env, profile, host) for _ in range(replicas.decoder)]
    busy = {"gateway": 0.0, "cache": 0.0}
    ttft: list[float] = []
    e2e: list[float] = []
    ends: list[float] = []
    starts: list[float] = []
    tiers: list[str] = []
    prefix: list[bool] = []
    sides, weights = list(workload.sides), list(workload.sides.values())

    def one(i: int, side: int, tier: str, image: int) -> Generator[Any, Any, None]:
        t0 = env.now
        times = profile.sides[side]
        with gateway.request() as slot:
            yield slot
            start = env.now
            yield host.work(draw(service, times.preprocess_ms[tier]))
            busy["gateway"] += env.now - start
        with caches[i % len(caches)].request() as slot:
            yield slot
            start = env.now
            yield host.work(draw(service, times.lookup_ms[tier]))
            busy["cache"] += env.now - start
        if tier == "miss":
            yield env.timeout(draw(service, profile.encode_delay_ms))
            done = env.event()
            yield encoders[i % len(encoders)].queue.put((side, done))
            yield done
        decoder = _route(decoders, image, i, replicas.routing)
        decoder.inflight += 1
        yield env.timeout(profile.decoder_delay_ms)
        cached = tier == "hit" and image in decoder.held
        decoder.held.add(image)
        seq = _Seq(
            draw(service, times.prefill_ms["hit" if cached else "miss"]),
            workload.max_tokens,
            env.event(),
            env.event(),
        )
        decoder.submit(seq)
        yield seq.first
        client = draw(service, profile.client_delay_ms[tier])
        first = env.now + client
        yield seq.done
        decoder.inflight -= 1
        if i >= warmup:
            starts.append(t0)
            ttft.append(first - t0)
            e2e.append(env.now + client - t0)
            ends.append(env.now)
            tiers.append(tier)
            if tier == "hit":
                prefix.append(cached)

    def replay(arrivals: Sequence[Arrival]) -> Generator[Any, Any, None]:
        for i, a in enumerate(arrivals):
            yield env.timeout(a.after_ms)
            repeat = a.kind != "unique" and rng.random() < profile.hit_of_repeats
            env.process(one(i, a.side, "hit" if repeat else "miss", a.image))

    def arrivals() -> Generator[Any, Any, None]:
        seen: list[int] = []
        for i in range(requests):
            side = rng.choices(sides, weights)[0]
            if seen and rng.random() < workload.repeat_fraction:
                image = rng.choice(seen)
                tier = "hit" if rng.random() < profile.hit_of_repeats else "miss"
            else:
                image, tier = i, "miss"
                seen.append(i)
            env.process(one(i, side, tier, image))
            yield env.timeout(rng.expovariate(workload.rate) * 1000)

    if trace is not None:
        warmup = 0
        env.process(replay(trace))
    else:
        env.process(arrivals())
    env.run()
    span_ms = max(ends) - min(starts) if ends else 0.0
    arrived_ms = max(starts) - min(starts) if len(starts) > 1 else 0.0
    total_ms = env.now or 1.0
    util = {
        "gateway": busy["gateway"] / total_ms,
        "cache": busy["cache"] / total_ms / len(caches),
        "encoder": sum(e.busy_ms for e in encoders) / total_ms / len(encoders),
        "decoder": sum(d.busy_ms for d in decoders) / total_ms / len(decoders),
    }
    return Prediction(
        ttft_p50_ms=round(percentile(ttft, 50), 1),
        ttft_p95_ms=round(percentile(ttft, 95), 1),
        ttft_mean_ms=round(statistics.fmean(ttft), 2),
        e2e_p50_ms=round(percentile(e2e, 50), 1),
        req_per_s=round(len(ends) / span_ms * 1000, 3) if span_ms else 0.0,
        offered_per_s=round((len(starts) - 1) / arrived_ms * 1000, 3) if arrived_ms else 0.0,
        utilisation={k: round(v, 3) for k, v in util.items()},
        hit_rate=round(tiers.count("hit") / len(tiers), 3),
        prefix_hit_rate=round(sum(prefix) / len(prefix), 3) if prefix else 0.0,
        requests=len(ttft),
        ttft_p50_ms_by_tier={
            t: round(percentile([x for x, k in zip(ttft, tiers, strict=True) if k == t], 50), 1)
            for t in TIERS
            if t in tiers
        },
    )


# -- the answer -----------------------------------------------------------------------
@dataclass
class Candidate:
    """One configuration the planner tried and its prediction."""

    replicas: Replicas
    prediction: Prediction
    meets: bool


def plan(
    profile: Profile,
    workload: Workload,
    *,
    p95_ttft_ms: float,
    max_replicas: int = 4,
    requests: int = 2000,
    seed: int = 0,
    host_cores: int = 0,
) -> list[Candidate]:
    """Every configuration up to ``max_replicas`` per service (caches up to 2), cheapest
    first (fewest instances, then lowest p95): ``meets`` when the predicted p95 TTFT is
    within ``p95_ttft_ms`` and the predicted req/s within 3% of the rate the simulated
    requests arrived at (a queue that grows without bound falls behind the arrivals; the
    nominal rate would refuse every candidate of a seed whose draws came slower).
    Utilisation is not a criterion: a batching server (the encoder, vLLM) is busy most of
    the time well before its capacity is used. The first that meets the target is the
    answer (:func:`answer`).
    ``host_cores``: every replica on one host of that many cores (0: each on its own).
    """
    out = []
    for encoders in range(1, max_replicas + 1):
        for decoders in range(1, max_replicas + 1):
            for caches in (1, 2):
                r = Replicas(encoders, decoders, caches, host_cores=host_cores)
                p = simulate(profile, workload, r, requests=requests, seed=seed)
                offered = p.offered_per_s or workload.rate
                meets = p.ttft_p95_ms <= p95_ttft_ms and p.req_per_s >= 0.97 * offered
                out.append(Candidate(r, p, meets))
    out.sort(key=lambda c: (c.replicas.total(), c.prediction.ttft_p95_ms))
    return out


def answer(candidates: Sequence[Candidate]) -> Candidate | None:
    """The cheapest configuration that meets the target, or None."""
    return next((c for c in candidates if c.meets), None)


def print_plan(candidates: Sequence[Candidate], target: float, out: Any, top: int = 8) -> None:
    """The answer and the cheapest candidates as a Markdown table."""
    best = answer(candidates)
    if best is None:
        print(f"no configuration up to the limit meets p95 TTFT <= {target:g} ms", file=out)
    else:
        r = best.replicas
        print(
            f"answer: {r.encoder} encoder, {r.decoder} decoder, {r.cache} cache "
            f"(p95 TTFT {best.prediction.ttft_p95_ms:g} ms <= {target:g} ms)",
            file=out,
        )
    print(
        "\n| encoders | decoders | caches | TTFT p50 ms | TTFT p95 ms | req/s "
        "| util gateway | util cache | util encoder | util decoder | meets |",
        file=out,
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|", file=out)
    shown = [c for c in candidates[:top]] + (
        [best] if best and best not in candidates[:top] else []
    )
    for c in shown:
        p, r, u = c.prediction, c.replicas, c.prediction.utilisation
        print(
            f"| {r.encoder} | {r.decoder} | {r.cache} | {p.ttft_p50_ms:g} | {p.ttft_p95_ms:g} "
            f"| {p.req_per_s:g} | {u['gateway']:.2f} | {u['cache']:.2f} | {u['encoder']:.2f} "
            f"| {u['decoder']:.2f} | {'yes' if c.meets else 'no'} |",
            file=out,
        )
