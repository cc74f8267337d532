"""OpenAI's chat completions protocol as splitvl serves it: the request models, their
conversion to ``gateway.v1.GenerateRequest``, and the JSON of errors (answers and chunks:
:mod:`gateway.openai_render`).

No HTTP here (the router is :mod:`gateway.openai_front`, the route's work
:mod:`gateway.openai_serving`), so the rules read and test as plain functions::

    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
    )
    converted = to_generate_request(body, served=("Qwen/Qwen3-VL-2B-Instruct",))
    converted.request                       # a gateway.v1.GenerateRequest
    converted.openai_param("images[0]")     # "messages[0].content[1].image_url.url"
    status, payload, headers = error_body(err, converted)  # 400, {"error": {...}}, {}

Only what is OpenAI-specific is checked here (unknown parameters, ``n``, content part
shapes, what a 32-bit float or UTF-8 cannot carry); every other rule (counts, sizes,
ranges, images, videos) is the pipeline's (:meth:`gateway.pipeline.Pipeline.parse`), with
the gRPC path's messages.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr
from qwenvl.common.v1 import generation_pb2
from qwenvl.gateway.v1 import gateway_service_pb2 as pb

from vlcommon.errors import ServiceError
from vlcommon.refusals import Refusal
from vlcommon.sampling import check_float32, check_max_tokens, check_top_p

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
#: OpenAI's ``finish_reason`` of each ``FinishReason``.
FINISH = {generation_pb2.FINISH_REASON_STOP: "stop", generation_pb2.FINISH_REASON_LENGTH: "length"}

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


# -- the request, as OpenAI's chat completions API defines it -----------------------------
class ChatMessage(BaseModel):
    """One message: ``role``, ``content`` as a string or a list of parts, and an earlier
    assistant turn's reasoning as ``reasoning`` or ``reasoning_content`` (vLLM's names: it
    takes ``reasoning_content`` as ``reasoning`` when that is unset)."""

    # Content parts are checked by hand (to_generate_request), so that each refusal names
    # its own field (a pydantic union reports only its first branch's error). Other keys
    # are refused by name unless "off" (MESSAGE_NO_OP_DEFAULTS).
    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: StrictStr | list[Any] | None = None
    name: StrictStr | None = None
    reasoning: StrictStr | None = None
    reasoning_content: StrictStr | None = None


class StreamOptions(BaseModel):
    """``stream_options``: only ``include_usage`` is served."""

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
    priority: StrictInt | None = None  # vLLM's extension: lower = sooner (gateway.priority)
    # vLLM's: False leaves the reasoning out of the answer (with a reasoning parser).
    include_reasoning: StrictBool = True


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
}
STREAM_OPTIONS_NO_OP_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "continuous_usage_stats": (None, False),  # vLLM's
}


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


@dataclass
class _Names:
    """gRPC field name -> OpenAI field name, filled in as a request is converted, and the
    media counted so far (the gRPC API numbers images and videos across messages)."""

    fields: dict[str, str] = field(default_factory=dict)
    whole: set[str] = field(default_factory=set)
    counts: Counter[str] = field(default_factory=Counter)

    def media(self, kind: str, openai_name: str) -> None:
        """Map the next ``images[n]`` or ``videos[n]`` (``kind``) to ``openai_name``."""
        name = f"{kind}[{self.counts[kind]}]"
        self.counts[kind] += 1
        self.fields[name] = openai_name
        self.whole.add(name)


def to_generate_request(
    body: ChatCompletionRequest, served: Sequence[str], max_tokens_limit: int = INT32_MAX
) -> Converted:
    """The gateway's GenerateRequest for an OpenAI chat completion request.

    Args:
        body: The parsed request body.
        served: The model ids served here; the first is named in a refusal.
        max_tokens_limit: The gateway's ``max_tokens_limit``, tokens.

    Returns:
        The request and the map from its gRPC field names to the client's.

    Raises:
        ServiceError: INVALID_ARGUMENT naming the OpenAI field (``messages[0].content[1]``,
            ``n``, ``max_tokens``, ...) for what the front does not serve or what cannot be
            represented; NOT_FOUND for a model it does not serve. Everything else (counts,
            sizes, ranges, images, videos) is checked by the pipeline itself, with the gRPC
            path's messages.
    """
    _check_parameters(body, served)
    request = pb.GenerateRequest()
    names = _Names()
    for i, message in enumerate(body.messages):
        _add_message(request, message, i, names)
    _set_sampling(request.sampling, body, names.fields, max_tokens_limit)
    if body.priority is not None:
        if not -INT32_MAX - 1 <= body.priority <= INT32_MAX:
            raise Refusal.PRIORITY_OUT_OF_RANGE.error(
                f"priority is {body.priority}; allowed {-INT32_MAX - 1}..{INT32_MAX} (32-bit)",
                field="priority",
            )
        request.priority = body.priority
    return Converted(request, names.fields, frozenset(names.whole))


def _check_parameters(body: ChatCompletionRequest, served: Sequence[str]) -> None:
    """Refuse the top-level fields splitvl does not serve (see to_generate_request)."""
    if body.model is not None and body.model not in served:
        raise Refusal.MODEL_NOT_FOUND.error(
            f"model {body.model!r} is not served here; this server serves {served[0]!r}",
            field="model",
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


def _add_message(request: pb.GenerateRequest, message: ChatMessage, i: int, names: _Names) -> None:
    """Append message ``i`` with its parts, mapping ``messages[i].parts[k]`` to
    ``messages[i].content[k]`` (or to ``messages[i].content`` for a string), and an
    assistant message's reasoning.

    The reasoning is ``reasoning``, else ``reasoning_content`` (vLLM's request model renames
    the latter to the former when unset); vLLM's chat_utils passes it to the chat template
    for assistant messages only and drops it elsewhere, and so does this front (the gRPC
    API refuses it there instead, with INVALID_ARGUMENT).
    """
    _check_extra(message.model_extra, MESSAGE_NO_OP_DEFAULTS, f"messages[{i}]")
    msg = request.messages.add(role=_utf8(message.role, f"messages[{i}].role"))
    which = "reasoning" if message.reasoning is not None else "reasoning_content"
    reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
    if reasoning is not None and message.role == "assistant":
        names.fields[f"messages[{i}].reasoning_content"] = f"messages[{i}].{which}"
        msg.reasoning_content = _utf8(reasoning, f"messages[{i}].{which}")
    parts, content = f"messages[{i}].parts", message.content
    names.fields[parts] = f"messages[{i}].content"
    names.whole.update((parts, f"{parts}[0]"))
    if content is None:
        return
    if isinstance(content, str):
        names.fields[f"{parts}[0]"] = f"messages[{i}].content"
        msg.parts.add(text=_utf8(content, f"messages[{i}].content"))
        return
    names.whole.discard(f"{parts}[0]")
    for k, part in enumerate(content):
        where = f"messages[{i}].content[{k}]"
        names.fields[f"{parts}[{k}]"] = where
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise _refused(where, f"{where} must be an object with a string 'type'")
        convert = _PARTS.get(kind)
        if convert is None:
            raise _refused(
                where, f"{where} has type {kind!r}; served: 'text', 'image_url', 'video_url'"
            )
        msg.parts.append(convert(part, where, names))


def _text_part(part: dict[str, Any], where: str, names: _Names) -> pb.ContentPart:
    """``{"type": "text", "text": str}``."""
    text = part.get("text")
    if not isinstance(text, str) or set(part) - {"type", "text"}:
        raise _refused(where, f"{where}: a text part is {{'type', 'text': string}}")
    return pb.ContentPart(text=_utf8(text, f"{where}.text"))


def _image_part(part: dict[str, Any], where: str, names: _Names) -> pb.ContentPart:
    """``{"type": "image_url", "image_url": {"url": str, "detail"?}}``; ``detail`` is
    accepted and ignored (the pixel budget decides)."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or not isinstance(url, str) or set(part) - {"type", "image_url"}:
        raise _refused(
            f"{where}.image_url",
            f"{where}: an image_url part is {{'type', 'image_url': {{'url': string}}}}",
        )
    if spec.get("detail") not in (None, "auto", "low", "high"):
        raise _refused(
            f"{where}.image_url.detail",
            f"{where}.image_url.detail is {spec.get('detail')!r}; expected 'auto', 'low' or 'high'",
        )
    if set(spec) - {"url", "detail"}:
        raise _refused(f"{where}.image_url", f"{where}.image_url takes only 'url' and 'detail'")
    url = _utf8(url, f"{where}.image_url.url")
    names.media("images", f"{where}.image_url.url")
    image = pb.ImageInput(data_url=url) if url[:5].lower() == "data:" else pb.ImageInput(url=url)
    return pb.ContentPart(image=image)


