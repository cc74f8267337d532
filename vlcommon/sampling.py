"""Range checks of ``qwenvl.common.v1.SamplingParams`` that need no engine.

The gateway runs them before any work (a request with temperature NaN used to be
refused by the decoder only after its images were encoded and cached); the decoder runs
them again, as it trusts no caller, before building vLLM's ``SamplingParams``.
"""

from __future__ import annotations

import math

import numpy as np
from qwenvl.common.v1 import generation_pb2

from vlcommon.refusals import Refusal

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
        raise Refusal.MAX_TOKENS_OUT_OF_RANGE.error(
            f"{field} is {value}; allowed 1..{limit}", field=field, limit=limit
        )
    return value


def check_top_p(value: float, field: str = "sampling.top_p") -> float:
    """Refuse a top_p outside (0, 1] (the gateway's fronts, the decoder): vLLM refuses 0,
    and so does the gRPC API, where top_p is ``optional`` (unset means 1.0).

    Raises:
        ServiceError: INVALID_ARGUMENT ``TOP_P_OUT_OF_RANGE`` naming ``field``.
    """
    if not math.isfinite(value) or not 0.0 < value <= 1.0:
        raise Refusal.TOP_P_OUT_OF_RANGE.error(f"{field} is {value}; allowed (0, 1]", field=field)
    return value


_FLOAT32_FIELDS = {
    "temperature": Refusal.TEMPERATURE_OUT_OF_RANGE,
    "top_p": Refusal.TOP_P_OUT_OF_RANGE,
}


def check_float32(value: float, field: str) -> float:
    """``value`` unchanged, if the gRPC API's 32-bit float keeps it (the OpenAI front's JSON
    numbers are 64-bit): one that would become infinite (``1e300``) or zero (``1e-50``, and
    a top_p of 0 is refused) is refused before the range rules see the wrong value.

    Args:
        value: The number the client sent.
        field: ``temperature`` or ``top_p`` (its reason is that field's range rule).

    Raises:
        ServiceError: INVALID_ARGUMENT ``TEMPERATURE_OUT_OF_RANGE`` / ``TOP_P_OUT_OF_RANGE``
            naming ``field``.
    """
    with np.errstate(over="ignore"):
        single = float(np.float32(value)) if math.isfinite(value) else value
    if math.isfinite(value) and (math.isinf(single) or (value != 0 and single == 0)):
        raise _FLOAT32_FIELDS[field].error(
            f"{field} is {value!r}; not representable as a 32-bit float", field=field
        )
    return value


def check_sampling_ranges(msg: generation_pb2.SamplingParams) -> float:
    """Check temperature, top_p and stop (max_tokens is each service's own limit).

    Returns:
        top_p in effect (unset means 1.0).

    Raises:
        ServiceError: INVALID_ARGUMENT naming ``sampling.<field>`` and its range.
    """
    # vLLM accepts temperatures in [0, 2] (its SamplingParams check); 0 means greedy.
    if not math.isfinite(msg.temperature) or not 0.0 <= msg.temperature <= MAX_TEMPERATURE:
        raise Refusal.TEMPERATURE_OUT_OF_RANGE.error(
            f"sampling.temperature is {msg.temperature}; allowed 0..{MAX_TEMPERATURE:g}",
            field="sampling.temperature",
            limit=MAX_TEMPERATURE,
        )
    top_p = check_top_p(msg.top_p) if msg.HasField("top_p") else 1.0
    if len(msg.stop) > MAX_STOP:
        raise Refusal.STOP_INVALID.error(
            f"sampling.stop has {len(msg.stop)} strings; the limit is {MAX_STOP}",
            field="sampling.stop",
            limit=MAX_STOP,
        )
    for k, stop in enumerate(msg.stop):
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise Refusal.STOP_INVALID.error(
                f"sampling.stop[{k}] has {len(stop)} characters; allowed 1..{MAX_STOP_CHARS}",
                field=f"sampling.stop[{k}]",
                limit=MAX_STOP_CHARS,
            )
    return top_p
