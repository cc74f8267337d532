"""``splitvl up`` as an operator meets it: a second instance on the same ports refuses at
once, a killed vLLM worker or encoder is restarted while the rest keep running, and a
SIGKILLed launcher takes every one of its processes with it.

One ``splitvl up`` serves the module; the tests run in order (the last one kills it).
"""

from __future__ import annotations

import hashlib
import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
from PIL import Image

from splitvl.client import build_request, generate
from splitvl.launcher import SERVICES, PortInUseError, Ports, check_ports, free_base

pytestmark = pytest.mark.e2e

# A restart is a cold start of the service (the decoder's vLLM engine: 25-50 s on this CPU)
# plus the launcher's 1 s backoff; the margin covers a slower, shared CI host.
RESTART_LIMIT_S = 90


class Up:
    def __init__(self, proc: subprocess.Popen[str], base: int, log_dir: Path) -> None:
        self.proc, self.base, self.log_dir = proc, base, log_dir
        self.output: list[str] = []

    @property
    def gateway(self) -> str:
        return f"127.0.0.1:{self.base}"

    def services(self) -> dict[str, psutil.Process]:
        """The service root processes under the launcher, by name."""
        packages = {
            "gateway": "gateway",
            "encoder_service": "encoder",
            "cache_service": "cache",
            "decoder_service": "decoder",
        }
        found = {}
        for child in psutil.Process(self.proc.pid).children():
            cmd = child.cmdline()
            if "-m" in cmd and cmd[cmd.index("-m") + 1] in packages:
                found[packages[cmd[cmd.index("-m") + 1]]] = child
        return found


