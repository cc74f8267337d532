"""Checks that run before anything reaches the vLLM engine (cases C05 and C07).

A wrong embedding row count or width kills vLLM's engine for every later request
(FACTS.md), so each image is checked against its grid and the model's widths here, and
user text that spells a control token is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import blake3
from qwenvl.common.v1 import tensor_pb2
from qwenvl.decoder.v1 import decoder_service_pb2 as pb

from decoder_service.engine import ImageInput, VideoInput
from vlcommon import tensors
from vlcommon.model_info import VisionSpec
from vlcommon.refusals import Refusal
from vlcommon.request_rules import (
    check_grid,
    check_media_count,
    check_message_counts,
    check_no_control_tokens,
    check_parts_present,
    check_reasoning_content,
    check_role,
    check_text_length,
    part_empty,
)
from vlcommon.tensors import EMBEDDING_DTYPES


@dataclass(frozen=True)
class Limits:
    """Request limits of the decoder.

    Attributes:
        max_images: Images per prompt (vLLM's ``limit_mm_per_prompt``).
        max_tokens_default: max_tokens when the request leaves it unset.
        max_tokens_limit: Largest max_tokens accepted.
        max_text_chars: Characters of text over all parts.
        max_messages: Messages per request.
        max_parts: Content parts over all messages.
    """

    max_images: int
    max_tokens_default: int
    max_tokens_limit: int
    max_text_chars: int
    max_messages: int
    max_parts: int


def to_chat_messages(
    request: pb.GenerateRequest, forbidden: tuple[str, ...], limits: Limits
) -> tuple[list[dict[str, Any]], list[int]]:
    """Turn the request's messages into chat-template dicts: ``role``, ``content`` (a list
    of ``{"type": "text", "text"}``, ``{"type": "image"}``, ``{"type": "video"}`` parts) and,
    for an assistant message that carries one, its ``reasoning_content`` under that key and
    under ``reasoning``, as vLLM's ``chat_utils._parse_chat_message_content`` passes it
    (Qwen3-VL Thinking templates read ``reasoning_content``).

    Returns:
        (messages, image_order): ``image_order[k]`` is the index into ``request.images``
        of the k-th image placeholder in the prompt.

    Raises:
        ServiceError: INVALID_ARGUMENT naming the field: counts, roles, empty parts, a
            control token in text or reasoning, ``reasoning_content`` on a message that is
            not the assistant's, an image index out of range, reused or unused.
    """
    # Counted before anything is rendered: the chat template and the tokenizer run on the
    # event loop, and 600,000 empty messages (4.8 MB) held it for 28 s.
    check_message_counts(
        request.messages, max_messages=limits.max_messages, max_parts=limits.max_parts
    )
    messages: list[dict[str, Any]] = []
    order: list[int] = []
    chars = 0
    for i, message in enumerate(request.messages):
        check_role(message.role, f"messages[{i}].role")
        check_parts_present(message.parts, i, has_reasoning=message.HasField("reasoning_content"))
        content: list[dict[str, Any]] = []
        for j, part in enumerate(message.parts):
            field = f"messages[{i}].parts[{j}]"
            kind = part.WhichOneof("part")
            if kind == "text":
                check_no_control_tokens(part.text, forbidden, f"{field}.text")
                chars += len(part.text)
                content.append({"type": "text", "text": part.text})
            elif kind == "video_index":
                content.append({"type": "video"})  # checked by video_order
            elif kind == "image_index":
                idx = part.image_index
                if not 0 <= idx < len(request.images):
                    raise Refusal.IMAGE_INDEX_INVALID.error(
                        f"{field}.image_index is {idx}; the request has "
                        f"{len(request.images)} images",
                        field=f"{field}.image_index",
                    )
                if idx in order:
                    raise Refusal.IMAGE_INDEX_REUSED.error(
                        f"{field}.image_index {idx} is used twice", field=f"{field}.image_index"
                    )
                order.append(idx)
                content.append({"type": "image"})
            else:
                raise part_empty(field, "text, image_index, video_index")
        entry: dict[str, Any] = {"role": message.role, "content": content}
        if message.HasField("reasoning_content"):
            reasoning = message.reasoning_content
            check_reasoning_content(message.role, reasoning, forbidden, i)
            chars += len(reasoning)
            entry["reasoning"] = entry["reasoning_content"] = reasoning
        messages.append(entry)
    check_text_length(chars, limits.max_text_chars)
    if len(order) != len(request.images):
        unused = sorted(set(range(len(request.images))) - set(order))
        raise Refusal.IMAGE_UNUSED.error(
            f"images {unused} are not referenced by any message part", field="images"
        )
    check_media_count(len(order), noun="images", limit=limits.max_images, where=" per prompt")
    return messages, order


def video_order(request: pb.GenerateRequest, max_videos: int) -> list[int]:
    """``order[k]``: the index into ``request.videos`` of the k-th video part, in prompt order.

    Raises:
        ServiceError: INVALID_ARGUMENT for an index out of range or used twice, a video no
            part references, or more videos than the engine's ``limit_mm_per_prompt``.
    """
    order: list[int] = []
    for i, message in enumerate(request.messages):
        for j, part in enumerate(message.parts):
            if part.WhichOneof("part") != "video_index":
                continue
            field = f"messages[{i}].parts[{j}].video_index"
            idx = part.video_index
            if not 0 <= idx < len(request.videos):
                raise Refusal.VIDEO_INDEX_INVALID.error(
                    f"{field} is {idx}; the request has {len(request.videos)} videos", field=field
                )
            if idx in order:
                raise Refusal.VIDEO_INDEX_REUSED.error(f"{field} {idx} is used twice", field=field)
            order.append(idx)
    if len(order) != len(request.videos):
        unused = sorted(set(range(len(request.videos))) - set(order))
        raise Refusal.VIDEO_UNUSED.error(
            f"videos {unused} are not referenced by any message part", field="videos"
        )
    check_media_count(len(order), noun="videos", limit=max_videos, where=" per prompt")
    return order


def check_video(
    msg: pb.VideoEmbedding,
    index: int,
    spec: VisionSpec,
    max_tokens: int,
    data: bytes | bytearray | None = None,
) -> VideoInput:
    """Validate one video's embeddings, grid and timestamps before the engine.

    Expected: the embeddings' shape as :func:`check_image` (with t >= 1), and one finite,
    non-negative timestamp per temporal patch (vLLM's Qwen3-VL asserts
    ``len(timestamps) == grid t`` inside the engine).

    Raises:
        ServiceError: INVALID_ARGUMENT naming ``videos[index]``.
    """
    field = f"videos[{index}]"
    emb = msg.embedding
    image = check_image(
        emb, index, spec, max_tokens, field=f"{field}.embedding", video=True, data=data
    )
    stamps = list(msg.timestamps)
    if len(stamps) != image.grid[0]:
        raise Refusal.VIDEO_TIMESTAMPS_MISMATCH.error(
            f"{field}.timestamps has {len(stamps)} entries; grid {list(image.grid)} needs "
            f"{image.grid[0]} (one per temporal patch)",
            field=f"{field}.timestamps",
            expected=image.grid[0],
            actual=len(stamps),
        )
    if not all(math.isfinite(t) and t >= 0 for t in stamps):
        raise Refusal.VIDEO_TIMESTAMPS_INVALID.error(
            f"{field}.timestamps holds a negative or non-finite time", field=f"{field}.timestamps"
        )
    return VideoInput(
        embeddings=image.embeddings, grid=image.grid, uuid=image.uuid, timestamps=tuple(stamps)
    )


def content_uuid(data: bytes | bytearray, dtype: int, grid: tuple[int, int, int]) -> str:
    """vLLM's identity of one image's embeddings (``multi_modal_uuids``): BLAKE3 of the
    bytes themselves, with their dtype and the grid, never a key the caller names.

    vLLM's caches (its encoder cache and the prefix cache's multimodal hashes) trust the
    uuid: two requests with one uuid share what was computed for the first. A key taken
    from the request would let a caller of the decoder's port bind its own embeddings to
    an image's key, and the next genuine request for that image would get them. The digest
    costs 3.2 ms per 16 MiB here (``blake3``, the hasher vLLM itself depends on), against an
    isfinite pass over the same bytes.
    """
    digest = blake3.blake3(data).hexdigest()[:32]
    return f"{digest}:{tensors.dtype_name(dtype)}:{grid[0]}x{grid[1]}x{grid[2]}"


def check_embedding_shape(
    msg: tensor_pb2.ImageEmbedding,
    index: int,
    spec: VisionSpec,
    max_tokens: int,
    *,
    field: str = "",
    video: bool = False,
) -> tuple[int, int, int]:
    """Check one image's grid, dtype and shape against the model, from the message alone
    (no payload): the decoder runs it before it reads any embedding sent by reference, so
    a ref whose shape does not fit its grid is refused before its bytes are allocated.

    Returns:
        The grid ``(t, h, w)``.

    Raises:
        ServiceError: INVALID_ARGUMENT naming ``field`` (default ``images[index]``).
    """
    field = field or f"images[{index}]"
    if not msg.HasField("grid"):
        raise Refusal.GRID_MISSING.error(
            f"{field}.grid is missing; image_grid_thw is required for every image",
            field=f"{field}.grid",
        )
    m = spec.spatial_merge_size
    grid = check_grid(msg.grid, f"{field}.grid", m, video=video)
    if not msg.HasField("embeddings"):
        raise Refusal.EMBEDDINGS_MISSING.error(
            f"{field}.embeddings is missing", field=f"{field}.embeddings"
        )
    emb = msg.embeddings
    if emb.dtype not in EMBEDDING_DTYPES or len(emb.shape) != 2:
        # validate names the dtype or the dimensions (it checks them before any payload)
        tensors.validate(emb, field=f"{field}.embeddings", dtypes=EMBEDDING_DTYPES, ndim=2)
    expected = [math.prod(grid) // (m * m), spec.embedding_width]
    if list(emb.shape) != expected:
        raise Refusal.EMBEDDING_SHAPE_MISMATCH.error(
            f"{field}.embeddings has shape {list(emb.shape)}; grid {list(grid)} needs "
            f"{expected} (rows = t*h*w/{m}**2, width = out_hidden {spec.out_hidden_size} x "
            f"(1 + {spec.n_deepstack} deepstack))",
            field=f"{field}.embeddings",
            expected=str(expected),
            actual=str(list(emb.shape)),
        )
    if expected[0] > max_tokens:
        raise Refusal.IMAGE_TOO_MANY_TOKENS.error(
            f"{field} has {expected[0]} image tokens; the limit is {max_tokens} per image "
            "(the decoder's encoder cache size)",
            field=field,
            limit=max_tokens,
        )
    return grid


def check_image(
    msg: tensor_pb2.ImageEmbedding,
    index: int,
    spec: VisionSpec,
    max_tokens: int,
    *,
    field: str = "",
    video: bool = False,
    data: bytes | bytearray | None = None,
) -> ImageInput:
    """Validate one image's embeddings against its grid and the model (case C07).

    Expected shape: ``[t*h*w / spatial_merge_size**2, out_hidden * (1 + n_deepstack)]``.
    ``data``: the payload read by reference (``msg.ref``), checked in place of
    ``msg.embeddings.data``.

    Raises:
        ServiceError: INVALID_ARGUMENT naming ``images[index]`` with expected and actual
            shape (or the missing grid, or the bad dtype/byte count).
    """
    field = field or f"images[{index}]"
    grid = check_embedding_shape(msg, index, spec, max_tokens, field=field, video=video)
    emb = msg.embeddings
    data = tensors.validate(
        emb, field=f"{field}.embeddings", dtypes=EMBEDDING_DTYPES, ndim=2, data=data
    )
    tensors.check_finite(emb, data, f"{field}.embeddings")
    uuid = content_uuid(data, emb.dtype, grid)
    return ImageInput(embeddings=tensors.to_torch(emb, data), grid=grid, uuid=uuid)


def blank_texts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same messages with every text part emptied (the template's own tokens only)."""
    return [
        {
            **m,
            "content": [{**c, "text": ""} if c.get("type") == "text" else c for c in m["content"]],
        }
        for m in messages
    ]


