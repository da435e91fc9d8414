"""Separating a model's reasoning from its answer (``reasoning_content`` vs ``content``).

Like the tool parsers, each format is a resumable scanner (``ReasoningParser._scan``) that returns
what it has decided, where it stopped, and the state to resume from; ``parse`` runs it once and
``ReasoningStream`` runs it over its buffer, holding back only a possible partial marker, so any
split of a text into deltas gives the same reasoning and content as ``parse``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class _Scan:
    reasoning: str  # decided reasoning text, not yet stripped
    content: str
    consumed: int  # text[:consumed] is decided; the rest is scanned again with more text
    state: Any = None  # where text[consumed:] starts; None: at the beginning, undecided


def _find_first(text: str, markers, pos: int) -> tuple[int, str]:
    """(index, marker) of the earliest marker in text[pos:], or (-1, "")."""
    hits = [(i, marker) for marker in markers if (i := text.find(marker, pos)) >= 0]
    return min(hits) if hits else (-1, "")


def _hold_index(text: str, pos: int, markers) -> int:
    """The smallest index >= pos from which text's tail is a proper prefix of a marker, else
    len(text). Text before it cannot become part of a marker whatever follows."""
    longest = max(len(m) for m in markers)
    for k in range(max(pos, len(text) - longest + 1), len(text)):
        if any(m.startswith(text[k:]) for m in markers):
            return k
    return len(text)


class ReasoningStream:
    """Incremental ``ReasoningParser.parse``: ``feed`` every delta, then ``finish`` once; each
    returns (reasoning delta, content delta). ``"".join(reasoning deltas) or None`` and
    ``"".join(content deltas)`` equal ``parse`` of the whole text."""

    def __init__(self, parser: ReasoningParser):
        self._parser, self._buf, self._state = parser, "", None
        self._started, self._pending = False, ""  # reasoning is stripped: trailing space waits

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        scan = self._parser._scan(self._buf, self._state, final)
        self._buf, self._state = self._buf[scan.consumed :], scan.state
        reasoning = scan.reasoning if self._started else scan.reasoning.lstrip()
        if reasoning:
            reasoning = self._pending + reasoning
            out = reasoning.rstrip()
            self._pending = reasoning[len(out) :]
            self._started = self._started or bool(out)
            reasoning = out
        return reasoning, scan.content


class ReasoningParser:
    """Splits output into reasoning and answer for models that think between ``start`` and ``end``.

    The output is reasoning when it begins (after whitespace) with ``start`` or when the generation
    began inside the reasoning (``force_reasoning``: the prompt ended with ``start``, or the chat
    template always thinks). Reasoning runs until ``end``; what follows, without its leading
    whitespace, is the content. Without ``end`` all of it is reasoning; without reasoning all of it
    is content, unchanged. Reasoning is returned stripped, None when empty.
    """

    start, end = "<think>", "</think>"
    always_forced = False  # the chat template always opens the reasoning in the prompt
    special_markers = False  # the markers are special tokens: the text must keep them

    def __init__(self, force_reasoning: bool = False):
        self.force_reasoning = force_reasoning or self.always_forced

    def parse(self, text: str) -> tuple[Optional[str], str]:
        """(reasoning_content or None, content)."""
        scan = self._scan(text, None, final=True)
        return scan.reasoning.strip() or None, scan.content

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def _scan(self, text: str, state: Any, final: bool) -> _Scan:
        reasoning, pos = "", 0
        if state is None:
            head = text.lstrip()
            if head.startswith(self.start):
                state, pos = "reasoning", len(text) - len(head) + len(self.start)
            elif self.start.startswith(head) and not final:
                return _Scan("", "", 0)  # only whitespace or part of the start marker so far
            else:
                state = "reasoning" if self.force_reasoning else "content"
        if state == "reasoning":
            j = text.find(self.end, pos)
            if j < 0:
                hold = len(text) if final else _hold_index(text, pos, (self.end,))
                return _Scan(text[pos:hold], "", hold, "reasoning")
            reasoning, pos, state = text[pos:j], j + len(self.end), "after"
        if state == "after":  # whitespace between the end marker and the answer is dropped
            answer = text[pos:].lstrip()
            if not answer:
                return _Scan(reasoning, "", len(text), "after")
            pos, state = len(text) - len(answer), "content"
        return _Scan(reasoning, text[pos:], len(text), "content")


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: its chat template ends the prompt with ``<think>\\n``, so always forced."""

    always_forced = True


