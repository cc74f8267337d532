"""What the encoder and decoder are started with, read from the checkpoint: its dtype,
the decoder's default vLLM engine arguments, and the user's extra arguments as words."""

from __future__ import annotations

import shlex
from pathlib import Path

from splitvl.errors import LaunchConfigError

# The tiny checkpoint's engine settings; a real model overrides them with
# ``splitvl up --decoder-arg`` or ``SPLITVL_DECODER_ARGS`` (vLLM's argparse keeps the last
# value of a repeated flag, so appended arguments win).
DECODER_DEFAULT_ARGS = ("--dtype", "float32", "--max-model-len", "4096", "--seed", "0")
#: Checkpoint dtypes (``config.json``) that the encoder and vLLM both run as given.
SERVED_DTYPES = ("float32", "bfloat16", "float16")


def checkpoint_dtype(model: str) -> str | None:
    """The dtype a checkpoint was saved in, from its ``config.json``; None if unknown.

    transformers 5 writes ``dtype``, 4.x wrote ``torch_dtype`` (and Qwen3-VL's published
    configs put it in ``text_config`` too). Only a local directory is read: a hub id
    is not resolved here (that may download), so it keeps ``DECODER_DEFAULT_ARGS``.
    """
    import json

    path = Path(model).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") or {}
    for value in (
        config.get("dtype"),
        config.get("torch_dtype"),
        text.get("dtype"),
        text.get("torch_dtype"),
    ):
        if isinstance(value, str) and value in SERVED_DTYPES:
            return value
    return None


def decoder_default_args(model: str) -> tuple[str, ...]:
    """``DECODER_DEFAULT_ARGS`` with ``--dtype`` set to the checkpoint's own dtype.

    The defaults say float32 because the tiny checkpoint's equality tests need it (and it
    is saved in float32); a bf16 checkpoint (``make-tiny-model --like``) is served in bf16,
    as ``vllm serve`` would (its ``--dtype auto`` takes the config's dtype).
    """
    dtype = checkpoint_dtype(model)
    args = list(DECODER_DEFAULT_ARGS)
    if dtype is not None:
        args[args.index("--dtype") + 1] = dtype
    return tuple(args)


def split_args(text: str, source: str) -> list[str]:
    """Shell words of a decoder-argument string (``shlex.split``).

    Raises:
        LaunchConfigError: unbalanced quotes or a trailing escape, naming ``source``.
    """
    try:
        return shlex.split(text)
    except ValueError as err:
        raise LaunchConfigError(f"{source}: {err} in {text!r}") from None
