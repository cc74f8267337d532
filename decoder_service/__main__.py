"""Run the decoder service: ``python -m decoder_service --model DIR --port 50054 [vLLM args]``.

All of vLLM's engine arguments are accepted as they are (``AsyncEngineArgs.add_cli_args``);
splitvl sets defaults it depends on: ``--enable-mm-embeds``, ``--limit-mm-per-prompt``
with a non-zero image count (with 0 vLLM drops deepstack, FACTS.md) and, on CPU,
``--enforce-eager`` and ``--block-size 32`` (``engine.CPU_BLOCK_SIZE``: a cache hit then
reuses its image's KV). Service flags: ``--host``, ``--port``, ``--metrics-port`` and the
``DECODER_*`` environment variables.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict
from qwenvl.decoder.v1 import decoder_service_pb2, decoder_service_pb2_grpc

from decoder_service import metrics
from decoder_service.engine import DecoderEngine, cpu_block_size_error, default_block_size
from decoder_service.servicer import DecoderServicer
from decoder_service.validation import Limits
from vlcommon import handoff
from vlcommon.handoff import Reader
from vlcommon.model_info import model_error
from vlcommon.server import limit_torch_threads, serve
from vlcommon.service_main import service_main
from vlcommon.settings import ServerSettings
from vlcommon.tls import ClientSecurity

log = logging.getLogger("decoder_service")
SERVICE = decoder_service_pb2.DESCRIPTOR.services_by_name["DecoderService"].full_name


class DecoderSettings(ServerSettings):
    """Service settings of the decoder (engine settings are vLLM's own flags)."""

    model_config = SettingsConfigDict(env_prefix="DECODER_", extra="ignore")

    max_tokens_default: int = Field(256, ge=1)
    max_tokens_limit: int = Field(4096, ge=1)
    max_text_chars: int = Field(65536, ge=1)
    max_messages: int = Field(64, ge=1, description="Messages per request.")
    max_parts: int = Field(256, ge=1, description="Content parts over all messages.")
    handoff_s: float | None = Field(
        None,
        ge=0,
        description="Seconds into a drain after which the streams still running are handed "
        "back to the gateway to move to another replica (UNAVAILABLE DECODER_DRAINING); "
        "unset: one second before the grace period ends.",
    )


def _on_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return True


async def main_async(settings: DecoderSettings, engine_args: object) -> None:
    # Before vLLM registers its semaphores and queues: a tracker that outlives a kill -9
    # of this process group unlinks them (sem.mp-* was left behind otherwise).
    handoff.start_resource_tracker_in_own_group()
    engine = DecoderEngine(engine_args)
    limits = Limits(
        max_images=0,
        max_tokens_default=settings.max_tokens_default,
        max_tokens_limit=settings.max_tokens_limit,
        max_text_chars=settings.max_text_chars,
        max_messages=settings.max_messages,
        max_parts=settings.max_parts,
    )
    stop = asyncio.Event()

    def engine_dead() -> None:
        if not stop.is_set():
            log.error("vLLM engine is dead: going NOT_SERVING and exiting for a restart")
            stop.set()

    reader = Reader(
        ClientSecurity.from_settings(settings), max_message_bytes=settings.max_message_bytes
    )
    servicer = DecoderServicer(engine, limits, on_engine_dead=engine_dead, reader=reader)

    # vLLM's shared-memory message queues (/dev/shm/psm_*, 160 MiB each) outlive a
    # kill -9 of the decoder's process group; the previous process's record lists them.
    handoff.sweep_dead_segments("decoder")

    record: list[Path] = []

    async def startup() -> None:
        await engine.start()
        metrics.RUNNING.set_function(engine.num_unfinished)
        path = handoff.record_owned_segments("decoder", handoff.mapped_segments(_process_tree()))
        if path is not None:
            record.append(path)

    hand_offs: list[asyncio.Task[None]] = []

    def on_drain() -> None:
        # New calls are refused from now; the streams running may finish until the
        # hand-off, then the gateway moves the rest (request migration) instead of the
        # grace cutting them.
        after = settings.handoff_s
        after = max(0.0, settings.grace_s - 1.0) if after is None else min(after, settings.grace_s)

        async def later() -> None:
            await asyncio.sleep(after)
            await servicer.hand_off()

        hand_offs.append(asyncio.ensure_future(later()))

    async def shutdown() -> None:
        for task in hand_offs:
            task.cancel()
        engine.shutdown()  # vLLM removes its own segments on a clean stop
        await reader.close()
        for path in record:  # so the record of them goes too
            path.unlink(missing_ok=True)

    await serve(
        service_name="decoder",
        service_full_names=[SERVICE],
        settings=settings,
        register=lambda server: decoder_service_pb2_grpc.add_DecoderServiceServicer_to_server(
            servicer, server
        ),
        startup=startup,
        shutdown=shutdown,
        stop_event=stop,
        on_drain=on_drain,
    )
    if engine.died:
        raise SystemExit(3)


def _process_tree() -> list[int]:
    """This process and its descendants (vLLM's engine core and workers)."""
    import psutil

    me = psutil.Process()
    return [me.pid, *(p.pid for p in me.children(recursive=True))]


def engine_problem(settings: DecoderSettings, args: argparse.Namespace) -> str | None:
    """A usage problem with vLLM's engine arguments, found before the engine starts."""
    from vllm import AsyncEngineArgs

    # Before AsyncEngineArgs, which resolves the model itself and raises from huggingface_hub.
    problem = model_error(args.model)
    if problem:
        return problem
    engine_args = AsyncEngineArgs.from_cli_args(args)
    if not engine_args.enable_mm_embeds:
        return "--enable-mm-embeds is required: the decoder takes precomputed embeddings"
    if _on_cpu() and engine_args.block_size is not None:
        problem = cpu_block_size_error(engine_args.block_size)
        if problem:
            return problem
    block, max_len = engine_args.block_size, engine_args.max_model_len
    if block is not None and max_len is not None and block > max_len:
        # vLLM would start, then fail to fit one block in the KV-cache space with a hint
        # about gpu_memory_utilization (measured: --block-size 1048576 under splitvl up).
        return f"--block-size {block} is larger than --max-model-len {max_len}"
    return None


def main(argv: list[str] | None = None) -> None:
    from vllm import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
    parser = FlexibleArgumentParser(prog="python -m decoder_service", description=__doc__)
    parser = AsyncEngineArgs.add_cli_args(parser)
    parser.set_defaults(
        enable_mm_embeds=True,
        limit_mm_per_prompt={"image": 8, "video": 2},
        enforce_eager=_on_cpu() or None,
        block_size=default_block_size(_on_cpu()),
        # The gateway's aged priorities (gateway.priority) order vLLM's waiting requests;
        # with fcfs vLLM would ignore them. --scheduling-policy fcfs restores arrival order.
        scheduling_policy="priority",
    )
    service_main(
        "decoder",
        DecoderSettings,
        flags=("host", "port", "metrics_port"),
        serve=lambda settings, args: main_async(settings, AsyncEngineArgs.from_cli_args(args)),
        argv=argv,
        parser=parser,
        check=engine_problem,
        prepare=lambda _: limit_torch_threads(),
    )


if __name__ == "__main__":
    main()
