"""Faults across replicas, under load: ``splitvl faults``' drill with 15 s windows.

Its own cluster (services die here): two replicas each of the encoder, the cache and the
decoder, the caches on a local redis-server, 16 concurrent streaming calls throughout
(splitvl_tools/replica_faults.py says what each step does). CI runs this; the 60 s
windows are ``splitvl faults`` run by hand, with the figures in docs/scaling.md.

The rolling step restarts the replicas the kills did not (cache-2, encoder-2, decoder-2),
so each of the six is started again once. About 8 minutes on 2 cores here, 13-15 on CI's
(two vLLM engines start, then each decoder once more, under load): its own timeout.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from splitvl.launcher import Cluster, Ports
from splitvl.redis_server import RedisServer
from splitvl_tools.replica_faults import REPLICAS, run_drill

WINDOW_S = 15.0
CONCURRENCY = 16
#: The replicas the earlier steps did not restart (they killed and restarted the first ones).
ROLLING = ("cache-2", "encoder-2", "decoder-2")


@pytest.fixture(scope="module")
def replicated(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("replica-faults")
    ports = Ports.free(REPLICAS)
    server = RedisServer.create(log_dir / "redis", avoid=[p for p, _, _ in ports.bindings()])
    with Cluster(model=str(tiny_model), ports=ports, log_dir=log_dir, store_server=server) as c:
        yield c


@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_replicas_and_the_store_killed_and_restarted_under_load(replicated: Cluster) -> None:
    pids_before = replicated.pids()
    report = run_drill(
        replicated, window_s=WINDOW_S, concurrency=CONCURRENCY, deadline_s=60.0, rolling=ROLLING
    )
    print(report)
    # Every call answered in every step: answers in progress on the killed decoder-1, or
    # on a decoder drained by the rolling restart, moved to the other replica.
    for step, codes in report["statuses_by_step"].items():
        assert set(codes) == {"OK"}, (step, codes, report["error_examples"])
    assert report["max_e2e_s"] <= 70.0
    # The mechanism, not only the outcome: replays, keys back, store errors as misses.
    assert report["failovers_decoder_killed"] >= 1
    assert report["decoder_1_answers_once_back"] >= 1
    assert report["store_errors_store_killed"] >= 1
    assert report["probe_after_store_back"] == ["exact"]
    assert report["rolling_exit_codes"] == dict.fromkeys(ROLLING, 0)
    assert report["tiers"].get("exact", 0) > 0
    assert all(n > 0 for n in report["encoded_by_step"].values()), report["encoded_by_step"]
    assert all(report["verdicts"].values()), report["verdicts"]
    # Every replica was restarted (a new process); the gateway never was.
    pids_after = replicated.pids()
    assert set(pids_after) == {"gateway", *(f"{s}-{r}" for s in REPLICAS for r in (1, 2))}
    assert {n for n in pids_after if pids_after[n] == pids_before[n]} == {"gateway"}
