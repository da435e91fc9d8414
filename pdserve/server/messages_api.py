"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request becomes a chat request (``openai_api.start_chat``): ``system`` a system message, text
blocks text, ``tool_use`` blocks an assistant turn's tool calls, ``tool_result`` blocks tool
messages, ``thinking`` blocks the assistant turn's ``reasoning_content``; tools with their
``input_schema`` are chat's function tools, and ``tool_choice`` ``auto`` / ``any`` / ``tool`` /
``none`` chat's ``auto`` / ``required`` / a named function / ``none``. ``thinking: {"type":
"disabled"}`` turns a model's thinking off where its template has the switch. The answer's
content is a ``thinking`` block (with ``--reasoning-parser``), a ``text`` block and a
``tool_use`` block per call; ``stop_reason`` is ``end_turn``, ``max_tokens``, ``stop_sequence`` or
``tool_use``. A stream sends Anthropic's events (``message_start``, ``content_block_start`` /
``_delta`` / ``_stop``, ``message_delta``, ``message_stop``; ``error`` on a failure). Errors are
Anthropic's ``{"type": "error", "error": {...}}``. Through PD, prefill answers with the whole
message and decode streams, as for chat.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, AsyncIterator, ClassVar, Optional

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pdserve.engine.request import INT64_MAX, INT64_MIN, MAX_TEMPERATURE
from pdserve.server import http_util
from pdserve.server.chat_output import THINKING_SWITCH
from pdserve.server.errors import APIError, bad_request
from pdserve.server.openai_api import chat_deltas, chat_prompt, start_chat, whole_delta
from pdserve.server.openai_protocol import ChatRequest, ModelName, PDBody, TopK, matched_stop
from pdserve.server.tokenizer_manager import ReqState, TokenizerManager

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


_TEXT = {"type": "string"}
_TEXT_BLOCK = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": _TEXT},
}
_TOOL_USE = {
    "type": "object",
    "required": ["type", "id", "name", "input"],
    "properties": {
        "type": {"const": "tool_use"},
        "id": _TEXT,
        "name": _TEXT,
        "input": {"type": "object"},
    },
}
_TOOL_RESULT = {
    "type": "object",
    "required": ["type", "tool_use_id"],
    "properties": {
        "type": {"const": "tool_result"},
        "tool_use_id": _TEXT,
        "content": {"anyOf": [_TEXT, {"type": "array", "items": _TEXT_BLOCK}]},
        "is_error": {"type": "boolean"},
    },
}
_THINKING = {
    "type": "object",
    "required": ["type", "thinking"],
    "properties": {"type": {"const": "thinking"}, "thinking": _TEXT, "signature": _TEXT},
}


def _turn(role: str, blocks: list) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"const": role},
            "content": {"anyOf": [_TEXT, {"type": "array", "items": {"anyOf": blocks}}]},
        },
    }


MESSAGES_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "items": {
        "anyOf": [
            _turn("user", [_TEXT_BLOCK, _TOOL_RESULT]),
            _turn("assistant", [_TEXT_BLOCK, _TOOL_USE, _THINKING]),
        ]
    },
}
TOOLS_SCHEMA = {
    "type": ["array", "null"],
    "items": {
        "type": "object",
        "required": ["name"],
        "properties": {
            "type": {"enum": ["custom", None]},
            "name": {"type": "string", "pattern": "^[a-zA-Z0-9_.-]{1,64}$"},
            "description": _TEXT,
            "input_schema": {"type": "object"},
        },
    },
}
TOOL_CHOICE_SCHEMA = {
    "anyOf": [
        {"type": "null"},
        {
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {"enum": ["auto", "any", "none"]},
                "disable_parallel_tool_use": {"type": "boolean"},
            },
        },
        {
            "type": "object",
            "required": ["type", "name"],
            "properties": {
                "type": {"const": "tool"},
                "name": {"type": "string", "minLength": 1},
                "disable_parallel_tool_use": {"type": "boolean"},
            },
        },
    ]
}
SYSTEM_SCHEMA = {"anyOf": [{"type": "null"}, _TEXT, {"type": "array", "items": _TEXT_BLOCK}]}


