"""Prefill side of a KV manager (``PrefillRole``): accepts decode registrations and transfer
requests, pushes KV pages and the metadata row into decode memory (through the transfer workers,
``writer.py``), and reports the outcome per room. ``sender.KVSender`` is the per-room face of it.

Room lifecycle on a prefill rank: ``KVSender`` created (Bootstrapping) -> every expected decode
rank sent its ``TransferRequest`` (WaitingForInput) -> ``send()`` chunks (Transferring) -> the
last chunk's pages and metadata row (``bootstrap_room`` last) landed and ``TransferStatus``
went to decode (Success) | anything fails (Failed, decode told why).

With tensor parallelism each rank writes into the decode ranks ``rank_map`` pairs it with
(``_Session.pair``) what each region's split says: whole pages when both hold the same bytes, a
slice of each page (its KV heads, its share of each segment) at the right offset otherwise, the
replicated regions from one prefill rank per decode rank. A rank whose bytes decode reads from
other ranks holds an empty pair with one decode rank: that rank's request names no page, and the
room goes through the same lifecycle here with nothing written (Success, or Failed and decode
told), so this rank concludes its part of every room like the others.

Liveness: decode ranks heartbeat every session; a session silent for ``heartbeat_misses *
heartbeat_interval`` seconds is declared dead, its rooms fail together ("decode instance
HOST:PORT unreachable") and the scheduler frees their KV. Destinations are checked against
what the session registered and what its other rooms hold (``destinations.py``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from pdserve.disagg.bootstrap import register_rank
from pdserve.disagg.destinations import (
    DestinationGuard,
    dst_regions,
    pair_plan,
    registration_errors,
)
from pdserve.disagg.messages import (
    Abort,
    Heartbeat,
    Register,
    RegisterAck,
    TransferRequest,
    TransferStatus,
)
from pdserve.disagg.poll import KVPoll
from pdserve.disagg.rank_map import PairPlan
from pdserve.disagg.writer import TransferWorkers
from pdserve.kv_region import Region

logger = logging.getLogger(__name__)

NUM_TRANSFER_WORKERS = 2
MAX_TOMBSTONES = 16384


@dataclass
class _Session:
    """One registered decode connection."""

    session_id: str
    reply_endpoint: str
    reg: Register
    guard: DestinationGuard
    error: str = ""
    dst_regions: list[Region] = field(
        default_factory=list
    )  # decode's region paired with each of this rank's
    last_seen: float = 0.0  # last message from the session (heartbeats keep it fresh)
    pair: Optional[PairPlan] = None  # what this rank writes into that decode rank

    @property
    def peer(self) -> str:
        return self.reply_endpoint.removeprefix("tcp://")


@dataclass
class _Room:
    room: int
    created: float
    dsts: dict[str, TransferRequest] = field(default_factory=dict)  # session_id -> request
    required: int = 1
    has_sender: bool = False


class PrefillRole:
    def __init__(self, mgr):
        self.mgr = mgr
        a = mgr.kv_args
        self.rank = a.engine_rank * a.pp_size + a.pp_rank  # unique within the prefill instance
        self.sessions: dict[str, _Session] = {}
        self.rooms: dict[int, _Room] = {}
        # rooms that ended here (or were aborted before anything arrived) -> why; a late
        # TransferRequest or sender for them fails at once instead of waiting for a timeout
        self._tombstones: OrderedDict[int, str] = OrderedDict()
        self.failed_here: set[int] = set()  # rooms that failed through this prefill's own fault
        self._written: dict[
            int, list[int]
        ] = {}  # room -> [KV descriptors, KV bytes] written so far
        self.workers = TransferWorkers(self, NUM_TRANSFER_WORKERS)
        self._next_sweep = 0.0
        self.dead_after_s = mgr.heartbeat_interval * mgr.heartbeat_misses

    # ---- bootstrap ------------------------------------------------------------------------
    def register_to_bootstrap(self) -> None:
        a, m = self.mgr.kv_args, self.mgr
        info = {
            "tp_size": a.tp_size,
            "tp_rank": a.engine_rank,
            "dp_size": a.dp_size,
            "dp_rank": a.system_dp_rank,
            "pp_size": a.pp_size,
            "pp_rank": a.pp_rank,
            "rank_ip": m.local_ip(m.bootstrap_host),
            "rank_port": m.port,
            # the pipeline stage's layers: it writes only these into decode's pool
            "start_layer": a.prefill_start_layer,
            "end_layer": a.prefill_start_layer + a.num_local_layers,
        }
        info.update(a.compat_info())
        register_rank(m.bootstrap_host, m.bootstrap_port, info, secret=m.secret)

    # ---- control messages (I/O thread) ----------------------------------------------------
    def on_message(self, msg) -> None:
        if isinstance(msg, TransferRequest):
            self._on_transfer_request(msg)
        elif isinstance(msg, Register):
            self._on_register(msg)
        elif isinstance(msg, Abort):
            self._on_abort(msg)
        elif isinstance(msg, Heartbeat):
            with self.mgr.lock:
                s = self.sessions.get(msg.session_id)
                if s is not None:
                    s.last_seen = time.monotonic()
            self.mgr.send(
                msg.reply_endpoint,
                Heartbeat(
                    session_id=msg.session_id,
                    seq=msg.seq,
                    ack=True,
                    prefill_rank=self.rank,
                    known=s is not None,
                ),
            )
        else:
            logger.warning(
                "%s: unexpected %s from a decode rank", self.mgr.name, type(msg).__name__
            )

    def _on_register(self, msg: Register) -> None:
        errs = registration_errors(self.mgr.kv_args, msg, self.mgr.backend_name)
        a = self.mgr.kv_args
        paired = [] if errs else dst_regions(a, msg.buffers)[0]  # decode's region for each of ours
        if not errs:
            try:
                self.mgr.backend.connect(msg.session_id, msg.backend_info, msg.buffers.spans())
            except Exception as e:
                errs.append(f"cannot attach to decode buffers: {e}")
        pair = None if errs else pair_plan(a, msg)
        regions = [msg.buffers.regions[j] for j in paired]
        guard = DestinationGuard(
            msg.buffers, regions, a.num_groups, empty=pair is not None and pair.empty
        )
        sess = _Session(
            msg.session_id,
            msg.reply_endpoint,
            msg,
            guard,
            "; ".join(errs),
            regions,
            time.monotonic(),
            pair,
        )
        with self.mgr.lock:
            self.sessions[msg.session_id] = sess
        if errs:
            logger.warning(
                "%s: rejected decode registration from %s: %s",
                self.mgr.name,
                msg.reply_endpoint,
                sess.error,
            )
        else:
            logger.info(
                "%s: decode rank %d registered (%s)%s",
                self.mgr.name,
                msg.decode_rank,
                msg.reply_endpoint,
                "; it reads none of this rank's bytes, this rank only concludes its rooms"
                if pair.empty
                else "",
            )
        self.mgr.send(
            msg.reply_endpoint,
            RegisterAck(
                session_id=msg.session_id, prefill_rank=self.rank, ok=not errs, error=sess.error
            ),
        )

    def _on_transfer_request(self, msg: TransferRequest) -> None:
        m = self.mgr
        with m.lock:
            sess = self.sessions.get(msg.session_id)
            reason, refused = "", False
            r = self.rooms.get(msg.room)
            old = r.dsts.get(msg.session_id) if r is not None else None
            if sess is None:
                reason = (
                    f"decode session {msg.session_id} is not registered with prefill rank "
                    f"{self.rank}"
                )
            elif sess.error:
                reason = sess.error
            elif msg.room in self._tombstones:
                reason = f"prefill already ended room {msg.room}: {self._tombstones[msg.room]}"
            elif (
                old is not None
                and old.generation != msg.generation
                and m.status.get(msg.room) in (KVPoll.Transferring, KVPoll.Success)
            ):
                # fence: never redirect writes of a transfer in progress to new pages
                reason = f"decode re-requested room {msg.room} while its transfer was in progress"
                m.update_status(msg.room, KVPoll.Failed, reason)
            else:
                reason = sess.guard.check(msg)
                refused = bool(reason)
                if refused:
                    logger.warning(
                        "%s: refused transfer request for room %d from %s: %s",
                        m.name,
                        msg.room,
                        sess.peer,
                        reason,
                    )
            if not reason:
                sess.last_seen = time.monotonic()
                sess.guard.claim(msg)
                r = self.rooms.setdefault(msg.room, _Room(msg.room, time.monotonic()))
                r.dsts[msg.session_id] = msg
                r.required = max(1, msg.required_dst_info_num)
                if m.status.get(msg.room) == KVPoll.Failed:
                    reason = m.failure_reason(msg.room) or "room already failed on prefill"
                elif len(r.dsts) >= r.required:
                    m.update_status(msg.room, KVPoll.WaitingForInput, create=True)
            elif sess is None or sess.error or refused:
                m.update_status(msg.room, KVPoll.Failed, reason, create=True)
                self.rooms.setdefault(msg.room, _Room(msg.room, time.monotonic()))
        if reason:
            endpoint = sess.reply_endpoint if sess is not None else msg.reply_endpoint
            if not endpoint:
                logger.warning(
                    "%s: transfer request for room %d from unknown session %s",
                    m.name,
                    msg.room,
                    msg.session_id,
                )
                return
            m.send(
                endpoint,
                TransferStatus(
                    room=msg.room,
                    generation=msg.generation,
                    state=int(KVPoll.Failed),
                    prefill_rank=self.rank,
                    reason=reason,
                ),
            )

    def _on_abort(self, msg: Abort) -> None:
        reason = f"aborted by decode: {msg.reason}"
        with self.mgr.lock:
            sess = self.sessions.get(msg.session_id)
            r = self.rooms.get(msg.room)
            if r is not None and r.has_sender:
                self.mgr.update_status(msg.room, KVPoll.Failed, reason)
            else:
                # this prefill never got the request: forget the room; a later sender fails at once
                self.rooms.pop(msg.room, None)
                self.mgr.status.clear(msg.room)
                self._bury(msg.room, reason)
        endpoint = sess.reply_endpoint if sess is not None else msg.reply_endpoint
        if endpoint:
            self.workers.submit_abort_ack(msg.room, msg.generation, endpoint)

    def tick(self, now: float) -> None:
        self.workers.supervise()
        self._check_sessions(now)
        if now < self._next_sweep:
            return
        self._next_sweep = now + 1.0
        m = self.mgr
        orphan_after = m.bootstrap_timeout + m.waiting_timeout
        with m.lock:
            # requests whose prefill-side request never arrived (or was already released)
            for room in [
                r.room
                for r in self.rooms.values()
                if not r.has_sender and now - r.created > orphan_after
            ]:
                self.rooms.pop(room, None)
                m.status.clear(room)
                self._bury(room, "the room expired before this prefill received the request")

    def _check_sessions(self, now: float) -> None:
        """Declare decode sessions that stopped heartbeating dead; fail all their rooms at once."""
        m = self.mgr
        with m.lock:
            dead = [s for s in self.sessions.values() if now - s.last_seen > self.dead_after_s]
            for s in dead:
                del self.sessions[s.session_id]
            lost = {
                s.session_id: [r.room for r in self.rooms.values() if s.session_id in r.dsts]
                for s in dead
            }
        for s in dead:
            rooms = lost[s.session_id]
            reason = (
                f"decode instance {s.peer} unreachable (no heartbeat for {now - s.last_seen:.1f}s)"
            )
            for room in rooms:
                self.fail(room, reason)
            if rooms:
                logger.warning("%s: %s; failed %d room(s)", m.name, reason, len(rooms))
            else:
                logger.info("%s: dropped decode session %s: %s", m.name, s.session_id, reason)
            m.backend.disconnect(s.session_id)
            m.drop_peer(s.reply_endpoint)

    # ---- scheduler-facing helpers ---------------------------------------------------------
    def _bury(self, room: int, reason: str) -> None:
        self._tombstones[room] = reason
        self._tombstones.move_to_end(room)
        while len(self._tombstones) > MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    def add_sender(self, room: int) -> None:
        with self.mgr.lock:
            r = self.rooms.setdefault(room, _Room(room, time.monotonic()))
            r.has_sender = True
            self.mgr.status.add(room, KVPoll.Bootstrapping)
            reason = self._tombstones.pop(room, None)
            if reason is not None:
                self.mgr.update_status(room, KVPoll.Failed, reason)

    def fail(self, room: int, reason: str, here: bool = False) -> None:
        """Fail the room locally now and tell decode once in-flight writes are done. When no
        decode rank has asked for the room yet, every registered session is told (generation 0:
        any), so a decode still preallocating for it ends the request at once. ``here``: this
        prefill caused it (not its decode peer)."""
        if not self.mgr.update_status(room, KVPoll.Failed, reason):
            return  # already failed (decode knows, or was told) or already cleared
        with self.mgr.lock:
            if here:
                self.failed_here.add(room)
            targets = [(sess, req.generation) for sess, req in self.targets(room)]
            r = self.rooms.get(room)
            if r is None or not r.dsts:
                targets = [(sess, 0) for sess in self.sessions.values() if not sess.error]
        self.workers.submit_failure(room, reason, targets)

    def reject(self, room: int, reason: str) -> None:
        """The prefill request for ``room`` was refused before it got a sender: fail the room for
        decode now (told at once, or when it asks) and forget it."""
        with self.mgr.lock:
            r = self.rooms.get(room)
            if r is not None and r.has_sender:
                return  # a live request owns this room
            self.rooms.setdefault(room, _Room(room, time.monotonic()))
            self.mgr.status.add(room, KVPoll.Bootstrapping)
        self.fail(room, reason)
        self.clear(room)

    def release(self, room: int) -> None:
        """This rank will not write for ``room`` again: its destinations may be reused."""
        with self.mgr.lock:
            for sess in self.sessions.values():
                sess.guard.release(room)

    def clear(self, room: int) -> None:
        with self.mgr.lock:
            st = self.mgr.status.get(room)
            if st == KVPoll.Failed:
                self._bury(room, "failed: " + (self.mgr.status.reason(room) or "unknown reason"))
            elif st is not None:
                self._bury(
                    room, "finished" if st == KVPoll.Success else "released before its transfer"
                )
            self.rooms.pop(room, None)
            self.mgr.status.clear(room)
            self.failed_here.discard(room)
            self._written.pop(room, None)
        self.release(room)
        self.mgr.faults.forget(room)

    def close(self) -> None:
        self.workers.close()

    def counts(self) -> dict:
        return {
            "kv_peer_sessions": len(self.sessions),
            "kv_dst_claims": sum(s.guard.rooms for s in self.sessions.values()),
        }

    def destinations(self, room: int, writing_only: bool = False) -> list[TransferRequest]:
        """The transfer requests decode ranks sent for ``room`` so far (caller holds the lock).
        ``writing_only``: leave out those of sessions this rank writes nothing into."""
        r = self.rooms.get(room)
        if r is None:
            return []
        return [
            req for sid, req in r.dsts.items() if not (writing_only and self._writes_nothing(sid))
        ]

    def _writes_nothing(self, session_id: str) -> bool:
        s = self.sessions.get(session_id)
        return s is not None and s.pair is not None and s.pair.empty

    def required_destinations(self, room: int) -> int:
        """Decode ranks that will ask for ``room`` (caller holds the lock)."""
        r = self.rooms.get(room)
        return r.required if r is not None else 1

    def count_written(self, room: int, descriptors: int, nbytes: int) -> None:
        """Account KV writes of ``room`` (transfer workers; takes the lock)."""
        with self.mgr.lock:
            w = self._written.setdefault(room, [0, 0, time.time()])
            w[0] += descriptors
            w[1] += nbytes

    def take_written(self, room: int) -> tuple[int, int, Optional[float]]:
        """(KV descriptors, KV bytes, wall time the first write completed) written for
        ``room``, forgetting them."""
        with self.mgr.lock:
            w = self._written.pop(room, [0, 0, None])
        return w[0], w[1], w[2]

    def mark_failed_here(self, room: int) -> None:
        """The room failed through this prefill's own fault (caller holds the lock)."""
        self.failed_here.add(room)

    def targets(self, room: int) -> list[tuple[_Session, TransferRequest]]:
        """(session, request) of every decode rank that asked for the room (caller holds the
        lock)."""
        r = self.rooms.get(room)
        if r is None:
            return []
        return [(self.sessions[sid], req) for sid, req in r.dsts.items() if sid in self.sessions]
