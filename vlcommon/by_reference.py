"""Answering one RPC by reference: whether to, and holding its payloads for that call.

The encoder (its ViT outputs, ``Encode``) and the cache (its hits, ``Lookup``) answer the
same way when the request names a ``transport``: each payload is held by the service's
:class:`vlcommon.handoff.Holder` and the response carries its ``EmbeddingRef``. This module
is that answer, written once::

    by_ref = by_reference(request.transport, self.holder)  # refuses a bad transport
    ...
    held = await hold_answer(
        self.holder, payloads, transport=request.transport, on_thread=big
    )

A holding that fails part-way (``HANDOFF_FULL``) frees what it had held; one made while
its call is cancelled is freed once made (:func:`vlcommon.handoff.hold_on_thread`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from opentelemetry import trace
from qwenvl.common.v1 import tensor_pb2

from vlcommon import handoff
from vlcommon.handoff import Holder, check_transport, transport_name


@dataclass(frozen=True)
class Payload:
    """One embedding to hold for its readers.

    Attributes:
        data: Row-major bytes (``dtype``, ``shape``) that nobody writes while held.
        dtype: A ``DataType`` value.
        shape: The tensor's shape, e.g. ``(tokens, width)``.
        on_release: Runs once: when the last reader released the hold or it expired,
            or, when the answer fails before this payload is held, at that failure (the
            cache ends the entry's lease there).
    """

    data: bytes | bytearray | memoryview
    dtype: int
    shape: tuple[int, ...]
    on_release: Callable[[], None] | None = None


@dataclass(frozen=True)
class Held:
    """A payload as held: the payload itself and the ref its readers fetch it by."""

    payload: Payload
    ref: tensor_pb2.EmbeddingRef


def by_reference(transport: int, holder: Holder | None, field: str = "transport") -> bool:
    """Whether a request answers by reference: it names a transport and this service has
    a holder (one built without a holder, embedded in a tool or a test, answers inline).

    Raises:
        ServiceError: INVALID_ARGUMENT ``TRANSPORT_UNSUPPORTED`` naming ``field`` for a
            number that is not a ``Transport`` value.
    """
    check_transport(transport, field)
    return transport != tensor_pb2.TRANSPORT_UNSPECIFIED and holder is not None


def hold_all(
    holder: Holder,
    payloads: Iterable[Payload | None],
    *,
    transport: int,
    readers: int = 1,
) -> list[Held | None]:
    """Hold each payload (None: nothing to hold, e.g. a miss) in order.

    ``payloads`` may be a generator: each payload is then made just before its hold (the
    encoder's cast, the cache's lease), and none after a failure.

    Returns:
        One :class:`Held` per payload, None where the payload was None.

    Raises:
        ServiceError: RESOURCE_EXHAUSTED ``HANDOFF_FULL`` from the holder; what this call
            had held is dropped first, and the ``on_release`` of the payload it failed on
            runs.
    """
    held: list[Held | None] = []
    payload: Payload | None = None
    try:
        for payload in payloads:
            if payload is None:
                held.append(None)
                continue
            ref = holder.hold(
                payload.data,
                payload.dtype,
                payload.shape,
                transport=transport,
                readers=readers,
                on_release=payload.on_release,
            )
            held.append(Held(payload, ref))
            payload = None
    except BaseException:  # HANDOFF_FULL part-way: free what this answer held
        if payload is not None and payload.on_release is not None:
            payload.on_release()
        for h in held:
            if h is not None:
                holder.drop(h.ref.ticket)
        raise
    return held


async def hold_answer(
    holder: Holder,
    payloads: Iterable[Payload | None],
    *,
    transport: int,
    readers: int = 1,
    on_thread: bool,
) -> list[Held | None]:
    """Hold one answer's payloads (:func:`hold_all`), and record on the current span the
    bytes held (``splitvl.embedding.held_bytes``) and each ref's transport
    (``splitvl.embedding.transports``).

    Args:
        on_thread: Make the payloads and hold them on a worker thread (a shared-memory
            copy of 16 MiB takes a few ms), through :func:`vlcommon.handoff.hold_on_thread`:
            no hold outlives a call cancelled meanwhile (it would have no reader and stay
            held, its cache entry leased, until the TTL). False: on the event loop, with
            no await between the holds and the answer.

    Raises:
        asyncio.CancelledError: the call was cancelled while holding (``on_thread``); the
            holds are freed once made.
        ServiceError: RESOURCE_EXHAUSTED ``HANDOFF_FULL`` (as :func:`hold_all`).
    """
    held: list[Held | None] = []

    def hold() -> list[tensor_pb2.EmbeddingRef | None]:
        held.extend(hold_all(holder, payloads, transport=transport, readers=readers))
        return [None if h is None else h.ref for h in held]

    refs = await handoff.hold_on_thread(holder, hold) if on_thread else hold()
    span = trace.get_current_span()
    span.set_attribute("splitvl.embedding.held_bytes", sum(r.nbytes for r in refs if r))
    span.set_attribute(
        "splitvl.embedding.transports", [transport_name(r.transport) for r in refs if r]
    )
    return held
