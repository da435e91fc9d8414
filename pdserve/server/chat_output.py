"""One chat choice's text as OpenAI returns it: ``reasoning_content`` apart from ``content``
(``--reasoning-parser``) and ``tool_calls`` (``--tool-call-parser`` for ``tool_choice: auto``;
the JSON the grammar forced for ``required`` or a named function), whole or as stream deltas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pdserve.server.reasoning_parser import REASONING_PARSERS, reasoning_parser
from pdserve.server.tool_choice import calls_from_forced_output
from pdserve.server.tool_parser import TOOL_PARSERS, ToolCall, tool_parser

# chat_template_kwargs switch that turns a model's thinking off, and its default
THINKING_SWITCH = {
    "qwen3": ("enable_thinking", True),
    "glm45": ("enable_thinking", True),
    "deepseek-v3": ("thinking", False),
}


def thinking_on(parser_name: str, template_kwargs: Optional[dict]) -> bool:
    key, default = THINKING_SWITCH.get(parser_name, (None, True))
    return default if key is None else bool((template_kwargs or {}).get(key, default))


def merge_deltas(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """One delta of two in a row (texts joined, tool calls listed in order)."""
    out = dict(first)
    for key, value in then.items():
        out[key] = out[key] + value if key in out else value
    return out


@dataclass
class ChatSetup:
    """What a chat request asks of its output (validated)."""

    reasoning: Optional[str] = None  # the reasoning parser's name (None: no split)
    force_reasoning: bool = False  # the prompt already opened the reasoning
    tools: Optional[list[dict]] = (
        None  # tools the model may call (None: tool_choice none, or none given)
    )
    tool_choice: Any = None
    tool_parser: Optional[str] = None

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the output's text must keep special tokens (the parsers' markers are some)."""
        return bool(
            (self.reasoning and REASONING_PARSERS[self.reasoning].special_markers)
            or (self.auto_tools and TOOL_PARSERS[self.tool_parser].special_markers)
        )

    @property
    def auto_tools(self) -> bool:
        """The tool-call parser finds the calls (tool_choice auto)."""
        return self.tools is not None and bool(self.tool_parser) and not self.forced

    @property
    def forced(self) -> bool:
        """The grammar forces the calls (``required`` or a named function): the output is JSON."""
        return self.tools is not None and (
            self.tool_choice == "required" or isinstance(self.tool_choice, dict)
        )


@dataclass
class ChoiceOutput:
    setup: ChatSetup
    calls: list[ToolCall] = field(default_factory=list)
    _text: str = ""

    def __post_init__(self) -> None:
        s = self.setup
        self._reasoning = (
            reasoning_parser(s.reasoning, force_reasoning=s.force_reasoning).stream()
            if s.reasoning
            else None
        )
        self._tools = tool_parser(s.tool_parser, s.tools).stream() if s.auto_tools else None
        self._forced_text = ""

    # ---- whole ---------------------------------------------------------------------------
    def message(self, text: str) -> dict[str, Any]:
        whole = merge_deltas(self.feed(text), self.finish())
        msg: dict[str, Any] = {"role": "assistant"}
        content = whole.get("content", "")
        reasoning = whole.get("reasoning_content", "")
        msg["content"] = content if content or not self.calls else None
        if self.setup.reasoning:
            msg["reasoning_content"] = reasoning or None
        if self.calls:
            msg["tool_calls"] = [c.to_openai() for c in self.calls]
        return msg

    # ---- streamed ------------------------------------------------------------------------
    def feed(self, text: str) -> dict[str, Any]:
        """The delta for new output ``text``: reasoning_content, content, tool_calls (what is
        decided so far; text that may still turn into a marker is held back)."""
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        return self._answer(reasoning, text if self._raw_tools else content, final=False)

    def finish(self) -> dict[str, Any]:
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        return self._answer(reasoning, "" if self._raw_tools else content, final=True)

    @property
    def _raw_tools(self) -> bool:
        return self._tools is not None and TOOL_PARSERS[self.setup.tool_parser].whole_output

    def _answer(self, reasoning: str, content: str, final: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        calls: list[ToolCall] = []
        if self.setup.forced:
            self._forced_text += content
            content = ""
            if final:
                try:
                    calls = calls_from_forced_output(
                        self._forced_text, self.setup.tools, self.setup.tool_choice
                    )
                except ValueError:  # cut short (max_tokens): the text is all there is
                    content = self._forced_text
        elif self._tools is not None:
            content, calls = self._tools.feed(content)
            if final:
                more, last = self._tools.finish()
                content, calls = content + more, calls + last
        if content:
            delta["content"] = content
        if calls:
            first = len(self.calls)
            self.calls += calls
            delta["tool_calls"] = [
                {"index": first + k, **c.to_openai()} for k, c in enumerate(calls)
            ]
        return delta

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        """OpenAI's ``tool_calls`` when the choice ended by calling tools."""
        return "tool_calls" if reason == "stop" and self.calls else reason
