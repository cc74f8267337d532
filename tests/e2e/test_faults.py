"""Fault injection under load: kill -9 the encoder, then the cache, and restart them.

Its own four services (not the session cluster: services die here). 24 concurrent
Generate calls loop the whole time, each with a deadline; half of them with the cache
off, so the encoder is always busy. The test asserts:

- every call ends with a result or a clear status (OK, UNAVAILABLE, DEADLINE_EXCEEDED;
  never INTERNAL/UNKNOWN) and none hangs past its deadline;
- encoder down: a request that needs the ViT gets UNAVAILABLE naming the encoder, while
  an image already in the cache is still answered;
- cache down: every request is served by encoding;
- after each restart (same port) requests succeed again through the restarted service,
  with the gateway and decoder never restarted (their channels reconnect on their own).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
import pytest
from qwenvl.common.v1 import generation_pb2
from qwenvl.gateway.v1 import gateway_service_pb2_grpc as pb_grpc

from splitvl.client import build_request
from splitvl_tools.load import HUNG, CallResult, build_requests, one_call
from splitvl_tools.workload import ImageFactory, png
from vlcommon.settings import channel_options

CONCURRENCY = 24
DEADLINE_S = 60.0
SLACK_S = 10.0
CLEAR = {"OK", "UNAVAILABLE", "DEADLINE_EXCEEDED"}


@dataclass
class Timed:
    """One load call and the phases it started and ended in."""

    phase: str
    ended: str
    result: CallResult


@pytest.fixture(scope="module")
def faulty_cluster(tiny_model, tmp_path_factory):
    from splitvl.launcher import Cluster, Ports

    c = Cluster(
        model=str(tiny_model), ports=Ports.free(), log_dir=tmp_path_factory.mktemp("faults")
    )
    with c:
        yield c


def probe_images(n: int) -> list[bytes]:
    """Images not in the load's pool (their own seed)."""
    factory = ImageFactory(side=96, seed=991)
    return [png(factory.make()) for _ in range(n)]


async def ask(stub, image: bytes, policy: int) -> CallResult:
    request = build_request(
        [image], "Describe this image.", max_tokens=4, ignore_eos=True, cache_policy=policy
    )
    return await one_call(stub, request, DEADLINE_S, SLACK_S)


async def until_ok(stub, image: bytes, policy: int, timeout_s: float = 60.0) -> CallResult:
    """Ask until OK (a restarted service is reached after the channel's reconnect backoff)."""
    end = time.monotonic() + timeout_s
    while True:
        r = await ask(stub, image, policy)
        if r.code == "OK" or time.monotonic() > end:
            return r
        assert r.code in CLEAR, (r.code, r.message)
        await asyncio.sleep(0.5)


