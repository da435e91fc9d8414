"""Decode side of a KV manager (``DecodeRole``): finds prefill ranks through their bootstrap
server, registers this rank's buffers with them (once per connection), handles their control
messages and tracks each room's completion. ``receiver.KVReceiver`` is the per-room face of it.

Liveness: every ready connection is heartbeated every ``heartbeat_interval``; a prefill rank
that answered none for ``heartbeat_misses * heartbeat_interval`` seconds gets its instance
declared dead: all its unfinished rooms fail at once, and the next room for that address looks
the instance up again and re-registers (so a restarted prefill is picked up without restarting
decode).

Fencing (``transfer/window.py``): with a network backend on CPU each connection registers its
own window of this rank's buffers and prefill is told only the window's addresses. The pages of a
room whose writer may still have bytes under way (its prefill declared dead, an abort never
acknowledged, a write prefill reports as failed, see ``TransferStatus.unsettled``) are freed only
after that window was fenced, so a late write can never land in pages given to another request.
A dead connection is fenced at once; a live one with such a room is retired (new rooms get a new
connection and window) and fenced once it holds only such rooms.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import msgspec

from pdserve.disagg import rank_map
from pdserve.disagg.bootstrap import (
    BootstrapNotReady,
    fetch_prefill_info,
    fetch_rank_info,
    parse_addr,
)
from pdserve.disagg.decode_conns import PrefillConn, PrefillTarget, RoomRecv
from pdserve.disagg.kv_args import COMPAT_FIELDS, compat_mismatches
from pdserve.disagg.messages import (
    Abort,
    AbortAck,
    BufferDesc,
    Heartbeat,
    Register,
    RegisterAck,
    TransferStatus,
    parse_completion_notice,
)
from pdserve.disagg.poll import KVPoll

logger = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 10.0


class DecodeRole:
    def __init__(self, mgr):
        self.mgr = mgr
        self.conns: dict[tuple[str, int], PrefillConn] = {}  # (bootstrap address, prefill DP group)
        self.retired: dict[
            str, PrefillConn
        ] = {}  # session id -> live connection waiting to be fenced
        self.fenced_windows = 0
        self.rooms: dict[int, RoomRecv] = {}
        self._sessions = itertools.count()
        self._generations = itertools.count(1)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"pd-connect-{mgr.name}")

    # ---- connections ----------------------------------------------------------------------
    def get_conn(self, addr: str, dp_rank: int = 0) -> PrefillConn:
        """The connection to DP group ``dp_rank`` of the prefill at ``addr``, starting the look-up
        + registration if there is none."""
        with self.mgr.lock:
            c = self.conns.get((addr, dp_rank))
            if c is None:
                c = PrefillConn(
                    addr,
                    f"{self.mgr.session_prefix}-{next(self._sessions)}",
                    dp_rank,
                    key=(addr, dp_rank),
                )
                self.conns[c.key] = c
                self._pool.submit(self._connect, c)
            return c

    def _connect(self, c: PrefillConn) -> None:
        try:
            self._do_connect(c)
        except Exception as e:  # any failure fails the connection's rooms, never hangs them
            self._fail_conn(c, f"cannot connect to prefill {c.addr}: {e}")

    def _do_connect(self, c: PrefillConn) -> None:
        m, a = self.mgr, self.mgr.kv_args
        host, port = parse_addr(c.addr)
        deadline = time.monotonic() + m.waiting_timeout
        delay = 0.05
        while True:
            try:
                info = fetch_prefill_info(host, port, timeout=2.0, secret=m.secret)
                break
            except BootstrapNotReady as e:
                if time.monotonic() + delay > deadline or m._closed.is_set():
                    return self._fail_conn(
                        c,
                        f"prefill bootstrap server {c.addr} not ready after "
                        f"{m.waiting_timeout:.1f}s: {e}",
                    )
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        errs = compat_mismatches({k: info[k] for k in COMPAT_FIELDS if k in info}, a.compat_info())
        c.info = info
        pp_size, p_tp = int(info["pp_size"]), int(info["tp_size"])
        if not 0 <= c.dp_rank < int(info.get("dp_size", 1)):
            errs.append(
                f"prefill has {info.get('dp_size', 1)} DP group(s), "
                f"the request names group {c.dp_rank}"
            )
        try:
            # which prefill ranks write what of this rank's regions, or only conclude (rank_map.py)
            pairs = rank_map.sources(
                p_tp, a.tp_size, a.total_kv_head_num, a.num_heads, a.engine_rank, a.splits
            )
        except ValueError as e:
            pairs = []
            errs.append(f"prefill tp {p_tp} and decode tp {a.tp_size} cannot exchange KV: {e}")
        for sl in pairs:
            required = rank_map.destinations_of(
                p_tp, a.tp_size, a.total_kv_head_num, a.num_heads, sl.prefill_rank, a.splits
            )
            for pp in range(pp_size):  # decode holds every layer: ask every prefill stage
                r = fetch_rank_info(
                    host, port, c.dp_rank, sl.prefill_rank, pp, timeout=2.0, secret=m.secret
                )
                c.targets.append(
                    PrefillTarget(
                        f"tcp://{r['rank_ip']}:{r['rank_port']}",
                        sl.prefill_rank * pp_size + pp,
                        sl,
                        required,
                    )
                )
        if errs:
            return self._fail_conn(
                c, f"prefill {c.addr} is incompatible: " + "; ".join(errs), tell_prefill=True
            )
        buffers = BufferDesc.from_kv_args(a)
        window = m.backend.open_window(c.session_id)
        if window is not None:  # this connection's own addresses, fenced when it fails
            buffers = _translated(buffers, window.translate)
            c.windowed = True
        reg = Register(
            session_id=c.session_id,
            decode_rank=a.engine_rank,
            decode_tp_size=a.tp_size,
            reply_endpoint=m.endpoint(host),
            buffers=buffers,
            compat=a.compat_info(),
            backend=m.backend_name,
            backend_info=m.backend.describe(),
        )
        for t in c.targets:
            m.send(t.endpoint, reg)
        with c.acked:
            c.acked.wait_for(
                lambda: len(c.acks) >= len(c.targets) or c.state == "failed", REGISTER_TIMEOUT_S
            )
        if c.state == "failed":
            return
        missing = [t.endpoint for t in c.targets if t.rank not in c.acks]
        if missing:
            hint = " (is --disaggregation-secret the same on both sides?)" if m.secret else ""
            return self._fail_conn(
                c,
                f"no registration answer from prefill rank(s) {', '.join(missing)} "
                f"within {REGISTER_TIMEOUT_S:.0f}s{hint}",
            )
        rejected = [ack.error for ack in c.acks.values() if not ack.ok]
        if rejected:
            return self._fail_conn(
                c,
                f"prefill {c.addr} rejected registration: {'; '.join(rejected)}",
                tell_prefill=True,
            )
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
            self.send_abort(c, room, generation, reason)
        idle = sum(1 for t in c.targets if t.pair is not None and t.pair.empty)
        logger.info(
            "%s: connected to prefill %s (%d rank(s)%s)",
            m.name,
            c.addr,
            len(c.targets),
            f"; {idle} of them write nothing here, their heads are read from other replicas, and "
            "only conclude each room"
            if idle
            else "",
        )

    def _fail_conn(self, c: PrefillConn, reason: str, tell_prefill: bool = False) -> None:
        """Fail the connection and its unfinished rooms. ``tell_prefill``: the prefill is alive
        (e.g. incompatible), so abort the rooms there too instead of letting them time out."""
        m = self.mgr
        failed = []
        with m.lock:
            if c.state == "failed":
                return failed
            c.state, c.error = "failed", reason
            if self.conns.get(c.key) is c:
                del self.conns[c.key]  # the next room to this address starts afresh
            self.retired.pop(c.session_id, None)
            for room in list(c.rooms):
                rs = self.rooms.get(room)
                if rs is not None and rs.conn is c and m.status.get(room) != KVPoll.Success:
                    rs.peer_dead = True
                    m.update_status(room, KVPoll.Failed, reason)
                    failed.append((room, rs.generation))
        with c.acked:
            c.acked.notify_all()
        self._fence(c)  # before any of its rooms' pages can be freed (writes_drained waits for it)
        logger.warning("%s: %s", m.name, reason)
        if tell_prefill:
            for room, generation in failed:
                self.send_abort(c, room, generation, reason)

    # ---- fencing ----------------------------------------------------------------------------
    def fenced(self, c: PrefillConn) -> bool:
        """True when no write of ``c``'s prefill session can reach this rank's buffers any more,
        or when the backend cannot fence (no window: the session's writes are not fenced)."""
        with self.mgr.lock:
            return c.fenced or not c.windowed

    def _fence(self, c: PrefillConn) -> None:
        if not c.windowed or c.fenced:
            return
        try:
            self.mgr.backend.fence_window(c.session_id)
        except Exception:  # never free the pages of an unfenced window: its rooms stay parked
            logger.exception(
                "%s: cannot fence the window of prefill %s (session %s); retrying",
                self.mgr.name,
                c.addr,
                c.session_id,
            )
            with self.mgr.lock:
                self.retired[c.session_id] = c  # tick() tries again
            return
        with self.mgr.lock:
            c.fenced = True
            self.fenced_windows += 1
        logger.info(
            "%s: fenced the KV window of prefill %s (session %s): its late writes land in scratch "
            "memory",
            self.mgr.name,
            c.addr,
            c.session_id,
        )

    def mark_suspect(self, rs: RoomRecv) -> None:
        """A writer of the room may still have bytes under way: free its pages only after the
        connection's window is fenced. The connection takes no new room from now on."""
        m, c = self.mgr, rs.conn
        with m.lock:
            rs.suspect = True
            if not c.windowed or c.retired or c.state == "failed":
                return
            c.retired = True
            if self.conns.get(c.key) is c:
                del self.conns[c.key]
            self.retired[c.session_id] = c
        logger.warning(
            "%s: room %d: a write from prefill %s may still arrive; its pages wait until the "
            "connection's window is fenced, new rooms use a new connection",
            m.name,
            rs.room,
            c.addr,
        )

    def _fence_retired(self) -> None:
        with self.mgr.lock:
            ready = [
                c
                for c in self.retired.values()
                if c.state == "failed"
                or all(
                    (rs := self.rooms.get(r)) is None or rs.conn is not c or rs.suspect
                    for r in c.rooms
                )
            ]
            for c in ready:
                del self.retired[c.session_id]  # heartbeats stop; prefill drops the session
        for c in ready:
            self._fence(c)

    def send_abort(self, c: PrefillConn, room: int, generation: int, reason: str) -> None:
        reply = self.mgr.endpoint(parse_addr(c.addr)[0])
        for t in c.targets:
            self.mgr.send(
                t.endpoint,
                Abort(
                    session_id=c.session_id,
                    room=room,
                    generation=generation,
                    reason=reason,
                    reply_endpoint=reply,
                ),
            )

    # ---- control messages (I/O thread) ----------------------------------------------------
    def on_message(self, msg) -> None:
        m = self.mgr
        if isinstance(msg, TransferStatus):
            with m.lock:
                rs = self.rooms.get(msg.room)
                any_gen = msg.generation == 0 and msg.state == KVPoll.Failed
                if rs is None or (rs.generation != msg.generation and not any_gen):
                    return  # a cleared room or an older generation of it
                if any_gen and m.status.get(msg.room) not in (
                    KVPoll.Bootstrapping,
                    KVPoll.WaitingForInput,
                ):
                    # this decode already asked, so the prefill will answer for this generation
                    return
                if msg.state == KVPoll.Transferring:  # progress: queued or writing on prefill
                    if rs.sent_at is not None and m.status.get(msg.room) == KVPoll.Transferring:
                        rs.sent_at = time.monotonic()
                    return
                rs.stopped.add(msg.prefill_rank)
                if msg.state == KVPoll.Failed and msg.unsettled:
                    self.mark_suspect(rs)
                if msg.state == KVPoll.Failed:
                    m.update_status(
                        msg.room,
                        KVPoll.Failed,
                        f"prefill {rs.conn.addr} rank {msg.prefill_rank}: {msg.reason}",
                    )
                elif msg.state == KVPoll.Success:
                    rs.succeeded.add(msg.prefill_rank)
                    if len(rs.succeeded) >= len(rs.conn.targets):
                        m.update_status(msg.room, KVPoll.Success)
        elif isinstance(msg, Heartbeat) and msg.ack:
            with m.lock:
                c = self._by_session(msg.session_id)
                if c is not None:
                    c.hb_acked[msg.prefill_rank] = time.monotonic()
            if c is not None and not msg.known and c.state == "ready":
                self._fail_conn(
                    c,
                    f"prefill instance {c.addr} no longer knows this decode rank (it restarted, "
                    "or declared this decode dead)",
                )
        elif isinstance(msg, AbortAck):
            with m.lock:
                rs = self.rooms.get(msg.room)
                if rs is not None and rs.generation == msg.generation:
                    rs.stopped.add(msg.prefill_rank)
        elif isinstance(msg, RegisterAck):
            with m.lock:
                c = self._by_session(msg.session_id)
            if c is not None:
                with c.acked:
                    c.acks[msg.prefill_rank] = msg
                    c.acked.notify_all()
        else:
            logger.warning("%s: unexpected %s from a prefill rank", m.name, type(msg).__name__)

    def _by_session(self, session_id: str) -> Optional[PrefillConn]:
        c = next((c for c in self.conns.values() if c.session_id == session_id), None)
        return c if c is not None else self.retired.get(session_id)

    def tick(self, now: float) -> None:
        m = self.mgr
        self._take_completion_notices()
        self._fence_retired()
        dead: list[tuple[PrefillConn, str]] = []
        beats: list[tuple[str, Heartbeat]] = []
        dead_after = m.heartbeat_misses * m.heartbeat_interval
        with m.lock:
            for c in [*self.conns.values(), *self.retired.values()]:
                if c.state != "ready":
                    continue
                silent = now - min(c.hb_acked.values(), default=now)
                if silent > dead_after:
                    dead.append(
                        (
                            c,
                            f"prefill instance {c.addr} unreachable (no heartbeat answer for "
                            f"{silent:.1f}s)",
                        )
                    )
                    continue
                if now < c.next_hb:
                    continue
                c.next_hb = now + m.heartbeat_interval
                c.hb_seq += 1
                host = parse_addr(c.addr)[0]
                hb = Heartbeat(
                    session_id=c.session_id, seq=c.hb_seq, reply_endpoint=m.endpoint(host)
                )
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
                    self.on_message(
                        TransferStatus(
                            room=room,
                            generation=generation,
                            state=int(KVPoll.Success),
                            prefill_rank=rank,
                        )
                    )

    # ---- receiver-facing helpers ----------------------------------------------------------
    def add_room(self, room: int, addr: str, dp_rank: int = 0) -> RoomRecv:
        c = self.get_conn(addr, dp_rank)
        with self.mgr.lock:
            old = self.rooms.get(room)
            if old is not None:
                old.conn.rooms.discard(room)
                self.mgr.status.clear(room)
            rs = self.rooms[room] = RoomRecv(room, next(self._generations), c)
            c.rooms.add(room)
            self.mgr.status.add(room, KVPoll.Bootstrapping)
            if c.state == "failed":
                self.mgr.update_status(room, KVPoll.Failed, c.error)
        return rs

    def clear(self, rs: RoomRecv) -> None:
        with self.mgr.lock:
            if self.rooms.get(rs.room) is rs:  # not a newer receiver of the same room
                del self.rooms[rs.room]
                self.mgr.status.clear(rs.room)
                rs.conn.rooms.discard(rs.room)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def counts(self) -> dict:
        return {
            "kv_peer_connections": len(self.conns),
            "kv_retired_connections": len(self.retired),
            "kv_fenced_windows": self.fenced_windows,
        }


def _translated(b: BufferDesc, translate) -> BufferDesc:
    """``b`` with every buffer address replaced by its window address."""

    def tr(ptrs: list[int], lens: list[int]) -> list[int]:
        return [translate(p) if n > 0 else p for p, n in zip(ptrs, lens)]

    return msgspec.structs.replace(
        b,
        regions=[r.at(translate(r.ptr)) if r.nbytes > 0 else r for r in b.regions],
        aux_data_ptrs=tr(b.aux_data_ptrs, b.aux_data_lens),
    )
