"""Stored responses of the Responses API (``POST /v1/responses`` with ``store``), for
``previous_response_id`` and ``GET /v1/responses/{id}``.

A response is kept with the input items that produced it (the previous turns already expanded),
so the next turn's history is ``input + output`` of the one it names. The store is bounded: past
``capacity`` responses the least recently used goes. A server keeps the responses it answered; a
router keeps the responses that passed through it and expands ``previous_response_id`` into the
input before it dispatches, because in PD the prefill server that computes the next turn's prompt
never saw the previous turn's output.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

DEFAULT_CAPACITY = 10_000
# the field a router that expanded ``previous_response_id`` sends in its place
EXPANDED_FROM = "expanded_from_response_id"


class UnknownResponse(KeyError):
    """``previous_response_id`` names a response this store does not hold."""

    def __init__(self, response_id: str):
        super().__init__(response_id)
        self.message = (
            f"previous_response_id: no stored response {response_id!r} (it was not stored, was "
            "deleted or was evicted)"
        )


def input_items(value: Any) -> list[Any]:
    """The ``input`` of a request as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value) if isinstance(value, list) else []


class Conversations:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[list[Any], dict[str, Any]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict[str, Any], items: list[Any]) -> None:
        """Keep ``response`` (its ``id``), produced from the expanded input ``items``."""
        rid = response.get("id")
        if not isinstance(rid, str):
            return
        self._items[rid] = (items, response)
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Optional[dict[str, Any]]:
        entry = self._items.get(response_id)
        return None if entry is None else entry[1]

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def history(self, response_id: str) -> list[Any]:
        """The items a turn after ``response_id`` continues: its input, then its output."""
        entry = self._items.get(response_id)
        if entry is None:
            raise UnknownResponse(response_id)
        self._items.move_to_end(response_id)
        items, response = entry
        return [*items, *response.get("output", [])]

    def expand(self, body: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        """``body`` with its ``previous_response_id`` replaced by the history in ``input``, and
        that whole input (what ``put`` keeps with the answer). ``UnknownResponse`` if unknown."""
        items = input_items(body.get("input"))
        previous = body.get("previous_response_id")
        if not isinstance(previous, str) or not previous:
            return body, items
        items = [*self.history(previous), *items]
        out = {k: v for k, v in body.items() if k != "previous_response_id"}
        out["input"] = items
        out[EXPANDED_FROM] = previous  # the server echoes it without looking it up
        return out, items
