"""argparse value types for the ``splitvl`` commands' numeric flags.

A value outside its range is an argparse usage error (exit status 2, the flag named) at
parse time, instead of a traceback or a hang later: ``--concurrency 0`` used to make the
bench wait forever on a zero-permit semaphore, ``--reps 0`` ended in a median of nothing.
"""

from __future__ import annotations

import argparse
import math


def _int(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} is not >= {minimum}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0 (0 where the flag documents it as 'the default')."""
    return _int(text, 0)


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not finite")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not > 0")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not >= 0")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1]."""
    value = _float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 1]")
    return value


def cosine(text: str) -> float:
    """A cosine similarity threshold in [-1, 1] (the cache service's own range)."""
    value = _float(text)
    if not -1.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not in [-1, 1]")
    return value


def base_port(text: str) -> int:
    """The first of four consecutive TCP ports: 1-65532."""
    value = positive_int(text)
    if value > 65532:
        raise argparse.ArgumentTypeError(f"{value} + 3 is past 65535")
    return value


def base_port_or_off(text: str) -> int:
    """Like base_port, or 0 for off."""
    return 0 if text.strip() == "0" else base_port(text)


def port_or_off(text: str) -> int:
    """One TCP port, 1-65535, or 0 for off."""
    value = _int(text, 0)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is past 65535")
    return value
