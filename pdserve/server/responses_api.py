"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A request becomes a chat request (``openai_api.start_chat``): its ``instructions`` a system
message, its input items messages (``developer`` is ``system``; ``function_call`` items an
assistant turn's tool calls, ``function_call_output`` items tool messages, ``reasoning`` items the
next assistant turn's ``reasoning_content``), its function tools and ``tool_choice`` chat's, its
``text.format`` a ``response_format``. The answer's output items are a ``reasoning`` item (with
``--reasoning-parser``), a ``message`` with one ``output_text`` and a ``function_call`` per call.
A stream sends the Responses event types (``response.created`` ... ``response.completed``, each
with its ``sequence_number``), as ``event:`` and ``data:`` lines, without ``[DONE]``.

Stored responses (``store``, the default) are kept in memory (``pdserve/conversations.py``) for
``previous_response_id`` and ``GET``; a router in front expands ``previous_response_id`` itself
and sends ``expanded_from_response_id`` instead, which is only echoed. Through PD, prefill answers
with the whole response object (as it does for chat) and decode streams.
"""

from __future__ import annotations

import copy
import time
import uuid
from typing import Annotated, Any, AsyncIterator, ClassVar, Literal, Optional, Union

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pdserve.conversations import Conversations, UnknownResponse
from pdserve.engine.request import INT64_MAX, INT64_MIN, MAX_TEMPERATURE
from pdserve.server import http_util
from pdserve.server.errors import APIError, bad_request
from pdserve.server.openai_api import ChatRun, chat_deltas, start_chat, whole_delta
from pdserve.server.openai_protocol import ChatRequest, ModelName, PDBody, TopK
from pdserve.server.tokenizer_manager import ReqState, TokenizerManager

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
    truncation: Optional[Literal["auto", "disabled"]] = None
    priority: Optional[Int64] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


# ---- request -> chat -----------------------------------------------------------------------
def _text_of(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"{where}[{j}]: {kind} is not supported; this model reads text")
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}]: must be a text part ({', '.join(_TEXT_PARTS)})")
        texts.append(part["text"])
    return "".join(texts)


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
            text = _text_of(item.get("content"), f"{where}.content")
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
        "chat_template_kwargs": req.chat_template_kwargs,
    }
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


# ---- output items --------------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [_text_part(text)],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": _id("fc"),
        "type": "function_call",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": "completed",
    }


class Output:
    """A choice's output items as they grow from chat deltas, and the events that tell it."""

    def __init__(self, emit):
        self.items: list[dict[str, Any]] = []
        self.emit = emit  # emit(type, **fields): one stream event (or nothing, unstreamed)
        self.open: Optional[dict[str, Any]] = None
        self.reasoning_text = ""

    def feed(self, delta: dict[str, Any]) -> None:
        if delta.get("reasoning_content"):
            self.reasoning_text += delta["reasoning_content"]
            self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            self._text("message", delta["content"])
        for call in delta.get("tool_calls", []):
            self.close("completed")
            item = _call_item(call)
            index = len(self.items)
            self.items.append(item)
            self.emit(
                "response.output_item.added", output_index=index, item={**item, "arguments": ""}
            )
            self.emit(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=item["arguments"],
            )
            self.emit(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
            self.emit("response.output_item.done", output_index=index, item=item)

    def _text(self, kind: str, text: str) -> None:
        if self.open is None or self.open["type"] != kind:
            self.close("completed")
            item_id = _id("rs" if kind == "reasoning" else "msg")
            item = (
                _reasoning_item(item_id, "")
                if kind == "reasoning"
                else _message_item(item_id, "", "in_progress")
            )
            self.open = item
            self.items.append(item)
            index = len(self.items) - 1
            self.emit("response.output_item.added", output_index=index, item=copy.deepcopy(item))
            part = item["content"][0]
            if kind == "message":
                self.emit(
                    "response.content_part.added",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part=dict(part),
                )
        item = self.open
        item["content"][0]["text"] += text
        event = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra = {} if kind == "reasoning" else {"logprobs": []}
        self.emit(
            event,
            item_id=item["id"],
            output_index=len(self.items) - 1,
            content_index=0,
            delta=text,
            **extra,
        )

    def close(self, status: str) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        index = self.items.index(item)
        text = item["content"][0]["text"]
        common = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            self.emit("response.reasoning_text.done", text=text, **common)
        else:
            item["status"] = status
            self.emit("response.output_text.done", text=text, logprobs=[], **common)
            self.emit("response.content_part.done", part=dict(item["content"][0]), **common)
        self.emit("response.output_item.done", output_index=index, item=copy.deepcopy(item))


def _cut_short(state: ReqState) -> bool:
    """It ended at max_output_tokens (the response is incomplete)."""
    return (state.finish_reason or {}).get("type") == "length"


# ---- the response object ---------------------------------------------------------------------
class _Response:
    def __init__(self, tm: TokenizerManager, req: ResponsesRequest, run: ChatRun):
        self.tm = tm
        self.req = req
        self.run = run
        self.id = _id("resp")
        self.created = int(time.time())

    def body(
        self, status: str, output: list[dict[str, Any]], state: Optional[ReqState], reasoning=""
    ) -> dict[str, Any]:
        req = self.req
        incomplete = state is not None and _cut_short(state)
        if status == "completed" and incomplete:
            status = "incomplete"
        usage = None
        if state is not None and state.finished:
            out_tokens = len(state.output_ids)
            usage = {
                "input_tokens": state.prompt_tokens,
                "input_tokens_details": {"cached_tokens": state.cached_tokens},
                "output_tokens": out_tokens,
                "output_tokens_details": {
                    "reasoning_tokens": min(
                        out_tokens, len(self.tm.tokenize(reasoning)) if reasoning else 0
                    )
                },
                "total_tokens": state.prompt_tokens + out_tokens,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": self.tm.server_args.served_model_name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id or req.expanded_from_response_id,
            "reasoning": req.reasoning or {"effort": None, "summary": None},
            "store": req.store,
            "temperature": req.temperature,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": req.top_p,
            "truncation": req.truncation or "disabled",
            "usage": usage,
            "user": req.user,
        }


# ---- routes ----------------------------------------------------------------------------------
class ResponsesAPI:
    def __init__(self, tm: TokenizerManager, capacity: int):
        self.tm = tm
        self.store = Conversations(capacity)

    async def create(self, request: Request) -> Response:
        tm = self.tm
        req = await http_util.read_body(request, tm.server_args.max_body_bytes, ResponsesRequest)
        if req.input is None:
            raise bad_request("input: is required")
        if not isinstance(req.input, (str, list)):
            raise bad_request("input: must be a string or a list of input items")
        try:
            _, items = self.store.expand(msgspec.structs.asdict(req))
        except UnknownResponse as e:
            raise APIError(404, e.message) from None
        run = start_chat(tm, to_chat(req, items))
        resp = _Response(tm, req, run)
        if run.stream:
            return http_util.sse_response(tm, run.states, self._events(resp, items))
        await http_util.unless_disconnected(request, http_util.wait_all(tm, run.states))
        out = Output(lambda *a, **k: None)
        out.feed(whole_delta(run))
        return http_util.json_response(self._finish(resp, out, run.states[0], items))

    def _finish(
        self, resp: _Response, out: Output, state: ReqState, items: list[Any]
    ) -> dict[str, Any]:
        """The finished response (its open item closed), stored if asked."""
        out.close("incomplete" if _cut_short(state) else "completed")
        body = resp.body("completed", out.items, state, out.reasoning_text)
        self._keep(resp.req, body, items)
        return body

    def _keep(self, req: ResponsesRequest, body: dict[str, Any], items: list[Any]) -> None:
        if req.store and self.tm.server_args.disaggregation_mode != "prefill":
            self.store.put(body, items)

    async def _events(self, resp: _Response, items: list[Any]) -> AsyncIterator[bytes]:
        tm, run = self.tm, resp.run
        events: list[bytes] = []
        seq = 0

        def emit(kind: str, **fields: Any) -> None:
            nonlocal seq
            events.append(
                http_util.sse_named_event(kind, {"type": kind, "sequence_number": seq, **fields})
            )
            seq += 1

        out = Output(emit)
        state = run.states[0]
        try:
            async for state, delta in chat_deltas(tm, run):
                if seq == 0:  # held back until decode has its KV: a failure before is retried
                    emit("response.created", response=resp.body("in_progress", [], None))
                    emit("response.in_progress", response=resp.body("in_progress", [], None))
                out.feed(delta)
                if events:
                    yield b"".join(events)
                    events.clear()
        except APIError as err:
            if seq == 0:  # an error the router can still retry elsewhere
                yield err.sse()
                return
            emit("error", code=err.type, message=err.message, param=None)
            yield b"".join(events)
            return
        body = self._finish(resp, out, state, items)
        emit(f"response.{body['status']}", response=body)
        yield b"".join(events)

    def get(self, response_id: str) -> Response:
        body = self.store.get(response_id)
        if body is None:
            raise APIError(404, f"response {response_id!r} not found")
        return http_util.json_response(body)

    def delete(self, response_id: str) -> Response:
        if not self.store.delete(response_id):
            raise APIError(404, f"response {response_id!r} not found")
        return http_util.json_response(
            {"id": response_id, "object": "response.deleted", "deleted": True}
        )
