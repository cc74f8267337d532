"""The OpenAI front's routes over :class:`gateway.pipeline.Pipeline`: one serving class per
route, as vLLM's ``OpenAIServingChat`` and ``OpenAIServingModels`` are over its engine.

:class:`OpenAIServingChat` serves ``POST /v1/chat/completions``: it takes an admission
slot, opens the server span, converts the body
(:func:`~gateway.openai_protocol.to_generate_request`), runs :meth:`Pipeline.parse` and
:meth:`Pipeline.generate`, and renders the events as one JSON answer or as server-sent
events. It never calls the gRPC servicer: both fronts are
adapters over the same pipeline. Usage (the router, :func:`gateway.openai_front.create_app`,
does this)::

    chat = OpenAIServingChat(pipeline, served_model_name="Qwen/Qwen3-VL-2B-Instruct")
    models = OpenAIServingModels("Qwen/Qwen3-VL-2B-Instruct")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.create_chat_completion(body, request)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import propagate, trace

from gateway.openai_protocol import (
    FINISH,
    INT32_MAX,
    ChatCompletionRequest,
    Converted,
    error_body,
    http_error_body,
    to_generate_request,
)
from gateway.openai_render import SSE_DONE, ChatCompletionRenderer, sse
from gateway.pipeline import GenerateEvent, Pipeline
from gateway.reasoning import ReasoningParser
from vlcommon.admission import AdmissionInterceptor
from vlcommon.auth import bearer_token
from vlcommon.deadline import Deadline
from vlcommon.errors import ServiceError
from vlcommon.refusals import Refusal

tracer = trace.get_tracer("splitvl.gateway.http")
T = TypeVar("T")

#: The status nginx named for a client that closed the connection before the answer;
#: nobody reads it (the client is gone), it marks the request in access logs.
CLIENT_CLOSED = 499


def error_response(err: ServiceError, converted: Converted | None = None) -> JSONResponse:
    """``err`` as OpenAI's error JSON with its HTTP status and ``Retry-After``
    (:func:`~gateway.openai_protocol.error_body`)."""
    status, body, headers = error_body(err, converted)
    return JSONResponse(body, status_code=status, headers=headers)


def http_error_response(
    status: int,
    code: Refusal,
    message: str,
    param: str | None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An error of the HTTP layer itself (no gRPC code maps to it: 404 path, 405, 408,
    415, an unparsable body) in OpenAI's shape."""
    return JSONResponse(
        http_error_body(status, code, message, param), status_code=status, headers=headers
    )


class OpenAIServingModels:
    """Serves ``GET /v1/models``: the one served model.

    Args:
        served_model_name: The id listed, as ``vllm serve`` names it (its ``--model``
            argument or ``--served-model-name``).
    """

    def __init__(self, served_model_name: str) -> None:
        self.served_model_name = served_model_name

    def show_available_models(self) -> dict[str, Any]:
        """OpenAI's model list (``created`` is now, Unix s, as vLLM's server answers)."""
        return {
            "object": "list",
            "data": [
                {
                    "id": self.served_model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "splitvl",
                    "root": self.served_model_name,
                }
            ],
        }


class _Disconnected(Exception):
    """The HTTP client went away while the pipeline worked."""


class _ChatCall:
    """One chat completion in flight: its server span, its admission slot and its pipeline
    events. :meth:`finish` ends the span and frees the slot once, whichever path (answer,
    error, disconnect, the stream's close) gets there first."""

    def __init__(self, span: trace.Span, admission: AdmissionInterceptor | None) -> None:
        self.span = span
        self.admission = admission
        self.converted: Converted | None = None
        self.events: AsyncGenerator[GenerateEvent, None] | None = None
        self._done = False

    def in_span(self) -> contextlib.AbstractContextManager[trace.Span]:
        """The server span as the current one, so the pipeline's spans are its children
        (an exception passing through marks the span as failed)."""
        return trace.use_span(self.span, end_on_exit=False)

    async def next_event(self) -> GenerateEvent | None:
        """The pipeline's next event, None after the last."""
        assert self.events is not None
        with self.in_span():
            return await anext(self.events, None)

    async def close_events(self) -> None:
        """Close the pipeline: its decoder call is cancelled, which aborts vLLM's request
        (a no-op once it ended)."""
        if self.events is None:
            return
        with contextlib.suppress(BaseException), self.in_span():
            await self.events.aclose()

    async def collect(self, first: GenerateEvent | None) -> list[GenerateEvent]:
        """``first`` and every later event, in order."""
        assert self.events is not None
        events = [first] if first is not None else []
        with self.in_span():
            async for event in self.events:
                events.append(event)
        return events

    async def close(self) -> None:
        """Close the pipeline and finish, without an error."""
        await self.close_events()
        self.finish()

    def finish(self, err: ServiceError | None = None) -> None:
        """End the span (failed with ``err``'s reason and message if given) and free the
        admission slot; later calls do nothing."""
        if self._done:
            return
        self._done = True
        if err is not None:
            self.span.set_attribute("splitvl.error.reason", err.reason)
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, err.message))
        if self.admission is not None:
            self.admission.release()
        self.span.end()


