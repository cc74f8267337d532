"""The reading side of embeddings by reference: :class:`Reader` fetches what a holder
(:class:`vlcommon.handoff.Holder`) keeps, from its shared-memory segment on the same host
or over its ``HandoffService/ReadEmbedding`` stream, and releases it once read. The module
docstring of :mod:`vlcommon.handoff` describes both transports.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from opentelemetry import trace
from qwenvl.common.v1 import tensor_pb2
from qwenvl.handoff.v1 import handoff_service_pb2 as pb
from qwenvl.handoff.v1 import handoff_service_pb2_grpc as pb_grpc

from vlcommon import tensors
from vlcommon.errors import ServiceError
from vlcommon.refusals import Refusal
from vlcommon.settings import MiB, channel_options
from vlcommon.shm_segments import SEGMENT_NAME as _SEGMENT
from vlcommon.shm_segments import SHM_DIR
from vlcommon.tls import ClientSecurity, aio_channel

log = logging.getLogger(__name__)
tracer = trace.get_tracer("splitvl.handoff")

MAX_TICKET_CHARS = 128
# The largest payload one ref may stand for: 16,384 video tokens of Qwen3-VL-8B's width in
# float32 are 16,384 x 16,384 x 4 = 1 GiB. The reader allocates nbytes before reading.
MAX_REF_BYTES = 1024 * MiB
# Longest wait for one ReadEmbedding, seconds, when the request set no deadline (or a
# longer one): 16 MiB over gRPC takes well under a second on loopback.
MAX_READ_S = 60.0
# Holder channels a Reader keeps open (one per address; the oldest closed beyond).
MAX_CHANNELS = 64


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