def test_kill_and_restart_encoder_then_cache_under_load(faulty_cluster) -> None:
    cluster = faulty_cluster
    pids_before = cluster.pids()
    pool = build_requests(48, side=96, repeat_fraction=0.5, max_tokens=4, seed=17)
    # Half the workers send their requests with the cache off, so the ViT runs on every
    # one of their calls (the pool's images are all cached after a few seconds).
    uncached = []
    for r in pool:
        copy = type(r)()
        copy.CopyFrom(r)
        copy.cache_policy = generation_pb2.CACHE_POLICY_OFF
        uncached.append(copy)
    probes = probe_images(4)
    log: list[Timed] = []
    reconnect: dict[str, float] = {}  # seconds from SERVING to served through it again
    phase = "baseline"

    async def main() -> dict[str, CallResult]:
        nonlocal phase
        seen: dict[str, CallResult] = {}
        stop = asyncio.Event()
        async with grpc.aio.insecure_channel(
            cluster.ports.address("gateway"), options=channel_options()
        ) as channel:
            stub = pb_grpc.GatewayServiceStub(channel)
            # One image in the cache: the encoder-down phase can still answer it.
            cached = await until_ok(stub, probes[0], generation_pb2.CACHE_POLICY_EXACT_ONLY)
            assert cached.code == "OK", cached.message
            n = 0

            async def worker(requests: list) -> None:
                nonlocal n
                while not stop.is_set():
                    request = requests[n % len(requests)]
                    n += 1
                    at = phase
                    result = await one_call(stub, request, DEADLINE_S, SLACK_S)
                    log.append(Timed(at, phase, result))
                    if result.code != "OK":
                        await asyncio.sleep(0.2)  # a down service fails fast: do not spin

            workers = [
                asyncio.ensure_future(worker(uncached if w % 2 else pool))
                for w in range(CONCURRENCY)
            ]
            try:
                await asyncio.sleep(8)

                phase = "encoder_down"
                await asyncio.to_thread(cluster.kill, "encoder")
                await asyncio.sleep(6)
                # On a loaded machine 6 s may see few calls end: stay down (bounded) until the
                # load has seen both an uncached failure and a cached success.
                end = time.monotonic() + 60
                while time.monotonic() < end and not (
                    {"OK", "UNAVAILABLE"}
                    <= {t.result.code for t in log if t.phase == t.ended == "encoder_down"}
                ):
                    await asyncio.sleep(0.5)
                # A miss needs the ViT: UNAVAILABLE naming the encoder.
                seen["encoder_down_miss"] = await ask(
                    stub, probes[1], generation_pb2.CACHE_POLICY_OFF
                )
                # An image in the cache is still answered without the encoder.
                seen["encoder_down_hit"] = await ask(
                    stub, probes[0], generation_pb2.CACHE_POLICY_EXACT_ONLY
                )

                phase = "encoder_restarting"
                await asyncio.to_thread(cluster.restart, "encoder")
                t_serving = time.monotonic()
                seen["encoder_back"] = await until_ok(
                    stub, probes[1], generation_pb2.CACHE_POLICY_OFF
                )
                reconnect["encoder"] = time.monotonic() - t_serving
                phase = "encoder_back"
                await asyncio.sleep(6)

                phase = "cache_down"
                await asyncio.to_thread(cluster.kill, "cache")
                await asyncio.sleep(6)
                # Cache down: the image is encoded instead.
                seen["cache_down"] = await ask(
                    stub, probes[2], generation_pb2.CACHE_POLICY_EXACT_ONLY
                )

                phase = "cache_restarting"
                await asyncio.to_thread(cluster.restart, "cache")
                t_serving = time.monotonic()
                # The restarted cache is empty: the first ask stores the image (the put
                # runs beside the decode), a later ask finds it (exact hit), which proves
                # the gateway reached the new cache process without a restart of its own.
                end = time.monotonic() + 60
                while True:
                    r = await ask(stub, probes[3], generation_pb2.CACHE_POLICY_EXACT_ONLY)
                    assert r.code in CLEAR, (r.code, r.message)
                    if r.code == "OK" and r.tiers == ["exact"] or time.monotonic() > end:
                        break
                    await asyncio.sleep(0.5)
                seen["cache_back"] = r
                reconnect["cache"] = time.monotonic() - t_serving
                phase = "cache_back"
                await asyncio.sleep(6)
            finally:
                stop.set()
                await asyncio.gather(*workers)
        return seen

    seen = asyncio.run(main())
    summary: dict[str, dict[str, int]] = {}
    for t in log:
        summary.setdefault(f"{t.phase}->{t.ended}", {}).setdefault(t.result.code, 0)
        summary[f"{t.phase}->{t.ended}"][t.result.code] += 1
    print("load calls by phase (started->ended):", summary)
    print("seconds from a restarted service's SERVING to a request served through it:", reconnect)
    # The gateway's channels retry within 2 s (vlcommon.settings.channel_options); gRPC's
    # default backoff (up to 120 s) could leave a restarted service unused far longer.
    assert max(reconnect.values()) < 30, reconnect

    # Every call ended with a result or a clear status, within its deadline.
    codes = {t.result.code for t in log}
    assert HUNG not in codes
    bad = [(t.phase, t.result.code, t.result.message) for t in log if t.result.code not in CLEAR]
    assert not bad, bad[:5]
    assert max(t.result.e2e_s for t in log) <= DEADLINE_S + SLACK_S
    # Any UNAVAILABLE came from the encoder being down, and says so.
    unavailable = [t for t in log if t.result.code == "UNAVAILABLE"]
    assert all("encoder" in t.result.message for t in unavailable), unavailable[:3]
    assert all(t.ended in ("encoder_down", "encoder_restarting") for t in unavailable)
    # The load did reach the dead encoder (uncached calls failed) ...
    assert any(t.phase == t.ended == "encoder_down" for t in unavailable)
    # ... while cached images were still served.
    assert any(t.phase == t.ended == "encoder_down" and t.result.code == "OK" for t in log)
    # Load was served before the faults and after each recovery, and calls made while the
    # cache was down were all served (by encoding): calls that began and ended in one phase.
    by_phase = {
        p: [t.result.code for t in log if t.phase == t.ended == p]
        for p in ("baseline", "encoder_back", "cache_down", "cache_back")
    }
    for p, phase_codes in by_phase.items():
        assert phase_codes and set(phase_codes) == {"OK"}, (p, phase_codes[:10])

    miss = seen["encoder_down_miss"]
    assert miss.code == "UNAVAILABLE"
    assert "encoder" in miss.message
    assert seen["encoder_down_hit"].code == "OK"
    assert seen["encoder_down_hit"].tiers == ["exact"]
    assert seen["encoder_back"].code == "OK"
    assert seen["encoder_back"].tiers == ["miss"]
    assert seen["cache_down"].code == "OK"
    assert seen["cache_down"].tiers == ["miss"]
    assert seen["cache_back"].code == "OK"
    assert seen["cache_back"].tiers == ["exact"]

    # The gateway and decoder were never restarted; the encoder and cache were.
    pids_after = cluster.pids()
    for name in ("gateway", "decoder"):
        assert pids_after[name] == pids_before[name], name
    for name in ("encoder", "cache"):
        assert pids_after[name] != pids_before[name], name
    assert set(pids_after) == {"gateway", "encoder", "cache", "decoder"}
