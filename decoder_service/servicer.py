"""``qwenvl.decoder.v1.DecoderService``: checks a request, prepares its engine inputs
(:mod:`decoder_service.prepare`), streams vLLM's output, and maps failures to statuses.

Usage::

    servicer = DecoderServicer(engine, limits, on_engine_dead=stop.set, reader=Reader())
    decoder_service_pb2_grpc.add_DecoderServiceServicer_to_server(servicer, server)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import grpc
from opentelemetry import trace
from qwenvl.common.v1 import generation_pb2, tensor_pb2
from qwenvl.decoder.v1 import decoder_service_pb2 as pb
from qwenvl.decoder.v1 import decoder_service_pb2_grpc as pb_grpc

from decoder_service import metrics
from decoder_service.continuation import ContinuedText
from decoder_service.engine import DecoderEngine, Delta
from decoder_service.prepare import Prepared, Preparer
from decoder_service.validation import Limits
from vlcommon.deadline import Deadline
from vlcommon.errors import ServiceError, abort
from vlcommon.handoff import Reader
from vlcommon.model_info import VisionSpec
from vlcommon.refusals import Refusal

log = logging.getLogger(__name__)
tracer = trace.get_tracer("splitvl.decoder")
FINISH = {"stop": generation_pb2.FINISH_REASON_STOP, "length": generation_pb2.FINISH_REASON_LENGTH}


def _wall_ns(monotonic_s: float) -> int:
    """Epoch nanoseconds of a ``time.monotonic()`` reading taken on this host.

    vLLM stamps its engine-core events with ``time.monotonic()`` in the engine-core process;
    CLOCK_MONOTONIC is one clock for the whole host on Linux, so the reading maps to wall
    time by its distance from now.
    """
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def _engine_spans(stats: object, parent_end_ns: int) -> tuple[float, float] | None:
    """Record ``decoder.queue`` (queued -> scheduled) and ``decoder.prefill`` (scheduled ->
    first token) as children of the current span, from vLLM's ``RequestStateStats``.

    Returns:
        (queue wait, prefill) in seconds, or None when vLLM kept no timestamps.
    """
    queued = float(getattr(stats, "queued_ts", 0.0) or 0.0)
    scheduled = float(getattr(stats, "scheduled_ts", 0.0) or 0.0)
    first = float(getattr(stats, "first_token_ts", 0.0) or 0.0)
    if not (0.0 < queued <= scheduled <= first):
        return None
    t_queued, t_scheduled, t_first = (
        min(_wall_ns(t), parent_end_ns) for t in (queued, scheduled, first)
    )
    queue = tracer.start_span("decoder.queue", start_time=t_queued)
    queue.set_attribute("splitvl.decoder.queue_wait_ms", (scheduled - queued) * 1000)
    queue.end(end_time=t_scheduled)
    prefill = tracer.start_span("decoder.prefill", start_time=t_scheduled)
    prefill.set_attribute("splitvl.decoder.prefill_ms", (first - scheduled) * 1000)
    prefill.add_event("first_token", timestamp=t_first)
    prefill.end(end_time=t_first)
    return scheduled - queued, first - scheduled


class _StreamRecord:
    """What one Generate stream records as its deltas arrive: TTFT and ITL, vLLM's queue
    wait and prefill (metrics and child spans), output and prompt tokens, and the
    ``decoder.generation`` span (first token -> last token) under ``span``."""

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.start = time.perf_counter()
        self.last = self.start
        self.first = True
        self.generation: trace.Span | None = None

    def tokens(self, delta: Delta) -> None:
        """Record the arrival of ``delta``'s tokens (none: nothing to record)."""
        if not delta.token_ids:
            return
        now = time.perf_counter()
        if self.first:
            metrics.TTFT.observe(now - self.start)
            self.span.add_event("first_token", {"splitvl.ttft_ms": (now - self.start) * 1000})
            engine_times = _engine_spans(delta.stats, time.time_ns())
            if engine_times is not None:
                metrics.QUEUE_WAIT.observe(engine_times[0])
                metrics.PREFILL_SECONDS.observe(engine_times[1])
            self.generation = tracer.start_span("decoder.generation")
            self.first = False
        else:
            metrics.ITL.observe((now - self.last) / len(delta.token_ids))
        self.last = now
        metrics.OUTPUT_TOKENS.inc(len(delta.token_ids))

    def finished(self, delta: Delta, reason: str) -> None:
        """Record the last delta's usage and finish ``reason``; end the generation span."""
        metrics.PROMPT_TOKENS.inc(delta.prompt_tokens)
        self.span.set_attribute("splitvl.usage.completion_tokens", delta.completion_tokens)
        self.span.set_attribute("splitvl.finish_reason", reason)
        if self.generation is not None:
            self.generation.set_attribute(
                "splitvl.usage.completion_tokens", delta.completion_tokens
            )
        self.end()

    def end(self) -> None:
        """End the generation span if it is open (cancelled, failed, or no finish reason)."""
        if self.generation is not None:
            self.generation.end()
            self.generation = None


