"""Decode side, one room (``KVReceiver``) on top of the rank's ``DecodeRole``.

Room lifecycle on a decode rank: ``KVReceiver`` created (Bootstrapping; the connection to the
prefill instance is looked up / registered on a helper thread) -> connection ready
(WaitingForInput) -> ``send_metadata`` (Transferring) -> Success from every required prefill
rank (Success) | error status, incompatible prefill, timeout, unreachable prefill (Failed).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence

from pdserve.disagg.bootstrap import parse_addr
from pdserve.disagg.decode_role import DecodeRole
from pdserve.disagg.messages import TransferRequest
from pdserve.disagg.poll import KVPoll

logger = logging.getLogger(__name__)


class KVReceiver:
    """One room on a decode rank. Call order: construct when the request arrives (look-up and
    registration start in the background); ``init()``; ``poll()`` until WaitingForInput;
    preallocate pages and a metadata slot; ``send_metadata(pages, slot)``; ``poll()`` until
    Success (then check ``MetadataBuffers.row_room(slot) == room``) or Failed; ``clear()``.
    ``abort()`` at any time; free the pages only once ``writes_drained()``."""

    def __init__(
        self, mgr, bootstrap_addr: str, room: int, prefill_dp_rank: Optional[int] = None, **_: Any
    ):
        self.mgr = mgr
        self.role: DecodeRole = mgr.role
        self.bootstrap_addr = bootstrap_addr
        self.room = room
        self.prefill_dp_rank = prefill_dp_rank or 0
        self._rs = self.role.add_room(room, bootstrap_addr, self.prefill_dp_rank)

    def init(self, prefill_dp_rank: Optional[int] = None) -> None:
        """Kept for the common call order (the fake receiver leaves Bootstrapping here); the real
        look-up already started in the constructor."""

    def poll(self) -> KVPoll:
        m, rs = self.mgr, self._rs
        timed_out = None
        with m.lock:
            st = m.status.get(self.room)
            if st is None or self.role.rooms.get(self.room) is not rs:
                return KVPoll.Failed
            if st == KVPoll.Bootstrapping and rs.conn.state == "ready":
                m.status.update(self.room, KVPoll.WaitingForInput)
                st = KVPoll.WaitingForInput
            elif st == KVPoll.Transferring and rs.sent_at is not None:
                waited = (
                    time.monotonic() - rs.sent_at
                )  # since the request, or prefill's last progress
                if waited > m.waiting_timeout:
                    timed_out = (
                        f"timed out after {waited:.1f}s waiting for KV from prefill {rs.conn.addr}"
                    )
        if timed_out:
            m.update_status(self.room, KVPoll.Failed, timed_out)
            self._send_abort(timed_out)
            return KVPoll.Failed
        return st

    def send_metadata(
        self, dst_pages: Sequence[Sequence[int]], aux_slot: int, decode_prefix_pages: int = 0
    ) -> None:
        """Ask the prefill rank(s) to write the request's pages into ``dst_pages`` (per cache group,
        from the group's first page sent: ``decode_prefix_pages`` on, or the first page a window
        still sees) and its metadata row into ``aux_slot``. Requires poll() >= WaitingForInput."""
        m, rs = self.mgr, self._rs
        st = m.get_status(self.room)
        if st in (None, KVPoll.Failed):
            return
        if st < KVPoll.WaitingForInput:
            raise RuntimeError(
                f"send_metadata for room {self.room} before the connection is ready ({st.name})"
            )
        c = rs.conn
        # each target writes its share; exactly one of them writes the metadata row; a target
        # with an empty pair (rank_map) is asked for nothing, which lets it conclude the room
        reqs = []
        for t in c.targets:
            writes = t.pair is None or not t.pair.empty
            reqs.append(
                (
                    t,
                    TransferRequest(
                        session_id=c.session_id,
                        room=self.room,
                        generation=rs.generation,
                        dst_pages=[[int(p) for p in g] for g in dst_pages]
                        if writes
                        else [[] for _ in dst_pages],
                        aux_slot=int(aux_slot) if t.pair is None or t.pair.writes_metadata else -1,
                        required_dst_info_num=t.required_dst,
                        decode_prefix_pages=int(decode_prefix_pages),
                        reply_endpoint=m.endpoint(parse_addr(c.addr)[0]),
                    ),
                )
            )
        with m.lock:
            rs.sent_at = time.monotonic()
            m.status.update(self.room, KVPoll.Transferring)
        for t, req in reqs:
            if not m.send(t.endpoint, req):
                m.update_status(self.room, KVPoll.Failed, f"cannot reach prefill rank {t.endpoint}")
                return

    def failure_reason(self) -> str:
        return self.mgr.failure_reason(self.room)

    def abort(self, reason: str = "aborted by decode") -> None:
        self.mgr.update_status(self.room, KVPoll.Failed, reason)
        self._send_abort(reason)

    def _send_abort(self, reason: str) -> None:
        """Tell the prefill rank(s) to stop (or never start) the room. Only after send_metadata
        can they write, so only then ``writes_drained`` waits for their acknowledgements."""
        rs = self._rs
        with self.mgr.lock:
            if rs.conn.state == "connecting" and rs.abort_at is None:
                rs.conn.pending_aborts[self.room] = (rs.generation, reason)  # sent once connected
            if rs.abort_at is not None or rs.peer_dead or rs.conn.state != "ready":
                return
            rs.abort_at = time.monotonic()
            if all(t.rank in rs.stopped for t in rs.conn.targets):
                return
        self.role.send_abort(rs.conn, self.room, rs.generation, reason)

    def writes_drained(self) -> bool:
        """True when no prefill rank can still write into this room's pages: nothing was asked,
        every asked rank reported Success/Failed or acknowledged an abort, or, where a writer may
        still have bytes under way (prefill declared dead, abort unacknowledged, a failed write),
        the connection's window was fenced. Free preallocated pages of a failed room only after
        this."""
        m, rs = self.mgr, self._rs
        with m.lock:
            if rs.sent_at is None or m.status.get(self.room) == KVPoll.Success:
                return True
            if rs.peer_dead or rs.suspect:  # bytes may still be under way: only a fence ends them
                return self.role.fenced(rs.conn)
            if all(t.rank in rs.stopped for t in rs.conn.targets):
                return True
            if rs.abort_at is None or time.monotonic() - rs.abort_at <= m.waiting_timeout:
                return False
        # the prefill answers heartbeats but not the abort: stop waiting for it, fence instead
        logger.warning(
            "%s: room %d: no abort acknowledgement within %.1fs",
            m.name,
            self.room,
            m.waiting_timeout,
        )
        self.role.mark_suspect(rs)
        return self.role.fenced(rs.conn)

    def clear(self) -> None:
        self.role.clear(self._rs)
