"""The preprocess threads: each image's header, digest, decode, resize plan, key,
similarity descriptor and verification image, off the event loop.

:class:`Preprocessor` owns two thread pools: the decode threads (``preprocess_threads``,
bounded with a queue of ``preprocess_queue`` requests, at a lower OS priority) and the
header threads (headers and file digests, about 2 ms for a 12 MP JPEG, so that a repeat
learns it needs no decode without waiting behind other requests' decodes). Work on a
thread stops between images when its request is cancelled or its deadline passes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import io
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
from opentelemetry import trace
from PIL import Image

from gateway import metrics
from gateway.pipeline.types import EncodedFile, PreparedImage
from gateway.settings import GatewaySettings
from vlcommon.deadline import NO_DEADLINE, Deadline
from vlcommon.errors import ServiceError
from vlcommon.grid_reuse import reusable_grids
from vlcommon.imaging import (
    ImageHeader,
    bytes_key,
    decode_image,
    exact_key,
    plan_resize,
    read_header,
    resize_to_plan,
    similarity_descriptor,
)
from vlcommon.model_info import VisionSpec
from vlcommon.refusals import Refusal
from vlcommon.verification import verifiable, verification_image

log = logging.getLogger(__name__)
tracer = trace.get_tracer("splitvl.gateway")

T = TypeVar("T")

# How much the decode threads lower their own OS priority (nice), relative to the
# process: enough that the header and digest threads (and the event loop) win a busy
# core, not so much that decodes starve behind the other services on the host.
DECODE_NICE = 5

# The warm-up's photo: a phone camera's 12 MP (4032x3024), the size the first request is
# most likely to bring. Smaller files left the first 12 MP image cold: its first decode
# touches fresh memory (Pillow's 16 MB blocks, glibc then keeps such blocks in the heap).
WARM_UP_PHOTO_SIZE = (4032, 3024)


def warm_up_files() -> list[bytes]:
    """Two files for :meth:`Preprocessor.warm_up`: a 4032x3024 JPEG stored sideways
    (EXIF orientation 6, quality 90) and a 1024x768 RGBA PNG, gradients with tiled noise so
    the codecs do a photo's work, both over the real model's pixel budget, so the resize
    runs (downscaling, antialiased)."""
    width, height = WARM_UP_PHOTO_SIZE
    tile = np.random.default_rng(0).integers(0, 24, size=(256, 256, 3), dtype=np.uint8)
    noise = np.tile(tile, (-(-height // 256), -(-width // 256), 1))[:height, :width]
    x = np.arange(width, dtype=np.uint16) * 200 // width
    y = np.arange(height, dtype=np.uint16) * 200 // height
    gradient = np.stack(
        np.broadcast_arrays(x[None, :], y[:, None], (x[None, :] + y[:, None]) // 2), -1
    )
    photo = (gradient + noise).astype(np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6
    jpeg = io.BytesIO()
    Image.fromarray(photo).save(jpeg, format="JPEG", quality=90, exif=exif)
    alpha = np.broadcast_to(y[:768, None].astype(np.uint8), (768, 1024))[..., None]
    rgba = np.concatenate([photo[:768, :1024], alpha], axis=-1)
    png = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(png, format="PNG")
    return [jpeg.getvalue(), png.getvalue()]


def _yield_to_headers() -> None:
    """Decode thread initializer: lower this thread's priority by DECODE_NICE.

    Linux applies ``setpriority(PRIO_PROCESS, tid)`` to one thread; raising one's own nice
    needs no privilege. Elsewhere (or where refused) it does nothing: an optimisation, not
    a guarantee.
    """
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + DECODE_NICE)


def check_live(stop: threading.Event | None, deadline: Deadline) -> None:
    """Stop preparing images for a request that was cancelled or ran out of time.

    Raises:
        ServiceError: CANCELLED or DEADLINE_EXCEEDED (counted in
            ``splitvl_gateway_preprocess_stopped_total``).
    """
    try:
        deadline.check(stop, "its images were prepared")
    except ServiceError as err:
        reason = "cancelled" if err.reason == Refusal.CANCELLED else "deadline"
        metrics.PREPROCESS_STOPPED.labels(reason=reason).inc()
        raise


class Preprocessor:
    """Reads, decodes and prepares images on its threads.

    Args:
        settings: Thread counts, queue bound, pixel limits, grid reuse bound.
        spec: Vision geometry of the served checkpoint (the resize plan).
        revision: Model revision folded into every key.
        for_cache: Whether a cache will be asked: only then are the verification image and
            the reusable grids computed.
    """

    def __init__(
        self, settings: GatewaySettings, spec: VisionSpec, revision: str, *, for_cache: bool
    ) -> None:
        self.settings = settings
        self.spec = spec
        self.revision = revision
        self.for_cache = for_cache
        self.decode_threads = ThreadPoolExecutor(
            max_workers=settings.preprocess_threads,
            thread_name_prefix="preprocess",
            initializer=_yield_to_headers,
        )
        # Headers and digests on threads of their own, at the process's priority: behind
        # the decode threads, a byte-identical repeat waited for other requests' 12 MP
        # decodes (up to ~470 ms at 32 in flight, docs/benchmarks.md, photos) only to
        # learn it needed none. hashlib and Pillow release the GIL on large buffers.
        self.header_threads = ThreadPoolExecutor(
            max_workers=settings.preprocess_threads, thread_name_prefix="headers"
        )
        # Requests submitted to the decode threads and not finished there (running or
        # queued); updated from the worker threads too, hence the lock.
        self._lock = threading.Lock()
        self.pending = 0

    def close(self) -> None:
        self.decode_threads.shutdown(wait=False, cancel_futures=True)
        self.header_threads.shutdown(wait=False, cancel_futures=True)

    # -- on a thread ----------------------------------------------------------------------
    def check_request_pixels(self, headers: list[ImageHeader | None]) -> None:
        """Refuse a request whose images sum to over ``max_request_pixels`` (headers only).

        Raises:
            ServiceError: RESOURCE_EXHAUSTED ``REQUEST_PIXELS_TOO_LARGE`` naming
                GATEWAY_MAX_REQUEST_PIXELS. An unreadable header is left to decode_image.
        """
        limit = self.settings.max_request_pixels
        total = sum(h.stored_width * h.stored_height for h in headers if h is not None)
        if total > limit:
            raise Refusal.REQUEST_PIXELS_TOO_LARGE.error(
                f"the request's {len(headers)} images hold {total} decoded pixels (width*height "
                f"summed); the limit is {limit} per request (GATEWAY_MAX_REQUEST_PIXELS)",
                field="images",
                limit=limit,
            )

    def read_files(
        self,
        datas: list[bytes],
        lo: int,
        hi: int,
        with_keys: bool,
        stop: threading.Event | None = None,
        deadline: Deadline = NO_DEADLINE,
    ) -> list[EncodedFile | None]:
        """Read each file's header, plan its resize and (``with_keys``) digest it.

        No pixel is decoded: a 12 MP JPEG's header and the SHA-256 of its bytes take about
        2 ms together (0.6 ms per MB hashed). An image whose header cannot be read, is over
        ``max_decoded_pixels`` or cannot be planned gets None: decoding it reports the
        fault with the status it always had (decode_image, plan_resize).

        Args:
            datas: The encoded files; ``lo``/``hi`` the pixel budget.
            with_keys: Compute each file's digest (the bytes key); else ``bytes_key`` is "".
            stop: Set when the request is cancelled; checked, with ``deadline``, per image.

        Raises:
            ServiceError: RESOURCE_EXHAUSTED ``REQUEST_PIXELS_TOO_LARGE``; CANCELLED /
                DEADLINE_EXCEEDED when stopped.
        """
        check_live(stop, deadline)
        headers = [read_header(data) for data in datas]
        self.check_request_pixels(headers)
        files: list[EncodedFile | None] = []
        for index, (data, header) in enumerate(zip(datas, headers, strict=True)):
            check_live(stop, deadline)
            with tracer.start_as_current_span("image.header") as span:
                span.set_attribute("splitvl.image.index", index)
                span.set_attribute("splitvl.image.encoded_bytes", len(data))
                files.append(self._read_file(data, header, index, lo, hi, with_keys, span))
        return files

    def _read_file(
        self,
        data: bytes,
        header: ImageHeader | None,
        index: int,
        lo: int,
        hi: int,
        with_keys: bool,
        span: trace.Span,
    ) -> EncodedFile | None:
        if header is None:
            return None
        span.set_attribute("splitvl.image.format", header.format)
        span.set_attribute("splitvl.image.exif_orientation", header.orientation)
        span.set_attribute("splitvl.image.width", header.width)
        span.set_attribute("splitvl.image.height", header.height)
        if header.stored_width * header.stored_height > self.settings.max_decoded_pixels:
            return None  # decode_image refuses it, naming the limit
        try:
            plan = plan_resize(
                header.height, header.width, self.spec, index=index, min_pixels=lo, max_pixels=hi
            )
        except ServiceError:
            return None  # the same plan after decoding raises it in order
        key = bytes_key(data, plan, self.revision) if with_keys else ""
        return EncodedFile(header, plan, key)

    def decode_images(
        self,
        datas: list[bytes],
        indices: list[int],
        files: list[EncodedFile | None],
        lo: int,
        hi: int,
        stop: threading.Event | None = None,
        deadline: Deadline = NO_DEADLINE,
        *,
        warm_up: bool = False,
    ) -> list[PreparedImage]:
        """Decode, plan, key, describe and resize each image, one at a time.

        The pixels kept (and sent to the encoder) are the resized ones, produced by the one
        shared resize function: a 6000x6000 upload shrinks to the pixel budget here instead
        of travelling as 108 MB, and only one full-size decode is alive per thread. The
        plan is the decoded image's: where the header's plan differs (an orientation only
        found after the pixel data), the file's digest is not kept, so it never answers
        for this image.

        Args:
            datas: The encoded files to decode; ``indices`` their positions in the request
                (for error messages and spans); ``files`` their headers (None: unread).
            stop: Set (from the event loop) when the request is cancelled; checked, with
                ``deadline``, before each image and stage.
            warm_up: The start-up run (:meth:`warm_up`): not counted as decoded images.

        Raises:
            ServiceError: as decode_image and plan_resize; CANCELLED / DEADLINE_EXCEEDED
                when stopped.
        """
        prepared = []
        for index, data, file in zip(indices, datas, files, strict=True):
            check_live(stop, deadline)
            with tracer.start_as_current_span("image.decode") as span:
                span.set_attribute("splitvl.image.index", index)
                span.set_attribute("splitvl.image.encoded_bytes", len(data))
                image = decode_image(
                    data, index=index, max_decoded_pixels=self.settings.max_decoded_pixels
                )
                if not warm_up:
                    metrics.IMAGES_DECODED.inc()
                span.set_attribute("splitvl.image.width", image.width)
                span.set_attribute("splitvl.image.height", image.height)
            check_live(stop, deadline)
            with tracer.start_as_current_span("image.resize") as span:
                im = self._prepare_decoded(image, data, index, lo, hi, stop, deadline, span)
            del image
            # Where the two plans disagree the pixel key alone stands for the image.
            im.bytes_key = file.bytes_key if file is not None and file.plan == im.plan else ""
            prepared.append(im)
        return prepared

    def _prepare_decoded(
        self,
        image: Image.Image,
        data: bytes,
        index: int,
        lo: int,
        hi: int,
        stop: threading.Event | None,
        deadline: Deadline,
        span: trace.Span,
    ) -> PreparedImage:
        """One decoded image's plan, resized pixels, key, descriptor, verification image
        and reusable grids."""
        plan = plan_resize(
            image.height, image.width, self.spec, index=index, min_pixels=lo, max_pixels=hi
        )
        span.set_attribute("splitvl.image.index", index)
        span.set_attribute("splitvl.image.resized_width", plan.resized_width)
        span.set_attribute("splitvl.image.resized_height", plan.resized_height)
        span.set_attribute("splitvl.image.grid_thw", list(plan.grid))
        span.set_attribute("splitvl.image.tokens", plan.tokens)
        # The key and the descriptor's thumbnail come from the resized pixels (exactly what
        # the ViT sees), a ninth of a 12 MP photo; the document test looks at the full
        # image, every k-th pixel.
        pixels = np.asarray(image, dtype=np.uint8)
        if pixels.shape[:2] == (plan.resized_height, plan.resized_width):
            resized = pixels  # already the planned size
        else:
            resized = resize_to_plan(pixels, plan).permute(1, 2, 0).contiguous().numpy()
        del pixels
        check_live(stop, deadline)
        # The verification image comes from the decoded image, not the plan
        # (vlcommon.verification): up to ~30 ms for 12 MP, a JPEG's luma decoded again for
        # the JPEG-matched check (~5 ms for 2 MP). Only a cache can use it, and the
        # reusable grids (about 1 ms).
        cached = self.for_cache
        size = plan.resized_height * plan.resized_width
        return PreparedImage(
            index=index,
            plan=plan,
            key=exact_key(resized, plan, self.revision),
            decoded=True,
            pixels=resized,
            descriptor=similarity_descriptor(image, resized),
            verification=verification_image(image, data)
            if cached and verifiable(image.width, image.height, size)
            else None,
            reusable=reusable_grids(
                image.height,
                image.width,
                self.spec,
                min_pixels=lo,
                max_pixels=hi,
                bound=self.settings.grid_reuse_scale,
            )[1:]
            if cached
            else [],
        )

    def prepare_images(
        self,
        datas: list[bytes],
        lo: int,
        hi: int,
        stop: threading.Event | None = None,
        deadline: Deadline = NO_DEADLINE,
    ) -> list[PreparedImage]:
        """Headers (the request's pixel total) and then every image decoded: the path
        without a cache lookup, so no file digest is computed.

        Raises:
            ServiceError: as :meth:`read_files` and :meth:`decode_images`.
        """
        files = self.read_files(datas, lo, hi, False, stop, deadline)
        return self.decode_images(datas, list(range(len(datas))), files, lo, hi, stop, deadline)

    # -- from the event loop ----------------------------------------------------------------
    async def run(
        self,
        work: Callable[..., T],
        *args: object,
        deadline: Deadline,
        headers_only: bool = False,
    ) -> T:
        """Run ``work(*args, stop, deadline)`` on a decode thread, bounded and cancellable.

        ``headers_only`` work (no pixel decoded: :meth:`read_files`) runs on the header
        threads, not counted against ``preprocess_threads + preprocess_queue`` (it holds no
        decoded pixels; the gRPC admission bound limits how many requests reach it).

        Raises:
            ServiceError: RESOURCE_EXHAUSTED ``PREPROCESS_BUSY`` (with a retry hint) when
                ``preprocess_threads + preprocess_queue`` requests are already there; what
                ``work`` raises.
        """
        deadline.remaining()  # DEADLINE_EXCEEDED now rather than on a thread
        stop = threading.Event()
        # In the thread, under the current span: image.decode/image.resize are its children.
        call = functools.partial(work, *args, stop, deadline)
        if headers_only:
            return await _await_thread(
                self.header_threads.submit(contextvars.copy_context().run, call), stop
            )
        self._admit()
        future = self.decode_threads.submit(contextvars.copy_context().run, call)
        future.add_done_callback(self._finished)
        return await _await_thread(future, stop)

    def _admit(self) -> None:
        s = self.settings
        capacity = s.preprocess_threads + s.preprocess_queue
        with self._lock:
            if self.pending >= capacity:
                raise Refusal.PREPROCESS_BUSY.error(
                    f"{self.pending} requests are preparing or waiting to prepare "
                    f"images; the limit is {capacity} (GATEWAY_PREPROCESS_THREADS + "
                    "GATEWAY_PREPROCESS_QUEUE); retry shortly",
                    field="images",
                    limit=capacity,
                    retry_after_ms=s.retry_after_ms,
                )
            self.pending += 1

    def _finished(self, _: object) -> None:
        with self._lock:
            self.pending -= 1

    async def warm_up(self) -> None:
        """Run the whole preprocess path once on every decode thread, before SERVING.

        A fresh gateway's first large image paid for lazy work that later images do not:
        starting the threads, importing torchvision's resize and creating torch's thread
        pool on first use, libjpeg/zlib's first decode, Pillow's transpose and RGBA
        compositing, the first SHA-256 over megabytes. Each thread here reads the header
        of, digests and decodes a 12 MP JPEG stored sideways (EXIF orientation 6) and an
        RGBA PNG, then plans, keys, describes and resizes them down (antialiased bicubic)
        with the model's own pixel budget, as a request would. Nothing is counted in
        ``splitvl_gateway_images_decoded_total``. About 0.3 s of CPU per thread plus 0.4 s
        to build the files (~1.1 s in all for 2 threads on 2 busy cores); the first 12 MP
        photo then costs what later ones do (docs/benchmarks.md).

        Raises:
            ServiceError: if the path itself fails on these files (a broken install
                should fail at start, not on the first request).
        """
        started = time.perf_counter()
        files = warm_up_files()
        threads = self.settings.preprocess_threads
        # Every task waits for the others, so each runs on its own thread: the pool starts
        # a new thread only when no idle one is there.
        barrier = threading.Barrier(threads)

        def run() -> None:
            try:
                barrier.wait(timeout=30)
            except threading.BrokenBarrierError:
                pass  # a machine too busy to start them all in time: warm those that ran
            lo, hi = self.spec.min_pixels, self.spec.max_pixels
            headers = self.read_files(files, lo, hi, True)
            self.decode_images(files, list(range(len(files))), headers, lo, hi, warm_up=True)

        loop = asyncio.get_running_loop()
        await asyncio.gather(
            *(loop.run_in_executor(self.decode_threads, run) for _ in range(threads))
        )
        log.info(
            "preprocess warmed up on %d threads in %.0f ms",
            threads,
            (time.perf_counter() - started) * 1000,
        )


async def _await_thread(future: concurrent.futures.Future[T], stop: threading.Event) -> T:
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        # The client hung up or its deadline passed: the thread stops at its next check
        # instead of decoding the rest of the request's images for nobody.
        stop.set()
        raise
