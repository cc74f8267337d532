"""Embeddings by reference: a holder keeps them for their readers, a reader fetches them.

The encoder (after a miss) and the cache (for a hit) *hold* an image's embeddings and hand
out an ``EmbeddingRef``; the decoder (and the cache, storing an encoder's output) *reads*
them straight from the holder, so the gateway moves keys, grids and refs, never
embedding bytes (DESIGN.md, "References, not payloads"). Two transports:

- ``TRANSPORT_SHM``: the holder writes the bytes into a file under ``/dev/shm`` (POSIX
  shared memory); a reader on the same host (or in the same Kubernetes pod, whose
  containers share IPC) reads the file. No socket carries the bytes.
- ``TRANSPORT_GRPC``: the reader calls the holder's ``HandoffService/ReadEmbedding``, one
  stream of raw chunks (``CHUNK_BYTES``), so no message approaches the size limit.

A reader whose shared-memory segment is not there (another host, another user) reads the
same ticket over gRPC instead. A held entry lives until its ``readers`` have released it
or its TTL passes; a reader that never comes (it died) costs memory only until then.

Segments are named ``splitvl-<service>-<pid>-<32 hex>``. A holder started after a
``kill -9`` of its predecessor removes the segments of dead processes of its own service
(:func:`sweep_dead_segments`), so nothing of a dead process stays in ``/dev/shm``.
``multiprocessing.shared_memory`` is not used: on Python 3.11 every process that opens a
segment registers it with its resource tracker, which unlinks it when that process exits
(bpo-39959), so a reader would free the holder's segment; plain files under /dev/shm
with ``os.posix_fallocate`` (which fails with ENOSPC instead of a later SIGBUS when the
tmpfs is full) do what is needed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from opentelemetry import trace
from prometheus_client import Counter, Gauge
from qwenvl.common.v1 import tensor_pb2
from qwenvl.handoff.v1 import handoff_service_pb2 as pb
from qwenvl.handoff.v1 import handoff_service_pb2_grpc as pb_grpc

from vlcommon import tensors
from vlcommon.errors import ServiceError
from vlcommon.refusals import Refusal
from vlcommon.settings import MiB, channel_options
from vlcommon.tls import ClientSecurity, aio_channel

log = logging.getLogger(__name__)
tracer = trace.get_tracer("splitvl.handoff")

SHM_DIR = Path("/dev/shm")
CHUNK_BYTES = 4 * MiB
MAX_READERS = 8
MAX_TICKET_CHARS = 128
# The largest payload one ref may stand for: 16,384 video tokens of Qwen3-VL-8B's width in
# float32 are 16,384 x 16,384 x 4 = 1 GiB. The reader allocates nbytes before reading.
MAX_REF_BYTES = 1024 * MiB
TRANSPORTS = {
    "shm": tensor_pb2.TRANSPORT_SHM,
    "grpc": tensor_pb2.TRANSPORT_GRPC,
}
HELD_BYTES = Gauge(
    "splitvl_handoff_held_bytes",
    "Embedding bytes held for readers that have not released them yet.",
    ["service"],
)
EXPIRED = Counter(
    "splitvl_handoff_expired_total",
    "Held embeddings freed at their TTL with readers still expected (a reader died or "
    "the request failed before reading them).",
    ["service"],
)
_SEGMENT = re.compile(r"^splitvl-([a-z]+)-(\d+)-([0-9a-f]{32})$")
# Longest wait for one ReadEmbedding, seconds, when the request set no deadline (or a
# longer one): 16 MiB over gRPC takes well under a second on loopback.
MAX_READ_S = 60.0
# Holder channels a Reader keeps open (one per address; the oldest closed beyond).
MAX_CHANNELS = 64


def check_transport(transport: int, field: str = "transport") -> None:
    """Refuse a number that is not a ``Transport`` value (the encoder's ``Encode``, the
    cache's ``Lookup``).

    Raises:
        ServiceError: INVALID_ARGUMENT ``TRANSPORT_UNSUPPORTED`` naming ``field``.
    """
    if transport not in tensor_pb2.Transport.values():
        raise Refusal.TRANSPORT_UNSUPPORTED.error(
            f"{field} {transport} is not a Transport value", field=field
        )


def transport_name(transport: int) -> str:
    """``shm``, ``grpc`` or ``inline`` (unspecified: the bytes travel in the message)."""
    return {tensor_pb2.TRANSPORT_SHM: "shm", tensor_pb2.TRANSPORT_GRPC: "grpc"}.get(
        transport, "inline"
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_dead_segments(service: str, shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove ``service``'s segments left by dead processes (and by an earlier process
    with this one's pid: a restarted container is often pid 1 again).

    Called once by a holder before it serves. Segments of live processes of the service
    (another replica on this host) are left alone.

    Returns:
        The names removed.
    """
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        m = _SEGMENT.match(name)
        if m is None or m.group(1) != service:
            continue
        pid = int(m.group(2))
        if pid == os.getpid() or not _pid_alive(pid):
            for owned in _owned_by(shm_dir / name):
                try:
                    os.unlink(shm_dir / owned)
                    removed.append(owned)
                except OSError:
                    pass
            try:
                os.unlink(shm_dir / name)
                removed.append(name)
            except OSError:
                pass
    if removed:
        log.info("removed %d shared-memory segments of dead %s processes", len(removed), service)
    return removed


_OWNED_MAGIC = b"splitvl-owned-segments\n"
_FOREIGN = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


def _owned_by(path: Path) -> list[str]:
    """The segment names a record written by :func:`record_owned_segments` lists (none
    for a held-embedding segment)."""
    try:
        with open(path, "rb") as f:
            # Only a record this user wrote is trusted: one planted by another local user
            # must not make this service delete files it names.
            if os.fstat(f.fileno()).st_uid != os.getuid():
                return []
            head = f.read(len(_OWNED_MAGIC))
            if head != _OWNED_MAGIC:
                return []
            names = f.read(1 << 20).decode(errors="replace").split()
    except OSError:
        return []
    return [n for n in names if _FOREIGN.match(n) and not n.startswith("splitvl-")]


def mapped_segments(pids: list[int], shm_dir: Path = SHM_DIR) -> list[str]:
    """Names of the files under ``shm_dir`` that the processes ``pids`` map (from
    /proc/<pid>/maps), e.g. vLLM's ``psm_*`` message-queue buffers."""
    prefix = f"{shm_dir}/"
    names: set[str] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            # An unlinked file (" (deleted)", e.g. a named semaphore) leaves nothing behind.
            if path.startswith(prefix) and not path.endswith(" (deleted)"):
                if "/" not in path[len(prefix) :]:
                    names.add(path[len(prefix) :])
    return sorted(names)


def record_owned_segments(service: str, names: list[str], shm_dir: Path = SHM_DIR) -> Path | None:
    """Write down segments this process (or its children) made through libraries that
    do not clean up after a ``kill -9`` (vLLM's shared-memory message queues: Python's
    resource tracker dies with the process group). The record is named like a held
    segment of this pid, so the service's next process removes it and every segment it
    lists (:func:`sweep_dead_segments`) once this one is dead. Returns the record's path
    (None when /dev/shm is unusable or there is nothing to record)."""
    names = [n for n in names if _FOREIGN.match(n) and not n.startswith("splitvl-")]
    if not names:
        return None
    path = shm_dir / f"splitvl-{service}-{os.getpid()}-{secrets.token_hex(16)}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(_OWNED_MAGIC + "\n".join(names).encode() + b"\n")
    except OSError as err:
        log.warning("could not record the shared-memory segments of %s: %s", service, err)
        return None
    return path


def start_resource_tracker_in_own_group() -> int | None:
    """Start this process's multiprocessing resource tracker in a process group of its own.

    Python's resource tracker unlinks the named semaphores (``/dev/shm/sem.mp-*``) and
    shared-memory segments its process tree registered once every process holding its pipe
    has exited, however they died. Started the stock way it is a plain child, in the
    caller's process group, so a ``kill -9`` of that group (an OOM kill of a container's
    processes, ``splitvl up``'s lifeline, an operator's ``kill -9 -PGID``) kills it too and
    nothing unlinks them: a semaphore vLLM's engine start registers, mapped by no process,
    outlived the decoder that way (found 2026-12-04). Started in its own group, it sees
    the pipe close when the last process of the group dies, cleans up as designed and
    exits. Its children (vLLM's engine core and workers, started with ``spawn``) inherit
    its pipe, so they use the same tracker.

    Call it before anything registers a resource (before vLLM starts its engine). Stdlib's
    own ``ensure_running`` launches it, so its pipe, signal mask and bookkeeping stay
    stdlib's; only the launch (``multiprocessing.util.spawnv_passfds``, whose fixed
    ``fork_exec`` arguments cannot ask for a new group) is replaced, for this one call, by
    ``subprocess.Popen(..., process_group=0)``.

    Returns:
        The tracker's pid, or None when this process already had a tracker (started
        before this call, or inherited from a parent): left as it is.
    """
    with _TRACKER_LAUNCH:  # two calls at once would restore each other's replacement
        return _start_tracker_in_own_group()


def _start_tracker_in_own_group() -> int | None:
    import subprocess
    from multiprocessing import resource_tracker, util

    tracker = resource_tracker._resource_tracker
    if getattr(tracker, "_fd", None) is not None:
        log.warning(
            "this process already has a resource tracker (started earlier or inherited): "
            "left where it is, in its own process group or not"
        )
        return None

    def spawn_in_own_group(path: str, args: list[str], passfds: list[int]) -> int:
        proc = subprocess.Popen(
            args,
            executable=path,
            pass_fds=tuple(sorted(map(int, passfds))),
            close_fds=True,
            restore_signals=False,
            process_group=0,
        )
        _TRACKERS.append(proc)  # kept: a collected Popen would warn while it runs
        return proc.pid

    original = util.spawnv_passfds
    util.spawnv_passfds = spawn_in_own_group  # type: ignore[assignment]
    try:
        tracker.ensure_running()
    finally:
        util.spawnv_passfds = original  # type: ignore[assignment]
    pid = getattr(tracker, "_pid", None)
    return int(pid) if pid is not None else None


_TRACKERS: list[Any] = []
_TRACKER_LAUNCH = threading.Lock()


@dataclass
class _Held:
    ticket: str
    dtype: int
    shape: tuple[int, ...]
    nbytes: int
    readers_left: int
    expires_at: float  # monotonic
    data: bytes | bytearray | memoryview | None = None  # TRANSPORT_GRPC (and the fallback of SHM)
    path: Path | None = None  # TRANSPORT_SHM
    on_release: Callable[[], None] | None = None


class Holder:
    """Holds embeddings for readers in other processes (thread-safe).

    Args:
        service: ``encoder`` or ``cache``: names segments, refs and spans.
        ttl_s: Seconds an entry is held at most (longer than any request's deadline).
        max_bytes: Bytes held at once, all transports together; a hold beyond it (after
            expired entries are dropped) raises RESOURCE_EXHAUSTED ``HANDOFF_FULL``.
        shm_dir: Where segments are created (``/dev/shm``).
    """

    def __init__(
        self,
        service: str,
        *,
        ttl_s: float = 120.0,
        max_bytes: int = 4096 * MiB,
        shm_dir: Path = SHM_DIR,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not re.fullmatch(r"[a-z]+", service):
            raise ValueError(f"service name {service!r} must be lowercase letters")
        self.service = service
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.shm_dir = shm_dir
        self.clock = clock
        self.address = ""  # host:port readers reach; set once the server listens
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._bytes = 0
        self._shm_failed = False
        HELD_BYTES.labels(service=service).set_function(lambda: self._bytes)

    # -- holding --------------------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def hold(
        self,
        data: bytes | bytearray | memoryview,
        dtype: int,
        shape: tuple[int, ...],
        *,
        transport: int,
        readers: int = 1,
        on_release: Callable[[], None] | None = None,
    ) -> tensor_pb2.EmbeddingRef:
        """Hold ``data`` (``dtype``, ``shape``, row-major) for ``readers`` readers.

        ``data`` must not change while held (bytes, or a view of an array nobody writes).
        With TRANSPORT_SHM the bytes are copied into a new segment, and ``data`` is not
        kept; if the segment cannot be made (no /dev/shm, ENOSPC) the entry is held for
        TRANSPORT_GRPC instead and the ref says so. ``on_release`` runs once, when the
        last reader released it or it expired (the cache ends the entry's lease there).

        Raises:
            ServiceError: RESOURCE_EXHAUSTED ``HANDOFF_FULL`` over ``max_bytes``.
        """
        nbytes = len(memoryview(data).cast("B"))
        if nbytes != tensors.numel(shape) * tensors.ITEMSIZE[dtype]:
            raise ValueError(f"{nbytes} bytes do not hold {shape} of {tensors.dtype_name(dtype)}")
        readers = min(max(readers, 1), MAX_READERS)
        with self._lock:
            over = self._bytes + nbytes > self.max_bytes
        if over:  # expired entries make room first (the periodic sweep may lag)
            self.expire()
        with self._lock:
            if self._bytes + nbytes > self.max_bytes:
                raise Refusal.HANDOFF_FULL.error(
                    f"the {self.service} holds {self._bytes} bytes of embeddings for readers "
                    f"that have not fetched them; {nbytes} more would exceed its hand-off "
                    f"budget of {self.max_bytes} bytes ({self.service.upper()}_HANDOFF_MAX_BYTES)",
                    field="images",
                    limit=self.max_bytes,
                    retry_after_ms=200,
                )
            self._bytes += nbytes  # reserved now, so two holds cannot both pass the check
        ticket = secrets.token_hex(16)
        held = _Held(
            ticket,
            dtype,
            tuple(shape),
            nbytes,
            readers,
            self.clock() + self.ttl_s,
            on_release=on_release,
        )
        if transport == tensor_pb2.TRANSPORT_SHM and not self._shm_failed:
            path = self.shm_dir / f"splitvl-{self.service}-{os.getpid()}-{ticket}"
            try:
                _write_segment(path, data, nbytes)
                held.path = path
            except OSError as err:
                # Logged once: a deployment without a usable /dev/shm keeps working on gRPC.
                log.warning("shared memory unusable (%s); holding for gRPC reads", err)
                self._shm_failed = err.errno != 28  # ENOSPC may pass; others stay
        if held.path is None:
            held.data = data
        with self._lock:
            self._held[ticket] = held
        return tensor_pb2.EmbeddingRef(
            holder=self.address,
            ticket=ticket,
            transport=tensor_pb2.TRANSPORT_SHM if held.path else tensor_pb2.TRANSPORT_GRPC,
            shm_name=held.path.name if held.path else "",
            nbytes=nbytes,
            expires_unix_ms=int((time.time() + self.ttl_s) * 1000),
            service=self.service,
        )

    def release(self, ticket: str) -> tuple[int, int]:
        """Count one reader off ``ticket``; free it when none is left.

        Returns:
            (released, readers_left): (0, 0) for an unknown ticket.
        """
        with self._lock:
            held = self._held.get(ticket)
            if held is None:
                return 0, 0
            held.readers_left -= 1
            if held.readers_left > 0:
                return 1, held.readers_left
            del self._held[ticket]
            self._bytes -= held.nbytes
        self._free(held)
        return 1, 0

    def drop(self, ticket: str) -> bool:
        """Free ``ticket`` whatever its readers left (the call that made it never
        delivered the ref).

        Returns:
            Whether the ticket was held.
        """
        with self._lock:
            held = self._held.pop(ticket, None)
            if held is None:
                return False
            self._bytes -= held.nbytes
        self._free(held)
        return True

    def expire(self) -> int:
        """Free entries past their TTL; returns how many."""
        now = self.clock()
        with self._lock:
            gone = [h for h in self._held.values() if h.expires_at <= now]
            for h in gone:
                del self._held[h.ticket]
                self._bytes -= h.nbytes
        for h in gone:
            EXPIRED.labels(service=self.service).inc()
            log.info(
                "%s: ticket %s expired with %d readers left",
                self.service,
                h.ticket[:8],
                h.readers_left,
            )
            self._free(h)
        return len(gone)

    def close(self) -> None:
        """Free everything (the service is stopping)."""
        with self._lock:
            held, self._held, self._bytes = list(self._held.values()), {}, 0
        for h in held:
            self._free(h)

    def _free(self, held: _Held) -> None:
        if held.path is not None:
            try:
                os.unlink(held.path)
            except FileNotFoundError:
                pass
        held.data = None
        if held.on_release is not None:
            held.on_release()

    def _get(self, ticket: str) -> _Held | None:
        now = self.clock()
        with self._lock:
            held = self._held.get(ticket)
            if held is None or held.expires_at <= now:
                return None
            return held

    def read_bytes(self, ticket: str) -> tuple[_Held, memoryview] | None:
        """The held bytes of ``ticket`` (from memory, or read back from its segment)."""
        held = self._get(ticket)
        if held is None:
            return None
        data = held.data
        if data is None and held.path is not None:
            try:
                data = held.path.read_bytes()
            except FileNotFoundError:
                return None
        if data is None:
            return None
        return held, memoryview(data).cast("B")


def _write_segment(path: Path, data: bytes | bytearray | memoryview, nbytes: int) -> None:
    """Create ``path`` (0600, exclusive), reserve ``nbytes`` and write ``data``."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
        view = memoryview(data).cast("B")
        written = 0
        while written < nbytes:
            written += os.pwrite(fd, view[written:], written)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    os.close(fd)


class HandoffServicer(pb_grpc.HandoffServiceServicer):
    """``qwenvl.handoff.v1.HandoffService`` over one :class:`Holder`."""

    def __init__(self, holder: Holder, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.holder = holder
        self.chunk_bytes = chunk_bytes

    @staticmethod
    def _ticket(ticket: str) -> str:
        if not ticket or len(ticket) > MAX_TICKET_CHARS:
            raise Refusal.TICKET_INVALID.error(
                f"ticket has {len(ticket)} characters; 1..{MAX_TICKET_CHARS} are allowed",
                field="ticket",
                limit=MAX_TICKET_CHARS,
            )
        return ticket

    async def ReadEmbedding(
        self, request: pb.ReadEmbeddingRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ReadEmbeddingResponse]:
        ticket = self._ticket(request.ticket)
        found = await asyncio.to_thread(self.holder.read_bytes, ticket)
        if found is None:
            raise Refusal.TICKET_UNKNOWN.error(
                f"ticket {ticket[:16]}: the {self.holder.service} holds no such embeddings "
                "(released, expired, or the holder restarted)",
                field="ticket",
                service=self.holder.service,
            )
        held, view = found
        header = tensor_pb2.Tensor(dtype=held.dtype, shape=list(held.shape))
        trace.get_current_span().set_attribute("splitvl.embedding.bytes", held.nbytes)
        if held.nbytes == 0:
            yield pb.ReadEmbeddingResponse(header=header)
        for start in range(0, held.nbytes, self.chunk_bytes):
            chunk = pb.ReadEmbeddingResponse(data=bytes(view[start : start + self.chunk_bytes]))
            if start == 0:
                chunk.header.CopyFrom(header)
            yield chunk
        if request.release:
            self.holder.release(ticket)

    async def ReleaseEmbedding(
        self, request: pb.ReleaseEmbeddingRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseEmbeddingResponse:
        released, left = self.holder.release(self._ticket(request.ticket))
        return pb.ReleaseEmbeddingResponse(released=released, readers_left=left)


# -- reading -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fetched:
    """One fetched embedding: its bytes and how they came."""

    data: bytes | bytearray
    transport: str  # "shm", "grpc" or "inline"
    service: str  # the holder's service, "" for inline
    nbytes: int


class Reader:
    """Fetches the embeddings an ``ImageEmbedding.ref`` points to (decoder, cache).

    One channel per holder address, with the internal channels' options (TLS, tokens,
    grpc's retry policy for ReadEmbedding on UNAVAILABLE). Releases of shared-memory reads
    go out in the background: they are not on the request's critical path.
    """

    def __init__(
        self,
        security: ClientSecurity | None = None,
        *,
        max_message_bytes: int = 256 * MiB,
        shm_dir: Path = SHM_DIR,
        max_read_s: float = MAX_READ_S,
        max_channels: int = MAX_CHANNELS,
    ) -> None:
        self.security = security or ClientSecurity()
        self.max_message_bytes = max_message_bytes
        self.shm_dir = shm_dir
        self.max_read_s = max_read_s
        self.max_channels = max_channels
        # Most recently used last; the oldest is closed past max_channels (a ref names
        # its holder, so a caller that forges many addresses must not grow this forever).
        self._channels: dict[str, tuple[grpc.aio.Channel, pb_grpc.HandoffServiceStub]] = {}
        self._background: set[asyncio.Task[Any]] = set()

    def _stub(self, address: str) -> pb_grpc.HandoffServiceStub:
        found = self._channels.pop(address, None)
        if found is None:
            channel = aio_channel(
                address, self.security, options=channel_options(self.max_message_bytes)
            )
            found = (channel, pb_grpc.HandoffServiceStub(channel))
            while len(self._channels) >= self.max_channels:
                oldest = next(iter(self._channels))
                old, _ = self._channels.pop(oldest)
                task = asyncio.ensure_future(old.close(grace=5.0))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        self._channels[address] = found
        return found[1]

    async def close(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for channel, _ in self._channels.values():
            await channel.close()
        self._channels.clear()

    async def fetch(
        self, msg: tensor_pb2.ImageEmbedding, *, field: str, timeout: float | None
    ) -> Fetched:
        """The payload of ``msg``: ``msg.embeddings.data`` when inline, else the bytes its
        ref holds, checked against ``msg.embeddings``' dtype and shape.

        Raises:
            ServiceError: INVALID_ARGUMENT for a malformed ref or a size that disagrees
                with the shape; UNAVAILABLE ``EMBEDDING_REF_GONE`` (the holder no longer
                has it) or ``EMBEDDING_HOLDER_UNAVAILABLE`` (it cannot be reached in
                time), naming ``field`` and the holder.
        """
        if not msg.HasField("ref"):
            data = msg.embeddings.data
            return Fetched(data, "inline", "", len(data))
        ref = msg.ref
        expected = tensors.payload_nbytes(msg.embeddings)
        if not ref.ticket or len(ref.ticket) > MAX_TICKET_CHARS or not ref.holder:
            raise Refusal.EMBEDDING_REF_INVALID.error(
                f"{field}.ref needs a holder and a ticket of 1..{MAX_TICKET_CHARS} characters",
                field=f"{field}.ref",
            )
        if ref.nbytes > MAX_REF_BYTES:
            raise Refusal.EMBEDDING_REF_TOO_LARGE.error(
                f"{field}.ref holds {ref.nbytes} bytes; one ref may hold at most {MAX_REF_BYTES}",
                field=f"{field}.ref",
                limit=MAX_REF_BYTES,
            )
        if ref.nbytes != expected or msg.embeddings.data:
            raise Refusal.EMBEDDING_REF_INVALID.error(
                f"{field}.ref holds {ref.nbytes} bytes but {field}.embeddings "
                f"({tensors.dtype_name(msg.embeddings.dtype)} {list(msg.embeddings.shape)}) "
                f"needs {expected}, and embeddings.data must be empty",
                field=f"{field}.ref",
            )
        with tracer.start_as_current_span("embedding.fetch") as span:
            span.set_attribute("splitvl.embedding.holder", ref.service)
            span.set_attribute("splitvl.embedding.bytes", ref.nbytes)
            data = None
            if ref.transport == tensor_pb2.TRANSPORT_SHM:
                data = await self._read_segment(ref, field)
            transport = "shm"
            if data is None:
                transport = "grpc"
                data = await self._read_grpc(ref, field, timeout)
            else:
                task = asyncio.ensure_future(self._release(ref))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            span.set_attribute("splitvl.embedding.transport", transport)
            return Fetched(data, transport, ref.service, ref.nbytes)

    async def _read_segment(self, ref: tensor_pb2.EmbeddingRef, field: str) -> bytearray | None:
        m = _SEGMENT.match(ref.shm_name)
        if m is None or m.group(3) != ref.ticket or m.group(1) != ref.service:
            # The service in the name is the holder's: a segment of another holder would
            # be read here and released there, at a holder that never held it.
            raise Refusal.EMBEDDING_REF_INVALID.error(
                f"{field}.ref.shm_name {ref.shm_name[:80]!r} is not a splitvl segment of "
                f"its ticket held by its service ({ref.service!r})",
                field=f"{field}.ref.shm_name",
            )
        path = self.shm_dir / ref.shm_name

        def read() -> bytearray | None:
            out = bytearray(ref.nbytes)
            try:
                with open(path, "rb", buffering=0) as f:
                    got = f.readinto(out)
                    extra = f.read(1)
            except (FileNotFoundError, PermissionError):
                return None  # another host or user, or already gone: ask the holder
            return out if got == ref.nbytes and not extra else None

        if ref.nbytes <= MiB:
            return read()
        return await asyncio.to_thread(read)

    async def _read_grpc(
        self, ref: tensor_pb2.EmbeddingRef, field: str, timeout: float | None
    ) -> bytearray:
        # A holder that accepts the call and never streams must not hold a request that
        # set no deadline forever.
        timeout = self.max_read_s if timeout is None else min(timeout, self.max_read_s)
        out = bytearray(ref.nbytes)
        got = 0
        try:
            call = self._stub(ref.holder).ReadEmbedding(
                pb.ReadEmbeddingRequest(ticket=ref.ticket, release=True), timeout=timeout
            )
            async for chunk in call:
                n = len(chunk.data)
                if got + n > ref.nbytes:
                    break
                out[got : got + n] = chunk.data
                got += n
        except grpc.aio.AioRpcError as err:
            raise self._unavailable(ref, field, err) from err
        if got != ref.nbytes:
            raise Refusal.EMBEDDING_REF_GONE.error(
                f"{field}.ref: the {ref.service} at {ref.holder} sent {got} of {ref.nbytes} bytes",
                field=f"{field}.ref",
                service=ref.service,
            )
        return out

    @staticmethod
    def _unavailable(
        ref: tensor_pb2.EmbeddingRef, field: str, err: grpc.aio.AioRpcError
    ) -> ServiceError:
        gone = err.code() == grpc.StatusCode.NOT_FOUND  # the holder's TICKET_UNKNOWN
        refusal = Refusal.EMBEDDING_REF_GONE if gone else Refusal.EMBEDDING_HOLDER_UNAVAILABLE
        return refusal.error(
            f"{field}.ref: the {ref.service or 'holder'} at {ref.holder} "
            + (
                "no longer holds these embeddings (restarted, expired or released)"
                if gone
                else f"could not be read: {err.code().name} {err.details() or ''}".rstrip()
            ),
            field=f"{field}.ref",
            service=ref.service,
            holder=ref.holder,
        )

    async def _release(self, ref: tensor_pb2.EmbeddingRef) -> None:
        try:
            await self._stub(ref.holder).ReleaseEmbedding(
                pb.ReleaseEmbeddingRequest(ticket=ref.ticket), timeout=5.0
            )
        except grpc.aio.AioRpcError as err:  # the holder frees it at its TTL anyway
            log.info("release of %s at %s failed: %s", ref.ticket[:8], ref.holder, err.code())

    def release_unread(self, refs: list[tensor_pb2.EmbeddingRef]) -> None:
        """Release, in the background, refs this reader will not read (its request failed
        before their reads), so their holder frees them now rather than at their TTL (a
        cache hit stays leased until then)."""
        for ref in refs:
            if ref.ticket and ref.holder:
                task = asyncio.ensure_future(self._release(ref))
                self._background.add(task)
                task.add_done_callback(self._background.discard)


def advertised_address(host: str, port: int, configured: str = "") -> str:
    """The host:port readers use to reach a holder: ``configured`` when set (say
    ``$(POD_IP):50052`` from the Kubernetes downward API), else the bind address, with a
    wildcard bind (0.0.0.0, ::) replaced by this host's name."""
    if configured:
        return configured
    if host in ("0.0.0.0", "::", "[::]", ""):
        import socket

        host = socket.gethostname()
    return f"{host}:{port}"


HANDOFF_SERVICE = pb.DESCRIPTOR.services_by_name["HandoffService"].full_name


def holder_for(service: str, settings: Any) -> Holder:
    """A :class:`Holder` from a service's ``HoldingSettings``, after removing the segments
    that dead processes of ``service`` left in /dev/shm."""
    sweep_dead_segments(service)
    return Holder(service, ttl_s=settings.handoff_ttl_s, max_bytes=settings.handoff_max_bytes)


def register_holder(holder: Holder, server: grpc.aio.Server) -> None:
    """Add ``holder``'s HandoffService to ``server`` (serve()'s registrar, in ``register``)."""
    pb_grpc.add_HandoffServiceServicer_to_server(HandoffServicer(holder), server)


def on_listening(holder: Holder, settings: Any) -> Callable[[int], None]:
    """serve()'s ``on_started``: the holder learns the address it advertises."""

    def started(port: int) -> None:
        holder.address = advertised_address(settings.host, port, settings.handoff_address)

    return started


async def expire_periodically(holder: Holder, every_s: float = 5.0) -> None:
    """Free expired entries every ``every_s`` seconds (a task for the service's lifetime)."""
    while True:
        await asyncio.sleep(every_s)
        await asyncio.to_thread(holder.expire)


async def hold_on_thread(
    holder: Holder, make: Callable[[], list[tensor_pb2.EmbeddingRef | None]]
) -> list[tensor_pb2.EmbeddingRef | None]:
    """Run ``make`` (which holds entries and returns their refs) on a worker thread for
    one RPC, so that no hold outlives a call that will not deliver it: when the call is
    cancelled (by its client, or past its deadline) while ``make`` runs, its holds are
    freed once it ends. (A response lost after the handler returned cannot be seen from
    here: grpc's aio context reports no cancellation then; the caller releases what it
    received late, ``gateway.pipeline.types.answer_or_release``, and the TTL bounds the rest.)

    Raises:
        asyncio.CancelledError: the call was cancelled (the holds are freed).
        ServiceError: as ``make`` (RESOURCE_EXHAUSTED ``HANDOFF_FULL``).
    """
    task = asyncio.ensure_future(asyncio.to_thread(make))
    try:
        refs = await asyncio.shield(task)
    except asyncio.CancelledError:

        def drop(done: asyncio.Future[list[tensor_pb2.EmbeddingRef | None]]) -> None:
            if not done.cancelled() and done.exception() is None:
                for ref in done.result():
                    if ref is not None:
                        holder.drop(ref.ticket)

        task.add_done_callback(drop)
        raise
    return refs
