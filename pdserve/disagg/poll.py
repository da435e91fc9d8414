"""Per-room transfer state (``KVPoll``) and rank-consistent polling.

States only move forward and Failed overrides everything. The numeric order matters: the TP
ranks of one server all-reduce their poll values with MIN, so one failing rank fails the room on
every rank and the slowest rank gates success.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Optional, Protocol, Sequence


class KVPoll(IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


def advance(old: Optional[KVPoll], new: KVPoll) -> KVPoll:
    """The state after reporting ``new`` in state ``old``: forward only (max), and Failed wins
    over everything, Success included; nothing leaves Failed."""
    if old is None:
        return new
    if old == KVPoll.Failed or new == KVPoll.Failed:
        return KVPoll.Failed
    return KVPoll(max(old, new))


class StatusTable:
    """room -> KVPoll (+ failure reason) with monotone updates. Not thread-safe by itself: the
    manager holds its lock around every call.

    ``update`` never recreates a room that was cleared (or never added) unless ``create`` is set:
    a late Failed for a room the scheduler already released must not resurrect it.
    """

    def __init__(self) -> None:
        self._state: dict[int, KVPoll] = {}
        self._reason: dict[int, str] = {}

    def add(self, room: int, state: KVPoll = KVPoll.Bootstrapping) -> None:
        self._state[room] = advance(self._state.get(room), state)

    def update(self, room: int, state: KVPoll, reason: str = "", create: bool = False) -> bool:
        """Apply ``state``; returns True when the stored state changed."""
        old = self._state.get(room)
        if old is None and not create:
            return False
        new = advance(old, state)
        if new == old:
            return False
        self._state[room] = new
        if new == KVPoll.Failed and reason and room not in self._reason:
            self._reason[room] = reason
        return True

    def get(self, room: int) -> Optional[KVPoll]:
        return self._state.get(room)

    def reason(self, room: int) -> str:
        return self._reason.get(room, "")

    def clear(self, room: int) -> None:
        self._state.pop(room, None)
        self._reason.pop(room, None)

    def __contains__(self, room: int) -> bool:
        return room in self._state

    def __len__(self) -> int:
        return len(self._state)


class Pollable(Protocol):
    def poll(self) -> KVPoll: ...

    def failure_reason(self) -> str: ...

    def abort(self, reason: str) -> None: ...


def poll_and_all_reduce(pollers: Sequence[Pollable], group=None) -> list[KVPoll]:
    """Poll every sender/receiver and MIN-all-reduce the values over ``group`` (a CPU gloo
    process group of the ranks that share the scheduler). Every rank must call this with its pollers
    for the same rooms in the same order. Without a group the local values are returned.

    A room that failed on some rank fails on every rank, with that rank's reason: the ranks that
    had not failed it abort it locally (so they stop writing or waiting and tell their peers), and
    all of them end the request with the same message."""
    values = [int(p.poll()) for p in pollers]
    if group is None or not values:
        return [KVPoll(v) for v in values]
    import msgspec
    import torch
    import torch.distributed as dist

    from pdserve.distributed import all_gather_bytes

    t = torch.tensor(values, dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    reduced = [KVPoll(int(v)) for v in t.tolist()]
    failed = [i for i, v in enumerate(reduced) if v == KVPoll.Failed]
    if failed:  # every rank sees the same reduced states, so every rank takes this branch
        mine = [pollers[i].failure_reason() if values[i] == KVPoll.Failed else "" for i in failed]
        ranks = [
            msgspec.msgpack.decode(b) for b in all_gather_bytes(msgspec.msgpack.encode(mine), group)
        ]
        for k, i in enumerate(failed):
            reason = next((r[k] for r in ranks if r[k]), "") or "KV transfer failed on another rank"
            if values[i] != KVPoll.Failed or not mine[k]:
                pollers[i].abort(reason)
    return reduced
