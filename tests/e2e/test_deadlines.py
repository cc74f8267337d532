"""C10: a 2 s deadline on a request whose encode takes longer.

Real services as subprocesses: the encoder (tiny checkpoint) with a batch wait window of
8 s (``ENCODER_MAX_WAIT_MS``: the first image of a batch waits that long for company,
so its encode really takes longer than the deadline) and the gateway (cache off; the
request never reaches the decoder, so none is started). The client must get
DEADLINE_EXCEEDED close to its deadline, and the encoder must drop the image without
running the ViT for it (its counters say so).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from splitvl.client import build_request, generate
from splitvl.launcher import free_port, health_status
from tests.conftest import photo

DEADLINE_S = 2.0
WAIT_MS = 8000


def _metric(port: int, name: str) -> float:
    """Sum of a Prometheus sample over its labels (0 when absent)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def slow_encoder_gateway(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, int]]:
    logs = tmp_path_factory.mktemp("deadline-logs")
    ports = {
        "encoder": free_port(),
        "encoder_metrics": free_port(),
        "gateway": free_port(),
        "decoder": free_port(),  # nothing listens: the request must fail before the decoder
    }
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "ENCODER_MAX_WAIT_MS": str(WAIT_MS),
        "ENCODER_MAX_BATCH_IMAGES": "8",
        "GATEWAY_CACHE_ADDRESS": "",
    }
    commands = {
        "encoder": [
            sys.executable, "-m", "encoder_service", "--model", str(tiny_model),
            "--port", str(ports["encoder"]), "--metrics-port", str(ports["encoder_metrics"]),
        ],
        "gateway": [
            sys.executable, "-m", "gateway", "--model", str(tiny_model),
            "--port", str(ports["gateway"]),
            "--encoder-address", f"127.0.0.1:{ports['encoder']}",
            "--decoder-address", f"127.0.0.1:{ports['decoder']}",
        ],
    }  # fmt: skip
    procs = {}
    for name, command in commands.items():
        with (logs / f"{name}.log").open("wb") as log:
            procs[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        for name in commands:
            while health_status(f"127.0.0.1:{ports[name]}") != "SERVING":
                if procs[name].poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"{name} did not start:\n{(logs / f'{name}.log').read_text()}")
                time.sleep(0.3)
        yield ports
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_c10_deadline_exceeded_close_to_the_deadline_and_the_encode_is_dropped(
    slow_encoder_gateway: dict[str, int],
) -> None:
    ports = slow_encoder_gateway
    metrics_port = ports["encoder_metrics"]
    dropped_before = _metric(metrics_port, "splitvl_encoder_dropped_images_total")
    batches_before = _metric(metrics_port, "splitvl_encoder_batch_images_count")

    request = build_request([photo("astronaut.png")], "Describe.", max_tokens=4)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        generate(f"127.0.0.1:{ports['gateway']}", request, timeout_s=DEADLINE_S)
    elapsed = time.monotonic() - t0
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    # Close to the deadline, nowhere near the 8 s the encode would have taken.
    assert DEADLINE_S <= elapsed < DEADLINE_S + 1.5, elapsed

    # The encoder got the remaining time, gave up on the image and never ran the ViT for
    # it: once its wait window closes, the image is dropped, not encoded.
    give_up = time.monotonic() + WAIT_MS / 1000 + 20
    while _metric(metrics_port, "splitvl_encoder_dropped_images_total") <= dropped_before:
        assert time.monotonic() < give_up, "the expired image was never dropped"
        time.sleep(0.5)
    assert _metric(metrics_port, "splitvl_encoder_dropped_images_total") == dropped_before + 1
    assert _metric(metrics_port, "splitvl_encoder_batch_images_count") == batches_before


def test_encoder_alone_answers_deadline_exceeded_to_a_direct_caller(
    slow_encoder_gateway: dict[str, int], tiny_model: Path
) -> None:
    """The encoder hop alone: a 1 s deadline straight to it ends DEADLINE_EXCEEDED at
    about 1 s and the image is dropped before its batch runs."""
    import numpy as np
    from qwenvl.common.v1 import tensor_pb2
    from qwenvl.encoder.v1 import encoder_service_pb2 as pb
    from qwenvl.encoder.v1 import encoder_service_pb2_grpc as pb_grpc

    from tests.conftest import rgb
    from vlcommon import tensors
    from vlcommon.imaging import plan_resize
    from vlcommon.model_info import load_vision_spec

    spec = load_vision_spec(tiny_model)
    image = rgb("chelsea.png")
    plan = plan_resize(image.height, image.width, spec, index=0)
    request = pb.EncodeRequest(
        images=[
            pb.EncodeImage(
                key="direct-deadline",
                pixels=tensors.from_numpy(np.asarray(image)),
                plan=tensor_pb2.ResizePlan(
                    resized_height=plan.resized_height,
                    resized_width=plan.resized_width,
                    grid=tensor_pb2.GridTHW(t=1, h=plan.grid_h, w=plan.grid_w),
                ),
            )
        ]
    )
    metrics_port = slow_encoder_gateway["encoder_metrics"]
    dropped_before = _metric(metrics_port, "splitvl_encoder_dropped_images_total")
    with grpc.insecure_channel(f"127.0.0.1:{slow_encoder_gateway['encoder']}") as channel:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.EncoderServiceStub(channel).Encode(request, timeout=1.0)
        elapsed = time.monotonic() - t0
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    assert elapsed < 1.0 + 1.5, elapsed
    give_up = time.monotonic() + WAIT_MS / 1000 + 20
    while _metric(metrics_port, "splitvl_encoder_dropped_images_total") <= dropped_before:
        assert time.monotonic() < give_up, "the expired image was never dropped"
        time.sleep(0.5)
