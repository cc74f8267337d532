"""Dynamic batching for the vision tower.

Concurrent ``submit()`` calls are gathered into one packed ViT call, bounded by
``max_batch_images``, ``max_batch_patches`` and ``max_wait_ms`` after the first image of
a batch arrives. Identical images in flight (same exact key) are encoded once and
shared. The queue is bounded: when full, ``submit()`` raises RESOURCE_EXHAUSTED at once.
A cancelled caller leaves the batch; the others are unaffected.

Tracing: each ViT call is one ``vit.batch`` span (batch id, images, patches) with an
OpenTelemetry link to the request span of every caller it served; it is a child of the
first caller's span, so it also shows inside that request's trace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from opentelemetry import trace

from encoder_service import metrics
from encoder_service.engine import Preprocessed
from vlcommon.cpus import name_this_thread
from vlcommon.errors import ServiceError
from vlcommon.refusals import Refusal

log = logging.getLogger(__name__)
tracer = trace.get_tracer("splitvl.encoder")


# eq=False: items compare by identity. With the generated __eq__, "in" over a batch
# compared two keyless items ("" == "") field by field down to their pixel tensors, which
# raised and killed the batcher's loop: every later call hung (found 2026-12-07).
@dataclass(eq=False)
class _Item:
    key: str
    image: Preprocessed
    future: asyncio.Future[torch.Tensor]
    enqueued: float = field(default_factory=time.perf_counter)
    waiters: int = 1
    # Request spans this image serves (one per caller, de-duplicated callers included).
    links: list[trace.SpanContext] = field(default_factory=list)
    started: float = 0.0  # perf_counter when its batch started
    batch_id: int = 0
    span: trace.Span | None = None  # its batch's vit.batch span, once the batch started


@dataclass(frozen=True)
class BatchInfo:
    """How one submitted image was batched.

    Attributes:
        batch_id: Sequence number of the ViT call (``splitvl.batch.id`` of its span).
        batch_size: Images in that call.
        queue_wait_s: Seconds from this caller's submit to the start of the call.
    """

    batch_id: int
    batch_size: int
    queue_wait_s: float


class Batcher:
    """Gathers images into packed ViT calls run on one worker thread.

    Args:
        encode: The engine's ``encode(list[Preprocessed]) -> list[Tensor]``.
        max_batch_images: Images per ViT call.
        max_batch_patches: Patches per ViT call (sum of t*h*w); one larger image runs alone.
        max_wait_ms: How long the first image of a batch waits for company, milliseconds.
        max_queue: Images waiting at most; more get RESOURCE_EXHAUSTED.
    """

    def __init__(
        self,
        encode: Callable[[list[Preprocessed]], list[torch.Tensor]],
        *,
        max_batch_images: int,
        max_batch_patches: int,
        max_wait_ms: float,
        max_queue: int,
    ) -> None:
        self._encode = encode
        self.max_batch_images = max_batch_images
        self.max_batch_patches = max_batch_patches
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_queue = max_queue
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        # An image too big to join the last batch; it leads the next one.
        self._carry: _Item | None = None
        self._inflight: dict[str, _Item] = {}
        # The OS name (and so torch's OpenMP threads, started from it) says "ViT":
        # ``splitvl bench --front-cpu`` counts these threads as the encoder's engine.
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="vit",
            initializer=name_this_thread,
            initargs=("splitvl-vit",),
        )
        self._task: asyncio.Task[None] | None = None
        self._batches = 0
        self._batch_sizes: dict[int, int] = {}
        self._batch_s = 0.1  # moving average of one ViT call's wall time (retry hints)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="vit-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def submit(self, key: str, image: Preprocessed) -> torch.Tensor:
        """Encode one image (shared with any in-flight request for the same key).

        Returns:
            ``[tokens, out_hidden * (1 + n_deepstack)]`` on the CPU.

        Raises:
            ServiceError: RESOURCE_EXHAUSTED when the queue is full.
        """
        return (await self.submit_timed(key, image))[0]

    async def submit_timed(self, key: str, image: Preprocessed) -> tuple[torch.Tensor, BatchInfo]:
        """:meth:`submit`, also saying which ViT call served the image and how long it
        queued. The current span (the caller's request span) is linked from that call's
        ``vit.batch`` span.
        """
        t_submit = time.perf_counter()
        caller = trace.get_current_span().get_span_context()
        item = self._inflight.get(key) if key else None
        if item is not None and not item.future.done():
            item.waiters += 1
            metrics.DEDUPLICATED.inc()
            if caller.is_valid:
                item.links.append(caller)
                if item.span is not None:  # its ViT call is running: link it now
                    item.span.add_link(caller)
        else:
            if self._queue.qsize() >= self.max_queue:
                raise Refusal.ENCODER_QUEUE_FULL.error(
                    f"encoder queue is full ({self.max_queue} images waiting); retry later",
                    field="images",
                    limit=self.max_queue,
                    retry_after_ms=self._retry_after_ms(),
                )
            item = _Item(key, image, asyncio.get_running_loop().create_future())
            if caller.is_valid:
                item.links.append(caller)
            if key:
                self._inflight[key] = item
            self._queue.put_nowait(item)
            metrics.QUEUED_IMAGES.set(self._queue.qsize())
        try:
            # shield: one caller's cancel must not cancel the shared future of the others.
            out = await asyncio.shield(item.future)
        finally:
            item.waiters -= 1
        info = BatchInfo(
            batch_id=item.batch_id,
            batch_size=self._batch_sizes.get(item.batch_id, 1),
            queue_wait_s=max(item.started - t_submit, 0.0),
        )
        return out, info

    async def _collect(self) -> list[_Item]:
        if self._carry is not None:
            first, self._carry = self._carry, None
        else:
            first = await self._queue.get()
        batch, patches = [first], first.image.pixel_values.shape[0]
        deadline = time.perf_counter() + self.max_wait_s
        while len(batch) < self.max_batch_images:
            timeout = deadline - time.perf_counter()
            if timeout <= 0 and self._queue.empty():
                break
            try:
                item = (
                    self._queue.get_nowait()
                    if self._queue.qsize()
                    else await asyncio.wait_for(self._queue.get(), max(timeout, 0))
                )
            except TimeoutError:
                break
            n = item.image.pixel_values.shape[0]
            if patches + n > self.max_batch_patches:
                # Too big for this batch: it leads the next one.
                self._carry = item
                break
            batch.append(item)
            patches += n
        metrics.QUEUED_IMAGES.set(self._queue.qsize())
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            # Drop images nobody waits for any more (all their callers cancelled or expired).
            live = [it for it in batch if it.waiters > 0 and not it.future.done()]
            for it in batch:
                if it not in live:
                    if not it.future.done():
                        metrics.DROPPED.inc()
                    self._finish(it, error=asyncio.CancelledError())
            if not live:
                continue
            now = time.perf_counter()
            self._batches += 1
            batch_id = self._batches
            self._batch_sizes[batch_id] = len(live)
            for it in live:
                metrics.QUEUE_WAIT.observe(now - it.enqueued)
                it.started, it.batch_id = now, batch_id
            patches = sum(int(it.image.pixel_values.shape[0]) for it in live)
            metrics.BATCH_IMAGES.observe(len(live))
            metrics.BATCH_PATCHES.observe(patches)
            span = self._batch_span(live, batch_id, patches)
            t0 = time.perf_counter()
            try:
                outcomes = await loop.run_in_executor(
                    self._executor, self._encode_splitting, [it.image for it in live]
                )
            except Exception as exc:  # noqa: BLE001 - every waiter must get an answer
                log.exception("ViT batch of %d failed", len(live))
                span.record_exception(exc)
                span.set_status(trace.StatusCode.ERROR, str(exc))
                span.end()
                for it in live:
                    self._finish(it, error=exc)
                self._forget_batch(batch_id)
                continue
            span.end()
            metrics.BATCH_SECONDS.observe(time.perf_counter() - t0)
            self._batch_s = 0.8 * self._batch_s + 0.2 * (time.perf_counter() - t0)
            for it, outcome in zip(live, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    self._finish(it, error=outcome)
                else:
                    self._finish(it, result=outcome)
            self._forget_batch(batch_id)

    def _forget_batch(self, batch_id: int) -> None:
        # Waiters read the size right after their future resolves (same loop turn or the
        # next); keep the last few batches' sizes, drop older ones.
        self._batch_sizes.pop(batch_id - 64, None)

    def _batch_span(self, live: list[_Item], batch_id: int, patches: int) -> trace.Span:
        """Start the ``vit.batch`` span: child of the first caller, linked to every caller."""
        links = [trace.Link(ctx) for it in live for ctx in it.links]
        parent = next((ctx for it in live for ctx in it.links), None)
        context = trace.set_span_in_context(trace.NonRecordingSpan(parent)) if parent else None
        span = tracer.start_span("vit.batch", context=context, links=links)
        span.set_attribute("splitvl.batch.id", batch_id)
        span.set_attribute("splitvl.batch.size", len(live))
        span.set_attribute("splitvl.batch.patches", patches)
        span.set_attribute("splitvl.batch.links", len(links))
        for it in live:
            it.span = span
        return span

    def _retry_after_ms(self) -> int:
        """Retry hint for a full queue: about the time to work through the queue now
        (batches needed x mean ViT call + wait window), at least 100 ms."""
        batches = -(-self._queue.qsize() // self.max_batch_images)
        return max(100, int(1000 * batches * (self._batch_s + self.max_wait_s)))

    def _encode_splitting(self, images: list[Preprocessed]) -> list[torch.Tensor | ServiceError]:
        """Encode ``images``; on out-of-memory, split the batch in halves and retry each.

        Runs on the worker thread. An image that does not fit alone gets a
        RESOURCE_EXHAUSTED error naming its patch count; the others are still encoded.
        """
        try:
            return list(self._encode(images))
        except (torch.OutOfMemoryError, MemoryError):
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            metrics.OOM_SPLITS.inc()
            if len(images) == 1:
                patches = int(images[0].pixel_values.shape[0])
                return [
                    Refusal.IMAGE_OUT_OF_MEMORY.error(
                        f"an image of {patches} patches does not fit in the encoder's memory "
                        "even alone; send a smaller image or a smaller pixel_budget",
                        field="images",
                        limit="encoder memory",
                    )
                ]
            half = len(images) // 2
            log.warning(
                "ViT out of memory on %d images: retrying as %d + %d",
                len(images),
                half,
                len(images) - half,
            )
            return self._encode_splitting(images[:half]) + self._encode_splitting(images[half:])

    def _finish(
        self, item: _Item, *, result: torch.Tensor | None = None, error: BaseException | None = None
    ) -> None:
        if self._inflight.get(item.key) is item:
            del self._inflight[item.key]
        if item.future.done():
            return
        if error is not None:
            item.future.set_exception(error)
            item.future.exception()  # mark retrieved: cancelled waiters never read it
        else:
            item.future.set_result(result)  # type: ignore[arg-type]
