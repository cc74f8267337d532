"""The ``splitvl`` command.

splitvl make-tiny-model DIR [--like M]   a random-weight Qwen3-VL checkpoint (tiny, or M's config)
splitvl up [--model PATH_OR_HUB_ID] [--decoder-arg=ARG ...]
           [--replicas gateway=2,decoder=2,cache=2,encoder=2 --store redis|URL]
                                      run the four services on loopback until SIGINT/SIGTERM
splitvl generate --image FILE|URL... --video FILE|URL... --prompt TEXT [--json]   stream an answer
splitvl demo [--json]                 start the services, ask about real photos and a video, stop
splitvl bench [--quick] [--json]      splitvl against vLLM alone: TTFT, ITL, throughput
                          (--photos, --video, --wide-only, --openai, --scale, --front-cpu: others)
splitvl cache-bench [--sizes N,...] [--json]   similarity index latency/memory/recall by size
splitvl cache-eval [--quick] [--json]   similarity threshold: false hits and recall by threshold
splitvl load [--concurrency N --duration S --json]   concurrent streams; statuses, latency
splitvl faults [--window S --json]    replicas and the store killed and restarted under load
splitvl soak [--requests N --json]    distinct images in a row; RSS growth of each service
splitvl plan --profile F --rate R --p95-ttft-ms T   replicas for a load (--calibrate F, --validate)

A service that fails to start ends the command with one line naming it and its log file
(exit status 1).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

from splitvl.argtypes import (
    base_port,
    base_port_or_off,
    non_negative_float,
    non_negative_int,
    port_or_off,
    positive_float,
    positive_int,
)
from splitvl.home import cluster_from_args
from splitvl.launcher import (
    DECODER_DEFAULT_ARGS,
    DEFAULT_BASE_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_METRICS_BASE_PORT,
    LaunchConfigError,
    ServiceStartError,
    StartInterrupted,
    StopFlag,
    Supervisor,
)
from splitvl.ports import PORT_STRIDE
from splitvl.redis_server import DEFAULT_MAXMEMORY, memory_size
from splitvl.replicas import layout_lines, parse_replicas, store_spec
from splitvl.tiny_model import LIKE


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` only where there is a value to show (not None, [], False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if default is None or default is False or (isinstance(default, list) and not default):
            return action.help
        return super()._get_help_string(action)


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from splitvl.tiny_model import make_tiny_model

    print(make_tiny_model(args.dir, seed=args.seed, bench=args.bench, like=args.like))
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    cluster = cluster_from_args(args)
    stop = StopFlag()  # not a threading.Event: its set() takes a lock (see StopFlag)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    for line in layout_lines(
        cluster.ports, cluster.log_dir, cluster.cache_store, cluster.store_server
    ):
        print(line, flush=True)
    cluster.start()
    failed = False
    try:
        try:
            cluster.wait_ready(progress=lambda line: print(line, flush=True), stop=stop)
        except StartInterrupted as err:
            print(f"splitvl up: {err}; stopping", file=sys.stderr, flush=True)
            return 130
        http = cluster.ports.http
        openai = f", OpenAI-compatible http://127.0.0.1:{http}/v1" if http else ""
        print(
            f"splitvl is SERVING: gateway {cluster.ports.gateway_address()}{openai} "
            f"(logs in {cluster.log_dir}); Ctrl-C stops it",
            flush=True,
        )
        supervisor = Supervisor(cluster, say=lambda line: print(line, file=sys.stderr, flush=True))
        while not stop.is_set():
            reason = supervisor.poll()
            if reason is not None:
                print(f"splitvl up: {reason}", file=sys.stderr, flush=True)
                failed = True
                break
            stop.wait(1.0)
    finally:
        codes = cluster.stop()
        print(f"stopped: {codes}", flush=True)
    return 1 if failed else 0


class _MediaAction(argparse.Action):
    """``--image`` / ``--video``: each value also lands in ``args.media`` as (flag, value),
    so images and videos are sent in the order the command line gives them."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        getattr(namespace, self.dest).append(values)
        media = getattr(namespace, "media", None) or []
        media.append((self.dest, values))
        namespace.media = media


def media_parts(args: argparse.Namespace) -> list[Any]:
    """The ``--image`` and ``--video`` values as ImageInput / VideoInput, in command-line order.

    Raises:
        OSError: a file cannot be read (``err.media_flag`` names the flag).
    """
    from splitvl.client import image_input, video_input

    media = getattr(args, "media", None) or [("image", s) for s in args.image]
    parts: list[Any] = []
    for kind, source in media:
        try:
            if kind == "video":
                parts.append(video_input(source, sample_fps=args.fps, max_frames=args.max_frames))
            else:
                parts.append(image_input(source))
        except OSError as err:
            err.media_flag = kind  # type: ignore[attr-defined]
            raise
    return parts


def cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    from splitvl.client import build_request, generate

    try:
        images = media_parts(args)
    except OSError as err:
        flag = getattr(err, "media_flag", "image")
        print(
            f"splitvl generate: cannot read --{flag} {err.filename}: {err.strerror}",
            file=sys.stderr,
        )
        return 2
    request = build_request(
        images,
        args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
    )
    # Unset (0) takes the model's default (GenerateRequest.pixel_budget).
    request.pixel_budget.min_pixels = args.min_pixels or 0
    request.pixel_budget.max_pixels = args.max_pixels or 0
    on_text = None if args.json else (lambda s: print(s, end="", flush=True))
    try:
        result = generate(args.address, request, timeout_s=args.timeout, on_text=on_text)
    except grpc.RpcError as err:
        code = err.code().name  # type: ignore[attr-defined]
        details = err.details()  # type: ignore[attr-defined]
        if args.json:
            print(json.dumps({"error": {"code": code, "message": details}}))
        print(f"{code}: {details}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print()
        for im in result.images:
            print(
                # On a miss the score is the nearest stored image's, which was refused
                # (another grid, or the verification): not a similarity of what was served.
                f"image {im['index']}: {im['tier']} "
                f"({'nearest' if im['tier'] == 'miss' else 'similarity'} {im['similarity']:.4f}, "
                f"grid {im['grid']}, {im['tokens']} tokens"
                + (
                    f"; the stored grid, the request's was {im['requested_grid']}"
                    if im["requested_grid"] != im["served_grid"]
                    else ""
                )
                + f"{'' if im['decoded'] else ', not decoded: found by its file digest'})",
                file=sys.stderr,
            )
        for v in result.videos:
            stamps = ", ".join(f"{t:.2f}" for t in v["timestamps"])
            print(
                f"video {v['index']}: {v['tier']} (grid {v['grid']}, {v['tokens']} tokens, "
                f"{v['frames']} frames at {stamps} s)",
                file=sys.stderr,
            )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from splitvl.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitvl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="build the tiny random-weight checkpoint")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--bench", action="store_true", help="the bench-sized checkpoint instead")
    p.add_argument(
        "--like",
        choices=sorted(LIKE),
        help="another configuration, random weights: Qwen/Qwen3-VL-2B-Instruct (every "
        "dimension, bf16), wide (its embedding width, a shallow ViT and language model, bf16), "
        "moe (the tiny checkpoint with a MoE language model), thinking (the tiny checkpoint "
        "with a Qwen3-VL-Thinking chat template)",
    )
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("up", help="run the four services")
    add_cluster_flags(p)
    add_replica_flags(p)
    p.add_argument(
        "--reasoning-parser",
        choices=["qwen3"],
        help="the OpenAI front returns the model's reasoning (before </think>) apart from its "
        "answer, as vLLM's --reasoning-parser qwen3 (the gateway's GATEWAY_REASONING_PARSER; "
        "Qwen3-VL Thinking checkpoints)",
    )
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("demo", help="run the demo on real photos and a video")
    add_cluster_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--max-tokens", type=positive_int, default=16)
    p.set_defaults(func=cmd_demo)

    add_tool_parsers(sub)
    add_generate_parser(sub)
    return parser


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    """The flags ``up`` and ``demo`` share: the checkpoint, ports, logs, engine arguments."""
    p.add_argument(
        "--model", help="checkpoint directory or hub id (default: tiny, built on first use)"
    )
    p.add_argument(
        "--base-port",
        type=base_port,
        default=DEFAULT_BASE_PORT,
        help="gateway port; encoder, cache, decoder take the next three, their replica r "
        f"{PORT_STRIDE}*(r-1) above that (default %(default)s)",
    )
    p.add_argument(
        "--metrics-base-port",
        type=base_port_or_off,
        default=DEFAULT_METRICS_BASE_PORT,
        help="Prometheus port of the gateway, +1..+3 for the others (replicas as for "
        "--base-port); 0 = off (default %(default)s)",
    )
    p.add_argument(
        "--http-port",
        type=port_or_off,
        default=DEFAULT_HTTP_PORT,
        help="the gateway's OpenAI-compatible HTTP front (/v1/chat/completions); 0 = off "
        "(default %(default)s)",
    )
    p.add_argument(
        "--log-dir",
        help="the services' logs (default: $SPLITVL_HOME/logs/BASE_PORT; a folder in use "
        "by a running instance is refused)",
    )
    p.add_argument(
        "--start-timeout",
        type=positive_float,
        default=900.0,
        metavar="S",
        help="seconds to wait for every service to be SERVING before giving up (a first "
        "start on a busy 2-core host spends minutes importing vLLM) (default %(default)s)",
    )
    p.add_argument(
        "--decoder-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="a vLLM engine argument for the decoder, appended after the tiny model's "
        f"defaults ({' '.join(DECODER_DEFAULT_ARGS)}) and $SPLITVL_DECODER_ARGS, so it "
        "overrides them (repeatable; write flags as --decoder-arg=--max-model-len=32768)",
    )


