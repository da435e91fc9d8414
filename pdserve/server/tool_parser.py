"""Tool calls for the OpenAI ``tools`` API: parsing them out of model output
(``--tool-call-parser``; the request side is ``server/tool_choice.py``).

Each output format is a resumable scanner (``ToolParser._scan``): over a text it returns the
content and calls it has decided, the position up to which it decided, and a small state to resume
from there. ``parse`` runs it once over the whole text; ``ToolStream`` runs it over what it has
buffered and keeps only the undecided tail (a partial start marker, an unterminated call), so for
any split of a text into deltas the stream yields the same content and calls as ``parse``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")
_NO_JSON = object()


@dataclass
class ToolCall:
    """One function call of the model; ``arguments`` is the JSON text of the arguments object."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class _Scan:
    content: str  # decided content with the markers removed, not yet stripped
    calls: list[ToolCall]
    consumed: int  # text[:consumed] is decided; the rest is scanned again once more text arrives
    state: Any = None  # where text[consumed:] starts (None: outside any call or message)


def _find_first(text: str, markers, pos: int) -> tuple[int, str]:
    """(index, marker) of the earliest marker in text[pos:], or (-1, "")."""
    hits = [(i, marker) for marker in markers if (i := text.find(marker, pos)) >= 0]
    return min(hits) if hits else (-1, "")


def _hold_index(text: str, pos: int, markers, final: bool = False) -> int:
    """The smallest index >= pos from which text's tail is a proper prefix of a marker (it may yet
    become one), else len(text), always when ``final``. Text before it cannot become a marker."""
    if final:
        return len(text)
    longest = max(len(m) for m in markers)
    for k in range(max(pos, len(text) - longest + 1), len(text)):
        if any(m.startswith(text[k:]) for m in markers):
            return k
    return len(text)


def _decode_json(text: str, pos: int = 0) -> tuple[Any, int]:
    """(value, end) of the JSON value at text[pos:] after whitespace, or (_NO_JSON, -1)."""
    try:
        return _DECODER.raw_decode(text, _WS.match(text, pos).end())
    except ValueError:
        return _NO_JSON, -1


def _whole_json(text: str) -> Any:
    """The value when text is exactly one JSON value (whitespace around allowed), else _NO_JSON."""
    value, end = _decode_json(text)
    return value if end >= 0 and not text[end:].strip() else _NO_JSON


class ToolStream:
    """Incremental ``ToolParser.parse``: ``feed`` every text delta, then ``finish`` once. Content is
    returned as soon as it cannot be part of a call, calls once complete. The content is stripped
    like ``parse``'s: trailing whitespace waits until something follows it."""

    def __init__(self, parser: ToolParser):
        self._parser, self._buf, self._state = parser, "", None
        self._started, self._pending = False, ""

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, list[ToolCall]]:
        scan = self._parser._scan(self._buf, self._state, final)
        self._buf, self._state = self._buf[scan.consumed :], scan.state
        content = scan.content if self._started else scan.content.lstrip()
        if content:
            content = self._pending + content
            out = content.rstrip()
            self._pending = content[len(out) :]
            self._started, content = self._started or bool(out), out
        return content, scan.calls


