"""``qwenvl.decoder.v1.DecoderService``: validates, renders the prompt, streams vLLM output."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
from opentelemetry import trace
from qwenvl.common.v1 import generation_pb2, tensor_pb2
from qwenvl.decoder.v1 import decoder_service_pb2 as pb
from qwenvl.decoder.v1 import decoder_service_pb2_grpc as pb_grpc

from decoder_service import metrics
from decoder_service.engine import DecoderEngine
from decoder_service.validation import (
    Limits,
    blank_texts,
    check_control_tokens,
    check_embedding_shape,
    check_image,
    check_video,
    to_chat_messages,
    video_order,
)
from vlcommon.errors import ServiceError, abort, invalid_argument
from vlcommon.handoff import Fetched, Reader
from vlcommon.sampling import check_max_tokens, check_sampling_ranges

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


def sampling_params(msg: generation_pb2.SamplingParams, limits: Limits) -> object:
    """vLLM SamplingParams from the proto, with every field range-checked.

    Raises:
        ServiceError: INVALID_ARGUMENT naming ``sampling.<field>`` and its range.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else limits.max_tokens_default
    check_max_tokens(max_tokens, limits.max_tokens_limit)
    top_p = check_sampling_ranges(msg)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=msg.temperature,
            top_p=top_p,
            seed=msg.seed if msg.HasField("seed") else None,
            stop=list(msg.stop) or None,
            ignore_eos=msg.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
        )
    except ValueError as exc:  # any check of vLLM's own that ours did not anticipate
        raise invalid_argument(
            "SAMPLING_INVALID", f"sampling is invalid: {exc}", field="sampling"
        ) from exc


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
        # Called once the engine is found dead: the service turns NOT_SERVING and exits so
        # its supervisor restarts it (a dead vLLM engine never recovers in process).
        self.on_engine_dead = on_engine_dead or (lambda: None)

    async def _fetch_all(
        self,
        request: pb.GenerateRequest,
        order: list[int],
        v_order: list[int],
        context: grpc.aio.ServicerContext,
        read: set[str],
    ) -> tuple[dict[int, Fetched], dict[int, Fetched]]:
        """Every image's and video's payload, inline or read by reference, concurrently
        and within the call's deadline (a failed read fails the request with UNAVAILABLE
        naming the image and its holder). ``read`` collects the tickets read."""
        timeout = context.time_remaining() if context is not None else None
        items = [(f"images[{i}]", request.images[i]) for i in order]
        items += [(f"videos[{i}].embedding", request.videos[i].embedding) for i in v_order]

        async def fetch(field: str, msg: tensor_pb2.ImageEmbedding) -> Fetched:
            got = await self.reader.fetch(msg, field=field, timeout=timeout)
            if msg.HasField("ref"):
                read.add(msg.ref.ticket)  # released by its read
            return got

        with tracer.start_as_current_span("decoder.fetch_embeddings") as span:
            # Every read ends before this returns or raises (none left running behind a
            # failed one, so the tickets read are known when the request fails).
            results = await asyncio.gather(
                *(fetch(field, msg) for field, msg in items), return_exceptions=True
            )
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            got = [r for r in results if isinstance(r, Fetched)]
            span.set_attribute("splitvl.embedding.bytes", sum(g.nbytes for g in got))
            span.set_attribute("splitvl.embedding.transports", [g.transport for g in got])
        images = dict(zip(order, got[: len(order)], strict=True))
        videos = dict(zip(v_order, got[len(order) :], strict=True))
        return images, videos

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = f"{request.request_id or 'req'}-{uuid.uuid4().hex[:12]}"
        generation: trace.Span | None = None  # first token -> last token
        read: set[str] = set()  # tickets of refs read (each read releases its own)
        fetched = False
        try:
            if self.engine.llm is None or self.engine.spec is None:
                raise ServiceError(
                    grpc.StatusCode.UNAVAILABLE, "ENGINE_NOT_READY", "decoder engine is not ready"
                )
            if self.engine.dead:
                self.on_engine_dead()
                raise ServiceError(
                    grpc.StatusCode.UNAVAILABLE,
                    "ENGINE_DEAD",
                    "decoder engine has died; the service is restarting",
                )
            limits = dataclasses.replace(self.limits, max_images=self.engine.max_images)
            messages, order = to_chat_messages(request, self.engine.forbidden_tokens, limits)
            v_order = video_order(request, self.engine.max_videos)
            # Every shape against its grid and the model before any byte is read: a ref's
            # size is then bounded by what its grid needs (a forged 1 GiB ref for a
            # 4-token grid was allocated, then refused).
            for i in order:
                check_embedding_shape(
                    request.images[i], i, self.engine.spec, self.engine.max_image_tokens
                )
            for i in v_order:
                check_embedding_shape(
                    request.videos[i].embedding,
                    i,
                    self.engine.spec,
                    self.engine.max_video_tokens,
                    field=f"videos[{i}].embedding",
                    video=True,
                )
            # Embeddings sent by reference are read from their holders while the prompt is
            # rendered and tokenised (the reads wait on other processes, not on this loop).
            fetching = asyncio.ensure_future(
                self._fetch_all(request, order, v_order, context, read)
            )
            fetching.add_done_callback(lambda f: f.cancelled() or f.exception())
            try:
                params = sampling_params(request.sampling, limits)
                # Render and tokenise once; the blank render is the template's own tokens.
                prompt = self.engine.render(messages)
                ids = self.engine.tokenize(prompt)
                check_control_tokens(
                    self.engine.control_tokens(ids),
                    self.engine.control_tokens(
                        self.engine.tokenize(self.engine.render(blank_texts(messages)))
                    ),
                    self.engine.forbidden_tokens,
                )
            except BaseException:
                fetching.cancel()
                raise
            image_data, video_data = await fetching
            fetched = True
            images = [
                check_image(
                    request.images[i],
                    i,
                    self.engine.spec,
                    self.engine.max_image_tokens,
                    data=image_data[i].data,
                )
                for i in order
            ]
            videos = [
                check_video(
                    request.videos[i],
                    i,
                    self.engine.spec,
                    self.engine.max_video_tokens,
                    data=video_data[i].data,
                )
                for i in v_order
            ]
            received = 0
            for got in [*image_data.values(), *video_data.values()]:
                metrics.EMBEDDING_RECEIVED_BYTES.labels(
                    transport=got.transport, holder=got.service
                ).inc(got.nbytes)
                received += got.nbytes
            n_prompt = self.engine.prompt_length(ids, images) + self.engine.video_prompt_length(
                videos
            )
            budget = self.engine.max_model_len - params.max_tokens  # type: ignore[attr-defined]
            if n_prompt >= self.engine.max_model_len:  # no max_tokens would make it fit
                raise invalid_argument(
                    "PROMPT_TOO_LONG",
                    f"the prompt is {n_prompt} tokens (images included); max_model_len is "
                    f"{self.engine.max_model_len}, and at least one token must be generated: "
                    "shorten the messages",
                    field="messages",
                    limit=self.engine.max_model_len,
                )
            if n_prompt > budget:
                raise invalid_argument(
                    "PROMPT_TOO_LONG",
                    f"the prompt is {n_prompt} tokens (images included) and max_tokens "
                    f"{params.max_tokens}; together they exceed max_model_len "  # type: ignore[attr-defined]
                    f"{self.engine.max_model_len}",
                    field="sampling.max_tokens",
                    limit=self.engine.max_model_len,
                )
            t0 = time.perf_counter()
            last = t0
            first = True
            with tracer.start_as_current_span("decoder.generate") as span:
                span.set_attribute("splitvl.request.model", str(self.engine.engine_args.model))
                span.set_attribute("splitvl.request.id", request_id)
                span.set_attribute("splitvl.request.images", len(images))
                span.set_attribute("splitvl.request.max_tokens", params.max_tokens)  # type: ignore[attr-defined]
                span.set_attribute("splitvl.usage.prompt_tokens", n_prompt)
                span.set_attribute("splitvl.embedding.bytes", received)
                # aclosing: a GeneratorExit at our yield closes the engine stream (and so aborts
                # the vLLM request) at once, not when the garbage collector finalises it.
                span.set_attribute("splitvl.request.videos", len(videos))
                stream = self.engine.generate(request_id, prompt, images, params, videos)
                async with contextlib.aclosing(stream):
                    async for delta in stream:
                        now = time.perf_counter()
                        if delta.token_ids:
                            if first:
                                metrics.TTFT.observe(now - t0)
                                ttft_ms = (now - t0) * 1000
                                span.add_event("first_token", {"splitvl.ttft_ms": ttft_ms})
                                engine_times = _engine_spans(delta.stats, time.time_ns())
                                if engine_times is not None:
                                    metrics.QUEUE_WAIT.observe(engine_times[0])
                                    metrics.PREFILL_SECONDS.observe(engine_times[1])
                                generation = tracer.start_span("decoder.generation")
                                first = False
                            else:
                                metrics.ITL.observe((now - last) / len(delta.token_ids))
                            last = now
                            metrics.OUTPUT_TOKENS.inc(len(delta.token_ids))
                        response = pb.GenerateResponse(token_ids=delta.token_ids, text=delta.text)
                        if delta.finish_reason is not None:
                            response.finish_reason = FINISH.get(
                                delta.finish_reason, generation_pb2.FINISH_REASON_STOP
                            )
                            response.usage.prompt_tokens = delta.prompt_tokens
                            response.usage.completion_tokens = delta.completion_tokens
                            metrics.PROMPT_TOKENS.inc(delta.prompt_tokens)
                            span.set_attribute(
                                "splitvl.usage.completion_tokens", delta.completion_tokens
                            )
                            span.set_attribute("splitvl.finish_reason", delta.finish_reason)
                            if generation is not None:
                                generation.set_attribute(
                                    "splitvl.usage.completion_tokens", delta.completion_tokens
                                )
                                generation.end()
                                generation = None
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
            from vllm.exceptions import VLLMClientError
            from vllm.v1.engine.exceptions import EngineDeadError

            if isinstance(exc, VLLMClientError | ValueError):
                await abort(
                    context,
                    invalid_argument(
                        "ENGINE_REJECTED", f"vLLM rejected the request: {exc}", field="request"
                    ),
                )
            if isinstance(exc, EngineDeadError) or self.engine.dead:
                log.error("vLLM engine died: %s", exc)
                self.on_engine_dead()
                await abort(
                    context,
                    ServiceError(
                        grpc.StatusCode.UNAVAILABLE, "ENGINE_DEAD", f"decoder engine died: {exc}"
                    ),
                )
            raise
        finally:
            if generation is not None:  # cancelled, failed, or ended without a finish reason
                generation.end()
            if not fetched:  # failed before every read: free the rest at their holders now
                refs = [e.ref for e in request.images if e.HasField("ref")]
                refs += [v.embedding.ref for v in request.videos if v.embedding.HasField("ref")]
                self.reader.release_unread([r for r in refs if r.ticket not in read])