class MessagesRequest(PDBody):
    REQUIRED: ClassVar[tuple[str, ...]] = ("messages", "max_tokens")

    messages: Annotated[
        Any,
        msgspec.Meta(
            description="the conversation: user and assistant turns, a string or content blocks",
            extra_json_schema=MESSAGES_SCHEMA,
        ),
    ] = None
    max_tokens: Optional[Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]] = None
    model: ModelName = None
    system: Annotated[Any, msgspec.Meta(extra_json_schema=SYSTEM_SCHEMA)] = None
    stop_sequences: Optional[list[Annotated[str, msgspec.Meta(min_length=1)]]] = None
    temperature: Optional[Annotated[float, msgspec.Meta(ge=0, le=MAX_TEMPERATURE)]] = None
    top_p: Optional[Annotated[float, msgspec.Meta(gt=0, le=1)]] = None
    top_k: TopK = None
    tools: Annotated[Any, msgspec.Meta(extra_json_schema=TOOLS_SCHEMA)] = None
    tool_choice: Annotated[Any, msgspec.Meta(extra_json_schema=TOOL_CHOICE_SCHEMA)] = None
    thinking: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, Any]] = None
    stream: bool = False
    priority: Optional[Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


def error_body(err: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(
        err.status, "api_error" if err.status >= 500 else "invalid_request_error"
    )
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_response(err: APIError) -> Response:
    response = http_util.json_response(error_body(err), err.status)
    if err.status == 429:
        response.headers["Retry-After"] = err.response().headers["Retry-After"]
    return response


# ---- request -> chat -----------------------------------------------------------------------
def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}: must be a string or a list of content blocks")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_request(f"{where}[{j}]: must be a content block with a 'type'")
    return content


def _text(blocks: Any, where: str) -> str:
    texts = []
    for j, block in enumerate(_blocks(blocks, where)):
        if block["type"] != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{where}[{j}]: must be a text block, got {block['type']!r}")
        texts.append(block["text"])
    return "".join(texts)


def chat_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: must be a non-empty list")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role: must be 'user' or 'assistant'")
        text, calls, reasoning = [], [], []
        for j, block in enumerate(_blocks(m.get("content"), f"{where}.content")):
            at, kind = f"{where}.content[{j}]", block["type"]
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise bad_request(f"{at}.text: must be a string")
                text.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("id"), str):
                    raise bad_request(f"{at}: a tool_use block needs a string id and name")
                args = json.dumps(block.get("input") or {}, ensure_ascii=False)
                calls.append(
                    {
                        "id": block["id"],
                        "type": "function",
                        "function": {"name": block["name"], "arguments": args},
                    }
                )
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise bad_request(f"{at}.tool_use_id: must be a string")
                result = block.get("content", "")
                body = result if isinstance(result, str) else _text(result, f"{at}.content")
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": body})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                reasoning.append(block.get("thinking") or "")
            elif kind in ("image", "document"):
                raise bad_request(f"{at}: {kind} blocks are not supported; this model reads text")
            else:
                raise bad_request(f"{at}: a {kind!r} block cannot be in a {role} message")
        if role == "user" and not text and out and out[-1]["role"] == "tool":
            continue  # a turn of tool results only
        msg: dict[str, Any] = {"role": role, "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        out.append(msg)
    return out


def _tools(tools: Any) -> Optional[list[dict[str, Any]]]:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools: must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{i}]: must be an object with a string 'name'")
        if tool.get("type") not in (None, "custom"):
            raise bad_request(f"tools[{i}]: only client tools are served, got {tool['type']!r}")
        fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if "description" in tool:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool]:
    """Chat's tool_choice and parallel_tool_calls."""
    if choice is None:
        return None, True
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise bad_request("tool_choice: must be an object of type auto, any, tool or none")
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice["type"]
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice.name: must name a tool")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def to_chat(tm: TokenizerManager, req: MessagesRequest) -> ChatRequest:
    if req.messages is None:
        raise bad_request("messages: is required")
    if req.max_tokens is None:
        raise bad_request("max_tokens: is required")
    choice, parallel = _tool_choice(req.tool_choice)
    kwargs = dict(req.chat_template_kwargs or {})
    parser = tm.server_args.reasoning_parser
    if isinstance(req.thinking, dict) and parser in THINKING_SWITCH:
        key = THINKING_SWITCH[parser][0]
        kwargs.setdefault(key, req.thinking.get("type") == "enabled")
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req.system, req.messages),
        "max_tokens": req.max_tokens,
        "stop": req.stop_sequences,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "tools": _tools(req.tools),
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        # a last assistant turn is the start of the answer, which the model continues
        "continue_final_message": req.messages[-1].get("role") == "assistant",
        "stream": req.stream,
        "priority": req.priority,
        "chat_template_kwargs": kwargs or None,
        **{k: getattr(req, k) for k in PDBody.__struct_fields__},
    }
    try:
        return msgspec.convert({k: v for k, v in body.items() if v is not None}, ChatRequest)
    except msgspec.ValidationError as e:
        raise bad_request(str(e)) from None


# ---- answer ------------------------------------------------------------------------------------
def _stop(state: ReqState, stops: Optional[list[str]], called: bool) -> tuple[str, Optional[str]]:
    fr = state.finish_reason or {}
    if fr.get("type") == "length":
        return "max_tokens", None
    matched = matched_stop(fr)
    if isinstance(matched, str) and stops and matched in stops:
        return "stop_sequence", matched
    return ("tool_use" if called else "end_turn"), None


