"""Prefill side of disaggregation: bootstrap queue -> waiting queue -> prefill -> inflight queue.

- bootstrap queue: a ``KVSender`` per request waits for decode's ``TransferRequest`` (the
  destination pages); then a metadata slot is taken and the request joins the scheduler's
  waiting queue with ``max_new_tokens`` forced to 1;
- after every chunk the newly completed full pages go out at once (``chunk_done``); with
  ``--enable-disagg-layer-pipeline`` a prompt of at least
  ``--disagg-layer-pipeline-min-prefill-len`` tokens sends them (and, in its last chunk, all its
  remaining pages) a group of ``--disagg-layer-group-size`` layers at a time while the forward goes
  on (``layer_hook``: the model calls it as each layer's caches are written), and the send after the
  forward carries only what is left (other groups, a window's pages, a draft's layers, the routed
  expert ids); decode needs no setting, it waits for the room's completion either way;
- after the first token is sampled its metadata row is filled, the remaining pages and the row go
  out as the last chunk, and the request waits in the inflight queue (holding its KV);
- Success: the KV is released (the prefix stays in the radix cache) and the HTTP request is
  answered with the one token; Failed: the request ends with an error naming the cause;
- while a request is queued, prefilled or transferring here, decode hears about it every
  ``keepalive_s`` (``KVSender.keepalive``; during a step from a thread of their own,
  ``_Liveness``), so its waiting timeout catches a silent prefill, not a busy one;
- a room that fails while its request is still being prefilled (decode aborted it, decode died)
  ends the request at the next step instead of finishing a prefill nobody will use;
- a request that ends here with an abort (client gone, timeout, error) fails its room, and
  decode is told at once (``KVSender.abort``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

from pdserve.disagg.bootstrap import parse_addr, register_dp_rank
from pdserve.disagg.fake import is_fake_host
from pdserve.disagg.metadata import MetadataBuffers, SlotAllocator
from pdserve.disagg.poll import KVPoll, poll_and_all_reduce
from pdserve.engine.pd_queues import PDQueues, SchedulerPort
from pdserve.engine.request import FinishKind, FinishReason, PDState, Req

logger = logging.getLogger(__name__)

# HTTP status of a failed room: 502 when the decode side caused it (aborted, died, never asked),
# 503 when this prefill did (its transfer failed). The router blames the other leg for a 502.
PEER_FAILED_STATUS = 502
OWN_TRANSFER_FAILED_STATUS = 503


class _Liveness:
    """Keepalives for the rooms held here while the scheduler thread is inside a step, sent by a
    thread of their own: a forward of minutes on one core (a long prompt's chunk) is work, not
    silence. Between steps the scheduler thread sends them itself (``PrefillQueues._keep_alive``)
    and leaves the senders of the rooms it holds for this thread; whenever it has sent none for
    ``interval`` seconds (it is computing), this thread sends them. Kernels run without the GIL,
    so the thread gets its turn during one long kernel call too."""

    def __init__(self, interval: float):
        self.interval = interval
        self.senders: list = []  # the rooms the scheduler thread held at its last step's start
        self.last = time.monotonic()  # the last keepalive, by either thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pd-keepalive", daemon=True)
        self._thread.start()

    def holding(self, senders: list) -> None:
        """The rooms the scheduler thread holds as a step starts."""
        self.senders = senders

    def sent(self) -> None:
        """The scheduler thread sent their keepalives."""
        self.last = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.interval / 4):
            if time.monotonic() - self.last < self.interval:
                continue
            self.last = time.monotonic()
            for sender in self.senders:  # a finished room's sender sends nothing
                try:
                    sender.keepalive()
                except Exception as e:  # the next round tries again
                    logger.warning("keepalive for room %s failed: %s", sender.room, e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@dataclass
class _PrefillState(PDState):
    sender: Any
    slot: Optional[int] = None
    decode_prefix: int = 0  # leading pages decode already held
    # per cache group: the first page sent (decode's prefix, or the first page a window still sees)
    starts: list[int] = field(default_factory=list)
    first_send: Optional[float] = None  # monotonic time of the first chunk handed to the sender
    last_send: Optional[float] = None
    # the current forward's pages and their regions ((cache group, layer)) sent layer by layer
    layers_sent: tuple = ((), frozenset())
    layer_groups: int = 0  # layer groups sent during forwards (the layer pipeline)

    def skip(self, pages: list[list[int]]) -> frozenset:
        """The regions of ``pages`` already sent layer by layer, forgotten after this call: per
        cache group, those of the pages the layer pipeline sent when they are these pages (a
        group final only after the last chunk, a window's, goes now in full)."""
        sent, keys = self.layers_sent
        self.layers_sent = ((), frozenset())
        same = {g for g, (a, b) in enumerate(zip(sent, pages)) if a and a == b}
        return frozenset((g, layer) for g, layer in keys if g in same)

    @property
    def sent_pages(self) -> list[int]:
        """Per cache group, pages of the request handled so far: those before its start and those
        the sender took."""
        return [s + n for s, n in zip(self.starts, self.sender.sent_pages)]


class PrefillQueues(PDQueues):
    def __init__(
        self,
        scheduler: SchedulerPort,
        mgr,
        metadata: MetadataBuffers,
        sender_cls,
        fake_sender_cls,
        group=None,
    ):
        self.s = scheduler
        self.mgr = mgr
        self.meta = metadata
        self.slots = SlotAllocator(metadata.num_slots)
        self.sender_cls = sender_cls
        self.fake_sender_cls = fake_sender_cls
        self.group = group
        self.bootstrap: list[Req] = []
        self.inflight: list[Req] = []
        # per finished transfer: bytes moved and timings (served in /server_info for benchmarks)
        self.recent_transfers: deque[dict] = deque(maxlen=256)
        self.kv_bytes_sent = 0  # by this rank, over all finished transfers
        self.transfer_rate: Optional[float] = (
            None  # bytes/s of recent transfers (moving average), for routers
        )
        self.keepalive_s = min(1.0, scheduler.args.disaggregation_waiting_timeout / 4)
        self._next_keepalive = 0.0
        self._liveness = _Liveness(self.keepalive_s)
        # the model's last layer: the layer pipeline sends its last group when it is written
        kv_args = getattr(mgr, "kv_args", None)
        self._last_layer = kv_args.num_layers - 1 if kv_args is not None else None
        self._dp_publisher: Optional[ThreadPoolExecutor] = None
        self.bootstrap_server = None  # the server's, on its first rank (disagg/setup.py)

    # ---- scheduler interface ----------------------------------------------------------------
    def accepts(self, req: Req) -> bool:
        return True

    def add(self, req: Req) -> None:
        req.sampling.max_new_tokens = 1
        if (
            req.bootstrap_host is None
            or is_fake_host(req.bootstrap_host)
            or req.bootstrap_room is None
        ):
            sender = self.fake_sender_cls(None, "", req.bootstrap_room or 0)
        else:
            addr = (
                f"{req.bootstrap_host}:"
                f"{req.bootstrap_port or self.s.args.disaggregation_bootstrap_port}"
            )
            sender = self.sender_cls(self.mgr, addr, req.bootstrap_room)
            self._publish_dp_rank(addr, req.bootstrap_room)
        req.disagg = _PrefillState(sender)
        self.bootstrap.append(req)

    def _publish_dp_rank(self, addr: str, room: int) -> None:
        """DP attention: tell the bootstrap server which group took the room (once per room, by
        the group's first rank), for decodes that are not told (``disagg_prefill_dp_rank``)."""
        a = getattr(self.mgr, "kv_args", None)
        if a is None or a.dp_size == 1 or a.engine_rank != 0 or a.pp_rank != 0:
            return
        if self._dp_publisher is None:
            self._dp_publisher = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="pd-dp-publish"
            )
        host, port = parse_addr(addr)

        def publish() -> None:
            try:
                register_dp_rank(
                    host, port, room, a.system_dp_rank, secret=getattr(self.mgr, "secret", None)
                )
            except Exception as e:  # decode then times out on the look-up, naming the room
                logger.warning("could not record room %d's DP group at %s: %s", room, addr, e)

        self._dp_publisher.submit(publish)

    def reject(self, host: Optional[str], port: Optional[int], room: int, reason: str) -> None:
        """The request for ``room`` was refused before it got here: end the room for decode now."""
        if host and not is_fake_host(host) and hasattr(self.mgr, "role"):
            self.mgr.role.reject(room, f"prefill request {reason}")

    def queued(self) -> list[Req]:
        return list(self.bootstrap)  # waiting for decode's pages (the rest are handed off)

    def all_reqs(self) -> list[Req]:
        return self.bootstrap + self.inflight

    def extra_pages(self) -> list[int]:
        return [0] * self.s.kv.num_groups

    @property
    def has_work(self) -> bool:
        return bool(self.bootstrap or self.inflight)

    def integrity(self) -> dict:
        counts = self.mgr.counts() if hasattr(self.mgr, "counts") else {}
        return {
            "metadata_slots_total": self.slots.num_slots,
            "metadata_slots_free": self.slots.num_free(),
            "bootstrap_queue": len(self.bootstrap),
            "inflight_queue": len(self.inflight),
            "kv_bytes_sent": self.kv_bytes_sent,
            **counts,
        }

    def discard(self, req: Req) -> None:
        """The request ended (finished, failed or aborted): leave the queues, free the slot."""
        st: Optional[_PrefillState] = req.disagg
        if st is None:
            return
        if req in self.bootstrap:
            self.bootstrap.remove(req)
        if req in self.inflight:
            self.inflight.remove(req)
        if req.finish_reason is not None and req.finish_reason.kind == FinishKind.ABORT:
            st.sender.abort(
                f"prefill request aborted: {req.finish_reason.message or 'no reason given'}"
            )
        st.sender.clear()
        if st.slot is not None:
            self.slots.free(st.slot)
            st.slot = None
        req.disagg = None

    def close(self) -> None:
        """Stop the KV manager, the bootstrap server and the queues' threads (a role switch)."""
        self._liveness.close()
        if self._dp_publisher is not None:
            self._dp_publisher.shutdown(wait=True)
        self.mgr.close()
        if self.bootstrap_server is not None:
            self.bootstrap_server.shutdown()

    # ---- queues ---------------------------------------------------------------------------------
    def process_queues(self) -> None:
        self._process_bootstrap()
        self._process_prefilling()
        self._process_inflight()

    def _process_prefilling(self) -> None:
        """End requests between the bootstrap and inflight queues whose room already failed;
        tell decode that the others are alive and queued."""
        reqs = [r for r in self.s.scheduled() if r.disagg is not None]
        self._keep_alive(reqs)
        if not reqs:
            return
        states = poll_and_all_reduce([r.disagg.sender for r in reqs], self.group)
        for req, state in zip(reqs, states):
            if state == KVPoll.Failed:
                self._fail(req, req.disagg.sender.failure_reason() or "KV transfer failed")

    def _keep_alive(self, reqs: list[Req]) -> None:
        """Tell decode, every ``keepalive_s``, that the rooms queued, prefilled or transferring
        here are alive (between steps; during one, ``_Liveness``'s thread does, for the rooms
        held at its start)."""
        senders = [r.disagg.sender for r in reqs + self.inflight]
        self._liveness.holding(senders)
        now = time.monotonic()
        if now < self._next_keepalive:
            return
        self._next_keepalive = now + self.keepalive_s
        for sender in senders:
            sender.keepalive()
        self._liveness.sent()

    def _fail(self, req: Req, reason: str) -> None:
        logger.warning("request %s (room %s) failed: %s", req.rid, req.bootstrap_room, reason)
        local = req.disagg is not None and req.disagg.sender.failed_here()
        status = OWN_TRANSFER_FAILED_STATUS if local else PEER_FAILED_STATUS
        self.s.finish(req, FinishReason(FinishKind.ABORT, message=reason, status_code=status))

    def _process_bootstrap(self) -> None:
        if not self.bootstrap:
            return
        states = poll_and_all_reduce([r.disagg.sender for r in self.bootstrap], self.group)
        for req, state in zip(list(self.bootstrap), states):
            st: _PrefillState = req.disagg
            if state == KVPoll.Failed:
                self._fail(
                    req, st.sender.failure_reason() or "KV transfer failed while bootstrapping"
                )
            elif state >= KVPoll.WaitingForInput:
                slot = self.slots.alloc()
                if slot is None:
                    break  # every metadata slot is in flight; try again next step
                st.slot = slot
                # decode's prefix cache holds the first pages: they are computed (or taken from this
                # prefill's cache) but not sent
                st.decode_prefix = st.sender.decode_prefix_pages()
                kv = self.s.kv
                st.starts = [
                    kv.transfer_start(g, req.prompt_len, st.decode_prefix)
                    for g in range(kv.num_groups)
                ]
                st.sender.init(kv.transfer_counts(req.prompt_len, st.decode_prefix), slot)
                self.bootstrap.remove(req)
                req.mark("bootstrapped")
                self.s.enqueue(req)

    def _process_inflight(self) -> None:
        if not self.inflight:
            return
        states = poll_and_all_reduce([r.disagg.sender for r in self.inflight], self.group)
        for req, state in zip(list(self.inflight), states):
            if state == KVPoll.Success:
                req.mark("kv_sent")
                self._record_transfer(req)
                self.s.finish(req, FinishReason(FinishKind.LENGTH, matched=len(req.output_ids)))
            elif state == KVPoll.Failed:
                self._fail(req, req.disagg.sender.failure_reason() or "KV transfer failed")

    def _record_transfer(self, req: Req) -> None:
        st: _PrefillState = req.disagg
        if st.first_send is None or req.bootstrap_room is None:
            return
        now = time.monotonic()
        # this rank's writes, into every decode rank it serves
        descriptors, nbytes, first_write = st.sender.written()
        if first_write is not None:
            req.timeline["kv_first_write"] = first_write
        window = now - st.first_send
        self.kv_bytes_sent += nbytes
        if window > 0 and nbytes:
            rate = nbytes / window
            self.transfer_rate = (
                rate if self.transfer_rate is None else 0.8 * self.transfer_rate + 0.2 * rate
            )
        self.recent_transfers.append(
            {
                "rid": req.rid,
                "room": req.bootstrap_room,
                "pages": sum(st.sender.sent_pages),
                "pages_per_group": list(st.sender.sent_pages),
                "decode_prefix_pages": st.decode_prefix,
                "kv_bytes": nbytes,
                "descriptors": descriptors,
                "layer_groups": st.layer_groups,  # sent during forwards, by the layer pipeline
                "window_s": window,
                "after_last_chunk_s": now - st.last_send,
                "gb_per_s": nbytes / window / 1e9 if window > 0 else None,
            }
        )

    def queues(self) -> dict[str, int]:
        """Requests in this role's queues (``GET /get_load``): waiting for decode's pages, or
        prefilled and being sent."""
        return {"bootstrap_queue": len(self.bootstrap), "inflight_queue": len(self.inflight)}

    def stats(self) -> dict:
        out: dict = {
            "recent_transfers": list(self.recent_transfers),
            **self.queues(),
            "kv_bytes_sent": self.kv_bytes_sent,
        }
        if hasattr(self.mgr, "faults"):
            out["disaggregation_faults"] = self.mgr.faults.stats()
            out["transfer_worker_restarts"] = self.mgr.role.workers.restarts
        return out

    # ---- the prompt's progress (called by the scheduler) ---------------------------------------
    def _chunk_pages(self, req: Req, kv_len: int) -> list[list[int]]:
        """The pages a non-last chunk ending at ``kv_len`` completes: the full ones of groups
        whose pages are final once computed (the others, a window, go after the last chunk)."""
        st: _PrefillState = req.disagg
        kv, full = self.s.kv, kv_len // self.s.page_size
        return [
            kv.send_pages(req, g, sent, full) if kv.sent_with_chunks(g) and full > sent else []
            for g, sent in enumerate(st.sent_pages)
        ]

    def before_forward(self, plan, fb) -> None:
        fb.layer_done = self.layer_hook(plan.batch)

    def after_forward(self, plan) -> None:
        for row in plan.rows:
            self.chunk_done(row.req)

    def layer_hook(self, batch: list[tuple[Req, int]]):
        """What the model calls between the layers of a forward of ``batch``, or None: the
        layer-by-layer sends of this forward's pages (``--enable-disagg-layer-pipeline``): the
        pages its chunk completes (a last chunk: every page left of groups final once computed),
        a group of layers at a time as the model writes them, the last group when the model's
        last layer is written whatever its size."""
        args = self.s.args
        if not args.enable_disagg_layer_pipeline:
            return None
        if not any(isinstance(req.disagg, _PrefillState) for req, _ in batch):
            return None
        plans = self._layer_plans(batch)
        if not plans:
            return None
        last, pending = self._last_layer, []

        def layer_done(layer: int) -> None:
            pending.append(layer)
            if len(pending) < args.disagg_layer_group_size and layer != last:
                return
            now = time.monotonic()
            for st, pages, groups in plans:
                keys = frozenset((g, n) for g in groups for n in pending)
                st.sender.send_layers(pages, keys)
                st.layers_sent = (pages, st.layers_sent[1] | keys)
                st.layer_groups += 1
                st.first_send = st.first_send or now
            pending.clear()

        return layer_done

    def _layer_plans(self, batch: list[tuple[Req, int]]) -> list:
        """(state, pages per group, groups with pages) of each request whose pages this forward
        sends layer by layer."""
        args, kv, plans = self.s.args, self.s.kv, []
        for req, ext in batch:
            st = req.disagg
            if not isinstance(st, _PrefillState) or st.slot is None:
                continue
            if req.prompt_len < args.disagg_layer_pipeline_min_prefill_len:
                continue
            if req.kv_len + ext >= req.prompt_len:  # the last chunk: every page left
                pages = [
                    kv.send_pages(req, g, sent) if kv.sent_with_chunks(g) else []
                    for g, sent in enumerate(st.sent_pages)
                ]
            else:
                pages = self._chunk_pages(req, req.kv_len + ext)
            if any(pages):
                plans.append((st, pages, [g for g, p in enumerate(pages) if p]))
        return plans

    def chunk_done(self, req: Req) -> None:
        """After a forward: send the full pages completed by a non-last chunk (the regions the
        layer pipeline has not sent yet)."""
        st: Optional[_PrefillState] = req.disagg
        if st is None or req.kv_len >= req.prompt_len:
            return
        pages = self._chunk_pages(req, req.kv_len)
        skip = st.skip(pages)
        if any(pages):
            st.first_send = st.first_send or time.monotonic()
            st.sender.send(pages, last_chunk=False, skip=skip)

    def takes_over(self, req: Req) -> bool:
        """The first token is committed: fill the metadata row, send the last chunk and hand the
        request to decode."""
        st: _PrefillState = req.disagg
        req.mark("forward_end")
        tok = req.output_ids[0]
        logprob = req.output_token_logprobs[0][0] if req.output_token_logprobs else None
        top = req.output_top_logprobs[0] if req.output_top_logprobs else None
        self.meta.set_row(
            st.slot,
            req.bootstrap_room or 0,
            tok,
            logprob=logprob,
            top_logprobs=top,
            cached_tokens=(req.cached_tokens, req.cached_tokens, 0, 0),
            rope_delta=req.rope_delta,
            # a draft head's first draft and hidden state (engine/speculative/eagle.py)
            **(req.spec.metadata_fields() if req.spec is not None else {}),
        )
        st.last_send = time.monotonic()
        st.first_send = st.first_send or st.last_send
        pages = [self.s.kv.send_pages(req, g, sent) for g, sent in enumerate(st.sent_pages)]
        st.sender.send(pages, last_chunk=True, skip=st.skip(pages))
        self.s.hand_off(req)
        self.inflight.append(req)
        return True