def add_generate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``splitvl generate``: one request to a running gateway."""
    p = sub.add_parser(
        "generate",
        help="stream an answer from the gateway",
        description="Stream one answer from a running gateway (TLS and tokens from "
        "SPLITVL_TLS_* and SPLITVL_AUTH_TOKEN, docs/security.md).",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument(
        "--image",
        action=_MediaAction,
        default=[],
        help="image file, http(s):// URL (fetched by the gateway; needs GATEWAY_ALLOW_URLS=true "
        "there) or data: URL; repeatable, sent in order (with --video) before the prompt",
    )
    p.add_argument(
        "--video",
        action=_MediaAction,
        default=[],
        help="video file (MP4, MOV, MKV, WebM, GIF...), http(s):// URL or data: URL; "
        "repeatable, sent in command-line order with the images",
    )
    p.add_argument(
        "--fps",
        type=non_negative_float,
        default=0.0,
        help="frames per second sampled from each video; 0 = the server's default (2)",
    )
    p.add_argument(
        "--max-frames",
        type=non_negative_int,
        default=0,
        help="most frames kept per video; 0 = the server's default",
    )
    p.add_argument("--prompt", required=True, help="the user's text, after the images")
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        help="output token limit; unset = the decoder's DECODER_MAX_TOKENS_DEFAULT (256)",
    )
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past EOS until max tokens"
    )
    p.add_argument(
        "--min-pixels",
        type=positive_int,
        default=None,
        help="pixel_budget.min_pixels of the resize plan; unset = the model's",
    )
    p.add_argument(
        "--max-pixels",
        type=positive_int,
        default=None,
        help="pixel_budget.max_pixels (at most the model's); unset = the model's",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, token_ids, images with their served and requested "
        "grids, videos, finish_reason, usage, timings)",
    )
    p.add_argument("--address", default=f"127.0.0.1:{DEFAULT_BASE_PORT}", help="the gateway")
    p.add_argument("--timeout", type=positive_float, default=300.0, help="deadline, seconds")
    p.set_defaults(func=cmd_generate)


def add_replica_flags(p: argparse.ArgumentParser) -> None:
    """``up``'s ``--replicas``, ``--store`` and ``--redis-maxmemory`` (splitvl/replicas.py)."""
    p.add_argument(
        "--replicas",
        type=parse_replicas,
        metavar="SERVICE=N[,...]",
        help="run N replicas of a service, e.g. decoder=2,cache=2,encoder=2 (ports and logs: "
        "the layout up prints, docs/usage.md); 2+ caches need --store; gateway=N runs N "
        "gateway processes on the one --base-port and --http-port (SO_REUSEPORT)",
    )
    p.add_argument(
        "--store",
        type=store_spec,
        metavar="memory|redis|URL",
        help="the caches' store (CACHE_STORE): memory (in the cache process; the default, "
        "unless $CACHE_STORE says otherwise), redis (a redis-server started on a free "
        "loopback port with a random password, data and log in the log folder, stopped with "
        "up), or a URL such as redis://:PASSWORD@HOST:6379/0 (nothing started)",
    )
    p.add_argument(
        "--redis-maxmemory",
        type=memory_size_arg,
        metavar="SIZE",
        help=f"maxmemory of the redis-server --store redis starts, evicted LRU (allkeys-lru); "
        f"redis units: 512mb, 2gb (default {DEFAULT_MAXMEMORY})",
    )


def memory_size_arg(text: str) -> str:
    """argparse type for ``--redis-maxmemory``."""
    try:
        return memory_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


#: Entry-point group through which the tools (``splitvl_tools``: bench, cache-eval, ...)
#: add their subcommands, so that the command never imports its tools (pyproject.toml).
TOOL_ENTRY_POINTS = "splitvl.commands"


def add_tool_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Let each installed tool add its subcommand (``add_parser(sub)``), in name order."""
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group=TOOL_ENTRY_POINTS), key=lambda e: e.name):
        try:
            add_parser = ep.load()
        except ModuleNotFoundError as err:
            # The service images (deploy/Dockerfile) ship the product without its tools.
            if (err.name or "").split(".")[0] == ep.module.split(".")[0]:
                continue
            raise
        add_parser(sub)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
    except ServiceStartError as err:
        # One line, not a traceback: the log file has the service's own error.
        print(f"splitvl {args.command}: {err.summary}", file=sys.stderr)
        rc = 1
    except LaunchConfigError as err:
        print(f"splitvl {args.command}: error: {err}", file=sys.stderr)
        rc = 2
    sys.exit(rc)


if __name__ == "__main__":
    main()