def _usage(state: ReqState) -> dict[str, Any]:
    return {
        "input_tokens": state.prompt_tokens - state.cached_tokens,
        "cache_read_input_tokens": state.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": len(state.output_ids),
    }


class Blocks:
    """A message's content blocks as they grow from chat deltas, and the events that tell it."""

    def __init__(self, emit):
        self.blocks: list[dict[str, Any]] = []
        self.emit = emit
        self.open: Optional[str] = None  # the type of the block still open

    def feed(self, delta: dict[str, Any]) -> None:
        if delta.get("reasoning_content"):
            self._text("thinking", delta["reasoning_content"])
        if delta.get("content"):
            self._text("text", delta["content"])
        for call in delta.get("tool_calls", []):
            self.close()
            fn = call["function"]
            try:
                args = json.loads(fn["arguments"] or "{}")
            except ValueError:
                args = {}
            block = {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": args}
            index = len(self.blocks)
            self.blocks.append(block)
            self.emit("content_block_start", index=index, content_block={**block, "input": {}})
            partial = json.dumps(args, ensure_ascii=False)
            self.emit(
                "content_block_delta",
                index=index,
                delta={"type": "input_json_delta", "partial_json": partial},
            )
            self.emit("content_block_stop", index=index)

    def _text(self, kind: str, text: str) -> None:
        key = "thinking" if kind == "thinking" else "text"
        if self.open != kind:
            self.close()
            start = {"type": kind, key: ""}
            if kind == "thinking":
                start["signature"] = ""
            self.blocks.append(dict(start))
            self.open = kind
            self.emit("content_block_start", index=len(self.blocks) - 1, content_block=start)
        self.blocks[-1][key] += text
        self.emit(
            "content_block_delta",
            index=len(self.blocks) - 1,
            delta={"type": f"{kind}_delta", key: text},
        )

    def close(self) -> None:
        if self.open is not None:
            self.open = None
            self.emit("content_block_stop", index=len(self.blocks) - 1)

    @property
    def called(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks)


def _message(
    tm: TokenizerManager, msg_id: str, blocks: list, stop: tuple, usage: dict
) -> dict[str, Any]:
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": tm.server_args.served_model_name,
        "content": blocks,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }


async def create(request: Request, tm: TokenizerManager) -> Response:
    try:
        req = await http_util.read_body(request, tm.server_args.max_body_bytes, MessagesRequest)
        run = start_chat(tm, to_chat(tm, req))
    except APIError as e:
        return error_response(e)
    msg_id = f"msg_{uuid.uuid4().hex}"
    if run.stream:
        return http_util.sse_response(tm, run.states, _events(tm, req, run, msg_id))
    try:
        await http_util.unless_disconnected(request, http_util.wait_all(tm, run.states))
    except APIError as e:
        return error_response(e)
    blocks = Blocks(lambda *a, **k: None)
    blocks.feed(whole_delta(run))
    state = run.states[0]
    stop = _stop(state, req.stop_sequences, blocks.called)
    return http_util.json_response(_message(tm, msg_id, blocks.blocks, stop, _usage(state)))


async def _events(
    tm: TokenizerManager, req: MessagesRequest, run, msg_id: str
) -> AsyncIterator[bytes]:
    events: list[bytes] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append(http_util.sse_named_event(kind, {"type": kind, **fields}))

    state = run.states[0]
    blocks = Blocks(emit)
    started = False
    try:
        async for state, delta in chat_deltas(tm, run):
            if not started:  # held back until decode has its KV: a failure before is retried
                started = True
                usage = {**_usage(state), "output_tokens": 0}
                emit("message_start", message=_message(tm, msg_id, [], (None, None), usage))
            blocks.feed(delta)
            if events:
                yield b"".join(events)
                events.clear()
    except APIError as err:
        # with its status as "code": a router retries an error before any output
        emit("error", error={**error_body(err)["error"], "code": err.status})
        yield b"".join(events)
        return
    blocks.close()
    reason, sequence = _stop(state, req.stop_sequences, blocks.called)
    emit(
        "message_delta",
        delta={"stop_reason": reason, "stop_sequence": sequence},
        usage={"output_tokens": len(state.output_ids)},
    )
    emit("message_stop")
    yield b"".join(events)


async def count_tokens(request: Request, tm: TokenizerManager) -> Response:
    """The prompt's token count, as ``POST /v1/messages/count_tokens`` answers it."""
    try:
        req = await http_util.read_body(request, tm.server_args.max_body_bytes, MessagesRequest)
        if req.max_tokens is None:
            req.max_tokens = 1  # count_tokens does not take it
        _, ids = chat_prompt(tm, to_chat(tm, req))
    except APIError as e:
        return error_response(e)
    return http_util.json_response({"input_tokens": len(ids)})
