"""C11 sized for CI: distinct images in a row; no service's memory grows after warm-up.

The full soak (``splitvl soak``: 1,000 requests, warm-up 200, 128 px images) is recorded in
docs/robustness.md. Here: 300 requests, warm-up 100, with 256 px images (64 image
tokens, the tiny checkpoint's largest): each request then carries ~200 KB of pixels and
~100 KB of fp32 embeddings through gateway, encoder, cache and decoder, so a service
that kept anything per request (pixels, embeddings, a per-request tensor, a task, an
index row) would grow by >= 100 KB x 200 requests = 20 MB after warm-up: over 5% of
the cache (~95 MB), encoder (~600 MB) and gateway (~500 MB) here; the decoder (~3.2 GiB
with vLLM's engine core) would need a leak of about the whole per-request payload (160 MB
over the window). Smaller leaks are the full soak's job (docs/robustness.md).

The cache's byte budget is set to 4 MiB, so it is full (evicting, with FAISS rows
removed) after ~40 requests: the measured window is the steady state of a bounded cache,
not the cache filling a 2 GiB budget by design. Its own cluster: the session one has
other tests' traffic and a 2 GiB cache.
"""

from __future__ import annotations

import asyncio

import pytest

from splitvl_tools.soak import MAX_GROWTH, build_requests, print_table, run_soak, soak_env

REQUESTS = 300
WARMUP = 100


@pytest.fixture(scope="module")
def soak_cluster(tiny_model, tmp_path_factory):
    from splitvl.launcher import Cluster, Ports

    c = Cluster(
        model=str(tiny_model),
        ports=Ports.free(),
        log_dir=tmp_path_factory.mktemp("soak"),
        env=soak_env(4.0),
    )
    with c:
        yield c


def test_c11_rss_of_every_service_levels_off_after_warmup(soak_cluster) -> None:
    requests = build_requests(REQUESTS, side=256, max_tokens=2, seed=23)
    report = asyncio.run(
        run_soak(
            soak_cluster.ports.address("gateway"),
            soak_cluster.pids(),
            requests,
            warmup=WARMUP,
            concurrency=2,
            sample_every=50,
        )
    )
    d = report.as_dict()
    print_table(d)
    assert d["status_counts"] == {"OK": REQUESTS}, d["error_examples"]
    assert set(d["services"]) == {"gateway", "encoder", "cache", "decoder"}
    for name, s in d["services"].items():
        assert s["rss_after_warmup_mib"] > 50, (name, s)  # a real process tree was measured
        assert s["growth"] < MAX_GROWTH, (name, s, d["rss_mib_by_requests"])
    # The cache stayed inside its byte budget (so it evicted: the run went past it).
    import grpc
    from qwenvl.cache.v1 import cache_service_pb2, cache_service_pb2_grpc

    with grpc.insecure_channel(soak_cluster.ports.address("cache")) as ch:
        stats = cache_service_pb2_grpc.CacheServiceStub(ch).GetStats(
            cache_service_pb2.GetStatsRequest(), timeout=10
        )
    assert 0 < stats.bytes <= 4 * 2**20
    assert 0 < stats.entries < REQUESTS - WARMUP
