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
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import Response

from pdserve.server import http_util
from pdserve.server.errors import APIError
from pdserve.server.messages_protocol import MessagesRequest, to_chat
from pdserve.server.openai_api import chat_deltas, chat_prompt, start_chat, whole_delta
from pdserve.server.openai_protocol import matched_stop
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
        _, ids, _ = chat_prompt(tm, to_chat(tm, req))
    except APIError as e:
        return error_response(e)
    return http_util.json_response({"input_tokens": len(ids)})