class DeepSeekV3ReasoningParser(ReasoningParser):
    """DeepSeek-V3.1+: the caller forces reasoning when thinking is enabled for the request."""


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 (hybrid): reasoning only when the output starts with ``<think>``."""


class Qwen3ThinkingReasoningParser(ReasoningParser):
    """Qwen3 thinking-only models (-Thinking-2507): the template opens ``<think>`` itself."""

    always_forced = True


class Glm45ReasoningParser(ReasoningParser):
    """GLM-4.5: like Qwen3."""


class KimiReasoningParser(ReasoningParser):
    """Kimi (k1.5 / VL thinking): ``◁think▷ ... ◁/think▷``."""

    start, end = "◁think▷", "◁/think▷"


class GptOssReasoningParser(ReasoningParser):
    """OpenAI harmony (gpt-oss): the reasoning is the body of ``analysis`` messages, the content the
    body of the ``final`` message (and any text outside messages); ``<|start|>ROLE`` headers,
    tool-call and other commentary messages belong to neither. ``force_reasoning`` is not used."""

    special_markers = True

    START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
    END, CALL, RETURN, CONSTRAIN = "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"
    MARKERS = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)
    BODY_ENDS = (END, CALL, RETURN, START, CHANNEL)  # the last two: a message missing its end
    start = "<|channel|>analysis<|message|>"
    end = "<|channel|>final<|message|>"
    _RECIPIENT = re.compile(r"\bto=\S")
    _CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")

    def _scan(self, text: str, state: Any, final: bool) -> _Scan:
        reasoning, content, pos = [], [], 0
        while True:
            if state in ("analysis", "final", "drop"):  # inside a message body
                j, marker = _find_first(text, self.BODY_ENDS, pos)
                if j >= 0:
                    stop = j
                else:
                    stop = len(text) if final else _hold_index(text, pos, self.BODY_ENDS)
                if state != "drop":
                    (reasoning if state == "analysis" else content).append(text[pos:stop])
                if j < 0:
                    return _Scan("".join(reasoning), "".join(content), stop, state)
                pos, state = j + (len(marker) if marker in self.BODY_ENDS[:3] else 0), None
                continue
            i, marker = _find_first(text, self.MARKERS, pos)
            if i < 0:
                hold = len(text) if final else _hold_index(text, pos, self.MARKERS)
                content.append(text[pos:hold])
                return _Scan("".join(reasoning), "".join(content), hold)
            content.append(text[pos:i])  # text outside any message
            if marker not in (self.START, self.CHANNEL, self.MESSAGE):
                pos = i + len(marker)  # a stray end or constrain marker
                continue
            h = text.find(self.MESSAGE, i)
            if h < 0:  # header still coming; cut off at the end it is markup, not content
                stop = len(text) if final else i
                return _Scan("".join(reasoning), "".join(content), stop)
            header, pos = text[i:h], h + len(self.MESSAGE)
            channel = self._CHANNEL_NAME.search(header)
            channel = channel.group(1) if channel else "final"
            if self._RECIPIENT.search(header) or channel not in ("analysis", "final"):
                state = "drop"
            else:
                state = channel


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek-r1": DeepSeekR1ReasoningParser,
    "deepseek-v3": DeepSeekV3ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
    "qwen3-thinking": Qwen3ThinkingReasoningParser,
    "glm45": Glm45ReasoningParser,
    "kimi": KimiReasoningParser,
    "gpt-oss": GptOssReasoningParser,
}


def _parser_class(name: str) -> type[ReasoningParser]:
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"--reasoning-parser: unknown parser {name!r}; "
            f"choose from {', '.join(sorted(REASONING_PARSERS))}"
        )
    return REASONING_PARSERS[name]


def reasoning_parser(name: str, force_reasoning: bool = False) -> ReasoningParser:
    """The parser registered as ``name`` (``--reasoning-parser``) for one request."""
    return _parser_class(name)(force_reasoning=force_reasoning)


def think_end_text(name: Optional[str]) -> Optional[str]:
    """The text that ends the reasoning for parser ``name`` (None for no parser): a grammar for the
    answer applies only after it."""
    return None if name is None else _parser_class(name).end
