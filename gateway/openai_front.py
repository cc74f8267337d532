"""The gateway's OpenAI-compatible HTTP front: ``/v1/chat/completions`` over the same pipeline.

A team moving from ``vllm serve`` changes a base URL, not its code::

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    out = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
            {"type": "text", "text": "Describe this image."},
        ]}],
        max_tokens=64,
    )

Served (FastAPI on uvicorn, on the gateway's event loop beside its gRPC server):

* ``POST /v1/chat/completions``: ``messages`` with ``content`` as a string or as parts
  ``text`` and ``image_url`` (``url``: an http(s) URL, fetched under the gRPC path's switch
  and SSRF guard, or a data URL; ``detail`` accepted and ignored: the pixel budget decides);
  ``max_tokens`` / ``max_completion_tokens``, ``temperature`` (absent: 1.0, as OpenAI and
  vLLM default), ``top_p``, ``seed``, ``stop``, ``n`` = 1, vLLM's ``ignore_eos``;
  ``stream`` as server-sent events in OpenAI's chunk format with
  ``stream_options.include_usage``. The answer carries ``usage`` and, in the extension
  field ``splitvl`` that OpenAI clients ignore, each image's cache tier, similarity, grid
  and tokens and the stage timings (ms).
* ``GET /v1/models`` (the served model, named as ``vllm serve`` names it: the ``--model``
  argument, or ``GATEWAY_SERVED_MODEL_NAME``), ``GET /health``, ``GET /metrics``
  (the gateway's Prometheus registry).

One pipeline: each request becomes a ``gateway.v1.GenerateRequest``, parsed by the same
rules (:meth:`gateway.pipeline.Pipeline.parse`) and run through the same
:class:`gateway.pipeline.Pipeline` as the gRPC front's, so validation, caching, encoding,
decoding, stage timings and spans are the gRPC path's. A W3C ``traceparent`` header joins
the caller's trace. Errors come in OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``, with the gRPC path's message, the ErrorInfo field as ``param`` and its reason
as ``code``, and the HTTP status of the gRPC code (:data:`HTTP_STATUS`); a client that
disconnects cancels the request down to vLLM. Bearer tokens (``GATEWAY_AUTH_TOKENS``),
TLS/mTLS (``GATEWAY_TLS_*``) and admission control (``max_concurrent_rpcs``, shared with
the gRPC server) are the gRPC gateway's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import propagate, trace
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.openai_protocol import (
    FINISH,
    INT32_MAX,
    ChatCompletionRequest,
    Converted,
    error_body,
    http_error_body,
    splitvl_extension,
    to_generate_request,
    usage,
)
from gateway.pipeline import GenerateEvent, Pipeline
from vlcommon.admission import AdmissionInterceptor
from vlcommon.auth import AuthInterceptor
from vlcommon.deadline import Deadline
from vlcommon.errors import ServiceError, invalid_argument

log = logging.getLogger(__name__)
tracer = trace.get_tracer("splitvl.gateway.http")


def _error_response(err: ServiceError, converted: Converted | None = None) -> JSONResponse:
    status, body, headers = error_body(err, converted)
    return JSONResponse(body, status_code=status, headers=headers)


def _http_error(
    status: int, code: str, message: str, param: str | None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """An error of the HTTP layer itself (no gRPC code maps to it: 404 path, 405, 408,
    415, an unparsable body) in OpenAI's shape."""
    return JSONResponse(
        http_error_body(status, code, message, param), status_code=status, headers=headers
    )