def check_control_tokens(
    actual: list[str], expected: list[str], forbidden: tuple[str, ...]
) -> None:
    """Refuse a prompt whose control tokens differ from what the template alone produces.

    Per-part checks miss tokens formed across parts ("<|im_" + "start|>"), since the
    template joins adjacent text. So the rendered prompt's control tokens (``actual``) are
    compared with those of the same messages with every text emptied (``expected``, from
    :func:`blank_texts`) (case C05).

    Raises:
        ServiceError: INVALID_ARGUMENT ``TEXT_CONTAINS_SPECIAL_TOKEN`` naming the token.
    """
    for token in forbidden:
        if actual.count(token) != expected.count(token):
            raise Refusal.TEXT_CONTAINS_SPECIAL_TOKEN.error(
                f"the text of messages forms the special token {token!r} (across parts); "
                "control tokens may not appear in text",
                field="messages",
                token=token,
            )


def check_prompt_length(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Refuse a prompt that leaves no room for ``max_tokens`` within ``max_model_len``
    (all three in tokens; the prompt's images and videos expanded).

    Raises:
        ServiceError: INVALID_ARGUMENT ``PROMPT_TOO_LONG`` with the limit max_model_len,
            naming ``messages`` when no max_tokens would make the prompt fit, else
            ``sampling.max_tokens``.
    """
    if prompt_tokens >= max_model_len:
        raise Refusal.PROMPT_TOO_LONG.error(
            f"the prompt is {prompt_tokens} tokens (images included); max_model_len is "
            f"{max_model_len}, and at least one token must be generated: shorten the messages",
            field="messages",
            limit=max_model_len,
        )
    if prompt_tokens > max_model_len - max_tokens:
        raise Refusal.PROMPT_TOO_LONG.error(
            f"the prompt is {prompt_tokens} tokens (images included) and max_tokens "
            f"{max_tokens}; together they exceed max_model_len {max_model_len}",
            field="sampling.max_tokens",
            limit=max_model_len,
        )
