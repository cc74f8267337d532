"""The image intake: URLs fetched, files digested and looked up by digest, the rest decoded.

With a cache and a policy that uses it, each file's header and digest come first (no
decode), then one ``Lookup`` by bytes key (a stage of its own in ``Pipeline._run``): a
file seen before is an exact hit and is never decoded. A request of one image whose file
another request is encoding waits for that request's put instead of decoding it again
(:class:`SameFileFlights`). The other images are decoded on the preprocess threads.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from opentelemetry import trace
from qwenvl.common.v1 import generation_pb2

from gateway import metrics
from gateway.fetch import UrlFetcher
from gateway.media import ImageUrl
from gateway.pipeline.cache import CacheStage
from gateway.pipeline.preprocess import Preprocessor
from gateway.pipeline.same_file import Claims, SameFileFlights
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


@dataclass
class ImageFiles:
    """A request's images between the intake's steps (:class:`ImageIntake`).

    Attributes:
        datas: The encoded files, in request order.
        lo: The smallest pixel budget (``min_pixels``) of the resize.
        hi: The largest (``max_pixels``).
        files: Each file's header, resize plan and digest (None where the header could not
            be read); empty when no lookup by digest runs (no cache, or policy off): the
            images are then decoded at once.
        done: The images prepared so far, by request position: exact hits by digest
            (never decoded), then the decoded ones.
        ask_cache: Whether the cache is to be asked by pixel key next (False without a
            cache, with policy off, or once a lookup failed: the cache is down or slow).
    """

    datas: list[bytes]
    lo: int
    hi: int
    files: list[EncodedFile | None] = field(default_factory=list)
    done: dict[int, PreparedImage] = field(default_factory=dict)
    ask_cache: bool = False

    @property
    def images(self) -> list[PreparedImage]:
        """Every image in request order, once :meth:`ImageIntake.decode` has run."""
        return [self.done[i] for i in range(len(self.datas))]


class ImageIntake:
    """The images of a request in three steps, each a stage of the pipeline:
    :meth:`read` (headers and digests; no decode), :meth:`lookup_files` (one ``Lookup`` by
    digest), :meth:`decode` (the images it did not answer). Without a cache (or with
    policy off) :meth:`read` decodes every image and computes no digest.

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

    def claims(self) -> Claims:
        """An empty set of claims for one request (:class:`Claims`)."""
        return Claims(self.same_file)

    async def read(
        self, datas: list[bytes], lo: int, hi: int, policy: int, deadline: Deadline
    ) -> ImageFiles:
        """Headers, resize plans and digests (no pixel decoded), or, without a cache or
        with policy off, every image decoded (no digest computed).

        Raises:
            ServiceError: as :meth:`Preprocessor.read_files`,
                :meth:`Preprocessor.prepare_images` and :meth:`Preprocessor.run`.
        """
        intake = ImageFiles(datas, lo, hi)
        pre = self.preprocessor
        if not datas:
            return intake
        if self.cache.cache is None or policy == generation_pb2.CACHE_POLICY_OFF:
            images = await pre.run(pre.prepare_images, datas, lo, hi, deadline=deadline)
            intake.done = {im.index: im for im in images}
            return intake
        intake.files = await pre.run(
            pre.read_files, datas, lo, hi, True, deadline=deadline, headers_only=True
        )
        intake.ask_cache = True
        return intake

    async def lookup_files(
        self,
        intake: ImageFiles,
        deadline: Deadline,
        held: HeldRefs | None = None,
        claims: Claims | None = None,
    ) -> None:
        """One ``Lookup`` by digest: the files it answers are exact hits, added to
        ``intake.done`` and never decoded. A failed lookup sets ``intake.ask_cache``
        False (the cache is asked no more).

        With ``claims`` (a request of one image, :class:`SameFileFlights`): a request whose
        missed files are all being encoded by other requests waits for their puts and
        looks them up again; otherwise it claims the missed files no one holds.
        """
        if not intake.files:
            return
        hits = await self.cache.lookup_files(intake.files, deadline, held)
        if hits is not None and claims is not None:
            if not await self._follow_same_files(intake.files, hits, deadline, held, claims):
                hits = None  # the second lookup failed: the cache is asked no more
        if hits is None:
            intake.ask_cache = False
        else:
            intake.done.update(hits)

    async def decode(self, intake: ImageFiles, deadline: Deadline) -> list[PreparedImage]:
        """Decode the images no lookup answered; every image, in request order.

        Raises:
            ServiceError: as :meth:`Preprocessor.decode_images` and :meth:`Preprocessor.run`.
        """
        todo = [i for i in range(len(intake.datas)) if i not in intake.done]
        if todo:
            pre = self.preprocessor
            decoded = await pre.run(
                pre.decode_images,
                [intake.datas[i] for i in todo],
                todo,
                [intake.files[i] if intake.files else None for i in todo],
                intake.lo,
                intake.hi,
                deadline=deadline,
            )
            intake.done.update((im.index, im) for im in decoded)
        return intake.images

    async def prepare(
        self,
        datas: list[bytes],
        lo: int,
        hi: int,
        policy: int,
        deadline: Deadline,
        held: HeldRefs | None = None,
        claims: Claims | None = None,
    ) -> ImageFiles:
        """The three steps in a row (tests, and images decoded again after lost refs)."""
        intake = await self.read(datas, lo, hi, policy, deadline)
        await self.lookup_files(intake, deadline, held, claims)
        await self.decode(intake, deadline)
        return intake

    async def _follow_same_files(
        self,
        files: list[EncodedFile | None],
        hits: dict[int, PreparedImage],
        deadline: Deadline,
        held: HeldRefs | None,
        claims: Claims,
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
        follow = claims.claim_or_follow(keys)
        if not follow or claims:
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