class ToolParser:
    """Finds the tool calls of one output format in generated text.

    Built per request from its validated ``tools``; a call naming a function outside them, or whose
    arguments are not a JSON object, is not a call and its text stays in the content. Parsing never
    raises. Subclasses implement ``_scan(text, state, final)``: decide as much of ``text`` as
    possible (everything when ``final``), holding back at ``consumed`` whatever more text could
    change, e.g. the tail matching the beginning of one of ``start_markers``.
    """

    start_markers: tuple[str, ...] = ()
    special_markers = False  # the markers are special tokens: the text must keep them
    whole_output = False  # reads the whole output (its channels), not the reasoning's content

    def __init__(self, tools: Optional[list[dict]]):
        self.tool_names: set[str] = {t["function"]["name"] for t in tools or ()}

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content outside the calls, stripped; the calls in order)."""
        scan = self._scan(text, None, final=True)
        return scan.content.strip(), scan.calls

    def stream(self) -> ToolStream:
        return ToolStream(self)

    def _scan(self, text: str, state: Any, final: bool) -> _Scan:
        raise NotImplementedError

    def _call(self, name: Any, arguments: Any) -> Optional[ToolCall]:
        if isinstance(arguments, str):  # some models encode the arguments object as a string
            arguments = _whole_json(arguments)
        if not (isinstance(name, str) and name in self.tool_names and isinstance(arguments, dict)):
            return None
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))

    def _call_from_obj(self, obj: Any, need_arguments: bool = False) -> Optional[ToolCall]:
        """A call from ``{"name": ..., "arguments"|"parameters": {...}}``."""
        if not isinstance(obj, dict):
            return None
        for key in ("arguments", "parameters"):
            if key in obj:
                return self._call(obj.get("name"), obj[key])
        return None if need_arguments else self._call(obj.get("name"), {})


class _MarkedToolParser(ToolParser):
    """Calls begin at one of ``start_markers`` anywhere in the text; the text around them is
    content. ``_calls_at`` reads what a marker begins: (calls, end), calls None when the text there
    is not valid calls (it then stays in the content verbatim), or None while undecided."""

    def _calls_at(self, text: str, begin: int, pos: int, final: bool):
        raise NotImplementedError

    def _scan(self, text: str, state: Any, final: bool) -> _Scan:
        content, calls, pos = [], [], 0
        while True:
            i, marker = _find_first(text, self.start_markers, pos)
            if i < 0:
                hold = _hold_index(text, pos, self.start_markers, final)
                content.append(text[pos:hold])
                return _Scan("".join(content), calls, hold)
            content.append(text[pos:i])
            found = self._calls_at(text, i, i + len(marker), final)
            if found is None:
                return _Scan("".join(content), calls, i)
            new_calls, pos = found
            if new_calls is None:
                content.append(text[i:pos])
            else:
                calls.extend(new_calls)


class _BlockToolParser(_MarkedToolParser):
    """Calls are ``block_start BODY block_end`` blocks; the other ``start_markers`` (section
    brackets) are dropped. An unterminated block at the end is a call when its body is complete."""

    block_start = block_end = ""

    def _body_call(self, body: str) -> Optional[ToolCall]:
        raise NotImplementedError

    def _calls_at(self, text: str, begin: int, pos: int, final: bool):
        if text[begin:pos] != self.block_start:
            return [], pos
        j = text.find(self.block_end, pos)
        if j < 0 and not final:
            return None
        if j < 0:  # cut off at the end of the generation, perhaps inside the end marker
            body, end = text[pos : _hold_index(text, pos, (self.block_end,))], len(text)
        else:
            body, end = text[pos:j], j + len(self.block_end)
        call = self._body_call(body)
        return ([call] if call else None), end


class QwenToolParser(_BlockToolParser):
    """Qwen2.5 / Qwen3 / Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    block_start, block_end = "<tool_call>", "</tool_call>"
    start_markers = (block_start,)

    def _body_call(self, body: str) -> Optional[ToolCall]:
        return self._call_from_obj(_whole_json(body))