@pytest.fixture(scope="module")
def up(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    base = free_base()
    log_dir = tmp_path_factory.mktemp("up-logs")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "splitvl.cli",
            "up",
            "--model",
            str(tiny_model),
            "--base-port",
            str(base),
            "--metrics-base-port",
            str(base + 10),
            "--http-port",
            str(base + 20),
            "--log-dir",
            str(log_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    instance = Up(proc, base, log_dir)
    assert proc.stdout is not None
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        instance.output.append(line)
        if "is SERVING" in line:
            break
    assert any("is SERVING" in ln for ln in instance.output), "".join(instance.output)
    os.set_blocking(proc.stdout.fileno(), False)
    try:
        yield instance
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _image(seed: int) -> bytes:
    """A new image each call, so the request needs the encoder (no cache hit)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _until_a_request_succeeds(up: Up, service: str, seed: int) -> tuple[float, list[str]]:
    """Send requests until one succeeds; returns the seconds it took and the failures."""
    t0 = time.monotonic()
    failures: list[str] = []
    while time.monotonic() - t0 < RESTART_LIMIT_S:
        seed += 1
        request = build_request([_image(seed)], "Describe.", max_tokens=2, ignore_eos=True)
        try:
            result = generate(up.gateway, request, timeout_s=10)
        except grpc.RpcError as err:
            failures.append(f"{err.code().name}: {err.details()}")  # type: ignore[attr-defined]
            time.sleep(1)
            continue
        assert len(result.token_ids) == 2
        return time.monotonic() - t0, failures
    pytest.fail(f"no request succeeded within {RESTART_LIMIT_S} s of killing the {service}")


def test_a_second_up_on_the_same_ports_refuses_at_once_and_leaves_the_logs(up: Up) -> None:
    def digests() -> dict[str, str]:
        return {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in up.log_dir.glob("*.log")
        }

    before = digests()
    assert set(before) == {f"{name}.log" for name in SERVICES}
    t0 = time.monotonic()
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitvl.cli",
            "up",
            "--base-port",
            str(up.base),
            "--metrics-base-port",
            str(up.base + 10),
            "--http-port",
            str(up.base + 20),
            "--log-dir",
            str(up.log_dir),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "SPLITVL_HOME": str(up.log_dir.parent)},
    )
    elapsed = time.monotonic() - t0
    assert second.returncode == 2, second.stdout + second.stderr
    assert elapsed < 10
    assert "SERVING" not in second.stdout + second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    gateway_pid = up.services()["gateway"].pid
    assert lines[0].startswith(
        f"splitvl up: error: port {up.base} (gateway gRPC) is already in use by another "
        f"splitvl (pid {gateway_pid}: python"
    ), lines
    assert lines[0].endswith("-m gateway); stop that or move this instance with --base-port")
    assert digests() == before


def test_a_killed_vllm_worker_then_encoder_are_restarted_and_the_others_keep_running(
    up: Up,
) -> None:
    services = up.services()
    assert set(services) == set(SERVICES)
    pids = {name: p.pid for name, p in services.items()}
    workers = [
        p for p in services["decoder"].children(recursive=True) if "Worker" in p.name() + " "
    ]
    assert workers, [p.name() for p in services["decoder"].children(recursive=True)]
    _, warm_failures = _until_a_request_succeeds(up, "decoder", seed=0)
    assert warm_failures == []

    os.kill(workers[0].pid, signal.SIGKILL)
    took, failures = _until_a_request_succeeds(up, "decoder", seed=1000)
    assert failures, "the request right after the kill should have failed"
    for failure in failures:  # UNAVAILABLE naming the decoder, never a hang or INTERNAL
        assert failure.startswith("UNAVAILABLE: decoder"), failures
    after = {name: p.pid for name, p in up.services().items()}
    assert after["decoder"] != pids["decoder"]
    assert {n: after[n] for n in ("gateway", "encoder", "cache")} == {
        n: pids[n] for n in ("gateway", "encoder", "cache")
    }
    print(f"decoder back in {took:.1f} s after its vLLM worker was killed")

    os.kill(after["encoder"], signal.SIGKILL)
    took, failures = _until_a_request_succeeds(up, "encoder", seed=2000)
    for failure in failures:
        assert failure.startswith("UNAVAILABLE: encoder"), failures
    final = {name: p.pid for name, p in up.services().items()}
    assert final["encoder"] != after["encoder"]
    assert {n: final[n] for n in ("gateway", "decoder", "cache")} == {
        n: after[n] for n in ("gateway", "decoder", "cache")
    }
    print(f"encoder back in {took:.1f} s after it was killed")
    assert up.proc.stdout is not None
    said = up.proc.stdout.read() or ""
    assert "splitvl: decoder exited with code 3; restarting it in 1 s" in said, said
    assert "splitvl: encoder exited with code -9; restarting it in 1 s" in said, said
    assert "splitvl: decoder is SERVING again" in said, said


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _ctime(name: str) -> float:
    try:
        return os.stat(f"/dev/shm/{name}").st_ctime
    except FileNotFoundError:
        return 0.0


def test_kill_9_of_a_holder_and_of_the_decoder_leaves_nothing_of_them_in_dev_shm(
    up: Up,
) -> None:
    """Issue 14: segments never leak. The encoder holds an embedding nobody reads (a
    segment of its pid), the decoder's vLLM maps its message-queue buffers (psm_*) and has
    POSIX named semaphores (``sem.*``); both are killed with SIGKILL (the decoder with its
    whole process group), and once the launcher has restarted them nothing of the dead
    processes is left in /dev/shm. The semaphores: one vLLM's engine start registers is
    mapped by no process, so only the resource tracker can unlink it, and the decoder
    starts that tracker outside its process group
    (``handoff.start_resource_tracker_in_own_group``; found 2026-12-04, when it died in
    the same killpg)."""
    from qwenvl.common.v1 import tensor_pb2
    from qwenvl.encoder.v1 import encoder_service_pb2 as epb
    from qwenvl.encoder.v1 import encoder_service_pb2_grpc as epb_grpc

    from vlcommon import handoff

    services = up.services()
    encoder, decoder = services["encoder"], services["decoder"]
    request = epb.EncodeRequest(transport=tensor_pb2.TRANSPORT_SHM)
    image = request.images.add(key="held-and-never-read")
    pixels = np.random.default_rng(5).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    image.pixels.CopyFrom(tensors_from_numpy(pixels))
    image.plan.resized_height = image.plan.resized_width = 64
    image.plan.grid.t, image.plan.grid.h, image.plan.grid.w = 1, 4, 4
    with grpc.insecure_channel(f"127.0.0.1:{up.base + 1}") as channel:
        held = epb_grpc.EncoderServiceStub(channel).Encode(request, timeout=60)
    segment = held.embeddings[0].ref.shm_name
    assert segment in _shm() and f"-encoder-{encoder.pid}-" in segment
    tree = [decoder.pid, *(p.pid for p in decoder.children(recursive=True))]
    queues = handoff.mapped_segments(tree)
    assert queues, "vLLM maps no shared-memory segment: nothing to check"
    assert any(n.startswith(f"splitvl-decoder-{decoder.pid}-") for n in _shm())  # the record
    # The semaphores made since the decoder started (another cluster of the same test
    # session, or anything else on the host, made its own earlier and keeps them).
    started = decoder.create_time() - 0.5
    semaphores = {n for n in _shm() if n.startswith("sem.") and _ctime(n) >= started}
    assert semaphores, "no named semaphore in /dev/shm while the decoder runs: nothing to check"

    os.killpg(os.getpgid(decoder.pid), signal.SIGKILL)
    os.kill(encoder.pid, signal.SIGKILL)
    assert {segment, *queues} <= _shm()  # what a kill -9 leaves behind
    _until_a_request_succeeds(up, "decoder", seed=3000)
    after = up.services()
    assert after["encoder"].pid != encoder.pid and after["decoder"].pid != decoder.pid
    left = _shm()
    assert segment not in left and not (set(queues) & left), sorted(left)
    assert not (semaphores & left), sorted(semaphores & left)
    dead = (f"splitvl-encoder-{encoder.pid}-", f"splitvl-decoder-{decoder.pid}-")
    assert not [n for n in left if n.startswith(dead)], sorted(left)


def tensors_from_numpy(array: np.ndarray):  # type: ignore[no-untyped-def]
    from vlcommon import tensors

    return tensors.from_numpy(array)


def test_sigkill_of_up_leaves_none_of_its_processes_alive(up: Up) -> None:
    tree = psutil.Process(up.proc.pid).children(recursive=True)
    names = {p.name() for p in tree}
    assert len(tree) >= 6, names  # four services, vLLM's engine core and worker
    up.proc.send_signal(signal.SIGKILL)
    up.proc.wait()
    deadline = time.monotonic() + 10
    alive = tree
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in tree if _alive(p)]
    assert alive == [], [(p.pid, p.name()) for p in alive]
    # The ports are free again within seconds: the next `up` starts cleanly. (Polled: a
    # CI run once found the decoder's metrics port still bound just after the last
    # process of the tree was reaped, with no holder left to name a moment later.)
    ports = Ports.from_base(up.base, up.base + 10, up.base + 20)
    deadline = time.monotonic() + 10
    while True:
        try:
            check_ports(ports)
            break
        except PortInUseError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
