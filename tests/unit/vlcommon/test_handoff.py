"""Embeddings by reference (vlcommon.handoff): a holder served over real gRPC on loopback,
read through both transports, with releases, expiry, budgets and dead-process segments."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from qwenvl.common.v1 import tensor_pb2
from qwenvl.handoff.v1 import handoff_service_pb2 as hpb
from qwenvl.handoff.v1 import handoff_service_pb2_grpc as hpb_grpc

from tests.conftest import in_process_server
from vlcommon import handoff, tensors
from vlcommon.errors import ServiceError, error_info

SHM = tensor_pb2.TRANSPORT_SHM
GRPC = tensor_pb2.TRANSPORT_GRPC


def embedding(rows: int = 64, width: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))


def ref_message(holder: handoff.Holder, t: torch.Tensor, transport: int, readers: int = 1):
    dtype, data = tensors.torch_payload(t)
    ref = holder.hold(data, dtype, tuple(t.shape), transport=transport, readers=readers)
    msg = tensor_pb2.ImageEmbedding(key="k", grid=tensor_pb2.GridTHW(t=1, h=16, w=16))
    msg.embeddings.dtype, msg.embeddings.shape[:] = dtype, list(t.shape)
    msg.ref.CopyFrom(ref)
    return msg


def segments(shm_dir: Path, service: str = "test") -> list[str]:
    return sorted(n for n in os.listdir(shm_dir) if n.startswith(f"splitvl-{service}-"))


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder of its own on the real tmpfs (/dev/shm) when there is one, else a
    temporary folder: what a failed test leaves is not another test's."""
    if not Path("/dev/shm").is_dir():
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="pytest-handoff-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def serving(holder: handoff.Holder, chunk_bytes: int = handoff.CHUNK_BYTES):  # type: ignore[no-untyped-def]
    """The holder's HandoffService through the real bootstrap on loopback; the holder
    learns its address as a service's does (``on_listening``)."""
    from vlcommon.settings import HoldingSettings

    return in_process_server(
        hpb_grpc.add_HandoffServiceServicer_to_server,
        handoff.HandoffServicer(holder, chunk_bytes=chunk_bytes),
        handoff.HANDOFF_SERVICE,
        on_port=handoff.on_listening(holder, HoldingSettings(port=0)),
    )


@pytest.mark.parametrize("transport", [SHM, GRPC], ids=["shm", "grpc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
async def test_a_reader_gets_the_held_bytes_once_and_the_holder_frees_them(
    shm_dir: Path, transport: int, dtype: torch.dtype
) -> None:
    holder = handoff.Holder("test", shm_dir=shm_dir)
    t = embedding(rows=300, width=2048).to(dtype)  # 2.4 MiB (fp32): several 1 MiB chunks
    async with serving(holder, chunk_bytes=1 << 20):
        msg = ref_message(holder, t, transport)
        if transport == SHM:
            assert msg.ref.shm_name in segments(shm_dir)
        reader = handoff.Reader(shm_dir=shm_dir)
        got = await reader.fetch(msg, field="images[0]", timeout=10)
        assert got.transport == ("shm" if transport == SHM else "grpc")
        assert got.service == "test" and got.nbytes == t.numel() * t.element_size()
        out = tensors.to_torch(msg.embeddings, got.data)
        assert out.dtype == dtype and torch.equal(out, t)
        await reader.close()  # waits for the background release of a shared-memory read
        assert len(holder) == 0 and holder.held_bytes == 0
        assert segments(shm_dir) == []
        # Read again: the ticket is gone, and the reader says which image and which holder.
        with pytest.raises(ServiceError) as err:
            await handoff.Reader(shm_dir=shm_dir).fetch(msg, field="images[0]", timeout=10)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert err.value.reason == "EMBEDDING_REF_GONE"
        assert "images[0].ref" in err.value.message and "test" in err.value.message


async def test_two_readers_each_get_the_bytes_and_the_second_release_frees_them(
    shm_dir: Path,
) -> None:
    holder = handoff.Holder("test", shm_dir=shm_dir)
    t = embedding()
    async with serving(holder):
        msg = ref_message(holder, t, SHM, readers=2)
        first, second = handoff.Reader(shm_dir=shm_dir), handoff.Reader(shm_dir=shm_dir)
        a = await first.fetch(msg, field="images[0]", timeout=10)
        await first.close()
        assert len(holder) == 1 and segments(shm_dir) == [msg.ref.shm_name]
        b = await second.fetch(msg, field="entries[0].embedding", timeout=10)
        await second.close()
        assert a.data == b.data == tensors.torch_payload(t)[1].tobytes()
        assert len(holder) == 0 and segments(shm_dir) == []


async def test_a_reader_that_cannot_open_the_segment_reads_it_over_grpc(tmp_path: Path) -> None:
    """Another host (or another user): the segment is not in the reader's /dev/shm."""
    holder = handoff.Holder("test", shm_dir=tmp_path / "holder")
    (tmp_path / "holder").mkdir()
    (tmp_path / "reader").mkdir()
    t = embedding(seed=3)
    async with serving(holder):
        msg = ref_message(holder, t, SHM)
        reader = handoff.Reader(shm_dir=tmp_path / "reader")
        got = await reader.fetch(msg, field="images[0]", timeout=10)
        await reader.close()
    assert got.transport == "grpc"
    assert torch.equal(tensors.to_torch(msg.embeddings, got.data), t)
    assert os.listdir(tmp_path / "holder") == []  # released by the read: unlinked


async def test_a_ref_whose_size_disagrees_with_its_shape_is_refused_before_any_read(
    shm_dir: Path,
) -> None:
    holder = handoff.Holder("test", shm_dir=shm_dir)
    holder.address = "127.0.0.1:9"  # never called: the checks come first
    msg = ref_message(holder, embedding(), SHM)
    msg.embeddings.shape[0] = 65  # one row more than was held
    reader = handoff.Reader(shm_dir=shm_dir)
    with pytest.raises(ServiceError) as err:
        await reader.fetch(msg, field="images[2]", timeout=1)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.metadata["field"] == "images[2].ref"
    # A segment name that is not the ticket's (or a path) is never opened.
    msg = ref_message(holder, embedding(), SHM)
    msg.ref.shm_name = "../../etc/passwd"
    with pytest.raises(ServiceError) as err:
        await reader.fetch(msg, field="images[0]", timeout=1)
    assert err.value.metadata["field"] == "images[0].ref.shm_name"
    holder.close()
    assert segments(shm_dir) == []


async def test_an_unreachable_holder_is_unavailable_naming_the_image_and_hop(
    shm_dir: Path,
) -> None:
    holder = handoff.Holder("encoder", shm_dir=shm_dir)
    holder.address = "127.0.0.1:9"  # nothing listens
    msg = ref_message(holder, embedding(), GRPC)
    reader = handoff.Reader(shm_dir=shm_dir)
    with pytest.raises(ServiceError) as err:
        await reader.fetch(msg, field="images[1]", timeout=2)
    await reader.close()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.reason == "EMBEDDING_HOLDER_UNAVAILABLE"
    assert "images[1].ref" in err.value.message and "encoder at 127.0.0.1:9" in err.value.message


def test_entries_expire_after_their_ttl_and_free_their_segment(shm_dir: Path) -> None:
    now = [100.0]
    released: list[int] = []
    holder = handoff.Holder("test", ttl_s=30, shm_dir=shm_dir, clock=lambda: now[0])
    dtype, data = tensors.torch_payload(embedding())
    ref = holder.hold(data, dtype, (64, 96), transport=SHM, on_release=lambda: released.append(1))
    now[0] += 29
    assert holder.expire() == 0 and holder.read_bytes(ref.ticket) is not None
    now[0] += 2
    assert holder.read_bytes(ref.ticket) is None  # past its TTL it is never served
    assert holder.expire() == 1 and released == [1]
    assert segments(shm_dir) == [] and holder.held_bytes == 0


def test_holding_past_the_budget_is_resource_exhausted(shm_dir: Path) -> None:
    holder = handoff.Holder("test", max_bytes=64 * 96 * 4 * 2, shm_dir=shm_dir)
    dtype, data = tensors.torch_payload(embedding())
    refs = [holder.hold(data, dtype, (64, 96), transport=GRPC) for _ in range(2)]
    with pytest.raises(ServiceError) as err:
        holder.hold(data, dtype, (64, 96), transport=SHM)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.reason == "HANDOFF_FULL" and "TEST_HANDOFF_MAX_BYTES" in err.value.message
    assert holder.release(refs[0].ticket) == (1, 0)
    holder.hold(data, dtype, (64, 96), transport=SHM)  # room again
    holder.close()
    assert segments(shm_dir) == []


def test_a_full_shm_falls_back_to_grpc(tmp_path: Path) -> None:
    """No usable /dev/shm (here: a folder that is not there): held for gRPC reads."""
    holder = handoff.Holder("test", shm_dir=tmp_path / "missing")
    dtype, data = tensors.torch_payload(embedding())
    ref = holder.hold(data, dtype, (64, 96), transport=SHM)
    assert ref.transport == GRPC and ref.shm_name == ""
    found = holder.read_bytes(ref.ticket)
    assert found is not None and found[1].tobytes() == data.tobytes()


async def test_read_embedding_errors_name_the_ticket(shm_dir: Path) -> None:
    holder = handoff.Holder("cache", shm_dir=shm_dir)
    async with serving(holder) as channel:
        stub = hpb_grpc.HandoffServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.ReadEmbedding(hpb.ReadEmbeddingRequest(ticket="ab" * 16)):
                pass
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert error_info(err.value).reason == "TICKET_UNKNOWN"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.ReadEmbedding(hpb.ReadEmbeddingRequest(ticket="x" * 200)):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(err.value).metadata["field"] == "ticket"
        released = await stub.ReleaseEmbedding(hpb.ReleaseEmbeddingRequest(ticket="ab" * 16))
        assert released.released == 0


def test_segments_of_a_killed_holder_are_removed_by_the_next_one(shm_dir: Path) -> None:
    """kill -9 leaves the dead holder's segments behind; a live replica's are kept."""
    code = (
        "import sys, time, torch\n"
        "from pathlib import Path\n"
        "from vlcommon import handoff, tensors\n"
        "h = handoff.Holder('test', shm_dir=Path(sys.argv[1]))\n"
        "dt, data = tensors.torch_payload(torch.zeros(8, 8))\n"
        "for _ in range(3):\n"
        "    h.hold(data, dt, (8, 8), transport=1)\n"
        "print('HELD', flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(shm_dir)], stdout=subprocess.PIPE, env=env
        )
        for _ in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == b"HELD"
        dead, alive = procs
        assert len([n for n in segments(shm_dir) if f"-{dead.pid}-" in n]) == 3
        dead.kill()
        dead.wait()
        removed = handoff.sweep_dead_segments("test", shm_dir)
        assert len(removed) == 3 and all(f"-{dead.pid}-" in n for n in removed)
        left = segments(shm_dir)
        assert len(left) == 3 and all(f"-{alive.pid}-" in n for n in left)
        # Another service's segments are never touched by this one's sweep.
        assert handoff.sweep_dead_segments("other", shm_dir) == []
    finally:
        for p in procs:
            p.kill()
            p.wait()
        handoff.sweep_dead_segments("test", shm_dir)
    assert segments(shm_dir) == []


def test_payload_views_are_the_tensors_bytes() -> None:
    t = embedding().to(torch.bfloat16)
    dtype, view = tensors.torch_payload(t)
    assert dtype == tensor_pb2.DATA_TYPE_BF16
    assert view.tobytes() == tensors.from_torch(t).data
    assert np.frombuffer(view, dtype="<u2").size == t.numel()


async def test_a_ref_over_the_size_bound_is_refused_before_anything_is_allocated() -> None:
    msg = tensor_pb2.ImageEmbedding(key="k", grid=tensor_pb2.GridTHW(t=1, h=2, w=2))
    msg.embeddings.dtype = tensor_pb2.DATA_TYPE_FP32
    msg.embeddings.shape[:] = [1 << 20, 1 << 10]  # 4 GiB
    msg.ref.holder, msg.ref.ticket, msg.ref.nbytes = "127.0.0.1:9", "ab" * 16, 4 << 30
    with pytest.raises(ServiceError) as err:
        await handoff.Reader().fetch(msg, field="videos[0].embedding", timeout=1)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.reason == "EMBEDDING_REF_TOO_LARGE"
    assert err.value.metadata == {
        "field": "videos[0].embedding.ref",
        "limit": str(handoff.MAX_REF_BYTES),
    }


class _SlowHolding(hpb_grpc.HandoffServiceServicer):
    """A handler that holds two entries for its caller on a worker thread, which takes
    ``hold_s`` (as the encoder's and the cache's answers by reference do)."""

    def __init__(self, holder: handoff.Holder, hold_s: float) -> None:
        self.holder, self.hold_s = holder, hold_s
        self.held: list[tensor_pb2.EmbeddingRef | None] = []

    def _hold(self) -> list[tensor_pb2.EmbeddingRef | None]:
        import time

        time.sleep(self.hold_s)
        t = embedding(rows=8, width=16)
        self.held = [ref_message(self.holder, t, SHM, readers=2).ref for _ in range(2)]
        return self.held

    async def ReleaseEmbedding(self, request, context):  # type: ignore[no-untyped-def]
        await handoff.hold_on_thread(self.holder, self._hold)
        return hpb.ReleaseEmbeddingResponse()


async def test_holds_made_while_their_call_is_cancelled_are_freed(shm_dir: Path) -> None:
    """A caller that gives up (its deadline passes) while the holds are being made never
    gets the refs: they are freed once made, not kept for their readers until the TTL
    (found by an adversarial probe: a by-reference Lookup of 200 entries with a short
    deadline left 200 segments held, and their entries leased, for 120 s)."""
    import asyncio

    holder = handoff.Holder("test", shm_dir=shm_dir)
    slow = _SlowHolding(holder, hold_s=1.0)
    async with in_process_server(
        hpb_grpc.add_HandoffServiceServicer_to_server, slow, handoff.HANDOFF_SERVICE
    ) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await hpb_grpc.HandoffServiceStub(channel).ReleaseEmbedding(
                hpb.ReleaseEmbeddingRequest(ticket="x"), timeout=0.3
            )
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(60):
            if slow.held and len(holder) == 0:
                break
            await asyncio.sleep(0.05)
        assert len(slow.held) == 2 and len(holder) == 0 and holder.held_bytes == 0
        assert segments(shm_dir) == []
    fast = _SlowHolding(holder, hold_s=0.0)  # a call that is answered keeps its holds
    async with in_process_server(
        hpb_grpc.add_HandoffServiceServicer_to_server, fast, handoff.HANDOFF_SERVICE
    ) as channel:
        await hpb_grpc.HandoffServiceStub(channel).ReleaseEmbedding(
            hpb.ReleaseEmbeddingRequest(ticket="x"), timeout=10
        )
        await asyncio.sleep(0.3)
        assert len(holder) == 2
    holder.close()


class _SilentHolder(hpb_grpc.HandoffServiceServicer):
    """Accepts ReadEmbedding and never streams a byte."""

    async def ReadEmbedding(self, request, context):  # type: ignore[no-untyped-def]
        import asyncio

        await asyncio.sleep(30)
        yield hpb.ReadEmbeddingResponse()


def forged(holder: str, service: str = "test", shm_name: str = "") -> tensor_pb2.ImageEmbedding:
    import secrets

    msg = tensor_pb2.ImageEmbedding(grid=tensor_pb2.GridTHW(t=1, h=4, w=4))
    msg.embeddings.dtype, msg.embeddings.shape[:] = tensor_pb2.DATA_TYPE_FP32, [4, 8]
    ticket = secrets.token_hex(16)
    msg.ref.CopyFrom(
        tensor_pb2.EmbeddingRef(
            holder=holder, ticket=ticket, nbytes=128, service=service,
            transport=SHM if shm_name else GRPC,
            shm_name=shm_name.format(ticket=ticket),
        )
    )  # fmt: skip
    return msg


async def test_a_holder_that_never_streams_fails_the_read_within_the_cap() -> None:
    """With no deadline from the request, a read still ends (found by an adversarial
    probe: a Put and a Generate waited on such a holder for over 60 s)."""
    import time

    ports: list[int] = []
    async with in_process_server(
        hpb_grpc.add_HandoffServiceServicer_to_server,
        _SilentHolder(),
        handoff.HANDOFF_SERVICE,
        on_port=ports.append,
    ):
        address = f"127.0.0.1:{ports[0]}"
        reader = handoff.Reader(max_read_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(ServiceError) as err:
            await reader.fetch(forged(address), field="images[0]", timeout=None)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 < 10
        await reader.close()


async def test_a_reader_keeps_a_bounded_number_of_holder_channels() -> None:
    """Refs name their holder; a caller forging many addresses must not grow the reader's
    channels forever (found by an adversarial probe: +77 MB for 2,000 addresses)."""
    reader = handoff.Reader(max_channels=3)
    for port in range(9, 9 + 10):
        with pytest.raises(ServiceError):
            await reader.fetch(forged(f"127.0.0.1:{port}"), field="images[0]", timeout=2)
        assert len(reader._channels) <= 3
    assert list(reader._channels) == [f"127.0.0.1:{p}" for p in (16, 17, 18)]
    await reader.close()


async def test_a_segment_of_another_service_than_the_refs_is_refused(shm_dir: Path) -> None:
    """A ref naming the encoder as its service but a cache segment: read there and
    released here, the cache's entry would stay held (found by an adversarial probe)."""
    reader = handoff.Reader(shm_dir=shm_dir)
    msg = forged("127.0.0.1:9", service="encoder", shm_name="splitvl-cache-1-{ticket}")
    with pytest.raises(ServiceError) as err:
        await reader.fetch(msg, field="images[0]", timeout=2)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "held by its service ('encoder')" in err.value.message
    await reader.close()


def test_a_record_of_owned_segments_is_private_and_only_its_owners_is_trusted(
    shm_dir: Path,
) -> None:
    """The record is created 0600; a record of another user lists nothing to delete (one
    planted by a local user must not make a service delete files it names)."""
    (shm_dir / "psm_0badc0de").write_bytes(b"x")
    path = handoff.record_owned_segments("decoder", ["psm_0badc0de"], shm_dir=shm_dir)
    assert path is not None and (path.stat().st_mode & 0o777) == 0o600
    assert handoff._owned_by(path) == ["psm_0badc0de"]
    if os.getuid() == 0:  # only root can give the record to another user
        os.chown(path, 65534, 65534)
        assert handoff._owned_by(path) == []


_SEMAPHORE_OWNER = """
import multiprocessing, sys, time
from vlcommon import handoff
tracker = handoff.start_resource_tracker_in_own_group() if sys.argv[1] == "own" else None
lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore, registered
print(lock._semlock.name, tracker, flush=True)
time.sleep(60)
"""


def _killed_group_leaves(group: str) -> tuple[bool, int | None, int]:
    """Start a process in a group of its own that makes a named semaphore, kill -9 its
    whole group, and say whether the semaphore's /dev/shm file is still there 10 s later
    (plus the tracker's pid and the group)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SEMAPHORE_OWNER, group],
        stdout=subprocess.PIPE,
        env=env,
        process_group=0,
    )
    assert proc.stdout is not None
    name, tracker = proc.stdout.readline().decode().split()
    path = Path("/dev/shm") / f"sem.{name.lstrip('/')}"
    try:
        assert path.exists(), path
        tracker_pid = None if tracker == "None" else int(tracker)
        if tracker_pid is not None:
            assert os.getpgid(tracker_pid) == tracker_pid != os.getpgid(proc.pid)
        os.killpg(proc.pid, 9)
        proc.wait()
        deadline = time.monotonic() + 10
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return path.exists(), tracker_pid, proc.pid
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="POSIX named semaphores live there")
def test_a_tracker_in_its_own_group_unlinks_semaphores_after_a_kill_9_of_the_group() -> None:
    """Issue 14: nothing of a killed process group stays in /dev/shm. With the stock
    tracker (in the caller's group) a killpg leaves the semaphore behind; with the tracker
    in its own group, the tracker outlives the kill, sees its pipe close and unlinks it."""
    left, tracker, _ = _killed_group_leaves("stock")
    assert left and tracker is None  # the failure the function exists for
    left, tracker, _ = _killed_group_leaves("own")
    assert tracker is not None and not left
    import psutil

    try:  # it exits once it has cleaned up (a zombie until its new parent reaps it)
        psutil.Process(tracker).wait(timeout=10)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        assert psutil.Process(tracker).status() == psutil.STATUS_ZOMBIE


def test_concurrent_calls_start_one_tracker_and_restore_the_stdlib_launcher() -> None:
    """Two threads calling it at once: one tracker starts (the other call finds it), and
    multiprocessing's own launcher is back afterwards (overlapping calls used to restore
    each other's replacement, leaving every later spawn in a group of its own)."""
    code = (
        "import threading, time\n"
        "from multiprocessing import resource_tracker, util\n"
        "from vlcommon import handoff\n"
        "original = util.spawnv_passfds\n"
        "stock = resource_tracker._resource_tracker.ensure_running\n"
        "def slow():  # widen the window in which the calls could overlap\n"
        "    time.sleep(0.3)\n"
        "    stock()\n"
        "resource_tracker._resource_tracker.ensure_running = slow\n"
        "got = []\n"
        "threads = [threading.Thread(target=lambda: got.append("
        "handoff.start_resource_tracker_in_own_group())) for _ in range(4)]\n"
        "for t in threads: t.start()\n"
        "for t in threads: t.join()\n"
        "print(sum(g is not None for g in got), util.spawnv_passfds is original)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.stdout.split() == ["1", "True"], out.stdout + out.stderr
