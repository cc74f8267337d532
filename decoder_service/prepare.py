"""References -> engine inputs: the decoder's work on a Generate request before vLLM.

Two steps, each raising :class:`~vlcommon.errors.ServiceError` with the status the
servicer sends:

1. :meth:`Preparer.check` runs every rule that needs no payload (message and part counts,
   roles, control tokens in text, image and video references, each embedding's grid,
   dtype and shape against the model), so the size of an embedding sent by reference is
   bounded by its grid before any byte of it is read.
2. :meth:`Preparer.prepare` reads the embeddings sent by reference while it renders and
   tokenises the prompt, then checks each payload and the prompt's length and returns
   vLLM's inputs.

Usage::

    preparer = Preparer(engine, limits, reader)
    checked = preparer.check(request, engine.spec)
    prepared = await preparer.prepare(request, checked, Deadline.of(context), read)
    engine.generate(rid, prepared.prompt, prepared.images, prepared.params, prepared.videos)
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from qwenvl.common.v1 import generation_pb2, tensor_pb2
from qwenvl.decoder.v1 import decoder_service_pb2 as pb

from decoder_service import metrics
from decoder_service.continuation import ContinuedText, check_continuation
from decoder_service.engine import DecoderEngine, ImageInput, VideoInput
from decoder_service.validation import (
    Limits,
    blank_texts,
    check_control_tokens,
    check_embedding_shape,
    check_image,
    check_prompt_length,
    check_video,
    to_chat_messages,
    video_order,
)
from vlcommon.deadline import Deadline
from vlcommon.handoff import Fetched, Reader
from vlcommon.model_info import VisionSpec
from vlcommon.refusals import Refusal
from vlcommon.sampling import check_max_tokens, check_sampling_ranges

tracer = trace.get_tracer("splitvl.decoder")


def answer_max_tokens(msg: generation_pb2.SamplingParams, limits: Limits) -> int:
    """The whole answer's max_tokens: the request's, else the decoder's default.

    Raises:
        ServiceError: INVALID_ARGUMENT ``MAX_TOKENS_OUT_OF_RANGE`` outside 1..the limit.
    """
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else limits.max_tokens_default
    return check_max_tokens(max_tokens, limits.max_tokens_limit)


def sampling_params(msg: generation_pb2.SamplingParams, limits: Limits, continued: int = 0) -> Any:
    """vLLM ``SamplingParams`` (DELTA output) from the proto, with every field range-checked.

    ``continued``: tokens of the answer another replica generated (``Continuation``);
    vLLM then generates ``max_tokens - continued`` more (the caller has checked that some
    are left).

    Raises:
        ServiceError: INVALID_ARGUMENT naming ``sampling.<field>`` and its range.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    max_tokens = answer_max_tokens(msg, limits)
    top_p = check_sampling_ranges(msg)
    try:
        return SamplingParams(
            max_tokens=max_tokens - continued,
            temperature=msg.temperature,
            top_p=top_p,
            seed=msg.seed if msg.HasField("seed") else None,
            stop=list(msg.stop) or None,
            ignore_eos=msg.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
        )
    except ValueError as exc:  # any check of vLLM's own that ours did not anticipate
        raise Refusal.SAMPLING_INVALID.error(
            f"sampling is invalid: {exc}", field="sampling"
        ) from exc


def count_received(fetched: Iterable[Fetched]) -> int:
    """Add each payload to ``splitvl_decoder_embedding_received_bytes_total`` (by transport
    and holder) and return their total, bytes."""
    total = 0
    for got in fetched:
        metrics.EMBEDDING_RECEIVED_BYTES.labels(transport=got.transport, holder=got.service).inc(
            got.nbytes
        )
        total += got.nbytes
    return total


@dataclass(frozen=True)
class Checked:
    """A request that passed every check that needs no payload.

    Attributes:
        messages: Chat-template messages (:func:`~decoder_service.validation.to_chat_messages`).
        image_order: ``image_order[k]``: the index into ``request.images`` of the prompt's
            k-th image.
        video_order: The same for ``request.videos``.
        limits: The limits it was checked against (``max_images``: the engine's).
        spec: The model's vision widths its embeddings' shapes were checked against.
    """

    messages: list[dict[str, Any]]
    image_order: list[int]
    video_order: list[int]
    limits: Limits
    spec: VisionSpec


