"""The one way a service starts: ``python -m <service>`` calls :func:`service_main`.

It builds the command line from the service's settings class (each listed field becomes a
``--kebab-case`` flag with the field's type, description and default; the environment,
with the service's prefix, still sets every field), checks the model path where the
service needs one, configures logging, starts the launcher watchdog
(:mod:`vlcommon.lifeline`), runs the service's own ``prepare`` step (CPU pinning, torch
threads) and then its ``serve`` coroutine through :func:`vlcommon.server.run`.

Usage::

    def main(argv: list[str] | None = None) -> None:
        service_main(
            "encoder",
            EncoderSettings,
            flags=("model", "host", "port", "metrics_port", "device", "dtype"),
            serve=main_async,
            argv=argv,
            doc=__doc__,
        )

Flags are derived by hand from ``model_fields`` rather than through pydantic-settings'
``CliSettingsSource``, which turns *every* field into a flag: secrets (``auth_tokens``,
``internal_token``) would then be accepted on the command line, where ``ps`` shows them.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from vlcommon.lifeline import start_watchdog
from vlcommon.model_info import model_error
from vlcommon.server import configure_logging, run

S = TypeVar("S", bound=BaseSettings)


def _flag_type(annotation: Any) -> tuple[Callable[[str], Any], list[str] | None]:
    """argparse ``type`` and ``choices`` for a settings field's annotation."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return str, [str(v) for v in typing.get_args(annotation)]
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(inner) == 1:
            return _flag_type(inner[0])
    if annotation is bool:
        return _parse_bool, None
    if annotation in (int, float, str):
        return annotation, None  # type: ignore[no-any-return]
    return str, None


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false)")


def add_settings_flags(
    parser: argparse.ArgumentParser, settings_cls: type[BaseSettings], names: Sequence[str]
) -> None:
    """Add ``--kebab-case`` flags for ``names``, typed and described by the settings class.

    A flag left out keeps the environment's (or the field's default) value: its argparse
    default is ``None``, and :func:`settings_from_args` passes only the flags given.

    Raises:
        KeyError: a name that is not a field of ``settings_cls`` (a programming error).
    """
    prefix = str(settings_cls.model_config.get("env_prefix", ""))
    for name in names:
        info = settings_cls.model_fields[name]
        type_, choices = _flag_type(info.annotation)
        env = f"{prefix}{name}".upper()
        text = info.description or ""
        default = info.get_default(call_default_factory=True)
        shown = "" if default in ("", None) else f"; default {default}"
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=type_,
            choices=choices,
            default=None,
            help=f"{text} (env {env}{shown})".strip(),
        )


def settings_from_args(settings_cls: type[S], args: argparse.Namespace, names: Sequence[str]) -> S:
    """The settings: environment first, the flags that were given on top."""
    given = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    return settings_cls(**given)


def service_main(
    service: str,
    settings_cls: type[S],
    *,
    flags: Sequence[str],
    serve: Callable[[S, argparse.Namespace], Awaitable[None]],
    argv: list[str] | None = None,
    doc: str | None = None,
    parser: argparse.ArgumentParser | None = None,
    check: Callable[[S, argparse.Namespace], str | None] | None = None,
    prepare: Callable[[S], None] | None = None,
) -> None:
    """Parse flags, build the settings, then run ``serve(settings, args)`` until a signal.

    Args:
        service: The service's short name for logs (``gateway``, ``encoder``, ``cache``).
        settings_cls: Its pydantic-settings class (environment prefix such as ``ENCODER_``).
        flags: The fields offered as flags; ``model`` among them makes it required and
            checked (:func:`vlcommon.model_info.model_error`) before anything loads.
        serve: The service's main coroutine, given the settings and the parsed flags.
        argv: Command line (default ``sys.argv[1:]``).
        doc: The ``--help`` description (the service module's docstring).
        parser: A parser with flags of its own (the decoder's carries vLLM's engine
            arguments); the settings' flags are added to it.
        check: Returns a usage problem (one line) or None, after the settings are built.
        prepare: Runs after logging is set up and before ``serve`` (CPU pinning, threads).

    Raises:
        SystemExit: status 2 with one ``error:`` line for a bad flag or environment value,
            a missing or unloadable model or a refused combination (never the whole usage:
            the decoder's would be vLLM's 250 lines); status 1 for a configuration the
            server refuses at start (``ConfigError``).
    """
    package = settings_cls.__module__.split(".")[0]
    if parser is None:
        parser = argparse.ArgumentParser(prog=f"python -m {package}", description=doc)
    add_settings_flags(parser, settings_cls, flags)
    args = parser.parse_args(argv)

    def usage_error(message: str) -> NoReturn:
        parser.exit(2, f"{parser.prog}: error: {message} (flags: --help)\n")

    try:
        settings = settings_from_args(settings_cls, args, flags)
    except ValidationError as err:
        usage_error(_one_line(err, settings_cls))
    if "model" in flags:
        model = str(getattr(settings, "model", "") or "")
        prefix = str(settings_cls.model_config.get("env_prefix", "")).upper()
        problem = f"--model (or {prefix}MODEL) is required" if not model else model_error(model)
        if problem:
            usage_error(problem)
    if check is not None:
        problem = check(settings, args)
        if problem:
            usage_error(problem)
    configure_logging(service)
    start_watchdog()
    if prepare is not None:
        prepare(settings)
    run(serve(settings, args))


def _one_line(err: ValidationError, settings_cls: type[BaseSettings]) -> str:
    """``ENCODER_DTYPE / --dtype: String should match pattern ...`` for the first error."""
    first = err.errors()[0]
    name = str(first["loc"][0]) if first.get("loc") else "?"
    prefix = str(settings_cls.model_config.get("env_prefix", "")).upper()
    return f"{prefix}{name.upper()} / --{name.replace('_', '-')}: {first['msg']}"
