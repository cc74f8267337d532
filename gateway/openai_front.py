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
  and SSRF guard, or a data URL; ``detail`` accepted and ignored: the pixel budget decides)
  and vLLM's ``video_url`` (``url`` only: the gateway's ``GATEWAY_VIDEO_*`` settings sample it);
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
as ``code``, and the HTTP status of the gRPC code
(:data:`gateway.openai_protocol.HTTP_STATUS`); a client that leaves a stream cancels the
request down to vLLM. Bearer tokens (``GATEWAY_AUTH_TOKENS``), TLS/mTLS
(``GATEWAY_TLS_*``) and admission control (``max_concurrent_rpcs``, shared with the gRPC
server) are the gRPC gateway's.

This module is the router (vLLM's layout): :func:`create_app` wires the exception
handlers, the body guard, the bearer-token check and the routes to the serving classes of
:mod:`gateway.openai_serving`; the protocol (request models, conversion, answer and error
JSON) is :mod:`gateway.openai_protocol`. :class:`HttpFront` runs the app on uvicorn::

    app = create_app(pipeline, served_model_name="Qwen/Qwen3-VL-2B-Instruct",
                     admission=admission, bearer_tokens=("s3cret",))
    front = HttpFront(app, "0.0.0.0", 8000, ("", "", ""))
    await front.start()
    ...
    await front.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.openai_protocol import INT32_MAX, ChatCompletionRequest
from gateway.openai_serving import (
    OpenAIServingChat,
    OpenAIServingModels,
    error_response,
    http_error_response,
)
from gateway.pipeline import Pipeline
from gateway.reasoning import ReasoningParser
from vlcommon.admission import AdmissionInterceptor
from vlcommon.auth import AuthInterceptor
from vlcommon.errors import ConfigError
from vlcommon.refusals import Refusal

log = logging.getLogger(__name__)


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
    reasoning: ReasoningParser | None = None,
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
        reasoning: The reasoning parser (``GATEWAY_REASONING_PARSER``); None = off.
    """
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    chat = OpenAIServingChat(
        pipeline,
        served_model_name=served_model_name,
        admission=admission,
        timeout_s=timeout_s,
        max_tokens_limit=max_tokens_limit,
        reasoning=reasoning,
    )
    models = OpenAIServingModels(served_model_name)
    app = FastAPI(title="splitvl", docs_url=None, redoc_url=None, openapi_url=None)
    # Starlette runs the middleware added last first: the bearer token is checked before
    # the body guard reads a byte of the body.
    app.add_middleware(BodyGuard, max_bytes=max_body_bytes, read_timeout_s=body_read_timeout_s)
    app.add_middleware(BearerAuth, tokens=bearer_tokens)
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def show_available_models() -> dict[str, Any]:
        return models.show_available_models()

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.create_chat_completion(body, request)

    return app


class BearerAuth:
    """ASGI middleware: the ``Authorization: Bearer`` check on ``/v1/*`` (not on
    ``/health`` or ``/metrics``), the gRPC path's own (:class:`vlcommon.auth.AuthInterceptor`),
    so 401 with reason ``AUTH_TOKEN_MISSING`` or ``AUTH_TOKEN_INVALID``. No tokens: no check.

    Plain ASGI, not Starlette's ``BaseHTTPMiddleware``: behind that one,
    ``request.is_disconnected()`` never saw a client leave (its receive runs in a task
    group that the check's cancelled scope cancels), so a non-streaming request, or a
    stream before its first token, ran to its end for a client that was gone.
    """

    def __init__(self, app: Any, tokens: Sequence[str]) -> None:
        self.app = app
        self.auth = AuthInterceptor(tokens) if tokens else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if self.auth is not None and scope["type"] == "http" and path.startswith("/v1/"):
            raw = dict(scope.get("headers") or []).get(b"authorization")
            header = raw.decode("latin-1") if raw is not None else None
            err = self.auth.check(path, [("authorization", header)] if header else [])
            if err is not None:
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


#: Tags pydantic adds to a location for the branch of a union ("str", "list[any]").
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


async def _invalid_body(request: Request, exc: Exception) -> JSONResponse:
    """400 ``REQUEST_INVALID`` for a body the request model refuses, naming the first
    error's field as OpenAI names it (``messages[0].content``; ``body`` for a body that is
    not JSON or not an object)."""
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
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
        message, field = "the body must be a JSON object (Content-Type: application/json)", "body"
    else:
        message = f"{field}: {first.get('msg', 'invalid value')}"
    return error_response(Refusal.REQUEST_INVALID.error(message, field=field))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (404 path, 405 method, a body that cannot be parsed) in
    OpenAI's shape."""
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    message = {
        404: f"{request.method} {request.url.path} is not served (served: "
        "/v1/chat/completions, /v1/models, /health, /metrics)",
        405: f"{request.method} is not allowed on {request.url.path}",
    }.get(status, str(exc.detail))
    if status == 400 and "parsing the body" in str(exc.detail):
        message = "the body could not be parsed as JSON (invalid UTF-8 or too deeply nested)"
    codes = {404: Refusal.NOT_FOUND, 405: Refusal.METHOD_NOT_ALLOWED}
    param = "body" if status == 400 else None
    return http_error_response(status, codes.get(status, Refusal.REQUEST_INVALID), message, param)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    """500 for a bug: logged with its traceback, the client told only to look there."""
    log.exception("unexpected error in %s %s", request.method, request.url.path)
    body = {
        "error": {
            "message": "internal error (see the gateway's log)",
            "type": "server_error",
            "param": None,
            "code": Refusal.INTERNAL,
        }
    }
    return JSONResponse(body, status_code=500)


class BodyGuard:
    """ASGI middleware for the request body, before FastAPI reads it, each refusal in
    OpenAI's shape:

    - over ``max_bytes``: 413 ``REQUEST_TOO_LARGE`` as it streams in (by Content-Length
      at once, else by counting), so a 1 GB body is never buffered or parsed (the gRPC
      server's message limit, applied to HTTP);
    - no byte of a body still due for ``read_timeout_s`` seconds (a client that sent a
      Content-Length and less body, or stalled mid-upload): 408 ``BODY_READ_TIMEOUT``.
      uvicorn bounds the idle time between requests (``timeout_keep_alive``), not a
      body that stops arriving, which would hold the connection and its request open
      with no answer;
    - a ``Content-Encoding`` other than ``identity`` (gzip, br, ...): 415
      ``CONTENT_ENCODING_UNSUPPORTED``, rather than a compressed body refused as "not
      JSON". ``vllm serve`` does not decompress bodies either.

    Args:
        app: The ASGI application it guards.
        max_bytes: Largest body, bytes.
        read_timeout_s: Longest wait for the next piece of a body still due, seconds.
    """

    def __init__(self, app: Any, max_bytes: int, read_timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s

    def _refusal(self, kind: str) -> JSONResponse:
        if kind == "timeout":
            return http_error_response(
                408,
                Refusal.BODY_READ_TIMEOUT,
                f"the request body stopped arriving: no byte for {self.read_timeout_s:g} s "
                "before it was complete (Content-Length larger than the body sent?)",
                "body",
                {"Connection": "close"},
            )
        return error_response(
            Refusal.REQUEST_TOO_LARGE.error(
                f"the request body is over the limit of {self.max_bytes} bytes "
                "(GATEWAY_MAX_MESSAGE_BYTES)",
                field="body",
                limit=str(self.max_bytes),
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
            await http_error_response(
                415,
                Refusal.CONTENT_ENCODING_UNSUPPORTED,
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


class HttpFront:
    """uvicorn serving :func:`create_app` on the running event loop, beside grpc.aio.

    Args:
        app: The application.
        host: Address to bind.
        port: TCP port (0 picks one; :attr:`port` is the bound one after :meth:`start`).
        ssl_files: ``(cert, key, client_ca)`` paths; an empty cert = plaintext.
        reuse_port: Bind with ``SO_REUSEPORT``, so that several gateway processes share
            the port (uvicorn has no such option: the socket is made here and handed over).
    """

    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        ssl_files: tuple[str, str, str],
        reuse_port: bool = False,
    ):
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
        self.reuse_port = reuse_port
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind and serve; returns once it listens (raises if binding failed)."""
        sockets = [self._shared_socket()] if self.reuse_port else None
        self._task = asyncio.ensure_future(self.server.serve(sockets=sockets))
        try:
            while not self.server.started:
                if self._task.done():
                    self._task.result()
                    raise RuntimeError("the HTTP front stopped before it started")
                await asyncio.sleep(0.02)
        except BaseException:
            for sock in sockets or ():
                sock.close()  # uvicorn closes it only once it serves
            raise
        sockets = [s for srv in self.server.servers for s in srv.sockets]
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        log.info("OpenAI-compatible front on http://%s:%d/v1", self.server.config.host, self.port)

    def _shared_socket(self) -> socket.socket:
        """A listening socket on the front's address with ``SO_REUSEPORT`` set."""
        config = self.server.config
        family, kind, proto, _, address = socket.getaddrinfo(
            config.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind(address)
            sock.listen(config.backlog)
        except OSError as err:
            sock.close()
            raise ConfigError(f"cannot listen on {config.host}:{self.port}: {err}") from None
        return sock

    def stop_accepting(self) -> None:
        """Close the listening sockets, keeping the connections open: with a shared port
        the other processes take every new connection while this one drains."""
        for server in getattr(self.server, "servers", []):
            server.close()

    async def stop(self) -> None:
        """Stop serving: open streams get up to 10 s (``timeout_graceful_shutdown``)."""
        self.server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
