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
import math
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import propagate, trace
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr
from qwenvl.common.v1 import generation_pb2
from qwenvl.gateway.v1 import gateway_service_pb2 as pb
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.pipeline import GenerateEvent, Pipeline
from vlcommon.admission import AdmissionInterceptor
from vlcommon.auth import AuthInterceptor
from vlcommon.deadline import Deadline
from vlcommon.errors import ServiceError, invalid_argument
from vlcommon.request_rules import TIER_NAMES
from vlcommon.sampling import check_max_tokens

log = logging.getLogger(__name__)
tracer = trace.get_tracer("splitvl.gateway.http")

#: HTTP status of each gRPC status code (OpenAI's and vLLM's choices where they have one).
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,  # 413 without a retry hint (error_body)
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
#: OpenAI's error ``type`` by HTTP status.
ERROR_TYPE = {
    400: "invalid_request_error",
    413: "invalid_request_error",
    501: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
FINISH = {generation_pb2.FINISH_REASON_STOP: "stop", generation_pb2.FINISH_REASON_LENGTH: "length"}


# -- the request, as OpenAI's chat completions API defines it -----------------------------
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


class ChatMessage(BaseModel):
    # Content parts are checked by hand (to_generate_request), so that each refusal names
    # its own field (a pydantic union reports only its first branch's error). Other keys
    # are refused by name unless "off" (MESSAGE_NO_OP_DEFAULTS); they used to be ignored.
    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: StrictStr | list[Any] | None = None
    name: StrictStr | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")  # refused by name unless off, as above

    include_usage: StrictBool = False


class ChatCompletionRequest(BaseModel):
    """The fields splitvl serves; any other field is refused by name (``extra`` below),
    except those whose value is the no-op default (``NO_OP_DEFAULTS``). Strict types: a
    ``max_tokens`` of ``true`` or ``"5"`` is refused, as the official clients never send
    one."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: StrictStr | None = None  # absent: the served model, as vLLM's server takes it
    messages: list[ChatMessage]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    user: StrictStr | None = None


#: Fields of OpenAI's or vLLM's API that splitvl does not implement, accepted only with
#: the value that means "off" (clients such as vLLM's benchmark send some of them).
NO_OP_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, False, True),
    "response_format": (None, {"type": "text"}),
    "metadata": (None, {}),
    "store": (None, False),
}


#: Keys of a message or of ``stream_options`` that OpenAI's or vLLM's API define and that
#: splitvl does not implement, accepted only "off" (an assistant turn replayed by a client
#: carries ``tool_calls: []`` or ``refusal: null``).
MESSAGE_NO_OP_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "tool_calls": (None, []),
    "tool_call_id": (None,),
    "function_call": (None,),
    "refusal": (None,),
    "audio": (None,),
    "reasoning_content": (None,),
}
STREAM_OPTIONS_NO_OP_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "continuous_usage_stats": (None, False),  # vLLM's
}


def _check_extra(
    extra: dict[str, Any] | None, allowed: dict[str, tuple[Any, ...]], where: str
) -> None:
    """Refuse a key splitvl does not serve by its full name (``where`` + key), unless its
    value is the one that means "off" (``allowed``)."""
    for name, value in (extra or {}).items():
        field = f"{where}.{name}" if where else name
        values = allowed.get(name)
        if values is None:
            raise _refused(field, f"{field} is not a parameter splitvl serves")
        if value not in values:
            raise _refused(field, f"{field}={value!r} is not supported; leave it unset")


def _refused(field: str, message: str) -> ServiceError:
    return invalid_argument("PARAMETER_UNSUPPORTED", message, field=field)


def _utf8(text: str, field: str) -> str:
    """``text`` if it can travel as UTF-8 (protobuf strings must): a lone surrogate
    (``"\\ud800"`` in the JSON) cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid_argument(
            "TEXT_NOT_UTF8",
            f"{field} holds a lone surrogate (\\ud800-\\udfff): it is not valid UTF-8 text",
            field=field,
        ) from None
    return text


@dataclass
class Converted:
    """A converted request and how its gRPC field names map back to OpenAI's (for
    ``param`` in errors: ``images[1]`` -> ``messages[0].content[2].image_url.url``)."""

    request: pb.GenerateRequest
    fields: dict[str, str]
    # gRPC names whose every sub-field is the one OpenAI field (an image's ``url`` and
    # ``data_url`` are both its ``image_url.url``; a string content's ``parts[0].text`` is
    # the ``content``).
    whole: frozenset[str] = frozenset()

    def openai_param(self, field: str | None) -> str | None:
        """The OpenAI name of a gRPC field name, by the longest mapped prefix of it."""
        if not field:
            return field
        matches = [
            name
            for name in self.fields
            if field == name or field.startswith((name + ".", name + "["))
        ]
        if not matches:
            return field
        name = max(matches, key=len)
        if name in self.whole:
            return self.fields[name]
        return (self.fields[name] + field[len(name) :]).lstrip(".")


def to_generate_request(
    body: ChatCompletionRequest, served: Sequence[str], max_tokens_limit: int = INT32_MAX
) -> Converted:
    """The gateway's GenerateRequest for an OpenAI chat completion request.

    Raises:
        ServiceError: INVALID_ARGUMENT naming the OpenAI field (``messages[0].content[1]``,
            ``n``, ``max_tokens``, ...) for what the front does not serve or what cannot be
            represented; NOT_FOUND for a model it does not serve. Everything else (counts,
            sizes, ranges, images, videos) is checked by the pipeline itself, with the gRPC
            path's messages.
    """
    if body.model is not None and body.model not in served:
        raise ServiceError(
            grpc.StatusCode.NOT_FOUND,
            "MODEL_NOT_FOUND",
            f"model {body.model!r} is not served here; this server serves {served[0]!r}",
            {"field": "model"},
        )
    _check_extra(body.model_extra, NO_OP_DEFAULTS, "")
    if body.stream_options is not None:
        _check_extra(
            body.stream_options.model_extra, STREAM_OPTIONS_NO_OP_DEFAULTS, "stream_options"
        )
    if body.n not in (None, 1):
        raise _refused("n", f"n is {body.n}; only n=1 is served")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        if body.max_tokens != body.max_completion_tokens:
            raise _refused(
                "max_completion_tokens", "max_tokens and max_completion_tokens differ; send one"
            )
    request = pb.GenerateRequest()
    fields: dict[str, str] = {}
    whole: set[str] = set()
    images = 0
    videos = 0
    for i, message in enumerate(body.messages):
        _check_extra(message.model_extra, MESSAGE_NO_OP_DEFAULTS, f"messages[{i}]")
        msg = request.messages.add(role=_utf8(message.role, f"messages[{i}].role"))
        fields[f"messages[{i}].parts"] = f"messages[{i}].content"
        whole.update((f"messages[{i}].parts", f"messages[{i}].parts[0]"))
        content = message.content
        if content is None:
            continue
        if isinstance(content, str):
            fields[f"messages[{i}].parts[0]"] = f"messages[{i}].content"
            msg.parts.add(text=_utf8(content, f"messages[{i}].content"))
            continue
        whole.discard(f"messages[{i}].parts[0]")
        for k, part in enumerate(content):
            field = f"messages[{i}].content[{k}]"
            fields[f"messages[{i}].parts[{k}]"] = field
            kind = part.get("type") if isinstance(part, dict) else None
            if not isinstance(kind, str):
                raise _refused(field, f"{field} must be an object with a string 'type'")
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, str) or set(part) - {"type", "text"}:
                    raise _refused(field, f"{field}: a text part is {{'type', 'text': string}}")
                msg.parts.add(text=_utf8(text, f"{field}.text"))
            elif kind == "image_url":
                spec = part.get("image_url")
                url = spec.get("url") if isinstance(spec, dict) else None
                if not isinstance(url, str) or set(part) - {"type", "image_url"}:
                    raise _refused(
                        f"{field}.image_url",
                        f"{field}: an image_url part is {{'type', 'image_url': {{'url': string}}}}",
                    )
                assert isinstance(spec, dict)
                if spec.get("detail") not in (None, "auto", "low", "high"):
                    raise _refused(
                        f"{field}.image_url.detail",
                        f"{field}.image_url.detail is {spec.get('detail')!r}; "
                        "expected 'auto', 'low' or 'high'",
                    )
                if set(spec) - {"url", "detail"}:
                    raise _refused(
                        f"{field}.image_url", f"{field}.image_url takes only 'url' and 'detail'"
                    )
                url = _utf8(url, f"{field}.image_url.url")
                fields[f"images[{images}]"] = f"{field}.image_url.url"
                whole.add(f"images[{images}]")
                images += 1
                image = pb.ImageInput(data_url=url) if url[:5].lower() == "data:" else None
                msg.parts.add(image=image or pb.ImageInput(url=url))
            elif kind == "video_url":
                # vLLM's chat part for a video file: {"type": "video_url", "video_url": {"url"}}.
                spec = part.get("video_url")
                url = spec.get("url") if isinstance(spec, dict) else None
                if not isinstance(url, str) or set(part) - {"type", "video_url"}:
                    raise _refused(
                        f"{field}.video_url",
                        f"{field}: a video_url part is {{'type', 'video_url': {{'url': string}}}}",
                    )
                assert isinstance(spec, dict)
                # Sampling of a video is set by the server (GATEWAY_VIDEO_*), not per
                # part: a key such as "fps" used to be ignored silently.
                extra = sorted(set(spec) - {"url"})
                if extra:
                    raise _refused(
                        f"{field}.video_url",
                        f"{field}.video_url takes only 'url' (got {', '.join(extra)})",
                    )
                url = _utf8(url, f"{field}.video_url.url")
                fields[f"videos[{videos}]"] = f"{field}.video_url.url"
                whole.add(f"videos[{videos}]")
                videos += 1
                file = pb.VideoFile(data_url=url) if url[:5].lower() == "data:" else None
                msg.parts.add(video=pb.VideoInput(file=file or pb.VideoFile(url=url)))
            else:
                raise _refused(
                    field, f"{field} has type {kind!r}; served: 'text', 'image_url', 'video_url'"
                )
    sampling = request.sampling
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if name == "max_completion_tokens" else body.max_tokens
    fields["sampling.max_tokens"] = name
    if max_tokens is not None:
        sampling.max_tokens = check_max_tokens(max_tokens, max_tokens_limit, name)
    fields["sampling"] = ""
    # OpenAI's and vLLM's default temperature is 1.0; the gRPC API's 0 means greedy.
    sampling.temperature = (
        1.0 if body.temperature is None else _float32(body.temperature, "temperature")
    )
    if body.top_p is not None:
        _float32(body.top_p, "top_p")
        if not 0.0 < body.top_p <= 1.0:  # the gRPC API's 0 means "unset"; vLLM refuses 0
            raise invalid_argument(
                "TOP_P_OUT_OF_RANGE", f"top_p is {body.top_p}; allowed (0, 1]", field="top_p"
            )
        sampling.top_p = body.top_p
    if body.seed is not None:
        if not -INT64_MAX - 1 <= body.seed <= INT64_MAX:
            raise invalid_argument(
                "SEED_OUT_OF_RANGE",
                f"seed is {body.seed}; allowed {-INT64_MAX - 1}..{INT64_MAX} (64-bit)",
                field="seed",
            )
        sampling.seed = body.seed
    if body.stop is not None:
        stops = [body.stop] if isinstance(body.stop, str) else body.stop
        sampling.stop.extend(_utf8(stop, f"stop[{k}]") for k, stop in enumerate(stops))
    sampling.ignore_eos = body.ignore_eos
    return Converted(request, fields, frozenset(whole))


