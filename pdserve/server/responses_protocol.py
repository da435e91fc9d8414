"""The Responses API's request body (typed, with the JSON Schemas /openapi.json publishes) and
its mapping to a chat request (``server/responses_api.py`` serves it)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

import msgspec

from pdserve.engine.request import INT64_MAX, INT64_MIN, MAX_TEMPERATURE
from pdserve.server.errors import bad_request
from pdserve.server.openai_protocol import ChatRequest, ModelName, PDBody, TopK

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


_TEXT = {"type": "string"}
_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"enum": ["input_text", "output_text"]}, "text": _TEXT},
}
_CONTENT = {"anyOf": [_TEXT, {"type": "array", "items": _PART}]}
_MESSAGE_ITEM = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "type": {"const": "message"},
        "role": {"enum": list(_ROLES)},
        "content": _CONTENT,
    },
}
_CALL_ITEM = {
    "type": "object",
    "required": ["type", "call_id", "name", "arguments"],
    "properties": {
        "type": {"const": "function_call"},
        "call_id": _TEXT,
        "name": _TEXT,
        # the arguments object as JSON text, as the model wrote it
        "arguments": {"type": "string", "contentMediaType": "application/json"},
    },
}
_OUTPUT_ITEM = {
    "type": "object",
    "required": ["type", "call_id", "output"],
    "properties": {
        "type": {"const": "function_call_output"},
        "call_id": _TEXT,
        "output": _CONTENT,
    },
}
_REASONING_ITEM = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"const": "reasoning"},
        "content": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "text"],
                "properties": {"type": {"const": "reasoning_text"}, "text": _TEXT},
            },
        },
    },
}
INPUT_SCHEMA = {
    "anyOf": [
        _TEXT,
        {
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": [_MESSAGE_ITEM, _CALL_ITEM, _OUTPUT_ITEM, _REASONING_ITEM]},
            # a conversation needs a turn that is not the instructions
            "contains": {
                "required": ["role"],
                "properties": {"role": {"enum": ["user", "assistant"]}},
            },
        },
    ]
}
TOOLS_SCHEMA = {
    "type": ["array", "null"],
    "items": {
        "type": "object",
        "required": ["type", "name"],
        "properties": {
            "type": {"const": "function"},
            "name": {"type": "string", "pattern": "^[a-zA-Z0-9_.-]{1,64}$"},
            "description": _TEXT,
            "parameters": {"type": "object"},
            "strict": {"type": ["boolean", "null"]},
        },
    },
}
TOOL_CHOICE_SCHEMA = {
    "anyOf": [
        {"type": "null"},
        {"enum": ["auto", "none", "required"]},
        {
            "type": "object",
            "required": ["type", "name"],
            "properties": {
                "type": {"const": "function"},
                "name": {"type": "string", "minLength": 1},
            },
        },
    ]
}
TEXT_SCHEMA = {
    "type": ["object", "null"],
    "properties": {
        "format": {
            "anyOf": [
                {
                    "type": "object",
                    "required": ["type"],
                    "properties": {"type": {"enum": ["text", "json_object"]}},
                },
                {
                    "type": "object",
                    "required": ["type", "schema"],
                    "properties": {
                        "type": {"const": "json_schema"},
                        "name": _TEXT,
                        "schema": {"type": "object"},
                        "strict": {"type": ["boolean", "null"]},
                    },
                },
            ]
        }
    },
}
Temperature = Annotated[float, msgspec.Meta(ge=0, le=MAX_TEMPERATURE)]
Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]
Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]


class ResponsesRequest(PDBody):
    REQUIRED: ClassVar[tuple[str, ...]] = ("input",)

    input: Annotated[
        Any,
        msgspec.Meta(
            description="a user message's text, or a list of input items",
            extra_json_schema=INPUT_SCHEMA,
        ),
    ] = None
    model: ModelName = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[Count] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[Annotated[float, msgspec.Meta(gt=0, le=1)]] = None
    top_k: TopK = None
    min_p: Optional[Annotated[float, msgspec.Meta(ge=0, le=1)]] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    repetition_penalty: Optional[Annotated[float, msgspec.Meta(ge=1e-6, le=1e6)]] = None
    seed: Optional[Int64] = None
    stop: Optional[
        Union[
            Annotated[str, msgspec.Meta(min_length=1)],
            list[Annotated[str, msgspec.Meta(min_length=1)]],
        ]
    ] = None
    tools: Annotated[Any, msgspec.Meta(extra_json_schema=TOOLS_SCHEMA)] = None
    tool_choice: Annotated[Any, msgspec.Meta(extra_json_schema=TOOL_CHOICE_SCHEMA)] = None
    parallel_tool_calls: bool = True
    previous_response_id: Optional[str] = None
    # set by a router that expanded previous_response_id into the input (echoed only)
    expanded_from_response_id: Optional[str] = None
    store: bool = True
    stream: bool = False
    background: Literal[False] = False
    reasoning: Optional[dict[str, Any]] = None
    text: Annotated[Any, msgspec.Meta(extra_json_schema=TEXT_SCHEMA)] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    # no truncation of a conversation longer than the context: it is refused (400) instead
    truncation: Optional[Literal["disabled"]] = None
    priority: Optional[Int64] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # extra output to include: "message.output_text.logprobs" (the sampled tokens' logprobs on
    # the output_text part); the others name outputs this server never makes and are ignored
    include: Optional[list[str]] = None
    top_logprobs: Optional[Annotated[int, msgspec.Meta(ge=0, le=20)]] = None

    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())


LOGPROBS_INCLUDE = "message.output_text.logprobs"


# ---- request -> chat -----------------------------------------------------------------------
def _text_of(content: Any, where: str, images: bool = False) -> Any:
    """The text of ``content``; with ``images`` (a user's message), chat's parts where it holds an
    ``input_image``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: must be a string or a list of content parts")
    texts: list[Any] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images:  # chat's image_url part (openai_protocol.py)
            url = part.get("image_url")
            if not isinstance(url, str):
                raise bad_request(f"{where}[{j}].image_url: must be a string (a data: URL)")
            texts.append({"type": "image_url", "image_url": {"url": url}})
            continue
        if kind in ("input_file", "input_audio"):
            raise bad_request(f"{where}[{j}]: {kind} is not supported; this model reads text")
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}]: must be a text part ({', '.join(_TEXT_PARTS)})")
        texts.append(part["text"])
    if all(isinstance(t, str) for t in texts):
        return "".join(texts)
    return [{"type": "text", "text": t} if isinstance(t, str) else t for t in texts]


