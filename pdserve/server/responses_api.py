"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A request becomes a chat request (``openai_api.start_chat``): its ``instructions`` a system
message, its input items messages (``developer`` is ``system``; ``function_call`` items an
assistant turn's tool calls, ``function_call_output`` items tool messages, ``reasoning`` items the
next assistant turn's ``reasoning_content``), its function tools and ``tool_choice`` chat's, its
``text.format`` a ``response_format``. The answer's output items are a ``reasoning`` item (with
``--reasoning-parser``), a ``message`` with one ``output_text`` and a ``function_call`` per call.
A stream sends the Responses event types (``response.created`` ... ``response.completed``, each
with its ``sequence_number``), as ``event:`` and ``data:`` lines, without ``[DONE]``. With
``include: ["message.output_text.logprobs"]`` (and ``top_logprobs``) the output_text part carries
chat's logprobs of the same tokens (``Output``).

Stored responses (``store``, the default) are kept in memory (``pdserve/conversations.py``) for
``previous_response_id`` and ``GET``; a router in front expands ``previous_response_id`` itself
and sends ``expanded_from_response_id`` instead, which is only echoed. Through PD, prefill answers
with the whole response object (as it does for chat) and decode streams.
"""

from __future__ import annotations

import copy
import time
import uuid
from typing import Any, AsyncIterator, Optional, Sequence

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pdserve.conversations import Conversations, UnknownResponse
from pdserve.server import http_util
from pdserve.server.errors import APIError, bad_request
from pdserve.server.openai_api import (
    ChatRun,
    chat_deltas,
    output_logprobs,
    start_chat,
    whole_delta,
)
from pdserve.server.responses_protocol import ResponsesRequest, to_chat
from pdserve.server.tokenizer_manager import ReqState, TokenizerManager


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
    """A choice's output items as they grow from chat deltas, and the events that tell it. The
    sampled tokens' logprobs (``feed``'s ``logprobs``, chat's entries, when asked) go on the
    message's output_text part as chat puts them in ``logprobs.content``: every output token's,
    each with the next output_text delta (those of reasoning or markers wait for it) and the rest
    when the part closes."""

    def __init__(self, emit):
        self.items: list[dict[str, Any]] = []
        self.emit = emit  # emit(type, **fields): one stream event (or nothing, unstreamed)
        self.open: Optional[dict[str, Any]] = None
        self.reasoning_text = ""
        self.pending: list[dict[str, Any]] = []  # logprobs not yet on an output_text delta

    def feed(self, delta: dict[str, Any], logprobs: Sequence[dict[str, Any]] = ()) -> None:
        self.pending.extend(logprobs)
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
        extra = {} if kind == "reasoning" else {"logprobs": self._take_logprobs(item)}
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
            self._take_logprobs(item)
            part = item["content"][0]
            self.emit("response.output_text.done", text=text, logprobs=part["logprobs"], **common)
            self.emit("response.content_part.done", part=dict(item["content"][0]), **common)
        self.emit("response.output_item.done", output_index=index, item=copy.deepcopy(item))

    def _take_logprobs(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """The pending logprobs, now on the message ``item``'s output_text part."""
        taken, self.pending = self.pending, []
        item["content"][0]["logprobs"].extend(taken)
        return taken


def _cut_short(state: ReqState) -> bool:
    """It ended at max_output_tokens (the response is incomplete)."""
    return (state.finish_reason or {}).get("type") == "length"


def _logprobs(tm: TokenizerManager, run: ChatRun, state: ReqState, start: int) -> list[dict]:
    """Chat's logprob entries of the output tokens from ``start`` on (none unless asked)."""
    lp = output_logprobs(tm, run.top, state, start)
    return [] if lp is None else lp["content"]


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
            "top_logprobs": req.top_logprobs,
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
        out.feed(whole_delta(run), _logprobs(tm, run, run.states[0], 0))
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
        sent_tokens = 0
        try:
            async for state, delta in chat_deltas(tm, run):
                if seq == 0:  # held back until decode has its KV: a failure before is retried
                    emit("response.created", response=resp.body("in_progress", [], None))
                    emit("response.in_progress", response=resp.body("in_progress", [], None))
                out.feed(delta, _logprobs(tm, run, state, sent_tokens))
                sent_tokens = len(state.output_ids)
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