class OpenAIServingChat:
    """Serves ``POST /v1/chat/completions`` over the pipeline, streaming (server-sent
    events in OpenAI's chunk format) or not.

    Args:
        pipeline: The gateway's request path, shared with the gRPC front.
        served_model_name: The model id requests must name (or leave out).
        admission: The gRPC server's admission control, shared, so one limit bounds both
            fronts; None = unbounded (tests).
        timeout_s: Deadline of one completion, seconds (None: none).
        max_tokens_limit: The gateway's ``max_tokens_limit``, tokens (named in the refusal).
        reasoning: The reasoning parser (``GATEWAY_REASONING_PARSER``): answers carry the
            model's reasoning apart, as ``vllm serve --reasoning-parser`` returns it; None
            = off, the text is all ``content``.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        served_model_name: str,
        admission: AdmissionInterceptor | None = None,
        timeout_s: float | None = 600.0,
        max_tokens_limit: int = INT32_MAX,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.served_model_name = served_model_name
        self.admission = admission
        self.timeout_s = timeout_s
        self.max_tokens_limit = max_tokens_limit
        self.reasoning = reasoning

    async def create_chat_completion(
        self, body: ChatCompletionRequest, request: Request
    ) -> Response:
        """Answer one chat completion request.

        Every input error arrives before the first event (the pipeline streams nothing
        before the first token), so it gets its own HTTP status even when streaming; an
        error after that is an ``{"error": ...}`` event in the stream, the status line
        being gone. A client that leaves a stream cancels the pipeline, down to vLLM's
        request; before the first token, or during a non-streaming answer, only as far
        as :func:`_watching` sees it leave.

        Args:
            body: The parsed request body.
            request: The HTTP request (its headers carry a W3C ``traceparent``; it is
                watched for the client's disconnect).

        Returns:
            200 with a ``chat.completion`` JSON or a ``text/event-stream``; an OpenAI error
            JSON with the status of its gRPC code (:data:`~gateway.openai_protocol.HTTP_STATUS`):
            400 bad input, 404 unknown model, 413 over a size limit, 429 over admission
            with ``Retry-After`` (s), 503 a dependency down, 504 past ``timeout_s``; 499
            with no body for a client that left.
        """
        call = _ChatCall(self._start_span(request), self.admission)
        if self.admission is not None and not self.admission.try_acquire():
            call.span.end()
            return error_response(self.admission.refusal())
        try:
            return await self._respond(call, body, request)
        except ServiceError as err:
            call.finish(err)
            return error_response(err, call.converted)
        except _Disconnected:
            call.finish()
            return Response(status_code=CLIENT_CLOSED)
        except BaseException:
            call.finish()
            raise

    async def _respond(
        self, call: _ChatCall, body: ChatCompletionRequest, request: Request
    ) -> Response:
        """The answer once the first event is in: the whole ``chat.completion`` (a client
        seen to leave meanwhile cancels it, :func:`_watching`), or the event stream.

        Raises:
            ServiceError, _Disconnected: as :meth:`_first_event`, or while collecting.
        """
        first = await self._first_event(call, body, request)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        render = ChatCompletionRenderer.new(
            self.served_model_name, include_usage, self.reasoning, body.include_reasoning
        )
        if not body.stream:
            events = await _watching(request, call.collect(first), poll_s=0.5)
            call.finish()
            return JSONResponse(render.completion(events))
        # on_close runs also when Starlette never starts the stream (the client left
        # before the first byte went out): the slot and the pipeline are released there,
        # not by the garbage collector.
        return _Stream(self._stream(call, first, render), "text/event-stream", call.close)

    def _start_span(self, request: Request) -> trace.Span:
        """The server span, a child of the caller's ``traceparent`` if it sent one."""
        span = tracer.start_span(
            "POST /v1/chat/completions",
            context=propagate.extract(dict(request.headers)),
            kind=trace.SpanKind.SERVER,
        )
        span.set_attribute("splitvl.front", "openai")
        return span

    async def _first_event(
        self, call: _ChatCall, body: ChatCompletionRequest, request: Request
    ) -> GenerateEvent | None:
        """Convert and parse the request, start the pipeline and wait for its first event
        (None: the pipeline ended without one).

        Raises:
            ServiceError: From the conversion, the parse or the pipeline.
            _Disconnected: The client left first (an encoder queue, a cold decoder); the
                pipeline is cancelled.
        """
        call.converted = to_generate_request(body, (self.served_model_name,), self.max_tokens_limit)
        parsed = self.pipeline.parse(
            call.converted.request,
            Deadline.after(self.timeout_s),
            caller=bearer_token([("authorization", request.headers.get("authorization"))]),
        )
        call.events = self.pipeline.generate(parsed)
        with call.in_span():
            # The span is current in the task _watching makes (it copies the context), so
            # the pipeline's spans are children of the server span.
            return await _watching(request, anext(call.events, None))

    async def _stream(
        self, call: _ChatCall, first: GenerateEvent | None, render: ChatCompletionRenderer
    ) -> AsyncIterator[str]:
        """The server-sent events: a role chunk, one chunk per event, the usage chunk if
        asked for, ``[DONE]``; a pipeline error mid-stream is an ``{"error": ...}`` event.
        With a reasoning parser each chunk's delta is its split (``reasoning`` /
        ``reasoning_content`` and ``content``), and a step the parser holds back sends no
        chunk, as ``vllm serve --reasoning-parser`` streams."""
        error: ServiceError | None = None
        splitter = render.reasoning.splitter() if render.reasoning is not None else None
        generated: list[int] = []  # token ids, for usage's reasoning_tokens (with a parser)
        try:
            yield render.chunk({"role": "assistant", "content": ""})
            event, last = first, first
            while event is not None:
                last = event
                if splitter is not None:
                    generated.extend(event.token_ids)
                reason = FINISH.get(event.finish_reason) if event.finish_reason else None
                # One chunk per engine step that made tokens, its text empty or not (a
                # byte-level token that ends inside a UTF-8 character has none yet), as
                # `vllm serve` streams: clients (and vLLM's benchmark, whose ITL counts
                # chunks) would otherwise see stalls of several tokens.
                if event.token_ids or event.text or reason:
                    if splitter is None:
                        yield render.chunk({"content": event.text}, reason)
                    else:
                        # The parser may hold a step's text back: no chunk, as vLLM's.
                        split = splitter.feed(event.text, event.token_ids, finished=event.finished)
                        split = render.visible(split)
                        if split is not None or reason:
                            yield render.chunk(render.delta(split), reason)
                event = await call.next_event()
            if render.include_usage and first is not None and last is not None:
                yield render.usage_chunk(first, last, render.reasoning_tokens(generated))
            yield SSE_DONE
        except ServiceError as err:
            error = err
            yield sse(error_body(err, call.converted)[1])
        finally:
            # A client that disconnects cancels this generator (Starlette watches for
            # it); closing the pipeline then aborts vLLM's request.
            await call.close_events()
            call.finish(error)


async def _watching(request: Request, work: Awaitable[T], poll_s: float = 0.25) -> T:
    """Await ``work``; cancel it and raise :class:`_Disconnected` if the client leaves
    (``request.is_disconnected()``, polled every ``poll_s`` seconds). Every middleware
    in front of the route is plain ASGI (``gateway.openai_front``): behind Starlette's
    ``BaseHTTPMiddleware`` this check never sees a client leave.
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                raise _Disconnected
    except BaseException:
        task.cancel()
        raise


class _Stream(StreamingResponse):
    """A StreamingResponse that always runs ``on_close`` once it is done with the client."""

    def __init__(
        self, content: AsyncIterator[str], media_type: str, on_close: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(content, media_type=media_type)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()