def chat_messages(instructions: Optional[str], items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages (a 400 names the item that cannot be one)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    reasoning = None  # a reasoning item waits for the assistant turn it belongs to

    def assistant() -> dict[str, Any]:
        nonlocal reasoning
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant" or "_closed" in last:
            last = {"role": "assistant", "content": ""}
            messages.append(last)
        if reasoning is not None:
            last["reasoning_content"] = reasoning
            reasoning = None
        return last

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise bad_request(f"{where}.role: must be one of {', '.join(_ROLES)}")
            text = _text_of(item.get("content"), f"{where}.content", images=role == "user")
            if role == "assistant":
                msg = assistant()
                msg["content"] += text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "")
            if not isinstance(name, str) or not isinstance(args, str):
                raise bad_request(f"{where}: a function_call needs a string name and arguments")
            call_id = item.get("call_id") or item.get("id") or f"call_{uuid.uuid4().hex[:24]}"
            msg = assistant()
            msg.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            )
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}.call_id: must be a string")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = _text_of(parts, f"{where}.content")
        else:
            raise bad_request(
                f"{where}.type: {kind!r} is not supported (message, function_call, "
                "function_call_output, reasoning)"
            )
    if not messages or all(m["role"] == "system" for m in messages):
        raise bad_request("input: must hold at least one message")
    return messages


def _chat_tools(tools: Any) -> Optional[list[dict[str, Any]]]:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools: must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools[{i}]: only function tools are served, got {kind!r}")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: Optional[dict[str, Any]]) -> Any:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    return {"type": fmt.get("type")}


def _template_kwargs(req: ResponsesRequest) -> Optional[dict[str, Any]]:
    """``reasoning.effort`` reaches the template as ``reasoning_effort`` (the name GPT-OSS's
    template reads), unless chat_template_kwargs set it."""
    effort = (req.reasoning or {}).get("effort")
    if effort is None:
        return req.chat_template_kwargs
    return {"reasoning_effort": effort, **(req.chat_template_kwargs or {})}


def to_chat(req: ResponsesRequest, items: list[Any]) -> ChatRequest:
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req.instructions, items),
        "max_completion_tokens": req.max_output_tokens,
        "tools": _chat_tools(req.tools),
        "tool_choice": _chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text),
        "stream": req.stream,
        "priority": req.priority,
        "chat_template_kwargs": _template_kwargs(req),
    }
    if req.wants_logprobs():
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    for key in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
        "stop",
        *PDBody.__struct_fields__,
    ):
        body[key] = getattr(req, key)
    try:
        return msgspec.convert({k: v for k, v in body.items() if v is not None}, ChatRequest)
    except msgspec.ValidationError as e:
        raise bad_request(str(e)) from None
