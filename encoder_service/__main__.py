"""Run the encoder service: ``python -m encoder_service --model DIR --port 50052``.

Settings come from ``ENCODER_*`` environment variables; flags override them.
"""

from __future__ import annotations

import asyncio
import logging
import os

from qwenvl.encoder.v1 import encoder_service_pb2, encoder_service_pb2_grpc

from encoder_service.batcher import Batcher
from encoder_service.engine import VisionEngine
from encoder_service.servicer import EncoderServicer
from encoder_service.settings import EncoderSettings, batch_patches_for
from vlcommon import handoff
from vlcommon.server import serve
from vlcommon.service_main import service_main

log = logging.getLogger("encoder_service")
SERVICE = encoder_service_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name


async def main_async(settings: EncoderSettings) -> None:
    state: dict[str, object] = {}
    holder = handoff.holder_for("encoder", settings)

    async def startup() -> None:
        engine = await asyncio.to_thread(
            VisionEngine.load,
            settings.model,
            device=settings.device,
            dtype=settings.dtype,
            fast_cpu_kernels=settings.fast_cpu_kernels,
        )
        batcher = Batcher(
            engine.encode,
            max_batch_images=settings.max_batch_images,
            max_batch_patches=batch_patches_for(settings.max_batch_patches, engine.device.type),
            max_wait_ms=settings.max_wait_ms,
            max_queue=settings.max_queue,
        )
        batcher.start()
        servicer.engine, servicer.batcher = engine, batcher
        if not settings.max_patches_per_image:
            # One image may not hold the ViT longer than the model's own largest image.
            servicer.max_patches = engine.spec.max_pixels // engine.spec.patch_size**2
        state["batcher"] = batcher
        state["expiry"] = asyncio.ensure_future(handoff.expire_periodically(holder))

    async def shutdown() -> None:
        expiry = state.get("expiry")
        if isinstance(expiry, asyncio.Future):
            expiry.cancel()
        holder.close()  # no segment outlives the service
        batcher = state.get("batcher")
        if isinstance(batcher, Batcher):
            await batcher.stop()

    servicer = EncoderServicer(
        None,
        None,
        max_images_per_request=settings.max_images_per_request,
        max_patches_per_image=settings.max_patches_per_image,
        max_patches_per_video=settings.max_patches_per_video,
        holder=holder,
    )

    def register(server: object) -> None:
        encoder_service_pb2_grpc.add_EncoderServiceServicer_to_server(servicer, server)
        handoff.register_holder(holder, server)  # type: ignore[arg-type]

    await serve(
        service_name="encoder",
        service_full_names=[SERVICE, handoff.HANDOFF_SERVICE],
        settings=settings,
        register=register,
        startup=startup,
        shutdown=shutdown,
        on_started=handoff.on_listening(holder, settings),
    )


def pin_cpus(settings: EncoderSettings) -> None:
    """Pin the process to ``ENCODER_CPUS`` (off vLLM's worker core), set torch threads and
    raise the niceness of its every thread to at least ``ENCODER_NICE`` (a process started
    nicer keeps its own).

    Linux keeps the CPU mask and the niceness per thread, and a new thread takes its
    creator's: the threads already running (the lifeline watchdog) are set one by one,
    and every later one (torch's OpenMP pool, grpc's) inherits them from the main thread.
    """
    import torch

    tasks = [int(task) for task in os.listdir("/proc/self/task")]
    if settings.nice:
        for task in tasks:  # never below the niceness it started with (needs no privilege)
            own = os.getpriority(os.PRIO_PROCESS, task)
            os.setpriority(os.PRIO_PROCESS, task, max(own, settings.nice))
        log.info("niceness %d", os.getpriority(os.PRIO_PROCESS, 0))

    if settings.cpus:
        from vlcommon.cpus import parse_cpu_list

        cpus = parse_cpu_list(settings.cpus)
        for task in tasks:
            os.sched_setaffinity(task, cpus)
        torch.set_num_threads(settings.threads or len(cpus))
        log.info("pinned to CPUs %s with %d torch threads", cpus, torch.get_num_threads())
    elif settings.threads:
        torch.set_num_threads(settings.threads)


def main(argv: list[str] | None = None) -> None:
    service_main(
        "encoder",
        EncoderSettings,
        flags=("model", "host", "port", "metrics_port", "device", "dtype"),
        serve=lambda settings, _: main_async(settings),
        argv=argv,
        doc=__doc__,
        prepare=pin_cpus,
    )


if __name__ == "__main__":
    main()