def _response(delta: Delta, record: _StreamRecord) -> pb.GenerateResponse:
    """The response for one delta; the last one carries the finish reason and usage."""
    record.tokens(delta)
    response = pb.GenerateResponse(token_ids=delta.token_ids, text=delta.text)
    if delta.finish_reason is not None:
        response.finish_reason = FINISH.get(delta.finish_reason, generation_pb2.FINISH_REASON_STOP)
        response.usage.prompt_tokens = delta.prompt_tokens
        response.usage.completion_tokens = delta.completion_tokens
        record.finished(delta, delta.finish_reason)
    return response


def _draining() -> ServiceError:
    """The status of a stream handed back as the decoder stops: the gateway moves it."""
    return Refusal.DECODER_DRAINING.error(
        "the decoder is stopping; the answer moves to another replica"
    )


def _continued(delta: Delta, text: ContinuedText, continuation: list[int]) -> tuple[Delta, bool]:
    """A continued answer's delta: the text over both replicas' tokens, a stop string
    across the boundary, and the counts of the whole answer (the original prompt; every
    completion token once). Returns it and whether a stop string ended the answer."""
    piece, stopped = text.step(delta.token_ids, finished=delta.finish_reason is not None)
    k = len(continuation)
    return (
        dataclasses.replace(
            delta,
            text=piece,
            finish_reason="stop" if stopped else delta.finish_reason,
            prompt_tokens=delta.prompt_tokens - k,
            completion_tokens=delta.completion_tokens + k,
        ),
        stopped,
    )


def _unread_refs(request: pb.GenerateRequest, read: set[str]) -> list[tensor_pb2.EmbeddingRef]:
    """The refs of ``request`` whose tickets are not in ``read``."""
    refs = [e.ref for e in request.images if e.HasField("ref")]
    refs += [v.embedding.ref for v in request.videos if v.embedding.HasField("ref")]
    return [r for r in refs if r.ticket not in read]