def _float32(value: float, field: str) -> float:
    """``value`` unchanged, if the gRPC API's 32-bit float keeps it: one that would become
    infinite (``1e300``) or zero (``1e-50``, and the gRPC API's 0 means "unset") is
    refused with INVALID_ARGUMENT naming ``field``, before the range rules see the wrong
    value."""
    with np.errstate(over="ignore"):
        single = float(np.float32(value)) if math.isfinite(value) else value
    if math.isfinite(value) and (math.isinf(single) or (value != 0 and single == 0)):
        raise invalid_argument(
            f"{field.upper()}_OUT_OF_RANGE",
            f"{field} is {value!r}; not representable as a 32-bit float",
            field=field,
        )
    return value


def error_body(
    err: ServiceError, converted: Converted | None = None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """HTTP status, OpenAI-shaped body and headers (``Retry-After``, seconds) of an error.

    RESOURCE_EXHAUSTED is 429 only when it carries a retry hint (over capacity: a retry
    later may pass); a size limit (an image's bytes, decoded pixels) is 413, which clients
    do not retry. ``param`` is the OpenAI name of the field (``converted`` maps the gRPC
    path's ``images[1]`` and ``sampling.*`` back to the request the client sent).
    """
    status = HTTP_STATUS.get(err.code, 500)
    if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.retry_after_ms is None:
        status = 413
    headers = {}
    if err.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, -(-err.retry_after_ms // 1000)))
    body = {
        "error": {
            "message": err.message,
            "type": ERROR_TYPE.get(status, "server_error"),
            "param": converted.openai_param(err.metadata.get("field"))
            if converted is not None
            else err.metadata.get("field"),
            "code": err.reason,
        }
    }
    return status, body, headers


def _error_response(err: ServiceError, converted: Converted | None = None) -> JSONResponse:
    status, body, headers = error_body(err, converted)
    return JSONResponse(body, status_code=status, headers=headers)


def _http_error(
    status: int, code: str, message: str, param: str | None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """An error of the HTTP layer itself (no gRPC code maps to it: 404 path, 405, 408,
    415, an unparsable body) in OpenAI's shape."""
    body = {
        "error": {
            "message": message,
            "type": ERROR_TYPE.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }
    return JSONResponse(body, status_code=status, headers=headers)


def _extension(first: GenerateEvent, last: GenerateEvent | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "images": [
            {
                "index": im.index,
                "tier": TIER_NAMES.get(im.tier, "unspecified"),
                "similarity": round(float(im.similarity), 6),
                "grid": [im.grid.t, im.grid.h, im.grid.w],
                # A similarity hit may serve the stored entry's grid (docs/cache.md).
                "served_grid": [im.served_grid.t, im.served_grid.h, im.served_grid.w],
                "requested_grid": [im.requested_grid.t, im.requested_grid.h, im.requested_grid.w],
                "tokens": im.tokens,
                "decoded": im.decoded,
            }
            for im in first.images
        ]
    }
    if last is not None and last.timings is not None:
        t = last.timings
        out["timings"] = {
            f"{name}_ms": round(getattr(t, f"{name}_ms"), 3)
            for name in ("preprocess", "lookup", "encode", "put", "ttft", "decode", "total")
        }
    return out


def _usage(u: generation_pb2.Usage | None) -> dict[str, Any]:
    u = u or generation_pb2.Usage()
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


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
                    usage = {
                        "id": rid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": served_model_name,
                        "choices": [],
                        "usage": _usage(last.usage),
                        "splitvl": _extension(first, last) if first is not None else {},
                    }
                    yield f"data: {json.dumps(usage)}\n\n"
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
                "usage": _usage(last.usage) if last is not None else None,
                "splitvl": _extension(first, last) if first is not None else {},
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
