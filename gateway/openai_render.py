"""The JSON of OpenAI's chat completions as splitvl answers them: the ``chat.completion``
of a whole answer, the ``chat.completion.chunk`` server-sent events of a stream, and the
``splitvl`` extension field (cache tiers, timings)::

    render = ChatCompletionRenderer.new("Qwen/Qwen3-VL-2B-Instruct", include_usage=False)
    render.chunk({"content": "Hel"})        # 'data: {"id": "chatcmpl-...", ...}\\n\\n'
    render.completion(events)               # the non-streaming answer, a dict

With a reasoning parser (``GATEWAY_REASONING_PARSER=qwen3``, :mod:`gateway.reasoning`) the
renderer splits the model's reasoning from its answer as ``vllm serve --reasoning-parser
qwen3`` does: ``render.delta(split)`` is a chunk's delta, ``render.completion`` the message
with ``reasoning`` / ``reasoning_content``. The request side and errors:
:mod:`gateway.openai_protocol`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from qwenvl.common.v1 import generation_pb2

from gateway.openai_protocol import FINISH
from gateway.pipeline import GenerateEvent
from gateway.reasoning import ReasoningDelta, ReasoningParser
from vlcommon.request_rules import TIER_NAMES


# -- answers ------------------------------------------------------------------------------
def sse(data: dict[str, Any]) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data)}\n\n"


#: The server-sent event that ends a stream, as OpenAI's API sends it.
SSE_DONE = "data: [DONE]\n\n"


def usage(u: generation_pb2.Usage | None, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's ``usage`` (tokens) of the pipeline's; zeros when there is none. With a
    reasoning parser, ``completion_tokens_details.reasoning_tokens`` as ``vllm serve
    --reasoning-parser`` adds it (:meth:`ReasoningParser.count_reasoning_tokens`)."""
    u = u or generation_pb2.Usage()
    out: dict[str, Any] = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def splitvl_extension(first: GenerateEvent, last: GenerateEvent | None) -> dict[str, Any]:
    """The ``splitvl`` field OpenAI clients ignore: each image's cache tier, cosine
    similarity, grids (``[t, h, w]``, patches) and tokens, from the first event, and the
    stage timings (ms, rounded to µs) from the last."""
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


@dataclass(frozen=True)
class ChatCompletionRenderer:
    """Renders one completion's :class:`~gateway.pipeline.GenerateEvent` s as OpenAI's
    ``chat.completion`` or ``chat.completion.chunk`` JSON, each repeating the completion's
    id, creation time and model.

    Attributes:
        id: ``chatcmpl-`` and 32 hex digits.
        created: Unix time, s, when the renderer was made (once the first event came).
        model: The served model id.
        include_usage: ``stream_options.include_usage``: each chunk carries ``usage: null``
            and a last chunk without choices carries the usage.
        reasoning: The reasoning parser, None = off (the text is all ``content``).
        include_reasoning: The request's ``include_reasoning`` (vLLM's field): False
            leaves the reasoning out of the answer (a stream step that only reasoned sends
            no chunk); the usage still counts its tokens, as vLLM's.
    """

    id: str
    created: int
    model: str
    include_usage: bool = False
    reasoning: ReasoningParser | None = None
    include_reasoning: bool = True

    @classmethod
    def new(
        cls,
        model: str,
        include_usage: bool,
        reasoning: ReasoningParser | None = None,
        include_reasoning: bool = True,
    ) -> ChatCompletionRenderer:
        """A renderer with a fresh id, created now."""
        return cls(
            f"chatcmpl-{uuid.uuid4().hex}",
            int(time.time()),
            model,
            include_usage,
            reasoning,
            include_reasoning,
        )

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> str:
        """One ``chat.completion.chunk`` event with ``delta`` for choice 0."""
        data = self._head("chat.completion.chunk")
        data["choices"] = [
            {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        ]
        if self.include_usage:
            data["usage"] = None
        return sse(data)

    @staticmethod
    def delta(split: ReasoningDelta | None) -> dict[str, Any]:
        """A streamed step's ``delta`` as vLLM serializes its ``DeltaMessage`` (the fields
        set, none for a None split): ``content``, and the reasoning as ``reasoning`` (vLLM
        0.32's field) and ``reasoning_content`` (its name in earlier vLLM and DeepSeek's
        API, which many clients read)."""
        delta: dict[str, Any] = {}
        if split is not None and split.content is not None:
            delta["content"] = split.content
        if split is not None and split.reasoning is not None:
            delta["reasoning"] = delta["reasoning_content"] = split.reasoning
        return delta

    def visible(self, split: ReasoningDelta | None) -> ReasoningDelta | None:
        """A streamed step's split as the client gets it: without its reasoning when
        ``include_reasoning`` is off (None, no chunk, when no content text is left: vLLM
        drops such a step, an empty content included)."""
        if self.include_reasoning or split is None:
            return split
        return ReasoningDelta(None, split.content) if split.content else None

    def reasoning_tokens(self, token_ids: Iterable[int]) -> int | None:
        """The answer's reasoning tokens (``token_ids``: all it generated, read only with
        a parser); None without a reasoning parser (the usage then has no
        ``completion_tokens_details``)."""
        return None if self.reasoning is None else self.reasoning.count_reasoning_tokens(token_ids)

    def usage_chunk(
        self, first: GenerateEvent, last: GenerateEvent, reasoning_tokens: int | None = None
    ) -> str:
        """The event after the last choice chunk: no choices, the usage and ``splitvl``."""
        data = self._head("chat.completion.chunk")
        data["choices"] = []
        data["usage"] = usage(last.usage, reasoning_tokens)
        data["splitvl"] = splitvl_extension(first, last)
        return sse(data)

    def completion(self, events: Sequence[GenerateEvent]) -> dict[str, Any]:
        """The non-streaming ``chat.completion`` of all of a request's events (the first
        carries the images, the last the finish reason, usage and timings). With a
        reasoning parser the message is ``{"role", "content", "reasoning",
        "reasoning_content"}``, each text None (``null``) when empty (the reasoning also
        when ``include_reasoning`` is off), as vLLM's."""
        first = events[0] if events else None
        last = events[-1] if events else None
        text = "".join(e.text for e in events)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text)
            reasoning = reasoning if self.include_reasoning else None
            message.update(content=content, reasoning=reasoning, reasoning_content=reasoning)
        data = self._head("chat.completion")
        data["choices"] = [
            {
                "index": 0,
                "message": message,
                "finish_reason": FINISH.get(last.finish_reason, "stop") if last else "stop",
                "logprobs": None,
            }
        ]
        ids = (token_id for e in events for token_id in e.token_ids)
        data["usage"] = usage(last.usage, self.reasoning_tokens(ids)) if last is not None else None
        data["splitvl"] = splitvl_extension(first, last) if first is not None else {}
        return data
