"""Faults across replicas, under load: ``splitvl faults``' drill with 15 s windows.

Its own cluster (services die here): two replicas each of the encoder, the cache and the
decoder, the caches on a local redis-server, 16 concurrent streaming calls throughout
(splitvl_tools/replica_faults.py says what each step does). CI runs this; the 60 s
windows are ``splitvl faults`` run by hand, with the figures in docs/scaling.md.

About 8 minutes on 2 cores: two vLLM engines start, and each decoder starts twice more.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from splitvl.launcher import Cluster, Ports
from splitvl.redis_server import RedisServer
from splitvl_tools.replica_faults import LOST_MID_STREAM, REPLICAS, run_drill

WINDOW_S = 15.0
CONCURRENCY = 16


@pytest.fixture(scope="module")
def replicated(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("replica-faults")
    ports = Ports.free(REPLICAS)
    server = RedisServer.create(log_dir / "redis", avoid=[p for p, _, _ in ports.bindings()])
    with Cluster(model=str(tiny_model), ports=ports, log_dir=log_dir, store_server=server) as c:
        yield c


@pytest.mark.e2e
def test_replicas_and_the_store_killed_and_restarted_under_load(replicated: Cluster) -> None:
    report = run_drill(replicated, window_s=WINDOW_S, concurrency=CONCURRENCY, deadline_s=60.0)
    print(report)
    failed = {
        code: n
        for step in report["statuses_by_step"].values()
        for code, n in step.items()
        if code != "OK"
    }
    # The only failures allowed: calls cut off mid-answer by the killed decoder.
    assert set(failed) <= {"UNAVAILABLE"}, (failed, report["error_examples"])
    if failed:
        assert LOST_MID_STREAM in report["error_examples"]["UNAVAILABLE"]
        assert set(report["statuses_by_step"]["decoder_killed"]) >= {"UNAVAILABLE"}
    for step in ("baseline", "cache_killed", "cache_back", "encoder_killed", "encoder_back"):
        assert set(report["statuses_by_step"][step]) == {"OK"}, (step, report)
    for step in ("decoder_back", "store_killed", "store_back", "rolling"):
        assert set(report["statuses_by_step"][step]) == {"OK"}, (step, report)
    assert report["max_e2e_s"] <= 70.0
    # The mechanism, not only the outcome: replays, keys back, store errors as misses.
    assert report["failovers_decoder_killed"] >= 1
    assert report["decoder_1_answers_once_back"] >= 1
    assert report["store_errors_store_killed"] >= 1
    assert report["probe_after_store_back"] == ["exact"]
    assert report["rolling_exit_codes"] == {
        "cache-1": 0,
        "cache-2": 0,
        "encoder-1": 0,
        "encoder-2": 0,
        "decoder-1": 0,
        "decoder-2": 0,
    }
    assert report["tiers"].get("exact", 0) > 0
    assert all(n > 0 for n in report["encoded_by_step"].values()), report["encoded_by_step"]
    assert all(report["verdicts"].values()), report["verdicts"]
    # Every replica was restarted; the gateway never was.
    assert set(replicated.pids()) == {"gateway", *(f"{s}-{r}" for s in REPLICAS for r in (1, 2))}
