"""The router's stored responses of ``/v1/responses`` (``pdserve/conversations.py``).

A request naming ``previous_response_id`` is expanded here, before dispatch: its ``input`` gets
the named response's input and output in front, and ``expanded_from_response_id`` stands in for
the id, so that a prefill server, which never saw the previous turn's output, computes the whole
conversation's KV, and any decode can continue it. The answer (decode's JSON, or the
``response.completed`` / ``response.incomplete`` event of its stream) is kept with that input.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pdserve.conversations import Conversations, UnknownResponse
from pdserve.router.protocol import BadRequest

logger = logging.getLogger(__name__)

PATH = "/v1/responses"
_FINAL_EVENTS = (b"event: response.completed", b"event: response.incomplete")


class Keeper:
    """Keeps one request's answer: ``json`` for a whole answer, ``events`` for stream chunks."""

    def __init__(self, store: Conversations, items: list[Any]):
        self.store = store
        self.items = items

    def json(self, raw: bytes) -> None:
        try:
            body = json.loads(raw)
        except ValueError:
            return
        if isinstance(body, dict) and body.get("object") == "response":
            self.store.put(body, self.items)

    def events(self, chunk: bytes) -> None:
        if not any(final in chunk for final in _FINAL_EVENTS):
            return
        for event in chunk.split(b"\n\n"):
            if event.startswith(_FINAL_EVENTS):
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        try:
                            data = json.loads(line[len(b"data: ") :])
                        except ValueError:
                            continue
                        if isinstance(data.get("response"), dict):
                            self.store.put(data["response"], self.items)


class Responses:
    def __init__(self, capacity: int):
        self.store = Conversations(capacity)

    def prepare(self, body: dict) -> tuple[dict, Keeper | None]:
        """``body`` with ``previous_response_id`` expanded, and the keeper of its answer (None
        when it is not to be stored). ``BadRequest`` (404) for an unknown id."""
        try:
            out, items = self.store.expand(body)
        except UnknownResponse as e:
            raise BadRequest(e.message, status=404) from None
        if body.get("store") is False or self.store.capacity == 0:
            return out, None
        return out, Keeper(self.store, items)