def _video_part(part: dict[str, Any], where: str, names: _Names) -> pb.ContentPart:
    """vLLM's chat part for a video file, ``{"type": "video_url", "video_url": {"url": str}}``."""
    spec = part.get("video_url")
    url = spec.get("url") if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or not isinstance(url, str) or set(part) - {"type", "video_url"}:
        raise _refused(
            f"{where}.video_url",
            f"{where}: a video_url part is {{'type', 'video_url': {{'url': string}}}}",
        )
    # The server samples a video (GATEWAY_VIDEO_*), not each part: a key such as "fps" is
    # refused rather than ignored, so a client never believes it took effect.
    extra = sorted(set(spec) - {"url"})
    if extra:
        raise _refused(
            f"{where}.video_url", f"{where}.video_url takes only 'url' (got {', '.join(extra)})"
        )
    url = _utf8(url, f"{where}.video_url.url")
    names.media("videos", f"{where}.video_url.url")
    file = pb.VideoFile(data_url=url) if url[:5].lower() == "data:" else pb.VideoFile(url=url)
    return pb.ContentPart(video=pb.VideoInput(file=file))


#: The converter of each content part ``type`` served.
_PARTS: dict[str, Callable[[dict[str, Any], str, _Names], pb.ContentPart]] = {
    "text": _text_part,
    "image_url": _image_part,
    "video_url": _video_part,
}


