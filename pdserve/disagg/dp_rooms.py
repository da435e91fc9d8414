"""Which prefill DP group holds each bootstrap room, as the bootstrap server keeps it.

A prefill server with several DP groups that picked a room's group itself (no
``disagg_prefill_dp_rank`` hint reached decode) registers it with ``POST /register_dp_rank``
``{"bootstrap_room", "dp_rank"}``; decode looks up the groups of its pending rooms with
``POST /query_dp_ranks`` ``{"bootstrap_rooms": [...]}`` -> ``{"<room>": dp_rank}`` (known rooms
only). An entry lives ``ttl_s`` seconds after its last registration (SGLang keeps them 120 s), so
the table is bounded by the registration rate, not by uptime.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

ROOM_LIMIT = 2**63  # rooms are in [0, 2^63), as the routers draw them
MAX_QUERY_ROOMS = 4096
DEFAULT_ENTRY_TTL_S = 120.0


class DPRoomTable:
    """room -> (dp_rank, registration time). Thread-safe; expired entries are dropped whenever
    the table is read or written."""

    def __init__(
        self, ttl_s: float = DEFAULT_ENTRY_TTL_S, clock: Callable[[], float] = time.monotonic
    ):
        if ttl_s <= 0:
            raise ValueError(f"entry_ttl_s: must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self.clock = clock
        self._lock = threading.Lock()
        # oldest registration first: a re-registration moves its room to the end, so the expired
        # entries are always a prefix and purging costs only what it removes
        self._entries: OrderedDict[int, tuple[int, float]] = OrderedDict()

    def _purge(self, now: float) -> None:
        while self._entries:
            room, (_, registered) = next(iter(self._entries.items()))
            if now - registered < self.ttl_s:
                return
            del self._entries[room]

    def put(self, room: int, dp_rank: int) -> None:
        with self._lock:
            now = self.clock()
            self._purge(now)
            self._entries.pop(room, None)
            self._entries[room] = (dp_rank, now)

    def get_many(self, rooms: list[int]) -> dict[int, int]:
        """The dp rank of each room in ``rooms`` that is known and not expired."""
        with self._lock:
            self._purge(self.clock())
            return {room: self._entries[room][0] for room in rooms if room in self._entries}

    def __len__(self) -> int:
        """Entries held, expired ones included until the next read or write."""
        with self._lock:
            return len(self._entries)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_room(name: str, room: Any) -> int:
    if not _is_int(room) or not 0 <= room < ROOM_LIMIT:
        raise ValueError(f"{name}: must be an integer in [0, 2^63), got {room!r}")
    return room


def parse_registration(body: Any, dp_size: int | None) -> tuple[int, int]:
    """(room, dp_rank) of a ``/register_dp_rank`` body; ``dp_size`` is the instance's, once its
    ranks registered. Raises ``ValueError`` naming the bad field."""
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object with bootstrap_room and dp_rank")
    room = _check_room("bootstrap_room", body.get("bootstrap_room"))
    dp_rank = body.get("dp_rank")
    if not _is_int(dp_rank) or dp_rank < 0:
        raise ValueError(f"dp_rank: must be an integer >= 0, got {dp_rank!r}")
    if dp_size is not None and dp_rank >= dp_size:
        raise ValueError(f"dp_rank: {dp_rank} out of range for the instance's dp_size {dp_size}")
    return room, dp_rank


def parse_query(body: Any) -> list[int]:
    """The rooms of a ``/query_dp_ranks`` body. Raises ``ValueError`` naming the bad field."""
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object with bootstrap_rooms")
    rooms = body.get("bootstrap_rooms")
    if not isinstance(rooms, list):
        raise ValueError(f"bootstrap_rooms: must be a list of rooms, got {type(rooms).__name__}")
    if len(rooms) > MAX_QUERY_ROOMS:
        raise ValueError(
            f"bootstrap_rooms: at most {MAX_QUERY_ROOMS} rooms per query, got {len(rooms)}"
        )
    return [_check_room("bootstrap_rooms", room) for room in rooms]
