"""The stored responses behind ``previous_response_id`` (pdserve/conversations.py) and the
router's keeper of answers passing through it (router/responses.py)."""

from __future__ import annotations

import json

import pytest

from pdserve.conversations import EXPANDED_FROM, Conversations, UnknownResponse
from pdserve.router.protocol import BadRequest
from pdserve.router.responses import Responses


def _response(rid: str, text: str) -> dict:
    return {
        "id": rid,
        "object": "response",
        "output": [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text}],
            }
        ],
    }


def test_expand_puts_the_named_turns_first_and_evicts_the_least_recent():
    store = Conversations(capacity=2)
    body, items = store.expand({"input": "hi"})
    assert items == [{"type": "message", "role": "user", "content": "hi"}] and body == {
        "input": "hi"
    }
    store.put(_response("r1", "hello"), items)
    body, items2 = store.expand({"input": "and?", "previous_response_id": "r1", "store": True})
    assert "previous_response_id" not in body and body[EXPANDED_FROM] == "r1"
    assert body["input"] == items2 == [*items, *_response("r1", "hello")["output"], items2[-1]]
    assert items2[-1]["content"] == "and?"
    store.put(_response("r2", "x"), items2)
    store.history("r1")  # r1 used last: r2 is the least recent
    store.put(_response("r3", "y"), [])
    assert store.get("r2") is None and store.get("r1") is not None and len(store) == 2
    with pytest.raises(UnknownResponse, match="r2"):
        store.expand({"input": "x", "previous_response_id": "r2"})
    assert store.delete("r1") and not store.delete("r1")


def test_router_keeps_whole_answers_and_final_stream_events():
    router = Responses(capacity=10)
    _, keeper = router.prepare({"input": "hi"})
    keeper.json(json.dumps(_response("a", "one")).encode())
    chunk = (
        b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta"}\n\n'
        b"event: response.completed\ndata: "
        + json.dumps({"type": "response.completed", "response": _response("b", "two")}).encode()
        + b"\n\n"
    )
    _, keeper = router.prepare({"input": "again", "previous_response_id": "a"})
    keeper.events(chunk)
    history = router.store.history("b")
    assert [i.get("content") for i in history[:1]] == ["hi"] and len(history) == 4
    assert router.prepare({"input": "x", "store": False})[1] is None
    with pytest.raises(BadRequest) as e:
        router.prepare({"input": "x", "previous_response_id": "nope"})
    assert e.value.status == 404 and "nope" in str(e.value)
