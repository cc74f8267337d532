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
from vlcommon.handoff_reader import MAX_CHANNELS as MAX_CHANNELS
from vlcommon.handoff_reader import MAX_READ_S as MAX_READ_S
from vlcommon.handoff_reader import MAX_REF_BYTES as MAX_REF_BYTES
from vlcommon.handoff_reader import MAX_TICKET_CHARS as MAX_TICKET_CHARS
from vlcommon.handoff_reader import Fetched as Fetched
from vlcommon.handoff_reader import Reader as Reader
from vlcommon.refusals import Refusal
from vlcommon.settings import MiB
from vlcommon.shm_segments import SHM_DIR as SHM_DIR
from vlcommon.shm_segments import _owned_by as _owned_by
from vlcommon.shm_segments import mapped_segments as mapped_segments
from vlcommon.shm_segments import record_owned_segments as record_owned_segments
from vlcommon.shm_segments import (
    start_resource_tracker_in_own_group as start_resource_tracker_in_own_group,
)
from vlcommon.shm_segments import sweep_dead_segments as sweep_dead_segments

log = logging.getLogger(__name__)
tracer = trace.get_tracer("splitvl.handoff")

CHUNK_BYTES = 4 * MiB
MAX_READERS = 8
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
