"""Continuing an answer another replica began (request migration, ``Continuation``).

The gateway sends the tokens a lost or drained replica generated (the model's own output:
only splitvl's gateway calls the decoder, and the public API takes no continuation); this
decoder renders the prompt as before, appends them after the generation prompt (vLLM gets
the token ids, so nothing is re-tokenised) and generates the rest, confirming it
(``GenerateResponse.continued_tokens`` on its first message). What the client sees must be what one
undisturbed replica would have sent:

- **Text.** vLLM detokenises only the new tokens, and a replica holds text back (an
  unfinished UTF-8 character; the last ``len(longest stop) - 1`` characters, which may be
  a stop string's start). :class:`ContinuedText` detokenises the whole answer as vLLM does
  (``tokenizers``' ``DecodeStream`` primed with the prompt, vLLM's
  ``FastIncrementalDetokenizer``), so the held-back text comes first and a character split
  between the two replicas' tokens is emitted once, whole.
- **Stop strings** are matched over the whole answer's text, so one that spans the
  boundary ends the answer as it would have (vLLM's own check sees only the new text).
- **Counts.** ``max_tokens`` stays the whole answer's: vLLM generates ``max_tokens - k``
  more; usage reports the original prompt and ``k`` + new completion tokens.

Usage::

    ids = check_continuation(request, max_tokens, engine.vocab_size, placeholders)
    text = ContinuedText(engine.tokenizer, prompt_ids, ids, request.continuation.text_chars,
                         stop=list(request.sampling.stop))
    piece, stopped = text.step(delta.token_ids, finished=delta.finish_reason is not None)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qwenvl.decoder.v1 import decoder_service_pb2 as pb

from vlcommon.refusals import Refusal


def check_continuation(
    request: pb.GenerateRequest,
    max_tokens: int,
    vocab_size: int,
    placeholder_ids: frozenset[int],
) -> list[int]:
    """The continuation's token ids, checked (empty when the request has none).

    Args:
        max_tokens: The whole answer's max_tokens (``sampling.max_tokens`` or the default).
        vocab_size: The model's vocabulary size (ids in ``[0, vocab_size)``).
        placeholder_ids: The image or video placeholder ids of the modalities the request
            carries (vLLM binds media to them). The model may write another modality's
            placeholder in an answer: vLLM reads that one as text (checked: a continuation
            holding the tiny model's own <|video_pad|> gave the undisturbed tokens).

    Raises:
        ServiceError: INVALID_ARGUMENT ``CONTINUATION_INVALID`` naming
            ``continuation.token_ids[i]`` (out of the vocabulary, a placeholder),
            ``continuation.token_ids`` (none, or max_tokens or more) or
            ``continuation.text_chars``.
    """
    if not request.HasField("continuation"):
        return []
    ids = list(request.continuation.token_ids)
    if not ids:
        raise Refusal.CONTINUATION_INVALID.error(
            "continuation.token_ids is empty: a continuation needs the answer's tokens",
            field="continuation.token_ids",
        )
    if len(ids) >= max_tokens:
        raise Refusal.CONTINUATION_INVALID.error(
            f"continuation.token_ids holds {len(ids)} tokens; max_tokens is {max_tokens}, "
            "so nothing is left to generate",
            field="continuation.token_ids",
            limit=max_tokens - 1,
        )
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size or t in placeholder_ids:
            what = (
                "the placeholder of a modality the request carries"
                if t in placeholder_ids
                else f"outside [0, {vocab_size})"
            )
            raise Refusal.CONTINUATION_INVALID.error(
                f"continuation.token_ids[{i}] is {t}, {what}",
                field=f"continuation.token_ids[{i}]",
                limit=vocab_size,
            )
    return ids


class ContinuedText:
    """The text of a continued answer, detokenised over both replicas' tokens.

    Args:
        tokenizer: The checkpoint's Hugging Face fast tokenizer.
        prompt_ids: The prompt's token ids as vLLM gets them (before the continuation;
            placeholders not expanded: the priming looks at the last few only).
        continuation: The answer's tokens so far.
        text_chars: Characters of their text the client already has.
        stop: The request's stop strings.

    Raises:
        ServiceError: INVALID_ARGUMENT ``CONTINUATION_INVALID`` naming
            ``continuation.text_chars`` when it is longer than those tokens' text.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        continuation: Sequence[int],
        text_chars: int,
        stop: Sequence[str] = (),
    ) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer._tokenizer
        # As vLLM's FastIncrementalDetokenizer: primed with the prompt, special tokens
        # skipped (SamplingParams.skip_special_tokens, on by default).
        self._stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=True)
        self.text = "".join(self._steps(continuation))
        if text_chars > len(self.text):
            raise Refusal.CONTINUATION_INVALID.error(
                f"continuation.text_chars is {text_chars}; the continuation's tokens make "
                f"{len(self.text)} characters",
                field="continuation.text_chars",
                limit=len(self.text),
            )
        self.emitted = text_chars
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        # The first replica found no stop string in the text it had: search from where
        # one could still begin.
        self._checked = len(self.text)

    def _steps(self, ids: Sequence[int]) -> list[str]:
        pieces = []
        for t in ids:
            piece = self._stream.step(self._tokenizer, t)
            if piece:
                pieces.append(piece)
        return pieces

    def step(self, token_ids: Sequence[int], finished: bool) -> tuple[str, bool]:
        """The text to stream after ``token_ids``, and whether a stop string matched
        (the answer ends there, the stop string not included).

        Args:
            token_ids: The new tokens of one vLLM output.
            finished: vLLM finished the request with this output (nothing held back).
        """
        self.text += "".join(self._steps(token_ids))
        start = max(0, self._checked - self._hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        self._checked = len(self.text)
        if hits:
            end, stopped = min(hits), True
            self.text = self.text[:end]
        else:
            end, stopped = (len(self.text) if finished else len(self.text) - self._hold), False
        if end <= self.emitted:
            return "", stopped
        piece, self.emitted = self.text[self.emitted : end], end
        return piece, stopped
