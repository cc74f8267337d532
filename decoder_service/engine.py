"""The decoder engine: vLLM ``AsyncLLM`` fed precomputed Qwen3-VL image embeddings.

Usage::

    engine = DecoderEngine(AsyncEngineArgs(model=DIR, enable_mm_embeds=True, ...))
    await engine.start()
    prompt = engine.render(messages)           # chat template, one <|image_pad|> per image
    async for delta in engine.generate(rid, prompt, images, params): ...

Everything that could kill the engine is checked first (``decoder_service.prepare``), with
``decoder_service.validation.check_image`` on each image (FACTS.md:
a wrong row count or width raises EngineDeadError and fails every later request).
vLLM gets ``{"image_embeds": [sum tokens, out_hidden*(1+n_deepstack)], "image_grid_thw":
LongTensor [n_images, 3]}`` and one ``multi_modal_uuids`` entry per image: the exact key of
the embeddings' content (a UUID shared by different content would make vLLM reuse the wrong
image's cached state; measured: two same-grid photos under one UUID gave identical tokens).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlcommon.model_info import VisionSpec, load_vision_spec, resolve_model_dir
from vlcommon.request_rules import forbidden_tokens

log = logging.getLogger(__name__)

# vLLM's KV-cache block size on CPU when the operator sets none (``--block-size``).
# vLLM's CPU default is 128 tokens; its prefix cache reuses whole blocks only, so a cache
# hit on a 448x448 image (196 image tokens after a 4-token header) reused only the first
# 128 tokens and still prefilled ~90 of ~215, ~40% of a miss. With 32 it reuses 192.
# Measured with `splitvl bench --quick --block-size 32` (docs/benchmarks.md, 2026-11-30),
# against the same run with 128: vLLM alone was faster too (32 concurrent: 1.92 against
# 1.82 req/s with no repeats, decode step 73 against 85 ms; one at a time 0.78 against
# 0.72 req/s), so the benchmark gives both systems this default. It is the smallest size
# vLLM's CPU attention runs (``cpu_block_size_error``; 16, vLLM's GPU default, is refused).
CPU_BLOCK_SIZE = 32


def default_block_size(on_cpu: bool) -> int | None:
    """The decoder's KV-cache block size (tokens) when none is given; None = vLLM's."""
    return CPU_BLOCK_SIZE if on_cpu else None


def cpu_block_size_error(block_size: int) -> str | None:
    """Why vLLM's CPU attention cannot run with this KV-cache block size, or None.

    The sizes come from vLLM itself (``CPUAttentionBackend.get_supported_kernel_block_sizes``:
    multiples of 32 in vLLM 0.32); any other size fails later, inside the engine core's
    KV-cache set-up, with a traceback instead of a usage error.
    """
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    allowed = CPUAttentionBackend.get_supported_kernel_block_sizes()
    names = []
    for size in allowed:
        base = getattr(size, "base", None)
        if base is not None:
            if block_size > 0 and block_size % base == 0:
                return None
            names.append(f"a positive multiple of {base}")
        else:
            if block_size == size:
                return None
            names.append(str(size))
    return (
        f"--block-size must be {' or '.join(names)} on CPU (vLLM's CPU attention kernels),"
        f" got {block_size}"
    )


@dataclass(frozen=True)
class ImageInput:
    """One image's embeddings as validated before the engine (``decoder_service.prepare``).

    Attributes:
        embeddings: float32, float16 or bfloat16 (``vlcommon.tensors.EMBEDDING_DTYPES``)
            ``[tokens, out_hidden*(1+n_deepstack)]``.
        grid: (t, h, w) in patches.
        uuid: Identity of the content for vLLM's caches
            (:func:`decoder_service.validation.content_uuid`: a digest of the bytes).
    """

    embeddings: torch.Tensor
    grid: tuple[int, int, int]
    uuid: str | None


@dataclass(frozen=True)
class VideoInput(ImageInput):
    """One video's embeddings (``video_embeds``) with its grid (``video_grid_thw``, t > 0)
    and one time per temporal patch, seconds (Qwen3-VL's ``<t seconds>`` prompt text)."""

    timestamps: tuple[float, ...] = ()


@dataclass(frozen=True)
class Delta:
    """A streamed piece of output; ``finish_reason`` is set on the last one."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    # vLLM's per-request timestamps (``RequestStateStats``: queued_ts, scheduled_ts,
    # first_token_ts, monotonic seconds of the engine core), or None without log stats.
    stats: Any = None


class DecoderEngine:
    """Wraps vLLM's AsyncLLM: chat template, multimodal input, streaming, abort."""

    def __init__(self, engine_args: Any) -> None:
        self.engine_args = engine_args
        self.llm: Any = None
        self.tokenizer: Any = None
        self.spec: VisionSpec | None = None
        self.max_model_len = 0
        self.max_images = 0
        self.max_videos = 0
        self.max_video_tokens = 0
        self.max_image_tokens = 0
        self.died = False
        self.forbidden_tokens: tuple[str, ...] = ()
        self._added_by_id: dict[int, str] = {}
        # Ids a continuation may hold (Continuation.token_ids): the tokenizer's (not the
        # padded embedding rows of the model's vocab_size), and not the placeholder token of
        # a modality the request carries, which vLLM would bind media to.
        self.vocab_size = 0
        self.placeholder_ids: dict[str, int] = {}

    async def start(self) -> None:
        """Start the engine (cold start tens of seconds on CPU) and load the tokenizer."""
        from transformers import AutoTokenizer
        from vllm.v1.engine.async_llm import AsyncLLM

        model_dir = resolve_model_dir(self.engine_args.model)
        self.spec = load_vision_spec(model_dir)
        # Off the event loop, as the engine below: the service's gRPC server runs on this
        # loop during startup, answering health NOT_SERVING and calls UNAVAILABLE "decoder is
        # starting"; a blocked loop held them until their deadlines (a restart takes 25-50 s).
        self.tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, model_dir)
        # Every added token (<|image_pad|>, <|im_start|>, ...) is a control token: user
        # text that spells one must not bind images or forge turns (case C05).
        added = self.tokenizer.get_added_vocab()
        self._added_by_id = {i: t for t, i in added.items()}
        # The gateway refuses the same set (vlcommon.request_rules.forbidden_tokens); the
        # added vocabulary is joined in case a tokenizer adds tokens beyond its files.
        tokens = set(forbidden_tokens(model_dir)) | set(added)
        self.forbidden_tokens = tuple(sorted(tokens, key=len, reverse=True))
        from decoder_service.metrics import engine_stat_logger

        # Our stat logger feeds splitvl_decoder_engine_* (KV-cache usage, queue depth);
        # vLLM still adds its own Prometheus logger beside it.
        # Built on a worker thread: with no running loop there, AsyncLLM starts its output
        # handler on the first generate() instead, on this loop.
        self.llm = await asyncio.to_thread(
            AsyncLLM.from_engine_args, self.engine_args, stat_loggers=[engine_stat_logger()]
        )
        self.max_model_len = int(self.llm.model_config.max_model_len)
        self.vocab_size = min(int(self.llm.model_config.get_vocab_size()), len(self.tokenizer))
        hf_config = self.llm.model_config.hf_config
        self.placeholder_ids = {
            modality: int(i)
            for modality, name in (("image", "image_token_id"), ("video", "video_token_id"))
            if (i := getattr(hf_config, name, None)) is not None
        }
        limits = self.llm.model_config.multimodal_config.limit_per_prompt
        image_limit = limits.get("image", 1)
        self.max_images = int(getattr(image_limit, "count", image_limit))
        video_limit = limits.get("video", 0)
        self.max_videos = int(getattr(video_limit, "count", video_limit))
        # vLLM refuses an image item with more tokens than its pre-allocated encoder cache.
        processor = getattr(self.llm, "input_processor", None)
        cache_size = int(getattr(processor, "mm_encoder_cache_size", 0) or 0)
        self.max_image_tokens = cache_size or self.max_model_len
        self.max_video_tokens = self.max_image_tokens
        log.info(
            "vLLM engine ready: max_model_len=%d, images per prompt <= %d",
            self.max_model_len,
            self.max_images,
        )

    def shutdown(self) -> None:
        self.died = self.dead
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    @property
    def dead(self) -> bool:
        return self.llm is not None and bool(self.llm.errored)

    def num_unfinished(self) -> int:
        return 0 if self.llm is None else int(self.llm.get_num_unfinished_requests())

    def render(self, messages: Sequence[dict[str, Any]]) -> str:
        """Apply the checkpoint's chat template; one ``<|image_pad|>`` per image part."""
        return str(
            self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=False
            )
        )

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of a rendered prompt (placeholders not yet expanded)."""
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def control_tokens(self, ids: Sequence[int]) -> list[str]:
        """The added (control) tokens among ``ids``, in order."""
        return [self._added_by_id[i] for i in ids if i in self._added_by_id]

    @staticmethod
    def prompt_length(ids: Sequence[int], images: Sequence[ImageInput]) -> int:
        """Prompt length after vLLM expands each ``<|image_pad|>`` to the image's tokens."""
        return len(ids) - len(images) + sum(int(im.embeddings.shape[0]) for im in images)

    def video_prompt_length(self, videos: Sequence[VideoInput]) -> int:
        """Tokens vLLM adds for the videos: each ``<|video_pad|>`` becomes, per temporal
        patch, the timestamp text, ``<|vision_start|>``, its tokens and ``<|vision_end|>``
        (``Qwen3VLMultiModalProcessor.get_video_repl``), less the placeholder itself."""
        extra = 0
        for v in videos:
            for t in v.timestamps:
                extra += len(self.tokenizer.encode(f"<{t:.1f} seconds>", add_special_tokens=False))
            extra += 2 * len(v.timestamps) + int(v.embeddings.shape[0]) - 1
        return extra

    async def generate(
        self,
        request_id: str,
        prompt: str,
        images: Sequence[ImageInput],
        params: Any,
        videos: Sequence[VideoInput] = (),
        priority: int = 0,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """Stream deltas. Cancelling the consumer aborts the vLLM request.

        ``priority`` is vLLM's (lower = sooner under ``--scheduling-policy priority``).
        ``prompt_token_ids``, when given, is what vLLM gets instead of ``prompt`` (a
        continued answer: the prompt's ids and the answer's so far; vLLM expands each
        placeholder in them as in a text prompt). ``finish_reason`` ``"abort"``: the
        request was aborted from outside (:meth:`abort`).

        Videos go in as ``{"video_embeds", "video_grid_thw", "timestamps"}``: vLLM 0.32's
        Qwen3-VL parser requires ``timestamps`` beside embeddings (its
        ``Qwen3VLMultiModalDataParser.embedding_fields``; without them it raises
        ``KeyError: 'timestamps'``), one list per video, one time per temporal patch.
        """
        inputs: dict[str, Any] = (
            {"prompt": prompt}
            if prompt_token_ids is None
            else {"prompt_token_ids": list(prompt_token_ids)}
        )
        mm: dict[str, Any] = {}
        uuids: dict[str, list[str]] = {}
        if images:
            mm["image"] = {
                "image_embeds": torch.cat([im.embeddings for im in images], dim=0),
                "image_grid_thw": torch.tensor([im.grid for im in images], dtype=torch.long),
            }
            if all(im.uuid for im in images):
                uuids["image"] = [str(im.uuid) for im in images]
        if videos:
            mm["video"] = {
                "video_embeds": torch.cat([v.embeddings for v in videos], dim=0),
                "video_grid_thw": torch.tensor([v.grid for v in videos], dtype=torch.long),
                "timestamps": [list(v.timestamps) for v in videos],
            }
            if all(v.uuid for v in videos):
                uuids["video"] = [str(v.uuid) for v in videos]
        if mm:
            inputs["multi_modal_data"] = mm
        if uuids and len(uuids) == len(mm):
            inputs["multi_modal_uuids"] = uuids
        finished = False
        completion = 0
        try:
            async for out in self.llm.generate(
                inputs, params, request_id=request_id, priority=priority
            ):
                choice = out.outputs[0]
                completion += len(choice.token_ids)
                finished = out.finished
                yield Delta(
                    token_ids=list(choice.token_ids),
                    text=choice.text,
                    finish_reason=choice.finish_reason if out.finished else None,
                    prompt_tokens=len(out.prompt_token_ids or ()),
                    completion_tokens=completion,
                    stats=out.metrics,
                )
        finally:
            if not finished and self.llm is not None and not self.llm.errored:
                # AsyncLLM.generate aborts on CancelledError/GeneratorExit itself; abort is
                # idempotent, and this also covers a consumer that stops iterating early.
                await self.llm.abort(request_id)

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests from outside their streams: a stream vLLM has registered then
        gets a last delta with ``finish_reason`` ``"abort"`` (vLLM's final output of an
        aborted request); an id vLLM does not know (not registered yet, or finished) is
        left alone."""
        if self.llm is not None and request_ids and not self.llm.errored:
            await self.llm.abort(list(request_ids))
