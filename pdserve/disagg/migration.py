"""Moving running requests from this decode to another (``POST /migrate``): KV migration.

The source decode plays prefill for the target over the ordinary PD path: a ``KVManager`` in
prefill mode over this decode's own pools, with its own bootstrap server
(``--migration-bootstrap-port``, 0: any free port), started at the first migration. The
target admits the request like any PD request (``disagg/decode.py``: receiver, preallocated
pages, metadata slot, Success), with the output produced so far in ``resume_output_ids``.

Per request, on the scheduler thread (between steps, so never mid-forward):
1. ``start``: a running request whose KV is complete up to its last token (``kv_len ==
   seq_len - 1``) leaves the running batch, keeping its pages, and gets a ``KVSender`` for a
   fresh room; the front end is told what the target needs (tokens, sampling state, room);
2. ``process``: once the target asked for the room (WaitingForInput), every page of every
   cache group holding ``all_ids[:-1]`` and the metadata row (the last token as "first token",
   its logprob) go out as one last chunk;
3. Success: the request ends here as ``MIGRATED`` (its pages freed by the usual finish); the
   front end relays the target's stream. Failed (target gone, refused, timed out): the request
   joins the running batch again and goes on here, as if nothing happened.

Pages are freed only after Success or Failed, both of which the writer reports after its last
write completed or was fenced: no write lands in a freed page. Not covered: decodes with more
than one rank (TP, PP, DP attention). A speculating request moves with its draft's state: a draft
model's or head's KV is in the pages (the target must run the same draft, which registration
checks), a head's next draft and hidden state in the metadata row (as prefill sends them); the
target's draft model computes the last position again (the source's may lag by that one).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Optional

import msgspec

from pdserve.disagg.poll import KVPoll, poll_and_all_reduce
from pdserve.engine.request import FinishKind, FinishReason, PDState, Req

logger = logging.getLogger(__name__)

MIGRATION_SLOTS = 64  # metadata rows: requests moving out at once


class MigrationRefused(ValueError):
    """A request or a server that cannot migrate (the message says why; HTTP 400/409)."""


@dataclass
class _OutState(PDState):
    sender: Any
    target: str
    slot: Optional[int] = None
    sent: bool = False


def movable(req: Req) -> str:
    """Why ``req`` cannot move now ("" when it can)."""
    if req.finished:
        return "it has finished"
    if not req.output_ids or req.kv is None or req.kv_len != req.seq_len - 1:
        return "it is not decoding yet (its prompt is still being received or computed)"
    if req.drafts:
        return "it is inside a speculative step"
    lag = req.kv_len - req.kv.draft_len if req.kv.draft_len is not None else 0
    if lag > 1:  # one token the target's draft computes again (``DraftModelProposer.started``)
        return f"its draft model's KV is {lag} tokens behind its own"
    if req.disagg is not None:
        return "it is already moving"
    return ""


class MigrationOut:
    """The source side of migrations on one decode rank; ``DecodeQueues.migration``."""

    def __init__(self, scheduler, par, host: str):
        from pdserve.disagg.manager import get_kv_class
        from pdserve.disagg.metadata import SlotAllocator
        from pdserve.disagg.setup import build_kv_args, metadata_buffers
        from pdserve.engine.kv_pool import default_allocator

        if par.world.size > 1:
            raise MigrationRefused(
                "migration needs a decode of one rank (no TP, PP or DP attention) for now"
            )
        self.s = scheduler
        args = scheduler.args
        backend = args.disaggregation_transfer_backend
        if backend == "fake":
            raise MigrationRefused("the fake transfer backend moves no KV: cannot migrate")
        self.bootstrap = get_kv_class(backend, "bootstrap_server")(
            host, args.migration_bootstrap_port, 1, secret=args.disaggregation_secret
        )
        self.host, self.port = host, self.bootstrap.port
        # the sending side's settings: a prefill registered with the bootstrap server above
        send_args = copy.copy(args)
        send_args.disaggregation_mode = "prefill"
        send_args.disaggregation_bootstrap_port = self.port
        self.meta = metadata_buffers(scheduler, default_allocator, MIGRATION_SLOTS)
        self.slots = SlotAllocator(MIGRATION_SLOTS)
        kv_args = build_kv_args(scheduler, par, self.meta)
        self.mgr = get_kv_class(backend, "manager")(kv_args, "prefill", send_args, backend)
        self.sender_cls = get_kv_class(backend, "sender")
        self.out: list[Req] = []
        self.moved = 0
        self.failed = 0
        self.kv_bytes_sent = 0
        logger.info("migration sender ready, bootstrap %s:%d", host, self.port)

    # ---- the control call -----------------------------------------------------------------
    def start(self, req: Req, room: int, target: str) -> dict:
        """Take ``req`` out of the running batch and open its room; what the target needs."""
        self.s.hand_off(req)
        req.bootstrap_room = room
        req.disagg = _OutState(self.sender_cls(self.mgr, f"{self.host}:{self.port}", room), target)
        self.out.append(req)
        req.mark("migration_started")
        return {
            **msgspec.structs.asdict(req.generation()),
            "rid": req.rid,
            "room": room,
            "output_ids": req.output_ids,
            "cached_tokens": req.cached_tokens,
        }

    # ---- the queue (DecodeQueues.process_queues) -------------------------------------------
    def process(self) -> None:
        if not self.out:
            return
        states = poll_and_all_reduce([r.disagg.sender for r in self.out], None)
        for req, state in zip(list(self.out), states):
            st: _OutState = req.disagg
            if state == KVPoll.Failed:
                self._resume(req, st.sender.failure_reason() or "KV transfer failed")
            elif state == KVPoll.Success and st.sent:
                descriptors, nbytes, _ = st.sender.written()
                self.kv_bytes_sent += nbytes
                self.moved += 1
                self._release(req)
                logger.info("request %s moved to %s (%d KV bytes)", req.rid, st.target, nbytes)
                self.s.finish(req, FinishReason(FinishKind.MIGRATED, message=st.target))
            elif state >= KVPoll.WaitingForInput and not st.sent:
                self._send(req)

    def _send(self, req: Req) -> None:
        st: _OutState = req.disagg
        slot = self.slots.alloc()
        if slot is None:
            return  # every row is in flight: next step
        st.slot = slot
        kv, n = self.s.kv, req.seq_len - 1  # the KV of all_ids[:-1] is here
        prefix = st.sender.decode_prefix_pages()  # the target's prefix cache holds these
        starts = [kv.transfer_start(g, n, prefix) for g in range(kv.num_groups)]
        counts = kv.transfer_counts(n, prefix)
        st.sender.init(counts, slot)
        tok = req.output_ids[-1]
        logprob = req.output_token_logprobs[-1][0] if req.output_token_logprobs else None
        top = req.output_top_logprobs[-1] if req.output_top_logprobs else None
        self.meta.set_row(
            slot,
            req.bootstrap_room,
            tok,
            logprob=logprob,
            top_logprobs=top,
            cached_tokens=(req.cached_tokens, req.cached_tokens, 0, 0),
            rope_delta=req.rope_delta,
            # a draft head's next draft and hidden state; a draft model's KV is in the pages
            **(req.spec.metadata_fields() if req.spec is not None else {}),
        )
        # those of all_ids[:-1] only: a speculating request's pages reach past it (room for drafts)
        pages = [kv.send_pages(req, g, a, a + n) for g, (a, n) in enumerate(zip(starts, counts))]
        st.sender.send(pages, last_chunk=True)
        st.sent = True

    def _resume(self, req: Req, reason: str) -> None:
        logger.warning("request %s stays here: migration failed: %s", req.rid, reason)
        self.failed += 1
        self._release(req)
        req.bootstrap_room = None
        self.s.resume(req)

    def _release(self, req: Req) -> None:
        st: _OutState = req.disagg
        self.out.remove(req)
        st.sender.clear()
        if st.slot is not None:
            self.meta.clear_row(st.slot)
            self.slots.free(st.slot)
        req.disagg = None

    def discard(self, req: Req) -> None:
        """``req`` ended while moving (client gone): the target is told, the pages go."""
        if req in self.out:
            req.disagg.sender.abort("the request ended on the source decode while migrating")
            self._release(req)

    def cancel(self, rid: str, reason: str) -> bool:
        """The target will not take ``rid`` (its front end refused it, or cannot be reached): end
        the room now, so the request goes on here at the next step rather than after the
        bootstrap timeout. False when ``rid`` is not moving (already moved, or ended)."""
        req = next((r for r in self.out if r.rid == rid), None)
        if req is None or req.disagg.sent:
            return False  # once sent, the transfer's own outcome decides
        req.disagg.sender.abort(f"the target refused the request: {reason}")
        return True

    def holds(self, req: Req) -> bool:
        return req in self.out

    def integrity(self) -> dict:
        """Rooms of moves still open, metadata rows taken (none once every move ended)."""
        rooms = self.mgr.counts()["kv_rooms"]
        free = self.slots.num_free()
        return {"migration_rooms": rooms, "migration_slots_in_use": MIGRATION_SLOTS - free}

    def stats(self) -> dict:
        return {
            "migrating": len(self.out),
            "migrated": self.moved,
            "migrations_failed": self.failed,
            "migration_kv_bytes_sent": self.kv_bytes_sent,
        }

    def close(self) -> None:
        self.mgr.close()
        self.bootstrap.shutdown()


def commit_resumed(req: Req, before: int) -> None:
    """Target side, after ``DecodeQueues._commit`` appended the last token: the output the
    source already streamed (``before`` tokens and that last one) is not sent again, and
    per-token lists line up with ``output_ids`` (their earlier entries live on the source)."""
    if req.return_logprob:
        req.output_token_logprobs[:0] = [(0.0, t) for t in req.output_ids[:before]]
        if req.top_logprobs_num:
            req.output_top_logprobs[:0] = [[] for _ in range(before)]
    req.sent_output_len = len(req.output_ids)
    req.sent_input_logprobs = True


def migrate_control(loop, args: dict) -> dict:
    """The ``migrate_out`` control op: ``args`` has ``moves`` ([rid, room, target] each).
    Returns ``{"moved": [...], "refused": {rid: why}, "bootstrap_port"}`` (the front end names
    the host a target reaches it at)."""
    s = loop.scheduler
    pd = s.pd
    if "cancel" in args:  # the front end's relay could not hand the request over
        m = getattr(pd, "migration", None)
        return {"cancelled": m is not None and m.cancel(args["cancel"], args.get("reason", ""))}
    if s.args.disaggregation_mode != "decode" or pd is None:
        raise MigrationRefused("only a decode server moves its requests")
    if pd.migration is None:  # its bootstrap server listens where the server does
        pd.migration = MigrationOut(s, loop.par, loop.args.host)
    m = pd.migration
    by_rid = {r.rid: r for r in s.running + s.waiting + pd.all_reqs()}
    moved, refused = [], {}
    for rid, room, target in args["moves"]:
        req = by_rid.get(rid)
        why = "it is not running here" if req is None else movable(req)
        if why:
            refused[rid] = why
            continue
        moved.append({**m.start(req, int(room), target), "target": target})
    return {"moved": moved, "refused": refused, "bootstrap_port": m.port}