class DeepSeekV3ToolParser(_BlockToolParser):
    """DeepSeek-V3 (``function<｜tool▁sep｜>NAME`` + a fenced json block) and DeepSeek-V3.1
    (``NAME<｜tool▁sep｜>{...}``) calls inside ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``."""

    block_start, block_end = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    start_markers = (block_start, "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    special_markers = True
    _V3 = re.compile(r"\s*function\s*<｜tool▁sep｜>\s*([^\s`]+)\s*```(?:json)?")
    _V31 = re.compile(r"\s*([^\s<`]+)\s*<｜tool▁sep｜>")

    def _body_call(self, body: str) -> Optional[ToolCall]:
        for pattern, allowed_tail in ((self._V3, "```"), (self._V31, "")):
            m = pattern.match(body)
            if m:
                value, end = _decode_json(body, m.end())
                if end >= 0 and allowed_tail.startswith(body[end:].strip()):
                    return self._call(m.group(1), value)
        return None


class MistralToolParser(_MarkedToolParser):
    """Mistral: ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}`` objects, or the
    newer ``[TOOL_CALLS]NAME[ARGS]{...}``, repeated. Text before the marker is content."""

    start_markers = ("[TOOL_CALLS]",)
    special_markers = True
    _NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")

    def _calls_at(self, text: str, begin: int, pos: int, final: bool):
        named = self._NAMED.match(text, pos)
        value, end = _NO_JSON, -1
        if named:
            value, end = _decode_json(text, named.end())
        elif text[_WS.match(text, pos).end() :][:1] in ("[", "{"):  # a bare word or number
            value, end = _decode_json(text, pos)  # could still grow: wait for the end
        if end < 0:  # no complete JSON object or array yet
            return (None, len(text)) if final else None
        if named:
            calls = [self._call(named.group(1), value)]
        else:
            items = value if isinstance(value, list) else [value]
            calls = [self._call_from_obj(item) for item in items]
        return (None if not calls or None in calls else calls), end


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: the whole output (after an optional ``<|python_tag|>``) is one or more
    ``{"name": ..., "parameters"|"arguments": {...}}`` separated by ``;`` or whitespace; any other
    output is content. Output that may be calls is held back until the end."""

    PYTHON_TAG = "<|python_tag|>"
    start_markers = (PYTHON_TAG, "{")

    def _scan(self, text: str, state: Any, final: bool) -> _Scan:
        body = text.lstrip()
        if state == "content" or not (
            body.startswith(self.start_markers) or self.PYTHON_TAG.startswith(body)
        ):
            return _Scan(text, [], len(text), "content")
        if not final:
            return _Scan("", [], 0)
        calls = self._calls(body.removeprefix(self.PYTHON_TAG))
        return _Scan("", calls, len(text)) if calls else _Scan(text, [], len(text))

    def _calls(self, body: str) -> list[ToolCall]:
        calls, pos = [], _WS.match(body).end()
        while pos < len(body):
            value, end = _decode_json(body, pos)
            call = self._call_from_obj(value, need_arguments=True) if end >= 0 else None
            if call is None:
                return []
            calls.append(call)
            pos = _WS.match(body, end).end()
            if body.startswith(";", pos):
                pos = _WS.match(body, pos + 1).end()
        return calls


class GptOssToolParser(ToolParser):
    """OpenAI harmony (gpt-oss). A message is ``[<|start|>ROLE] <|channel|>CHANNEL [to=RECIPIENT]
    [<|constrain|>json] <|message|>BODY`` ended by ``<|end|>``, ``<|call|>`` or ``<|return|>``.
    Calls are messages to ``functions.NAME``; content is the ``final`` channel (and text outside
    any message); ``analysis`` and other messages are dropped."""

    START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
    END, CALL, RETURN, CONSTRAIN = "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"
    start_markers = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)
    special_markers = whole_output = True
    BODY_ENDS = (END, CALL, RETURN, START, CHANNEL)  # the last two: a message missing its end
    _RECIPIENT = re.compile(r"\bto=([^\s<]+)")
    _CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")

    def _scan(self, text: str, state: Any, final: bool) -> _Scan:
        content, calls, pos = [], [], 0
        while True:
            if state in ("final", "drop"):  # inside a message body
                j, marker = _find_first(text, self.BODY_ENDS, pos)
                stop = j if j >= 0 else _hold_index(text, pos, self.BODY_ENDS, final)
                if state == "final":
                    content.append(text[pos:stop])
                if j < 0:
                    return _Scan("".join(content), calls, stop, state)
                pos, state = j + (len(marker) if marker in self.BODY_ENDS[:3] else 0), None
                continue
            i, marker = _find_first(text, self.start_markers, pos)
            if i < 0:
                hold = _hold_index(text, pos, self.start_markers, final)
                content.append(text[pos:hold])
                return _Scan("".join(content), calls, hold)
            content.append(text[pos:i])
            if marker not in (self.START, self.CHANNEL, self.MESSAGE):
                pos = i + len(marker)  # a stray end or constrain marker
                continue
            h = text.find(self.MESSAGE, i)
            if h < 0:  # header still coming; cut off at the end it is markup, not content
                return _Scan("".join(content), calls, len(text) if final else i)
            header, body_start = text[i:h], h + len(self.MESSAGE)
            recipient = self._RECIPIENT.search(header)
            if recipient is None:
                channel = self._CHANNEL_NAME.search(header)
                state = "final" if channel is None or channel.group(1) == "final" else "drop"
                pos = body_start
                continue
            j, marker = _find_first(text, self.BODY_ENDS, body_start)
            if j < 0 and not final:
                return _Scan("".join(content), calls, i)
            body = text[body_start : j if j >= 0 else len(text)]
            pos = body_start + len(body) + (len(marker) if marker in self.BODY_ENDS[:3] else 0)
            name = recipient.group(1)
            if name.startswith("functions."):  # other recipients are built-in tools: dropped
                call = self._call(name[len("functions.") :], _whole_json(body))
                if call:
                    calls.append(call)
                else:
                    content.append(body)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "llama3": Llama3JsonToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
    "qwen25": QwenToolParser,
    "qwen": QwenToolParser,
    "hermes": QwenToolParser,
    "mistral": MistralToolParser,
    "gpt-oss": GptOssToolParser,
    "openai": GptOssToolParser,
    "deepseekv3": DeepSeekV3ToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseekv31": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV3ToolParser,
}


def tool_parser(name: str, tools: Optional[list[dict]]) -> ToolParser:
    """The parser registered as ``name`` (``--tool-call-parser``) for a request's tools."""
    if name not in TOOL_PARSERS:
        raise ValueError(
            f"--tool-call-parser: unknown parser {name!r}; "
            f"choose from {', '.join(sorted(TOOL_PARSERS))}"
        )
    return TOOL_PARSERS[name](tools)
