"""Rules a request must meet, shared by the gateway and the decoder: message and part
counts, chat roles, and the control tokens user text may not hold.

Each check raises :class:`~vlcommon.errors.ServiceError` with INVALID_ARGUMENT naming the
field (and the limit where one applies).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vlcommon.errors import invalid_argument


def check_count(n: int, *, field: str, limit: int, noun: str = "entries") -> None:
    """Refuse an empty or over-long repeated field.

    Raises:
        ServiceError: INVALID_ARGUMENT naming ``field`` (and ``limit`` when over it).
    """
    if n == 0:
        raise invalid_argument(
            f"{field.upper().replace('.', '_')}_EMPTY",
            f"{field} is empty; send at least one",
            field=field,
        )
    if n > limit:
        raise invalid_argument(
            f"TOO_MANY_{field.upper().replace('.', '_')}",
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
        raise invalid_argument(
            "TOO_MANY_PARTS",
            f"messages hold {parts} parts; the limit is {max_parts}",
            field="messages",
            limit=max_parts,
        )


ROLES = ("system", "user", "assistant")


def check_role(role: str, field: str) -> None:
    """Refuse a chat role other than system, user or assistant (INVALID_ARGUMENT)."""
    if role not in ROLES:
        raise invalid_argument(
            "ROLE_INVALID",
            f"{field} is {role!r}; expected one of {', '.join(ROLES)}",
            field=field,
        )


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
            raise invalid_argument(
                "TEXT_CONTAINS_SPECIAL_TOKEN",
                f"{field} contains the special token {token!r}; images are given as image "
                "parts, and control tokens may not appear in text",
                field=field,
                token=token,
            )
