"""One cluster for the modules of this package: two replicas each of the encoder, the cache
and the decoder, the caches on a local redis-server, spans to the session's OTLP receiver.

Started once for the package (about a minute of CPU on 2 cores: two vLLM engines) and
stopped after its last module. Its modules kill, drain and restart replicas, and each
leaves every replica SERVING when it ends (test_migration restarts a decoder after each
test; test_replica_faults restarts every replica it stops), so the next one starts from
the same layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from splitvl.launcher import Cluster, Ports
from splitvl.redis_server import RedisServer
from splitvl_tools.replica_faults import REPLICAS
from tests.conftest import OtlpReceiver


@pytest.fixture(scope="package")
def replicated(
    tiny_model: Path, otlp_receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("replicated")
    ports = Ports.free(REPLICAS)
    server = RedisServer.create(log_dir / "redis", avoid=[p for p, _, _ in ports.bindings()])
    env = {
        **otlp_receiver.env(),
        # A drained decoder hands its streams back 0.3 s into the drain (not at the end
        # of its 10 s grace), while test_migration's 600-token answers are still running.
        "DECODER_HANDOFF_S": "0.3",
    }
    with Cluster(
        model=str(tiny_model), ports=ports, log_dir=log_dir, env=env, store_server=server
    ) as c:
        yield c
