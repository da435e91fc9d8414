"""What decode's KV manager keeps per prefill connection and per room (``decode_role.py``): the
prefill ranks a connection writes through, its registration and heartbeat state, its fencing
state, and each room's progress."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

from pdserve.disagg.messages import RegisterAck
from pdserve.disagg.rank_map import PairPlan


@dataclass
class PrefillTarget:
    endpoint: str
    rank: int  # the prefill rank's unique id (tp_rank * pp_size + pp_rank)
    pair: Optional[PairPlan] = None  # what it writes into this rank (empty: nothing, see rank_map)
    required_dst: int = 1  # decode ranks that ask this prefill rank for each room


@dataclass
class PrefillConn:
    """Connection to one prefill instance (one bootstrap address), or to one of its DP groups."""

    addr: str
    session_id: str
    dp_rank: int = 0  # the prefill's attention-DP group
    state: str = "connecting"  # connecting | ready | failed
    error: str = ""
    info: dict = field(default_factory=dict)
    targets: list[PrefillTarget] = field(default_factory=list)
    rooms: set[int] = field(default_factory=set)
    pending_aborts: dict[int, tuple[int, str]] = field(
        default_factory=dict
    )  # room -> (generation, reason)
    acks: dict[int, RegisterAck] = field(default_factory=dict)
    acked: threading.Condition = field(default_factory=threading.Condition)
    hb_seq: int = 0
    key: tuple = ()
    hb_acked: dict[int, float] = field(
        default_factory=dict
    )  # rank -> monotonic time of its last answer
    next_hb: float = 0.0
    windowed: bool = False  # prefill writes through this connection's own window (fenceable)
    fenced: bool = False
    retired: bool = False  # takes no new room; fenced once only suspect rooms are left


@dataclass
class RoomRecv:
    room: int
    generation: int
    conn: PrefillConn
    sent_at: Optional[float] = None
    succeeded: set[int] = field(default_factory=set)  # prefill ranks that reported Success
    stopped: set[int] = field(default_factory=set)  # ranks that will not write again
    abort_at: Optional[float] = None
    peer_dead: bool = False
    suspect: bool = False  # a writer may still have bytes of this room under way
