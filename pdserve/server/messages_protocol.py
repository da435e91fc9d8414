"""The Messages API's request body (typed, with the JSON Schemas /openapi.json publishes) and
its mapping to a chat request (``server/messages_api.py`` serves it)."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Optional

import msgspec

from pdserve.engine.request import INT64_MAX, INT64_MIN, MAX_TEMPERATURE
from pdserve.server.chat_output import THINKING_SWITCH
from pdserve.server.errors import bad_request
from pdserve.server.openai_protocol import ChatRequest, ModelName, PDBody, TopK
from pdserve.server.tokenizer_manager import TokenizerManager

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


def _image_part(block: dict[str, Any], at: str) -> dict[str, Any]:
    """An image block as chat's ``image_url`` part (a base64 source as a data URL)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad_request(f"{at}.source: must be an object")
    if source.get("type") == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise bad_request(f"{at}.source: a base64 source needs a media_type and data")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise bad_request(f"{at}.source.type: must be 'base64' or 'url'")


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
            elif kind == "image" and role == "user":
                text.append(_image_part(block, at))
            elif kind in ("image", "document"):
                raise bad_request(f"{at}: {kind} blocks are not supported here")
            else:
                raise bad_request(f"{at}: a {kind!r} block cannot be in a {role} message")
        if role == "user" and not text and out and out[-1]["role"] == "tool":
            continue  # a turn of tool results only
        content: Any = "".join(text) if all(isinstance(t, str) for t in text) else text
        if not isinstance(content, str):  # with images: chat's parts (openai_protocol.py)
            content = [{"type": "text", "text": t} if isinstance(t, str) else t for t in text]
        msg: dict[str, Any] = {"role": role, "content": content}
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