@dataclass(frozen=True)
class Prepared:
    """A request's engine inputs.

    Attributes:
        prompt: The rendered chat template (one ``<|image_pad|>`` per image, one
            ``<|video_pad|>`` per video).
        images: Each image's embeddings, in prompt order.
        videos: Each video's embeddings and timestamps, in prompt order.
        params: vLLM ``SamplingParams`` (:func:`sampling_params`).
        max_tokens: ``params.max_tokens``, tokens.
        prompt_tokens: The prompt's length with its images and videos expanded, tokens.
        received_bytes: Embedding bytes received, inline and by reference.
        priority: vLLM's scheduling priority, the request's as sent (lower = sooner).
        prompt_ids: The rendered prompt's token ids (placeholders not expanded).
        continuation: The answer's tokens another replica generated (``Continuation``;
            empty for a new answer): vLLM gets ``prompt_ids + continuation`` as token ids,
            ``max_tokens`` counts them, ``prompt_tokens`` does not.
        text: The continued answer's text (:class:`ContinuedText`), None for a new one.
    """

    prompt: str
    images: list[ImageInput]
    videos: list[VideoInput]
    params: Any
    max_tokens: int
    prompt_tokens: int
    received_bytes: int
    priority: int = 0
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    continuation: list[int] = dataclasses.field(default_factory=list)
    text: ContinuedText | None = None


@dataclass(frozen=True)
class _Rendered:
    """What :meth:`Preparer.prepare` makes of a request while its embeddings are read
    (the fields of :class:`Prepared` of the same names)."""

    prompt: str
    prompt_ids: list[int]
    max_tokens: int
    params: Any
    continuation: list[int]
    text: ContinuedText | None


