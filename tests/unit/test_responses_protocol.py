"""The Responses API body as a chat request (server/responses_protocol.py)."""

from __future__ import annotations

from pdserve.conversations import input_items
from pdserve.server.responses_protocol import ResponsesRequest, to_chat


def test_reasoning_effort_reaches_the_template():
    req = ResponsesRequest(input="hi", reasoning={"effort": "low"})
    assert to_chat(req, input_items(req.input)).chat_template_kwargs == {"reasoning_effort": "low"}
    req = ResponsesRequest(
        input="hi", reasoning={"effort": "low"}, chat_template_kwargs={"reasoning_effort": "high"}
    )
    assert to_chat(req, input_items(req.input)).chat_template_kwargs == {"reasoning_effort": "high"}
    req = ResponsesRequest(input="hi")
    assert to_chat(req, input_items(req.input)).chat_template_kwargs is None
