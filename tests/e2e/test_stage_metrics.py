"""The gateway's stage histogram records only stages that ran (issue 14).

Before, every request observed all five stages: an all-hit request put a 0 into ``encode``
and ``put`` (nothing was encoded or stored), a request with the cache off a 0 into
``lookup``, and the put, which ends after the stream, was observed as 0 when the decode
finished first. Those zeros diluted the dashboard's per-stage quantiles.
"""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from qwenvl.common.v1 import generation_pb2

from splitvl.client import build_request, generate
from tests.conftest import png_bytes, rgb

STAGE = "splitvl_gateway_stage_duration_seconds"


def stages(cluster) -> dict[str, tuple[float, float]]:
    """Per stage: (count, sum seconds) of the gateway's stage histogram."""
    url = f"http://127.0.0.1:{cluster.ports.metrics['gateway']}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            stage = sample.labels.get("stage")
            if stage is None or not sample.name.startswith(STAGE):
                continue
            entry = out.setdefault(stage, [0.0, 0.0])
            if sample.name == STAGE + "_count":
                entry[0] = sample.value
            elif sample.name == STAGE + "_sum":
                entry[1] = sample.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def delta(before, after, stage: str) -> tuple[float, float]:
    b = before.get(stage, (0.0, 0.0))
    a = after.get(stage, (0.0, 0.0))
    return a[0] - b[0], a[1] - b[1]


def ask(cluster, image: bytes, policy: int = generation_pb2.CACHE_POLICY_UNSPECIFIED):
    request = build_request(
        [image], "Describe this image.", max_tokens=4, ignore_eos=True, cache_policy=policy
    )
    return generate(cluster.ports.address("gateway"), request, timeout_s=120)


def settled(cluster, stage: str, count: float, timeout_s: float = 10.0):
    """The histogram once ``stage`` has ``count`` observations (the put ends after the stream)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = stages(cluster)
        if now.get(stage, (0.0, 0.0))[0] >= count or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def test_only_stages_that_ran_are_observed(cluster) -> None:
    image = png_bytes(rgb("coffee.png").crop((11, 13, 331, 253)))
    before = stages(cluster)
    first = ask(cluster, image)
    assert first.images[0]["tier"] == "miss"
    after_miss = settled(cluster, "put", before.get("put", (0.0, 0.0))[0] + 1)
    # A miss runs every stage once; its put is observed with its real (non-zero) duration.
    for stage in ("preprocess", "lookup", "encode", "decode"):
        assert delta(before, after_miss, stage)[0] == 1, stage
    count, seconds = delta(before, after_miss, "put")
    assert count == 1
    assert seconds > 0

    second = ask(cluster, image)
    assert second.images[0]["tier"] == "exact"
    time.sleep(0.5)  # any put would have been observed by now
    after_hit = stages(cluster)
    assert delta(after_miss, after_hit, "encode")[0] == 0  # was +1 with a 0
    assert delta(after_miss, after_hit, "put")[0] == 0  # was +1 with a 0
    assert delta(after_miss, after_hit, "lookup")[0] == 1
    assert delta(after_miss, after_hit, "decode")[0] == 1

    off = ask(
        cluster,
        png_bytes(rgb("coffee.png").crop((3, 5, 323, 245))),
        policy=generation_pb2.CACHE_POLICY_OFF,
    )
    assert off.images[0]["tier"] == "miss"
    time.sleep(0.5)
    after_off = stages(cluster)
    assert delta(after_hit, after_off, "lookup")[0] == 0  # the cache was not asked
    assert delta(after_hit, after_off, "put")[0] == 0  # nor written
    assert delta(after_hit, after_off, "encode")[0] == 1
