"""The image intake: URLs fetched, files digested and looked up by digest, the rest decoded.

With a cache and a policy that uses it, each file's header and digest come first (no
decode), then one ``Lookup`` by bytes key: a file seen before is an exact hit and is never
decoded. A request of one image whose file another request is encoding waits for that
request's put instead of decoding it again (:class:`SameFileFlights`). The other images
are decoded on the preprocess threads.
"""

from __future__ import annotations

import asyncio
import time

from opentelemetry import trace
from qwenvl.common.v1 import generation_pb2

from gateway import metrics
from gateway.fetch import UrlFetcher
from gateway.media import ImageUrl
from gateway.pipeline.cache import CacheStage
from gateway.pipeline.preprocess import Preprocessor
from gateway.pipeline.same_file import SameFileFlights
from gateway.pipeline.types import EncodedFile, HeldRefs, PreparedImage
from vlcommon.deadline import Deadline

tracer = trace.get_tracer("splitvl.gateway")

# The longest a request waits for another request's encode of the same file bytes (half
# the time left to its deadline bounds it first, when shorter); then it decodes and
# encodes them itself.
SAME_FILE_WAIT_S = 60.0


async def fetch_urls(
    fetcher: UrlFetcher, sources: list[bytes | ImageUrl], deadline: Deadline
) -> list[bytes]:
    """Fetch the URL images (concurrently, within the deadline); bytes stay as they are.

    Raises:
        ServiceError: as :class:`gateway.fetch.UrlFetcher` documents.
    """
    urls = [(i, src.url) for i, src in enumerate(sources) if isinstance(src, ImageUrl)]
    if not urls:
        return [src for src in sources if isinstance(src, bytes)]
    with tracer.start_as_current_span("gateway.fetch_urls") as span:
        span.set_attribute("splitvl.images", len(urls))
        fetched = await fetcher.fetch_all(urls, deadline.remaining())
        span.set_attribute("splitvl.transfer_bytes", sum(map(len, fetched.values())))
    return [fetched[i] if isinstance(src, ImageUrl) else src for i, src in enumerate(sources)]


class ImageIntake:
    """Every image of a request, prepared; decoded only where its file's digest missed.

    Args:
        preprocessor: The preprocess threads.
        cache: The cache stage (its stub None: no lookup, no digest).
    """

    def __init__(self, preprocessor: Preprocessor, cache: CacheStage) -> None:
        self.preprocessor = preprocessor
        self.cache = cache
        # Files being encoded now, by bytes key: a request for the same bytes waits for
        # that put instead of decoding and encoding them again.
        self.same_file = SameFileFlights()

    async def prepare(
        self,
        datas: list[bytes],
        lo: int,
        hi: int,
        policy: int,
        deadline: Deadline,
        held: HeldRefs | None = None,
        owned: list[str] | None = None,
    ) -> tuple[list[PreparedImage], float, bool]:
        """Every image of the request, prepared.

        With a cache and a policy that uses it: headers and file digests first (no
        decode), one ``Lookup`` by bytes key, then the decode of the images it did not
        answer. Without: every image decoded, no digest computed.

        With ``owned`` (the request's claims, :class:`SameFileFlights`): a request whose
        missed files are all being encoded by other requests waits for their puts and
        looks them up again (the wait counts as lookup time); otherwise it claims the
        missed files no one holds (appended to ``owned``, which the caller must land).

        Returns:
            The images in request order; the milliseconds spent in the bytes-key lookup
            and any wait for the same files (part of ``lookup_ms``, not of
            ``preprocess_ms``); and whether the cache is to be asked by pixel key (False
            without a cache, with policy off, or when the bytes-key lookup failed: the
            cache is then down or slow, asked no more).

        Raises:
            ServiceError: as :meth:`Preprocessor.read_files`,
                :meth:`Preprocessor.decode_images` and :meth:`Preprocessor.run`.
        """
        pre = self.preprocessor
        if not datas:
            return [], 0.0, False
        if self.cache.cache is None or policy == generation_pb2.CACHE_POLICY_OFF:
            images = await pre.run(pre.prepare_images, datas, lo, hi, deadline=deadline)
            return images, 0.0, False
        files = await pre.run(
            pre.read_files, datas, lo, hi, True, deadline=deadline, headers_only=True
        )
        t = time.perf_counter()
        hits = await self.cache.lookup_files(files, deadline, held)
        if hits is not None and owned is not None:
            if not await self._follow_same_files(files, hits, deadline, held, owned):
                hits = None  # the second lookup failed: the cache is asked no more
        lookup_ms = (time.perf_counter() - t) * 1000
        todo = [i for i in range(len(datas)) if hits is None or i not in hits]
        decoded: list[PreparedImage] = []
        if todo:
            decoded = await pre.run(
                pre.decode_images,
                [datas[i] for i in todo],
                todo,
                [files[i] for i in todo],
                lo,
                hi,
                deadline=deadline,
            )
        by_index = {im.index: im for im in decoded}
        by_index.update(hits or {})
        return [by_index[i] for i in range(len(datas))], lookup_ms, hits is not None

    async def _follow_same_files(
        self,
        files: list[EncodedFile | None],
        hits: dict[int, PreparedImage],
        deadline: Deadline,
        held: HeldRefs | None,
        owned: list[str],
    ) -> bool:
        """Claims the missed files no request holds; when it claimed none, waits for the
        requests encoding them and adds what a second bytes-key lookup answers to
        ``hits``. The wait lasts at most half the time left to the deadline (the other
        half is for decoding and encoding the files itself, should they still miss) and
        at most :data:`SAME_FILE_WAIT_S`.

        Returns:
            False when the second lookup failed (then counted in
            ``splitvl_gateway_cache_failures_total{op="lookup"}``), else True.
        """
        if any(f is None for f in files):
            return True  # a file without a digest (unreadable header): fail it now, no wait
        missed = [i for i, f in enumerate(files) if f is not None and f.bytes_key and i not in hits]
        if not missed:
            return True
        keys = [files[i].bytes_key for i in missed]  # type: ignore[union-attr]
        follow = self.same_file.claim_or_follow(keys, owned)
        if not follow or owned:
            return True  # nothing to wait for, or a holder of claims: it never waits
        waited = {missed[pos] for pos in follow}
        left = deadline.remaining()
        wait_s = SAME_FILE_WAIT_S if left is None else min(SAME_FILE_WAIT_S, left / 2)
        with tracer.start_as_current_span("cache.same_file_wait") as span:
            span.set_attribute("splitvl.images", sorted(waited))
            await asyncio.wait(set(follow.values()), timeout=wait_s)
            again = await self.cache.lookup_files(
                [f if i in waited else None for i, f in enumerate(files)], deadline, held
            )
            if again is None:
                return False
            span.set_attribute(
                "splitvl.cache.tiers", ["exact" if i in again else "miss" for i in sorted(waited)]
            )
        hits.update(again)
        metrics.SAME_FILE_WAITS.labels(outcome="hit").inc(len(again))
        metrics.SAME_FILE_WAITS.labels(outcome="miss").inc(len(waited) - len(again))
        return True