class DecoderServicer(pb_grpc.DecoderServiceServicer):
    """Serves Generate on a :class:`DecoderEngine`."""

    def __init__(
        self,
        engine: DecoderEngine,
        limits: Limits,
        on_engine_dead: Callable[[], None] | None = None,
        reader: Reader | None = None,
    ) -> None:
        self.engine = engine
        self.limits = limits
        # Reads the embeddings that arrive by reference (ImageEmbedding.ref).
        self.reader = reader or Reader()
        self.preparer = Preparer(engine, limits, self.reader)
        # Called once the engine is found dead: the service turns NOT_SERVING and exits so
        # its supervisor restarts it (a dead vLLM engine never recovers in process).
        self.on_engine_dead = on_engine_dead or (lambda: None)
        # vLLM request ids of the streams in progress, for a drain's hand-off.
        self._streams: set[str] = set()
        self.handing_off = False

    async def hand_off(self) -> int:
        """End every stream in progress with UNAVAILABLE ``DECODER_DRAINING``, which the
        gateway reads as "move this answer to another replica" (request migration): each
        stream ends at its next output, and vLLM's requests are aborted so that queued ones
        end too; a call still preparing ends the same way before it reaches vLLM. Called
        when a drain's grace is nearly over, so the answers still running move instead of
        being cut. Returns how many streams vLLM was running.
        """
        self.handing_off = True
        ids = sorted(self._streams)
        if ids:
            log.warning("handing %d streams in progress to the gateway to move", len(ids))
            metrics.HANDED_OFF.inc(len(ids))
            await self.engine.abort(ids)
        return len(ids)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Check the request, prepare its engine inputs, stream vLLM's output; a cancel
        aborts the vLLM request.

        Raises:
            ServiceError: INVALID_ARGUMENT for a request a check refuses; UNAVAILABLE when
                the engine is not ready or dead, or an embedding's holder cannot be read;
                UNAVAILABLE ``DECODER_DRAINING`` when the service is stopping and hands
                the stream back (:meth:`hand_off`); DEADLINE_EXCEEDED. vLLM's own refusal
                aborts the call with INVALID_ARGUMENT ``ENGINE_REJECTED``, and its engine's
                death with UNAVAILABLE ``ENGINE_DEAD``.
        """
        request_id = f"{request.request_id or 'req'}-{uuid.uuid4().hex[:12]}"
        read: set[str] = set()  # tickets of refs read (each read releases its own)
        try:
            if self.handing_off:
                raise _draining()
            checked = self.preparer.check(request, self._ready_spec())
            prepared = await self.preparer.prepare(request, checked, Deadline.of(context), read)
            # aclosing: a GeneratorExit at our yield closes _stream (aborting vLLM's) at once.
            async with contextlib.aclosing(self._stream(request_id, prepared)) as stream:
                async for response in stream:
                    yield response
        except (asyncio.CancelledError, GeneratorExit):
            # A client cancel arrives as CancelledError when it lands in one of our awaits, and
            # as GeneratorExit when it lands while grpc.aio writes a response we yielded (the
            # framework then closes this generator). Either way vLLM's request is aborted by
            # the engine wrapper's finally.
            metrics.ABORTED.inc()
            log.info("request %s cancelled by the client: vLLM request aborted", request_id)
            raise
        except Exception as exc:
            await self._abort_on_engine_error(context, exc)
            raise
        finally:
            # Refs not read (the request failed before their reads) are freed at their
            # holders now rather than at their TTL.
            self.reader.release_unread(_unread_refs(request, read))

    def _ready_spec(self) -> VisionSpec:
        """The model's vision spec, once the engine is up and alive.

        Raises:
            ServiceError: UNAVAILABLE ``ENGINE_NOT_READY`` or ``ENGINE_DEAD`` (the latter
                also calls ``on_engine_dead``).
        """
        if self.engine.llm is None or self.engine.spec is None:
            raise Refusal.ENGINE_NOT_READY.error("decoder engine is not ready")
        if self.engine.dead:
            self.on_engine_dead()
            raise Refusal.ENGINE_DEAD.error("decoder engine has died; the service is restarting")
        return self.engine.spec

    async def _stream(
        self, request_id: str, prepared: Prepared
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Submit ``prepared`` to vLLM under the ``decoder.generate`` span and yield a
        response per delta. Closing this generator closes the engine stream at once, which
        aborts the vLLM request."""
        with tracer.start_as_current_span("decoder.generate") as span:
            self._describe(span, request_id, prepared)
            record = _StreamRecord(span)
            stream = self._submit(request_id, prepared)
            self._streams.add(request_id)
            try:
                if self.handing_off:  # hand_off ran while this call was preparing
                    raise _draining()
                # aclosing: a GeneratorExit at our yield closes the engine stream (and so
                # aborts the vLLM request) at once, not when the garbage collector
                # finalises it.
                async with contextlib.aclosing(stream):
                    first = True
                    async for delta in stream:
                        # Checked on every output, not only vLLM's "abort" one: a request
                        # vLLM had not registered yet when hand_off aborted it runs on.
                        if self.handing_off:
                            span.add_event("handed_off")
                            raise _draining()
                        if prepared.text is None:
                            yield _response(delta, record)
                            continue
                        delta, stopped = _continued(delta, prepared.text, prepared.continuation)
                        response = _response(delta, record)
                        if first:
                            response.continued_tokens = len(prepared.continuation)
                            first = False
                        yield response
                        if stopped:  # a stop string across the boundary: vLLM did not see it
                            return
            finally:
                self._streams.discard(request_id)
                record.end()

    def _submit(self, request_id: str, prepared: Prepared) -> AsyncGenerator[Delta, None]:
        """vLLM's output stream of ``prepared`` (a continuation: the prompt's ids and the
        answer so far as token ids)."""
        return self.engine.generate(
            request_id,
            prepared.prompt,
            prepared.images,
            prepared.params,
            prepared.videos,
            priority=prepared.priority,
            prompt_token_ids=(
                prepared.prompt_ids + prepared.continuation if prepared.continuation else None
            ),
        )

    def _describe(self, span: trace.Span, request_id: str, prepared: Prepared) -> None:
        """The request on its ``decoder.generate`` span."""
        span.set_attribute("splitvl.request.model", str(self.engine.engine_args.model))
        span.set_attribute("splitvl.request.id", request_id)
        span.set_attribute("splitvl.request.images", len(prepared.images))
        span.set_attribute("splitvl.request.max_tokens", prepared.max_tokens)
        span.set_attribute("splitvl.usage.prompt_tokens", prepared.prompt_tokens)
        span.set_attribute("splitvl.embedding.bytes", prepared.received_bytes)
        span.set_attribute("splitvl.request.videos", len(prepared.videos))
        span.set_attribute("splitvl.continuation.tokens", len(prepared.continuation))

    async def _abort_on_engine_error(
        self, context: grpc.aio.ServicerContext, exc: Exception
    ) -> None:
        """Abort the call for a failure of vLLM's: INVALID_ARGUMENT ``ENGINE_REJECTED``
        when it refused the request, UNAVAILABLE ``ENGINE_DEAD`` (and ``on_engine_dead``)
        when its engine died. Any other failure returns, for the caller to re-raise."""
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, VLLMClientError | ValueError):
            await abort(
                context,
                Refusal.ENGINE_REJECTED.error(f"vLLM rejected the request: {exc}", field="request"),
            )
        if isinstance(exc, EngineDeadError) or self.engine.dead:
            log.error("vLLM engine died: %s", exc)
            self.on_engine_dead()
            await abort(
                context,
                Refusal.ENGINE_DEAD.error(f"decoder engine died: {exc}"),
            )