class Preparer:
    """Checks Generate requests and turns them into inputs of a :class:`DecoderEngine`,
    reading the embeddings sent by reference (``ImageEmbedding.ref``) with ``reader``."""

    def __init__(self, engine: DecoderEngine, limits: Limits, reader: Reader) -> None:
        self.engine = engine
        self.limits = limits
        self.reader = reader

    def check(self, request: pb.GenerateRequest, spec: VisionSpec) -> Checked:
        """Every rule that needs no payload, in this order: messages
        (:func:`~decoder_service.validation.to_chat_messages`), video references, then each
        image's and video's grid, dtype and shape against ``spec``.

        Raises:
            ServiceError: INVALID_ARGUMENT naming the field (and the limit where one
                applies).
        """
        engine = self.engine
        limits = dataclasses.replace(self.limits, max_images=engine.max_images)
        messages, order = to_chat_messages(request, engine.forbidden_tokens, limits)
        v_order = video_order(request, engine.max_videos)
        # Every shape against its grid and the model before any byte is read, so a ref's
        # size is bounded by what its grid needs (else a forged 1 GiB ref for a 4-token
        # grid is allocated before it is refused).
        for i in order:
            check_embedding_shape(request.images[i], i, spec, engine.max_image_tokens)
        for i in v_order:
            check_embedding_shape(
                request.videos[i].embedding,
                i,
                spec,
                engine.max_video_tokens,
                field=f"videos[{i}].embedding",
                video=True,
            )
        return Checked(messages, order, v_order, limits, spec)

    async def prepare(
        self,
        request: pb.GenerateRequest,
        checked: Checked,
        deadline: Deadline,
        read: set[str],
    ) -> Prepared:
        """Read the embeddings and render the prompt, concurrently; check both.

        Args:
            request: The request :meth:`check` passed.
            checked: What :meth:`check` returned for it.
            deadline: The call's deadline; each read by reference gets the time left.
            read: Collects the tickets of the refs read (each read releases its own).

        Raises:
            ServiceError: INVALID_ARGUMENT for sampling out of range, text that forms a
                control token across parts, a payload of the wrong size or holding NaN or
                inf, a prompt that leaves no room for max_tokens, a continuation that does
                not fit (``CONTINUATION_INVALID``); UNAVAILABLE naming the
                image and its holder when a ref cannot be read; DEADLINE_EXCEEDED.
        """
        # Embeddings sent by reference are read from their holders while the prompt is
        # rendered and tokenised (the reads wait on other processes, not on this loop).
        fetching = asyncio.ensure_future(self._fetch_all(request, checked, deadline, read))
        fetching.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            rendered = self._prompt_and_params(request, checked)
        except BaseException:
            fetching.cancel()
            raise
        image_data, video_data = await fetching
        images, videos = self._check_payloads(request, checked, image_data, video_data)
        received = count_received([*image_data.values(), *video_data.values()])
        engine = self.engine
        ids = rendered.prompt_ids
        n_prompt = engine.prompt_length(ids, images) + engine.video_prompt_length(videos)
        # The continuation's tokens are the answer's: they count against max_tokens
        # (params asks vLLM for the rest) and take their room in the model length.
        check_prompt_length(n_prompt, rendered.max_tokens, engine.max_model_len)
        return Prepared(
            rendered.prompt,
            images,
            videos,
            rendered.params,
            rendered.max_tokens,
            n_prompt,
            received,
            request.priority,
            prompt_ids=ids,
            continuation=rendered.continuation,
            text=rendered.text,
        )

    def _prompt_and_params(self, request: pb.GenerateRequest, checked: Checked) -> _Rendered:
        """Everything :meth:`prepare` needs but the payloads, in this order: max_tokens,
        the continuation, the sampling params, the prompt rendered and tokenised.

        Raises:
            ServiceError: INVALID_ARGUMENT for max_tokens or sampling out of range, a
                continuation that does not fit (``CONTINUATION_INVALID``), text that forms
                a control token across parts.
        """
        max_tokens = answer_max_tokens(request.sampling, checked.limits)
        engine = self.engine
        # The placeholder of a modality the request carries: vLLM binds media to it.
        # Another (a <|video_pad|> the model wrote in an answer about an image) is text.
        carried = {"image": bool(request.images), "video": bool(request.videos)}
        placeholders = frozenset(
            i for modality, i in engine.placeholder_ids.items() if carried.get(modality)
        )
        continuation = check_continuation(request, max_tokens, engine.vocab_size, placeholders)
        params = sampling_params(request.sampling, checked.limits, len(continuation))
        prompt, ids = self._render(checked.messages)
        text = (
            ContinuedText(
                engine.tokenizer,
                ids,
                continuation,
                request.continuation.text_chars,
                stop=list(request.sampling.stop),
            )
            if continuation
            else None
        )
        return _Rendered(prompt, ids, max_tokens, params, continuation, text)

    def _check_payloads(
        self,
        request: pb.GenerateRequest,
        checked: Checked,
        image_data: dict[int, Fetched],
        video_data: dict[int, Fetched],
    ) -> tuple[list[ImageInput], list[VideoInput]]:
        """Each image's and video's payload checked against its grid, in prompt order.

        Args:
            image_data, video_data: The payloads by index into ``request.images`` and
                ``request.videos`` (:meth:`_fetch_all`).

        Returns:
            (images, videos): the engine's inputs, in prompt order.

        Raises:
            ServiceError: INVALID_ARGUMENT for a payload of the wrong size or holding NaN
                or inf.
        """
        spec, engine = checked.spec, self.engine
        images = [
            check_image(
                request.images[i], i, spec, engine.max_image_tokens, data=image_data[i].data
            )
            for i in checked.image_order
        ]
        videos = [
            check_video(
                request.videos[i], i, spec, engine.max_video_tokens, data=video_data[i].data
            )
            for i in checked.video_order
        ]
        return images, videos

    def _render(self, messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
        """The prompt and its token ids, rendered and tokenised once; the same messages with
        blank texts give the template's own control tokens, which the prompt's must match.

        Raises:
            ServiceError: INVALID_ARGUMENT ``TEXT_CONTAINS_SPECIAL_TOKEN`` (case C05).
        """
        engine = self.engine
        prompt = engine.render(messages)
        ids = engine.tokenize(prompt)
        check_control_tokens(
            engine.control_tokens(ids),
            engine.control_tokens(engine.tokenize(engine.render(blank_texts(messages)))),
            engine.forbidden_tokens,
        )
        return prompt, ids

    async def _fetch_all(
        self,
        request: pb.GenerateRequest,
        checked: Checked,
        deadline: Deadline,
        read: set[str],
    ) -> tuple[dict[int, Fetched], dict[int, Fetched]]:
        """Every image's and video's payload, inline or read by reference, concurrently
        and within the call's deadline (a failed read fails the request with UNAVAILABLE
        naming the image and its holder). ``read`` collects the tickets read.

        Returns:
            (images, videos): the payloads by index into ``request.images`` and
            ``request.videos``.
        """
        order, v_order = checked.image_order, checked.video_order
        items = [(f"images[{i}]", request.images[i]) for i in order]
        items += [(f"videos[{i}].embedding", request.videos[i].embedding) for i in v_order]

        async def fetch(field: str, msg: tensor_pb2.ImageEmbedding) -> Fetched:
            got = await self.reader.fetch(msg, field=field, timeout=deadline.remaining())
            if msg.HasField("ref"):
                read.add(msg.ref.ticket)  # released by its read
            return got

        with tracer.start_as_current_span("decoder.fetch_embeddings") as span:
            # Every read ends before this returns or raises (none left running behind a
            # failed one, so the tickets read are known when the request fails).
            results = await asyncio.gather(
                *(fetch(field, msg) for field, msg in items), return_exceptions=True
            )
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            got = [r for r in results if isinstance(r, Fetched)]
            span.set_attribute("splitvl.embedding.bytes", sum(g.nbytes for g in got))
            span.set_attribute("splitvl.embedding.transports", [g.transport for g in got])
        images = dict(zip(order, got[: len(order)], strict=True))
        videos = dict(zip(v_order, got[len(order) :], strict=True))
        return images, videos