def create_app(
    pipeline: Pipeline,
    *,
    served_model_name: str,
    bearer_tokens: Sequence[str] = (),
    admission: AdmissionInterceptor | None = None,
    timeout_s: float | None = 600.0,
    max_tokens_limit: int = INT32_MAX,
    max_body_bytes: int = 256 * 1024 * 1024,
    body_read_timeout_s: float = 30.0,
) -> FastAPI:
    """The FastAPI application of the front.

    Args:
        pipeline: The gateway's request path, shared with the gRPC front.
        served_model_name: The model id ``/v1/models`` lists and requests must name.
        bearer_tokens: Accepted ``Authorization: Bearer`` tokens; empty = no auth.
        admission: The gRPC server's admission control, shared, so one limit bounds both
            fronts; None = unbounded (tests).
        timeout_s: Deadline of one completion, seconds (None: none).
        max_tokens_limit: The gateway's ``max_tokens_limit`` (named in the refusal).
        max_body_bytes: Largest request body, bytes (the gRPC server's message limit);
            a larger one is refused with 413 while it streams in, before it is parsed.
        body_read_timeout_s: Longest wait for the next byte of a body still due,
            seconds; past it, 408 (:class:`BodyGuard`).
    """
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    auth = AuthInterceptor(bearer_tokens) if bearer_tokens else None
    app = FastAPI(title="splitvl", docs_url=None, redoc_url=None, openapi_url=None)
    served = (served_model_name,)

    app.add_middleware(BodyGuard, max_bytes=max_body_bytes, read_timeout_s=body_read_timeout_s)

    @app.exception_handler(RequestValidationError)
    async def invalid_json(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        # Without "body" and the union-branch tags pydantic adds ("str", "list[any]").
        loc = [
            x
            for x in first.get("loc", ())
            if x != "body" and not (isinstance(x, str) and (x in _TYPE_TAGS or "[" in x))
        ]
        field = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")
        kind = first.get("type", "")
        if kind == "json_invalid":
            where = f" (at character {loc[0]})" if loc else ""
            message, field = f"the body is not valid JSON{where}", "body"
        elif not field:
            message, field = (
                "the body must be a JSON object (Content-Type: application/json)",
                "body",
            )
        else:
            message = f"{field}: {first.get('msg', 'invalid value')}"
        return _error_response(invalid_argument("REQUEST_INVALID", message, field=field))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message = {
            404: f"{request.method} {request.url.path} is not served (served: "
            "/v1/chat/completions, /v1/models, /health, /metrics)",
            405: f"{request.method} is not allowed on {request.url.path}",
        }.get(status, str(exc.detail))
        if status == 400 and "parsing the body" in str(exc.detail):
            message = "the body could not be parsed as JSON (invalid UTF-8 or too deeply nested)"
        codes = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}
        param = "body" if status == 400 else None
        return _http_error(status, codes.get(status, "REQUEST_INVALID"), message, param)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        body = {
            "error": {
                "message": "internal error (see the gateway's log)",
                "type": "server_error",
                "param": None,
                "code": "INTERNAL",
            }
        }
        return JSONResponse(body, status_code=500)

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Any) -> Response:
        if auth is not None and request.url.path.startswith("/v1/"):
            # The gRPC path's own check (reasons AUTH_TOKEN_MISSING / AUTH_TOKEN_INVALID).
            header = request.headers.get("authorization")
            err = auth.check(request.url.path, [("authorization", header)] if header else [])
            if err is not None:
                return _error_response(err)
        response: Response = await call_next(request)
        return response

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": served_model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "splitvl",
                    "root": served_model_name,
                }
            ],
        }

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request
    ) -> Response | StreamingResponse:
        span = tracer.start_span(
            "POST /v1/chat/completions",
            context=propagate.extract(dict(request.headers)),
            kind=trace.SpanKind.SERVER,
        )
        span.set_attribute("splitvl.front", "openai")
        if admission is not None and not admission.try_acquire():
            span.end()
            return _error_response(admission.refusal())
        done = False

        def finish(err: ServiceError | None = None) -> None:
            nonlocal done
            if done:
                return
            done = True
            if err is not None:
                span.set_attribute("splitvl.error.reason", err.reason)
                span.set_status(trace.Status(trace.StatusCode.ERROR, err.message))
            if admission is not None:
                admission.release()
            span.end()

        converted: Converted | None = None
        responses: Any = None
        try:
            converted = to_generate_request(body, served, max_tokens_limit)
            parsed = pipeline.parse(converted.request, Deadline.after(timeout_s))
            responses = pipeline.generate(parsed)
            # Every input error arrives before the first response (the pipeline streams
            # nothing before the first token), so it still gets its HTTP status. A client
            # that leaves meanwhile (an encoder queue, a cold decoder) cancels the pipeline.
            with trace.use_span(span, end_on_exit=False):
                first = await _watching(request, _next(responses))
        except ServiceError as err:
            finish(err)
            return _error_response(err, converted)
        except _Disconnected:
            finish()
            return Response(status_code=499)
        except BaseException:
            finish()
            raise
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if not body.stream:
            return await _complete(request, responses, first, rid, created, span, finish, converted)

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> str:
            data: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": served_model_name,
                "choices": [
                    {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
                ],
            }
            if include_usage:
                data["usage"] = None
            return f"data: {json.dumps(data)}\n\n"

        async def events() -> AsyncIterator[str]:
            last = first
            error: ServiceError | None = None
            try:
                yield chunk({"role": "assistant", "content": ""})
                item: GenerateEvent | None = first
                while item is not None:
                    last = item
                    reason = FINISH.get(item.finish_reason) if item.finish_reason else None
                    # One chunk per engine step that made tokens, its text empty or not (a
                    # byte-level token that ends inside a UTF-8 character has none yet), as
                    # `vllm serve` streams: skipping those bunched the stream into a few
                    # events, and clients (and vLLM's benchmark, whose ITL counts chunks)
                    # saw stalls of several tokens.
                    if item.token_ids or item.text or reason:
                        yield chunk({"content": item.text}, reason)
                    with trace.use_span(span, end_on_exit=False):
                        item = await _next(responses)
                if include_usage and last is not None:
                    tail = {
                        "id": rid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": served_model_name,
                        "choices": [],
                        "usage": usage(last.usage),
                        "splitvl": splitvl_extension(first, last) if first is not None else {},
                    }
                    yield f"data: {json.dumps(tail)}\n\n"
                yield "data: [DONE]\n\n"
            except ServiceError as err:
                # Mid-stream the status line is gone: OpenAI's clients read an error event.
                error = err
                yield f"data: {json.dumps(error_body(err, converted)[1])}\n\n"
            finally:
                # A disconnected client cancels this generator (Starlette watches for the
                # disconnect): closing the pipeline cancels the decoder call, which aborts
                # vLLM's request.
                with contextlib.suppress(BaseException), trace.use_span(span, end_on_exit=False):
                    await responses.aclose()
                finish(error)

        async def close() -> None:
            # Also when Starlette never starts events() (the client left before the first
            # byte went out): the slot and the pipeline are released here, not by the GC.
            with contextlib.suppress(BaseException), trace.use_span(span, end_on_exit=False):
                await responses.aclose()
            finish()

        return _Stream(events(), media_type="text/event-stream", on_close=close)

    async def _complete(
        request: Request,
        responses: Any,
        first: GenerateEvent | None,
        rid: str,
        created: int,
        span: trace.Span,
        finish: Any,
        converted: Converted | None,
    ) -> Response:
        """The non-streaming answer; a client that disconnects meanwhile cancels it."""

        async def collect() -> list[GenerateEvent]:
            chunks = [first] if first is not None else []
            with trace.use_span(span, end_on_exit=False):
                async for item in responses:
                    chunks.append(item)
            return chunks

        task = asyncio.ensure_future(collect())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    task.cancel()  # cancels the decoder call: vLLM aborts the request
                    with contextlib.suppress(BaseException):
                        await task
                    finish()
                    return Response(status_code=499)
            chunks = task.result()
        except ServiceError as err:
            finish(err)
            return _error_response(err, converted)
        except BaseException:
            task.cancel()
            finish()
            raise
        finish()
        last = chunks[-1] if chunks else None
        text = "".join(c.text for c in chunks)
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": served_model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": text,
                        },
                        "finish_reason": FINISH.get(last.finish_reason, "stop") if last else "stop",
                        "logprobs": None,
                    }
                ],
                "usage": usage(last.usage) if last is not None else None,
                "splitvl": splitvl_extension(first, last) if first is not None else {},
            }
        )

    return app


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class _Disconnected(Exception):
    """The HTTP client went away while the pipeline worked."""


