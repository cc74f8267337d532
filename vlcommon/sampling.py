"""Range checks of ``qwenvl.common.v1.SamplingParams`` that need no engine.

The gateway runs them before any work (a request with temperature NaN used to be
refused by the decoder only after its images were encoded and cached); the decoder runs
them again, as it trusts no caller, before building vLLM's ``SamplingParams``.
"""

from __future__ import annotations

import math

from qwenvl.common.v1 import generation_pb2

from vlcommon.errors import invalid_argument

MAX_TEMPERATURE = 2.0
MAX_STOP = 16
MAX_STOP_CHARS = 256


def check_max_tokens(value: int, limit: int, field: str = "sampling.max_tokens") -> int:
    """Refuse a max_tokens outside 1..``limit`` (the gateway, its OpenAI front, the decoder).

    Raises:
        ServiceError: INVALID_ARGUMENT ``MAX_TOKENS_OUT_OF_RANGE`` naming ``field`` and the
            limit.
    """
    if not 1 <= value <= limit:
        raise invalid_argument(
            "MAX_TOKENS_OUT_OF_RANGE",
            f"{field} is {value}; allowed 1..{limit}",
            field=field,
            limit=limit,
        )
    return value


def check_sampling_ranges(msg: generation_pb2.SamplingParams) -> float:
    """Check temperature, top_p and stop (max_tokens is each service's own limit).

    Returns:
        top_p in effect (unset or 0 means 1.0).

    Raises:
        ServiceError: INVALID_ARGUMENT naming ``sampling.<field>`` and its range.
    """
    # vLLM accepts temperatures in [0, 2] (its SamplingParams check); 0 means greedy.
    if not math.isfinite(msg.temperature) or not 0.0 <= msg.temperature <= MAX_TEMPERATURE:
        raise invalid_argument(
            "TEMPERATURE_OUT_OF_RANGE",
            f"sampling.temperature is {msg.temperature}; allowed 0..{MAX_TEMPERATURE:g}",
            field="sampling.temperature",
            limit=MAX_TEMPERATURE,
        )
    top_p = msg.top_p or 1.0
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise invalid_argument(
            "TOP_P_OUT_OF_RANGE",
            f"sampling.top_p is {msg.top_p}; allowed (0, 1]",
            field="sampling.top_p",
        )
    if len(msg.stop) > MAX_STOP:
        raise invalid_argument(
            "STOP_INVALID",
            f"sampling.stop has {len(msg.stop)} strings; the limit is {MAX_STOP}",
            field="sampling.stop",
            limit=MAX_STOP,
        )
    for k, stop in enumerate(msg.stop):
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise invalid_argument(
                "STOP_INVALID",
                f"sampling.stop[{k}] has {len(stop)} characters; allowed 1..{MAX_STOP_CHARS}",
                field=f"sampling.stop[{k}]",
                limit=MAX_STOP_CHARS,
            )
    return top_p