def _set_sampling(
    sampling: generation_pb2.SamplingParams,
    body: ChatCompletionRequest,
    fields: dict[str, str],
    max_tokens_limit: int,
) -> None:
    """Fill ``sampling`` from the request's sampling fields, mapping ``sampling.*`` back to
    the top-level OpenAI names."""
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if name == "max_completion_tokens" else body.max_tokens
    fields["sampling.max_tokens"] = name
    if max_tokens is not None:
        sampling.max_tokens = check_max_tokens(max_tokens, max_tokens_limit, name)
    fields["sampling"] = ""
    # OpenAI's and vLLM's default temperature is 1.0; the gRPC API's 0 means greedy.
    sampling.temperature = (
        1.0 if body.temperature is None else check_float32(body.temperature, "temperature")
    )
    if body.top_p is not None:
        # The rule's owner, named as the client sent it (the gateway checks it again).
        sampling.top_p = check_top_p(check_float32(body.top_p, "top_p"), "top_p")
    if body.seed is not None:
        if not -INT64_MAX - 1 <= body.seed <= INT64_MAX:
            raise Refusal.SEED_OUT_OF_RANGE.error(
                f"seed is {body.seed}; allowed {-INT64_MAX - 1}..{INT64_MAX} (64-bit)", field="seed"
            )
        sampling.seed = body.seed
    if body.stop is not None:
        stops = [body.stop] if isinstance(body.stop, str) else body.stop
        sampling.stop.extend(_utf8(stop, f"stop[{k}]") for k, stop in enumerate(stops))
    sampling.ignore_eos = body.ignore_eos


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
    return Refusal.PARAMETER_UNSUPPORTED.error(message, field=field)


def _utf8(text: str, field: str) -> str:
    """``text`` if it can travel as UTF-8 (protobuf strings must): a lone surrogate
    (``"\\ud800"`` in the JSON) cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise Refusal.TEXT_NOT_UTF8.error(
            f"{field} holds a lone surrogate (\\ud800-\\udfff): it is not valid UTF-8 text",
            field=field,
        ) from None
    return text


# -- errors -------------------------------------------------------------------------------
def error_body(
    err: ServiceError, converted: Converted | None = None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """HTTP status, OpenAI-shaped body and headers (``Retry-After``, seconds) of an error.

    RESOURCE_EXHAUSTED is 429 only when it carries a retry hint (over capacity: a retry
    later may pass); a size limit (an image's bytes, decoded pixels) is 413, which clients
    do not retry. ``param`` is the OpenAI name of the field (``converted`` maps the gRPC
    path's ``images[1]`` and ``sampling.*`` back to the request the client sent).

    Args:
        err: The error, with its gRPC code, ErrorInfo reason (``code``) and metadata
            (``field`` becomes ``param``).
        converted: The request's conversion, to name ``param`` as the client did; None
            before there is one (the gRPC name is kept).

    Returns:
        ``(status, {"error": {"message", "type", "param", "code"}}, headers)``; the status
        is :data:`HTTP_STATUS` of the code, else 500.
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


def http_error_body(status: int, code: Refusal, message: str, param: str | None) -> dict[str, Any]:
    """OpenAI's error shape for an error of the HTTP layer itself, which no gRPC code maps
    to (a 404 path, 405, 408, 415, an unparsable body)."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPE.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }
