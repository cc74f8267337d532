"""Embeddings by reference (vlcommon.handoff): a holder served over real gRPC on loopback,
read through both transports, with releases, expiry, budgets and dead-process segments."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
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
        assert error_info(err.value).reason == "EMBEDDING_REF_GONE"
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
