"""Decode side of disaggregation: prealloc queue -> transfer queue -> running batch.

- prealloc queue: a ``KVReceiver`` per request looks up the prefill instance and registers with
  it; once the connection is ready, pages for the whole prompt and a metadata slot are
  preallocated within a budget that keeps ``num_reserved_decode_tokens`` per running request,
  and their indices go to prefill (``send_metadata``);
- transfer queue: on Success the metadata row is checked (its room must be the request's), the
  first token and its logprobs are committed, and the request joins the running batch without a
  prefill forward; while ``--max-running-requests`` requests run, a request whose KV arrived
  waits in the transfer queue, first come first served (``GET /get_load`` counts it in
  ``num_waiting_reqs``, as SGLang's decode counts its waiting queue);
- on Failed (or abort) the request ends at once with the reason; its preallocated pages are freed
  only when no prefill rank can still write into them (``writes_drained``);
- backpressure: a request that cannot get its pages within ``--disaggregation-prealloc-timeout``
  seconds of being ready for them, or that arrives while ``--disaggregation-max-prealloc-queue``
  requests already wait, ends at once with 503 and the reason (the router then tries another
  decode), and its prefill is told to drop the room instead of waiting for a timeout.

Requests that arrive without bootstrap fields are served like on a colocated server.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from pdserve.disagg.dp_resolver import PrefillDPResolver, ResolvingReceiver
from pdserve.disagg.fake import FakeKVReceiver, is_fake_host
from pdserve.disagg.metadata import MetadataBuffers, SlotAllocator
from pdserve.disagg.migration import commit_resumed
from pdserve.disagg.poll import KVPoll, poll_and_all_reduce
from pdserve.engine.pd_queues import PDQueues, SchedulerPort
from pdserve.engine.request import FinishKind, FinishReason, PDState, Req

logger = logging.getLogger(__name__)

# HTTP status of a failed request: 502 when its KV did not come from prefill (prefill failed,
# died, timed out, sent an untrusted row), 503 when this decode is overloaded. The router blames
# the prefill leg for a 502 and this decode for a 503.
KV_NOT_RECEIVED_STATUS = 502
OVERLOADED_STATUS = 503


@dataclass
class _DecodeState(PDState):
    receiver: Any
    slot: Optional[int] = None
    ready_since: Optional[float] = None  # when the connection was ready and pages were first wanted


class DecodeQueues(PDQueues):
    def __init__(
        self,
        scheduler: SchedulerPort,
        mgr,
        metadata: MetadataBuffers,
        receiver_cls,
        fake: bool = False,
        group=None,
    ):
        self.s = scheduler
        self.mgr = mgr
        self.meta = metadata
        self.slots = SlotAllocator(metadata.num_slots)
        self.receiver_cls = receiver_cls
        self.fake = fake  # fake backend: nothing arrives, decode computes the prompt itself
        self.group = group
        self.prealloc: list[Req] = []
        self.transfer: list[Req] = []
        self.kv_ready = (
            0  # of ``transfer``: KV arrived, waiting for a place in the batch (at the last step)
        )
        # (receiver, pages per cache group, slot) of ended rooms whose writers may still be active
        self.draining: list[tuple[Any, list[list[int]], Optional[int]]] = []
        self.migration = None  # requests moving out (disagg/migration.py), from the first move
        self.dp_resolver = PrefillDPResolver(
            getattr(mgr, "name", "decode"), getattr(mgr, "secret", None)
        )

    # ---- scheduler interface ----------------------------------------------------------------
    def accepts(self, req: Req) -> bool:
        return req.bootstrap_host is not None and req.bootstrap_room is not None

    def add(self, req: Req) -> None:
        if is_fake_host(req.bootstrap_host):
            receiver = FakeKVReceiver(None, "", req.bootstrap_room)  # warm-up: no peer is contacted
        else:
            addr = (
                f"{req.bootstrap_host}:"
                f"{req.bootstrap_port or self.s.args.disaggregation_bootstrap_port}"
            )
            if req.prefill_dp_rank is not None or self.fake:
                receiver = self.receiver_cls(
                    self.mgr, addr, req.bootstrap_room, prefill_dp_rank=req.prefill_dp_rank
                )
            else:  # the prefill's bootstrap server says which of its DP groups holds the KV
                receiver = ResolvingReceiver(
                    self.mgr, addr, req.bootstrap_room, self.receiver_cls, self.dp_resolver
                )
        receiver.init()
        req.disagg = _DecodeState(receiver)
        limit = self.s.args.disaggregation_max_prealloc_queue
        full = limit and len(self.prealloc) >= limit
        self.prealloc.append(req)
        if full:
            self._fail(
                req,
                f"decode is overloaded: {len(self.prealloc) - 1} requests already wait for KV "
                f"pages (--disaggregation-max-prealloc-queue {limit})",
                OVERLOADED_STATUS,
            )

    def reject(self, host: Optional[str], port: Optional[int], room: int, reason: str) -> None:
        """The request for ``room`` was refused before it got here: tell its prefill (once the
        connection is up) instead of letting it wait for its bootstrap timeout."""
        if not host or is_fake_host(host) or self.fake:
            return
        receiver = self.receiver_cls(
            self.mgr, f"{host}:{port or self.s.args.disaggregation_bootstrap_port}", room
        )
        receiver.abort(f"decode request {reason}")
        self.draining.append((receiver, [], None))  # no pages

    def queued(self) -> list[Req]:
        # waiting for pages, or for their KV and then a running place
        return self.prealloc + self.transfer

    def all_reqs(self) -> list[Req]:
        moving = self.migration.out if self.migration is not None else []
        return self.prealloc + self.transfer + moving

    def extra_pages(self) -> list[int]:
        out = [0] * self.s.kv.num_groups
        for _, pages, _ in self.draining:
            for g, ids in enumerate(pages):
                out[g] += len(ids)
        return out

    @property
    def has_work(self) -> bool:
        moving = self.migration is not None and self.migration.out
        return bool(self.prealloc or self.transfer or self.draining or moving)

    def integrity(self) -> dict:
        counts = self.mgr.counts() if hasattr(self.mgr, "counts") else {}
        out = {
            "metadata_slots_total": self.slots.num_slots,
            "metadata_slots_free": self.slots.num_free(),
            "prealloc_queue": len(self.prealloc),
            "transfer_queue": len(self.transfer),
            "draining_rooms": len(self.draining),
            **counts,
        }
        if self.migration is not None:  # its rooms count as the server's (``kv_rooms``)
            moves = self.migration.integrity()
            out["kv_rooms"] = out.get("kv_rooms", 0) + moves["migration_rooms"]
            out.update(moves)
        return out

    def stats(self) -> dict:
        moves = self.migration.stats() if self.migration is not None else {}
        return {"draining_rooms": len(self.draining), **self.queues(), **moves}

    def queues(self) -> dict[str, int]:
        """Requests in this role's queues (``GET /get_load``): waiting for KV pages, or for their
        KV."""
        return {
            "prealloc_queue": len(self.prealloc),
            "transfer_queue": len(self.transfer) - self.kv_ready,
        }

    def discard(self, req: Req) -> None:
        """The request ended before joining the running batch: park its pages until drained."""
        st: Optional[_DecodeState] = req.disagg
        if st is None:
            return
        if self.migration is not None and self.migration.holds(req):
            self.migration.discard(req)
            return
        in_flight = req in self.prealloc or req in self.transfer
        if req in self.prealloc:
            self.prealloc.remove(req)
        if req in self.transfer:
            self.transfer.remove(req)
        if in_flight:
            # also when already Failed: ranks that did not report yet must stop (idempotent)
            st.receiver.abort(
                req.finish_reason.message if req.finish_reason else "aborted by decode"
            )
            # the cached prefix stays in the tree, unlocked; the own pages wait until drained
            self.draining.append((st.receiver, self.s.kv.park(req), st.slot))
        elif st.slot is not None:
            self.slots.free(st.slot)
        req.disagg = None

    def close(self) -> None:
        """Stop the KV manager and the look-up threads (a role switch)."""
        self.dp_resolver.close()
        self.mgr.close()
        if self.migration is not None:
            self.migration.close()

    # ---- queues ---------------------------------------------------------------------------------
    def process_queues(self) -> None:
        self._process_draining()
        self._process_prealloc()
        self._process_transfer()
        if self.migration is not None:
            self.migration.process()

    def _fail(self, req: Req, reason: str, status: int = KV_NOT_RECEIVED_STATUS) -> None:
        logger.warning("request %s (room %s) failed: %s", req.rid, req.bootstrap_room, reason)
        self.s.finish(req, FinishReason(FinishKind.ABORT, message=reason, status_code=status))

    def _process_draining(self) -> None:
        keep = []
        for receiver, pages, slot in self.draining:
            if receiver.writes_drained():
                receiver.clear()
                self.s.kv.free(pages)
                if slot is not None:
                    self.meta.clear_row(slot)
                    self.slots.free(slot)
            else:
                keep.append((receiver, pages, slot))
        self.draining = keep

    def _reserve_pages(self) -> int:
        tokens = self.s.num_running() * self.s.args.num_reserved_decode_tokens
        return (tokens + self.s.page_size - 1) // self.s.page_size

    def _process_prealloc(self) -> None:
        if not self.prealloc:
            return
        states = poll_and_all_reduce([r.disagg.receiver for r in self.prealloc], self.group)
        now = self.s.now()  # the loop clock: every rank times out alike
        blocked = False
        for req, state in zip(list(self.prealloc), states):
            st: _DecodeState = req.disagg
            if state == KVPoll.Failed:
                self._fail(
                    req, st.receiver.failure_reason() or "KV transfer failed while bootstrapping"
                )
                continue
            if state < KVPoll.WaitingForInput:
                continue
            st.ready_since = st.ready_since or now
            # the prompt, and for a request moved here mid-generation its output but the last token
            need = (req.seq_len + self.s.page_size - 1) // self.s.page_size
            if blocked or not self._try_prealloc(req, need):
                blocked = True  # first come, first served: later requests wait behind this one
                waited = now - st.ready_since
                if waited > self.s.args.disaggregation_prealloc_timeout:
                    free = self.s.kv.available()
                    self._fail(
                        req,
                        f"decode is overloaded: no room for {need} KV pages within {waited:.1f}s "
                        f"({free} free, {self._reserve_pages()} kept for running requests)",
                        OVERLOADED_STATUS,
                    )

    def _try_prealloc(self, req: Req, need: int) -> bool:
        """Take pages and a metadata slot and ask prefill for the KV; False when out of either."""
        st: _DecodeState = req.disagg
        slot = self.slots.alloc()
        # decode prefix cache: the leading full pages this server holds stay (locked) and are not
        # sent; at least the prompt's last page comes from prefill, with the first token
        got = self.s.kv.prealloc(req, self._reserve_pages()) if slot is not None else None
        if got is None:  # keep headroom for running decodes; retry next step
            if slot is not None:
                self.slots.free(slot)
            return False
        pages, cached = got
        st.slot = slot
        self.s.count("cache_hit_tokens", cached * self.s.page_size)
        self.meta.clear_row(slot)
        req.mark("preallocated")  # before prefill can hear of it: the timeline stays causal
        st.receiver.send_metadata(pages, slot, decode_prefix_pages=cached)
        self.prealloc.remove(req)
        self.transfer.append(req)
        return True

    def _process_transfer(self) -> None:
        self.kv_ready = 0
        if not self.transfer:
            return
        states = poll_and_all_reduce([r.disagg.receiver for r in self.transfer], self.group)
        for req, state in zip(list(self.transfer), states):
            if state == KVPoll.Success:
                if self.s.num_running() >= self.s.args.max_running_requests or self.kv_ready:
                    self.kv_ready += 1  # the batch is full (or one before it waits): next step
                    continue
                self._commit(req)
            elif state == KVPoll.Failed:
                self._fail(req, req.disagg.receiver.failure_reason() or "KV transfer failed")

    def _commit(self, req: Req) -> None:
        st: _DecodeState = req.disagg
        row = self.meta.get_row(st.slot)
        if row.room != req.bootstrap_room:
            if isinstance(
                st.receiver, FakeKVReceiver
            ):  # warm-up or the fake backend: nothing arrived
                self._compute_locally(req)
                return
            self._fail(
                req,
                f"metadata row {st.slot} belongs to room {row.room}, expected room "
                f"{req.bootstrap_room}; the KV cannot be trusted",
            )
            return
        if row.rope_delta != req.rope_delta:
            self._fail(
                req,
                f"prefill computed the prompt's positions shifted by {row.rope_delta} past its "
                f"images, this decode by {req.rope_delta}: their image processors differ",
                status=500,
            )
            return
        req.mark("kv_received")
        self.transfer.remove(req)
        self.meta.clear_row(st.slot)
        self.slots.free(st.slot)
        st.receiver.clear()
        req.disagg = None
        before = len(req.output_ids)  # output a request moved here brought along
        req.kv_len = req.seq_len
        req.cached_tokens = row.cached_tokens[0]
        req.input_logprobs_done = True
        req.output_ids.append(row.first_token)
        if row.hidden_states is not None and row.topk_p and row.topk_p[0] > 0:
            # a draft head's first draft and hidden state, computed by prefill
            from pdserve.engine.speculative import SpecState

            width = sum(1 for p in row.topk_p if p > 0)  # the head's first level, best first
            req.spec = SpecState(
                budget=self.s.args.speculative_num_draft_tokens,
                next_draft=row.topk_index[0],
                next_draft_p=row.topk_p[0],
                hidden=row.hidden_states,
                next_topk=(row.topk_index[:width], row.topk_p[:width]),
            )
        if req.grammar is not None:  # continue the grammar from prefill's first token
            req.grammar.replay(req.output_ids)
            if req.grammar.failed:
                message = (
                    f"prefill's first token {row.first_token} is not allowed by the request's "
                    "grammar here: prefill and decode disagree on the grammar"
                )
                failure = FinishReason(FinishKind.ABORT, status_code=500, message=message)
                self.s.start_decoding(req, failure)
                return
        if req.return_logprob:
            req.output_token_logprobs.append(
                (row.logprob if row.logprob is not None else 0.0, row.first_token)
            )
            if req.top_logprobs_num:
                req.output_top_logprobs.append(list(row.top_logprobs[: req.top_logprobs_num]))
        if req.resumed:
            commit_resumed(req, before)
        self.s.start_decoding(req)

    def _compute_locally(self, req: Req) -> None:
        """Fake backend: no KV arrived, so run the prompt here like a colocated server."""
        st: _DecodeState = req.disagg
        self.transfer.remove(req)
        self.s.kv.free(self.s.kv.park(req))
        self.slots.free(st.slot)
        req.disagg = None
        self.s.enqueue(req)