async def _watching(request: Request, work: Any, poll_s: float = 0.25) -> Any:
    """Await ``work``; cancel it and raise :class:`_Disconnected` if the client leaves."""
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

    def __init__(self, content: Any, *, media_type: str, on_close: Any) -> None:
        super().__init__(content, media_type=media_type)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


class BodyGuard:
    """ASGI middleware for the request body, before FastAPI reads it, each refusal in
    OpenAI's shape:

    - over ``max_bytes``: 413 ``REQUEST_TOO_LARGE`` as it streams in (by Content-Length
      at once, else by counting), so a 1 GB body is never buffered or parsed (the gRPC
      server's message limit, applied to HTTP);
    - no byte of a body still due for ``read_timeout_s`` seconds (a client that sent a
      Content-Length and less body, or stalled mid-upload): 408 ``BODY_READ_TIMEOUT``.
      uvicorn bounds the idle time between requests (``timeout_keep_alive``), not a
      body that stops arriving, which used to hold the connection and its request
      open with no answer;
    - a ``Content-Encoding`` other than ``identity`` (gzip, br, ...): 415
      ``CONTENT_ENCODING_UNSUPPORTED`` (it used to be read as JSON and refused as not
      JSON). ``vllm serve`` does not decompress bodies either.
    """

    def __init__(self, app: Any, max_bytes: int, read_timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s

    def _refusal(self, kind: str) -> JSONResponse:
        if kind == "timeout":
            return _http_error(
                408,
                "BODY_READ_TIMEOUT",
                f"the request body stopped arriving: no byte for {self.read_timeout_s:g} s "
                "before it was complete (Content-Length larger than the body sent?)",
                "body",
                {"Connection": "close"},
            )
        return _error_response(
            ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "REQUEST_TOO_LARGE",
                f"the request body is over the limit of {self.max_bytes} bytes "
                "(GATEWAY_MAX_MESSAGE_BYTES)",
                {"field": "body", "limit": str(self.max_bytes)},
            )
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        if encoding not in (b"", b"identity"):
            name = encoding.decode("latin-1")
            await _http_error(
                415,
                "CONTENT_ENCODING_UNSUPPORTED",
                f"Content-Encoding {name!r} is not supported; "
                "send the JSON body uncompressed (identity)",
                "body",
            )(scope, receive, send)
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refusal("size")(scope, receive, send)
            return
        seen = 0
        refused: str | None = None  # "size" or "timeout" once the body is refused
        replaced = False
        complete = False

        async def guarded_send(message: Any) -> None:
            # Once the body is refused, whatever the app answers (FastAPI turns the
            # aborted body into its own 400) is replaced by the refusal.
            nonlocal replaced
            if refused is None:
                await send(message)
            elif not replaced:
                replaced = True
                refusal = self._refusal(refused)
                await send(
                    {
                        "type": "http.response.start",
                        "status": refusal.status_code,
                        "headers": refusal.raw_headers,
                    }
                )
                await send({"type": "http.response.body", "body": refusal.body})

        async def guarded_receive() -> Any:
            nonlocal seen, refused, complete
            if complete:  # after the body: the wait for http.disconnect has no bound
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except TimeoutError:
                refused = "timeout"
                raise _BodyRefused from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    refused = "size"
                    raise _BodyRefused
                complete = not message.get("more_body", False)
            else:
                complete = True
            return message

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except _BodyRefused:
            if not replaced and refused is not None:
                await guarded_send(None)


class _BodyRefused(Exception):
    pass


async def _next(responses: Any) -> GenerateEvent | None:
    try:
        return await responses.__anext__()  # type: ignore[no-any-return]
    except StopAsyncIteration:
        return None


class HttpFront:
    """uvicorn serving :func:`create_app` on the running event loop, beside grpc.aio.

    Args:
        app: The application.
        host: Address to bind.
        port: TCP port (0 picks one; :attr:`port` is the bound one after :meth:`start`).
        ssl_files: ``(cert, key, client_ca)`` paths; an empty cert = plaintext.
    """

    def __init__(self, app: FastAPI, host: str, port: int, ssl_files: tuple[str, str, str]):
        import uvicorn

        cert, key, ca = ssl_files
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ssl_certfile=cert or None,
            ssl_keyfile=key or None,
            ssl_ca_certs=ca or None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if (cert and ca) else ssl.CERT_NONE,
            # The gateway's SIGTERM handling drains both fronts; uvicorn must not take it.
            timeout_graceful_shutdown=10,
        )

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Any:
                yield

        self.server = _Server(config)
        self.port = port
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind and serve; returns once it listens (raises if binding failed)."""
        self._task = asyncio.ensure_future(self.server.serve())
        while not self.server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the HTTP front stopped before it started")
            await asyncio.sleep(0.02)
        sockets = [s for srv in self.server.servers for s in srv.sockets]
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        log.info("OpenAI-compatible front on http://%s:%d/v1", self.server.config.host, self.port)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
