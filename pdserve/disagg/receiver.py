"""Decode side: finds prefill ranks through their bootstrap server, registers this rank's
buffers with them (once per connection), asks for rooms, and tracks completion.

Room lifecycle on a decode rank: ``KVReceiver`` created (Bootstrapping; the connection to the
prefill instance is looked up / registered on a helper thread) -> connection ready
(WaitingForInput) -> ``send_metadata`` (Transferring) -> Success from every required prefill
rank (Success) | error status, incompatible prefill, timeout, unreachable prefill (Failed).

Liveness: every ready connection is heartbeated every ``heartbeat_interval``; a prefill rank
that answered none for ``heartbeat_misses * heartbeat_interval`` seconds gets its instance
declared dead: all its unfinished rooms fail at once, and the next room for that address looks
the instance up again and re-registers (so a restarted prefill is picked up without restarting
decode).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from pdserve.disagg.bootstrap import BootstrapNotReady, fetch_prefill_info, fetch_rank_info, parse_addr
from pdserve.disagg.kv_args import COMPAT_FIELDS, compat_mismatches
from pdserve.disagg.messages import (Abort, AbortAck, BufferDesc, Heartbeat, Register, RegisterAck,
                                     TransferRequest, TransferStatus, parse_completion_notice)
from pdserve.disagg.poll import KVPoll

logger = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 10.0


@dataclass
class _Target:
    endpoint: str
    rank: int  # the prefill rank's unique id (tp_rank * pp_size + pp_rank)


@dataclass
class _Conn:
    """Connection to one prefill instance (one bootstrap address)."""

    addr: str
    session_id: str
    state: str = "connecting"  # connecting | ready | failed
    error: str = ""
    info: dict = field(default_factory=dict)
    targets: list[_Target] = field(default_factory=list)
    rooms: set[int] = field(default_factory=set)
    pending_aborts: dict[int, tuple[int, str]] = field(default_factory=dict)  # room -> (generation, reason)
    acks: dict[int, RegisterAck] = field(default_factory=dict)
    acked: threading.Condition = field(default_factory=threading.Condition)
    hb_seq: int = 0
    hb_acked: dict[int, float] = field(default_factory=dict)  # rank -> monotonic time of its last answer
    next_hb: float = 0.0


@dataclass
class _RoomRecv:
    room: int
    generation: int
    conn: _Conn
    sent_at: Optional[float] = None
    succeeded: set[int] = field(default_factory=set)  # prefill ranks that reported Success
    stopped: set[int] = field(default_factory=set)  # ranks that will not write again
    abort_at: Optional[float] = None
    peer_dead: bool = False


class DecodeRole:
    def __init__(self, mgr):
        self.mgr = mgr
        self.conns: dict[str, _Conn] = {}
        self.rooms: dict[int, _RoomRecv] = {}
        self._sessions = itertools.count()
        self._generations = itertools.count(1)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"pd-connect-{mgr.name}")

    # ---- connections ----------------------------------------------------------------------
    def get_conn(self, addr: str) -> _Conn:
        """The connection to ``addr``, starting the look-up + registration if there is none."""
        with self.mgr.lock:
            c = self.conns.get(addr)
            if c is None:
                c = self.conns[addr] = _Conn(addr, f"{self.mgr.session_prefix}-{next(self._sessions)}")
                self._pool.submit(self._connect, c)
            return c

    def _connect(self, c: _Conn) -> None:
        try:
            self._do_connect(c)
        except Exception as e:  # any failure fails the connection's rooms, never hangs them
            self._fail_conn(c, f"cannot connect to prefill {c.addr}: {e}")

    def _do_connect(self, c: _Conn) -> None:
        m, a = self.mgr, self.mgr.kv_args
        host, port = parse_addr(c.addr)
        deadline = time.monotonic() + m.waiting_timeout
        delay = 0.05
        while True:
            try:
                info = fetch_prefill_info(host, port, timeout=2.0)
                break
            except BootstrapNotReady as e:
                if time.monotonic() + delay > deadline or m._closed.is_set():
                    return self._fail_conn(c, f"prefill bootstrap server {c.addr} not ready after "
                                              f"{m.waiting_timeout:.1f}s: {e}")
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        errs = compat_mismatches({k: info.get(k) for k in COMPAT_FIELDS}, a.compat_info())
        if info.get("tp_size") != a.tp_size:
            errs.append(f"tp_size mismatch: prefill {info.get('tp_size')}, decode {a.tp_size} "
                        "(different TP sizes are not supported yet)")
        c.info = info
        pp_size = int(info["pp_size"])
        tp_rank = a.engine_rank % int(info["tp_size"])
        for pp in range(pp_size):  # decode holds every layer: ask every prefill stage
            r = fetch_rank_info(host, port, 0, tp_rank, pp, timeout=2.0)
            c.targets.append(_Target(f"tcp://{r['rank_ip']}:{r['rank_port']}", tp_rank * pp_size + pp))
        if errs:
            return self._fail_conn(c, f"prefill {c.addr} is incompatible: " + "; ".join(errs), tell_prefill=True)
        reg = Register(session_id=c.session_id, decode_rank=a.engine_rank, decode_tp_size=a.tp_size,
                       reply_endpoint=m.endpoint(host), buffers=BufferDesc.from_kv_args(a),
                       compat=a.compat_info(), backend=m.backend_name, backend_info=m.backend.describe())
        for t in c.targets:
            m.send(t.endpoint, reg)
        with c.acked:
            c.acked.wait_for(lambda: len(c.acks) >= len(c.targets) or c.state == "failed", REGISTER_TIMEOUT_S)
        if c.state == "failed":
            return
        missing = [t.endpoint for t in c.targets if t.rank not in c.acks]
        if missing:
            hint = " (is --disaggregation-secret the same on both sides?)" if m.secret else ""
            return self._fail_conn(c, f"no registration answer from prefill rank(s) {', '.join(missing)} "
                                      f"within {REGISTER_TIMEOUT_S:.0f}s{hint}")
        rejected = [ack.error for ack in c.acks.values() if not ack.ok]
        if rejected:
            return self._fail_conn(c, f"prefill {c.addr} rejected registration: {'; '.join(rejected)}",
                                   tell_prefill=True)
        with m.lock:
            if c.state == "connecting":
                c.state = "ready"
                now = time.monotonic()
                c.next_hb = now
                c.hb_acked = {t.rank: now for t in c.targets}
            # rooms aborted or failed while the connection was being set up: tell prefill now
            aborted = dict(c.pending_aborts)
            c.pending_aborts.clear()
            for r in c.rooms:
                rs = self.rooms.get(r)
                if rs is not None and m.status.get(r) == KVPoll.Failed:
                    rs.abort_at = time.monotonic()
                    aborted[r] = (rs.generation, m.failure_reason(r))
        for room, (generation, reason) in aborted.items():
            self._send_abort(c, room, generation, reason)
        logger.info("%s: connected to prefill %s (%d rank(s))", m.name, c.addr, len(c.targets))

    def _fail_conn(self, c: _Conn, reason: str, tell_prefill: bool = False) -> None:
        """Fail the connection and its unfinished rooms. ``tell_prefill``: the prefill is alive
        (e.g. incompatible), so abort the rooms there too instead of letting them time out."""
        m = self.mgr
        failed = []
        with m.lock:
            if c.state == "failed":
                return failed
            c.state, c.error = "failed", reason
            if self.conns.get(c.addr) is c:
                del self.conns[c.addr]  # the next room to this address starts afresh
            for room in list(c.rooms):
                rs = self.rooms.get(room)
                if rs is not None and rs.conn is c and m.status.get(room) != KVPoll.Success:
                    rs.peer_dead = True
                    m.update_status(room, KVPoll.Failed, reason)
                    failed.append((room, rs.generation))
        with c.acked:
            c.acked.notify_all()
        logger.warning("%s: %s", m.name, reason)
        if tell_prefill:
            for room, generation in failed:
                self._send_abort(c, room, generation, reason)

    def _send_abort(self, c: _Conn, room: int, generation: int, reason: str) -> None:
        reply = self.mgr.endpoint(parse_addr(c.addr)[0])
        for t in c.targets:
            self.mgr.send(t.endpoint, Abort(session_id=c.session_id, room=room, generation=generation,
                                            reason=reason, reply_endpoint=reply))

    # ---- control messages (I/O thread) ----------------------------------------------------
    def on_message(self, msg) -> None:
        m = self.mgr
        if isinstance(msg, TransferStatus):
            with m.lock:
                rs = self.rooms.get(msg.room)
                any_gen = msg.generation == 0 and msg.state == KVPoll.Failed
                if rs is None or (rs.generation != msg.generation and not any_gen):
                    return  # a cleared room or an older generation of it
                if any_gen and m.status.get(msg.room) not in (KVPoll.Bootstrapping, KVPoll.WaitingForInput):
                    return  # this decode already asked, so the prefill will answer for this generation
                if msg.state == KVPoll.Transferring:  # progress: queued or writing on prefill
                    if rs.sent_at is not None and m.status.get(msg.room) == KVPoll.Transferring:
                        rs.sent_at = time.monotonic()
                    return
                rs.stopped.add(msg.prefill_rank)
                if msg.state == KVPoll.Failed:
                    m.update_status(msg.room, KVPoll.Failed,
                                    f"prefill {rs.conn.addr} rank {msg.prefill_rank}: {msg.reason}")
                elif msg.state == KVPoll.Success:
                    rs.succeeded.add(msg.prefill_rank)
                    if len(rs.succeeded) >= len(rs.conn.targets):
                        m.update_status(msg.room, KVPoll.Success)
        elif isinstance(msg, Heartbeat) and msg.ack:
            with m.lock:
                c = next((c for c in self.conns.values() if c.session_id == msg.session_id), None)
                if c is not None:
                    c.hb_acked[msg.prefill_rank] = time.monotonic()
            if c is not None and not msg.known and c.state == "ready":
                self._fail_conn(c, f"prefill instance {c.addr} no longer knows this decode rank (it restarted, "
                                   "or declared this decode dead)")
        elif isinstance(msg, AbortAck):
            with m.lock:
                rs = self.rooms.get(msg.room)
                if rs is not None and rs.generation == msg.generation:
                    rs.stopped.add(msg.prefill_rank)
        elif isinstance(msg, RegisterAck):
            with m.lock:
                c = next((c for c in self.conns.values() if c.session_id == msg.session_id), None)
            if c is not None:
                with c.acked:
                    c.acks[msg.prefill_rank] = msg
                    c.acked.notify_all()
        else:
            logger.warning("%s: unexpected %s from a prefill rank", m.name, type(msg).__name__)

    def tick(self, now: float) -> None:
        m = self.mgr
        self._take_completion_notices()
        dead: list[tuple[_Conn, str]] = []
        beats: list[tuple[str, Heartbeat]] = []
        dead_after = m.heartbeat_misses * m.heartbeat_interval
        with m.lock:
            for c in self.conns.values():
                if c.state != "ready":
                    continue
                silent = now - min(c.hb_acked.values(), default=now)
                if silent > dead_after:
                    dead.append((c, f"prefill instance {c.addr} unreachable (no heartbeat answer for {silent:.1f}s)"))
                    continue
                if now < c.next_hb:
                    continue
                c.next_hb = now + m.heartbeat_interval
                c.hb_seq += 1
                host = parse_addr(c.addr)[0]
                hb = Heartbeat(session_id=c.session_id, seq=c.hb_seq, reply_endpoint=m.endpoint(host))
                beats += [(t.endpoint, hb) for t in c.targets]
        for c, reason in dead:
            self._fail_conn(c, reason)
            for t in c.targets:
                m.drop_peer(t.endpoint)
        for endpoint, hb in beats:
            m.send(endpoint, hb)

    def _take_completion_notices(self) -> None:
        """Backends that notify on completion (NIXL) mark a room's rank done when its last write
        landed, without waiting for the control-plane Success status."""
        take = getattr(self.mgr.backend, "take_notifications", None)
        if take is None:
            return
        for msgs in take().values():
            for msg in msgs:
                notice = parse_completion_notice(msg)
                if notice is not None:
                    room, generation, rank = notice
                    self.on_message(TransferStatus(room=room, generation=generation, state=int(KVPoll.Success),
                                                   prefill_rank=rank))

    # ---- receiver-facing helpers ----------------------------------------------------------
    def add_room(self, room: int, addr: str) -> _RoomRecv:
        c = self.get_conn(addr)
        with self.mgr.lock:
            old = self.rooms.get(room)
            if old is not None:
                old.conn.rooms.discard(room)
                self.mgr.status.clear(room)
            rs = self.rooms[room] = _RoomRecv(room, next(self._generations), c)
            c.rooms.add(room)
            self.mgr.status.add(room, KVPoll.Bootstrapping)
            if c.state == "failed":
                self.mgr.update_status(room, KVPoll.Failed, c.error)
        return rs

    def clear(self, rs: _RoomRecv) -> None:
        with self.mgr.lock:
            if self.rooms.get(rs.room) is rs:  # not a newer receiver of the same room
                del self.rooms[rs.room]
                self.mgr.status.clear(rs.room)
                rs.conn.rooms.discard(rs.room)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def counts(self) -> dict:
        return {"kv_peer_connections": len(self.conns)}


class KVReceiver:
    """One room on a decode rank. Call order: construct when the request arrives (look-up and
    registration start in the background); ``init()``; ``poll()`` until WaitingForInput;
    preallocate pages and a metadata slot; ``send_metadata(pages, slot)``; ``poll()`` until
    Success (then check ``MetadataBuffers.row_room(slot) == room``) or Failed; ``clear()``.
    ``abort()`` at any time; free the pages only once ``writes_drained()``."""

    def __init__(self, mgr, bootstrap_addr: str, room: int, prefill_dp_rank: Optional[int] = None, **_: Any):
        self.mgr = mgr
        self.role: DecodeRole = mgr.role
        self.bootstrap_addr = bootstrap_addr
        self.room = room
        self._rs = self.role.add_room(room, bootstrap_addr)

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
                waited = time.monotonic() - rs.sent_at  # since the request, or prefill's last progress
                if waited > m.waiting_timeout:
                    timed_out = f"timed out after {waited:.1f}s waiting for KV from prefill {rs.conn.addr}"
        if timed_out:
            m.update_status(self.room, KVPoll.Failed, timed_out)
            self._send_abort(timed_out)
            return KVPoll.Failed
        return st

    def send_metadata(self, dst_pages: Sequence[int], aux_slot: int, state_indices: Optional[Sequence[int]] = None,
                      decode_prefix_pages: int = 0) -> None:
        """Ask the prefill rank(s) to write the request's pages (after ``decode_prefix_pages``) into
        ``dst_pages`` and its metadata row into ``aux_slot``. Requires poll() >= WaitingForInput."""
        m, rs = self.mgr, self._rs
        st = m.get_status(self.room)
        if st in (None, KVPoll.Failed):
            return
        if st < KVPoll.WaitingForInput:
            raise RuntimeError(f"send_metadata for room {self.room} before the connection is ready ({st.name})")
        c = rs.conn
        reqs = [(t, TransferRequest(session_id=c.session_id, room=self.room, generation=rs.generation,
                                    dst_pages=[int(p) for p in dst_pages], aux_slot=int(aux_slot),
                                    state_indices=[int(i) for i in state_indices or []],
                                    required_dst_info_num=1, decode_prefix_pages=int(decode_prefix_pages),
                                    reply_endpoint=m.endpoint(parse_addr(c.addr)[0])))
                for t in c.targets]
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
        self.role._send_abort(rs.conn, self.room, rs.generation, reason)

    def writes_drained(self) -> bool:
        """True when no prefill rank can still write into this room's pages: nothing was asked,
        every asked rank reported Success/Failed or acknowledged an abort, or the prefill was
        declared dead. Free preallocated pages of a failed room only after this."""
        m, rs = self.mgr, self._rs
        with m.lock:
            if rs.sent_at is None or rs.peer_dead or m.status.get(self.room) == KVPoll.Success:
                return True
            if all(t.rank in rs.stopped for t in rs.conn.targets):
                return True
            if rs.abort_at is not None and time.monotonic() - rs.abort_at > m.waiting_timeout:
                # the prefill answers heartbeats but not the abort: stop waiting, but say so
                logger.warning("%s: room %d: no abort acknowledgement within %.1fs; releasing its pages",
                               m.name, self.room, m.waiting_timeout)
                rs.peer_dead = True
                return True
            return False

    def clear(self) -> None:
        self.role.clear(self._rs)
