"""Rules a request must meet, shared by the gateway, the cache and the decoder: message and
part counts, image and video counts, text length, chat roles, the control tokens user text
may not hold, where an earlier turn's reasoning may go, the grid rule (``image_grid_thw`` /
``video_grid_thw``), and the names of cache tiers and policies.

Each check raises :class:`~vlcommon.errors.ServiceError` with INVALID_ARGUMENT naming the
field (and the limit where one applies).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qwenvl.common.v1 import generation_pb2

from vlcommon.errors import ServiceError
from vlcommon.refusals import Refusal

#: Cache policy names (settings, the OpenAI front's ``cache_policy``) and their enum values.
CACHE_POLICIES = {
    "exact_only": generation_pb2.CACHE_POLICY_EXACT_ONLY,
    "similar": generation_pb2.CACHE_POLICY_SIMILAR,
    "off": generation_pb2.CACHE_POLICY_OFF,
}
#: Cache tier names and their enum values (the tier a result was served from).
CACHE_TIERS = {
    "exact": generation_pb2.CACHE_TIER_EXACT,
    "similar": generation_pb2.CACHE_TIER_SIMILAR,
    "miss": generation_pb2.CACHE_TIER_MISS,
}
#: A tier's name by its enum value (clients, the OpenAI front, the benchmarks).
TIER_NAMES = {value: name for name, value in CACHE_TIERS.items()}


def check_cache_policy(value: int, field: str) -> None:
    """Refuse a number that is not a ``CachePolicy`` value (the gateway's ``cache_policy``,
    the cache's ``Lookup.policy``; unspecified is the server's default).

    Raises:
        ServiceError: INVALID_ARGUMENT ``CACHE_POLICY_INVALID`` naming ``field``.
    """
    if value not in generation_pb2.CachePolicy.values():
        raise Refusal.CACHE_POLICY_INVALID.error(
            f"{field} {value} is not a CachePolicy value", field=field
        )


#: The refusals of :func:`check_count` by field: (empty, over the limit).
_COUNT_REFUSALS = {
    "messages": (Refusal.MESSAGES_EMPTY, Refusal.TOO_MANY_MESSAGES),
    "images": (Refusal.IMAGES_EMPTY, Refusal.TOO_MANY_IMAGES),
}
#: The refusal of :func:`check_media_count` by noun.
_TOO_MANY_MEDIA = {"images": Refusal.TOO_MANY_IMAGES, "videos": Refusal.TOO_MANY_VIDEOS}


def check_count(n: int, *, field: str, limit: int, noun: str = "entries") -> None:
    """Refuse an empty or over-long repeated field (``field``: ``messages``, or an Encode
    call's ``images``).

    Raises:
        ServiceError: INVALID_ARGUMENT ``MESSAGES_EMPTY`` / ``TOO_MANY_MESSAGES`` (or
            ``IMAGES_EMPTY`` / ``TOO_MANY_IMAGES``) naming ``field`` (and ``limit`` when
            over it).
    """
    empty, too_many = _COUNT_REFUSALS[field]
    if n == 0:
        raise empty.error(f"{field} is empty; send at least one", field=field)
    if n > limit:
        raise too_many.error(
            f"{field} has {n} {noun}; the limit is {limit}",
            field=field,
            limit=limit,
        )


def check_message_counts(messages: Sequence[Any], *, max_messages: int, max_parts: int) -> None:
    """Refuse no messages, too many messages, or too many content parts over all of them,
    before any content is read (the gateway and the decoder alike).

    Raises:
        ServiceError: INVALID_ARGUMENT naming ``messages`` (and the limit when over it).
    """
    check_count(len(messages), field="messages", limit=max_messages)
    parts = sum(len(m.parts) for m in messages)
    if parts > max_parts:
        raise Refusal.TOO_MANY_PARTS.error(
            f"messages hold {parts} parts; the limit is {max_parts}",
            field="messages",
            limit=max_parts,
        )


def check_media_count(n: int, *, noun: str, limit: int, where: str = "") -> None:
    """Refuse more images or videos than ``limit`` in one request (``noun``: ``images`` or
    ``videos``; ``where`` names what sets the limit, e.g. `` (GATEWAY_MAX_VIDEOS)`` or
    `` per prompt``).

    Raises:
        ServiceError: INVALID_ARGUMENT ``TOO_MANY_IMAGES`` / ``TOO_MANY_VIDEOS`` naming
            ``images`` / ``videos`` and the limit.
    """
    if n > limit:
        raise _TOO_MANY_MEDIA[noun].error(
            f"the request has {n} {noun}; the limit is {limit}{where}",
            field=noun,
            limit=limit,
        )


def check_text_length(chars: int, limit: int) -> None:
    """Refuse more than ``limit`` characters of text over all messages' parts.

    Raises:
        ServiceError: INVALID_ARGUMENT ``TEXT_TOO_LONG`` naming ``messages`` and the limit.
    """
    if chars > limit:
        raise Refusal.TEXT_TOO_LONG.error(
            f"messages hold {chars} characters of text; the limit is {limit}",
            field="messages",
            limit=limit,
        )


def check_parts_present(
    parts: Sequence[Any], message_index: int, *, has_reasoning: bool = False
) -> None:
    """Refuse a message without content parts (INVALID_ARGUMENT ``PARTS_EMPTY``), unless it
    carries an earlier turn's reasoning (``has_reasoning``): an assistant turn that only
    reasoned, which OpenAI clients send back with ``content: null`` and vLLM renders with
    an empty content."""
    if not parts and not has_reasoning:
        field = f"messages[{message_index}].parts"
        raise Refusal.PARTS_EMPTY.error(f"{field} is empty", field=field)


def part_empty(field: str, kinds: str) -> ServiceError:
    """The error for a part that sets none of its oneof's ``kinds`` (``PART_EMPTY``)."""
    return Refusal.PART_EMPTY.error(f"{field} has none of {kinds}", field=field)


ROLES = ("system", "user", "assistant")


def check_role(role: str, field: str) -> None:
    """Refuse a chat role other than system, user or assistant (INVALID_ARGUMENT)."""
    if role not in ROLES:
        raise Refusal.ROLE_INVALID.error(
            f"{field} is {role!r}; expected one of {', '.join(ROLES)}", field=field
        )


# Qwen's vision and turn tokens: refused even where a tokenizer's files lack them.
QWEN_CONTROL_TOKENS = frozenset(
    {
        "<|vision_start|>",
        "<|vision_end|>",
        "<|vision_pad|>",
        "<|image_pad|>",
        "<|video_pad|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
    }
)


def added_tokens(model_dir: Path) -> dict[str, tuple[int, bool]]:
    """Every added token of the checkpoint's tokenizer, text -> (token id, special):
    ``tokenizer.json``'s ``added_tokens`` and ``tokenizer_config.json``'s
    ``added_tokens_decoder`` (the sources of transformers' ``get_added_vocab``; the first
    wins where both name a token).

    Raises:
        json.JSONDecodeError: a tokenizer file that is not JSON (at startup).
    """
    out: dict[str, tuple[int, bool]] = {}
    path = Path(model_dir) / "tokenizer.json"
    if path.exists():
        for token in json.loads(path.read_text()).get("added_tokens", []):
            out[token["content"]] = (int(token["id"]), bool(token.get("special")))
    path = Path(model_dir) / "tokenizer_config.json"
    if path.exists():
        decoder = json.loads(path.read_text()).get("added_tokens_decoder", {})
        for token_id, token in decoder.items():
            out.setdefault(token["content"], (int(token_id), bool(token.get("special"))))
    return out


def forbidden_tokens(model_dir: Path) -> tuple[str, ...]:
    """The control tokens user text may not spell (case C05), longest first, as the
    gateway and the decoder both refuse them: every added token of the checkpoint's
    tokenizer (:func:`added_tokens`) and :data:`QWEN_CONTROL_TOKENS`.

    Raises:
        json.JSONDecodeError: a tokenizer file that is not JSON (at startup).
    """
    tokens = set(QWEN_CONTROL_TOKENS) | set(added_tokens(model_dir))
    return tuple(sorted(tokens, key=len, reverse=True))


def check_no_control_tokens(text: str, forbidden: tuple[str, ...], field: str) -> None:
    """Refuse text containing a control token such as ``<|image_pad|>`` (case C05).

    Raises:
        ServiceError: INVALID_ARGUMENT ``TEXT_CONTAINS_SPECIAL_TOKEN`` naming the field
            and the token.
    """
    if "<" not in text:
        return
    for token in forbidden:
        if token in text:
            raise Refusal.TEXT_CONTAINS_SPECIAL_TOKEN.error(
                f"{field} contains the special token {token!r}; images are given as image "
                "parts, and control tokens may not appear in text",
                field=field,
                token=token,
            )


def check_reasoning_content(
    role: str, reasoning: str, forbidden: tuple[str, ...], message_index: int
) -> None:
    """Refuse a message's ``reasoning_content`` (an earlier assistant turn's reasoning, as
    vLLM's chat_utils hands it to the chat template for assistant messages only) on a role
    other than assistant, or holding a control token (the rule of text parts, case C05).

    Raises:
        ServiceError: INVALID_ARGUMENT ``REASONING_CONTENT_NOT_ASSISTANT`` or
            ``TEXT_CONTAINS_SPECIAL_TOKEN``, naming ``messages[i].reasoning_content``.
    """
    field = f"messages[{message_index}].reasoning_content"
    if role != "assistant":
        raise Refusal.REASONING_CONTENT_NOT_ASSISTANT.error(
            f"{field} is set on a {role!r} message; only assistant messages carry the "
            "reasoning of an earlier turn",
            field=field,
        )
    check_no_control_tokens(reasoning, forbidden, field)


#: Most patches (t * h * w) one grid may have: 2**24, i.e. 4,194,304 tokens at a merge of
#: 2, sixteen times the longest context of any Qwen3-VL. The fields are int64: without a
#: bound, a forged grid's product (up to 2**189) reached the shape checks and the grid
#: comparisons of the cache and the decoder, and its message quoted a 57-digit count.
MAX_GRID_PATCHES = 2**24


def check_grid(grid: Any, field: str, merge: int, *, video: bool = False) -> tuple[int, int, int]:
    """The ``(t, h, w)`` of a ``GridTHW`` (in patches), checked by one rule everywhere an
    embedding's grid arrives (the cache's Lookup and Put, the decoder).

    A still image has ``t == 1``: vLLM asserts it for image items, and a ``t > 1`` image
    killed its engine; a video (``video_grid_thw``) has any ``t >= 1``. ``h`` and ``w`` are
    positive multiples of ``spatial_merge_size`` (``merge``), and ``t * h * w`` is at most
    :data:`MAX_GRID_PATCHES`.

    Raises:
        ServiceError: INVALID_ARGUMENT ``GRID_INVALID`` naming ``field`` and the rule, or
            ``GRID_TOO_LARGE`` naming ``field`` and the limit.
    """
    thw = (int(grid.t), int(grid.h), int(grid.w))
    if (thw[0] != 1 and not video) or min(thw) <= 0 or thw[1] % merge or thw[2] % merge:
        what = "a video has t >= 1" if video else "an image has t = 1"
        raise Refusal.GRID_INVALID.error(
            f"{field} is {list(thw)}; {what} and h, w > 0, multiples of spatial_merge_size {merge}",
            field=field,
        )
    patches = thw[0] * thw[1] * thw[2]
    if patches > MAX_GRID_PATCHES:
        raise Refusal.GRID_TOO_LARGE.error(
            f"{field} is {list(thw)}: {patches} patches; the limit is {MAX_GRID_PATCHES} "
            "patches (t*h*w)",
            field=field,
            limit=MAX_GRID_PATCHES,
        )
    return thw
