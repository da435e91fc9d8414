"""Prefill-side transfer workers: turn queued chunks into backend writes and tell decode.

Every job of a room (chunks, abort acknowledgements, failure notices) goes to the same worker
queue (picked by room), in submission order. So a notice to decode leaves only after all earlier
writes of the room finished: an ``AbortAck`` or a Failed status means "this rank will not write
for the room again", and Success is sent after the metadata row's ``bootstrap_room`` landed.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

from pdserve.disagg.descriptors import region_descriptors
from pdserve.disagg.messages import AbortAck, TransferRequest, TransferStatus
from pdserve.disagg.poll import KVPoll

logger = logging.getLogger(__name__)

WRITE_TIMEOUT_S = 60.0


@dataclass
class Chunk:
    room: int
    page_offset: int  # index (among the pages to send) of src_pages[0]
    src_pages: list[int]
    last: bool
    aux_slot: int
    state_indices: list[int]
    ready_event: Any = None  # CUDA event recorded at send(): the KV is written once it fires


class TransferWorkers:
    def __init__(self, role, num_workers: int = 2):
        self.role = role
        self.mgr = role.mgr
        self._queues: list[queue.Queue] = [queue.Queue() for _ in range(num_workers)]
        self._threads = [threading.Thread(target=self._loop, args=(q,), daemon=True,
                                          name=f"pd-xfer-{self.mgr.name}-{i}") for i, q in enumerate(self._queues)]
        for t in self._threads:
            t.start()

    def submit_chunk(self, chunk: Chunk) -> None:
        self._queue(chunk.room).put(chunk)

    def submit_abort_ack(self, room: int, generation: int, endpoint: str) -> None:
        self._queue(room).put(("abort_ack", room, generation, endpoint))

    def submit_failure(self, room: int, reason: str, targets) -> None:
        self._queue(room).put(("notify_failed", room, reason, targets))

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=5)

    def _queue(self, room: int) -> queue.Queue:
        return self._queues[room % len(self._queues)]

    def _loop(self, q: queue.Queue) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            try:
                if isinstance(job, Chunk):
                    self._run_chunk(job)
                elif job[0] == "abort_ack":
                    _, room, gen, endpoint = job
                    self.mgr.send(endpoint, AbortAck(room=room, generation=gen, prefill_rank=self.role.rank))
                elif job[0] == "notify_failed":
                    _, room, reason, targets = job
                    self.notify(room, targets, KVPoll.Failed, reason)
            except Exception:  # a bad job fails its room, never the worker
                logger.exception("%s: transfer worker error", self.mgr.name)

    def notify(self, room: int, targets, state: KVPoll, reason: str = "") -> None:
        for sess, req in targets:
            self.mgr.send(sess.reply_endpoint, TransferStatus(room=room, generation=req.generation, state=int(state),
                                                              prefill_rank=self.role.rank, reason=reason))

    def _run_chunk(self, job: Chunk) -> None:
        m = self.mgr
        with m.lock:
            if m.status.get(job.room) in (None, KVPoll.Failed):
                return  # cleared, aborted or failed: write nothing more
            targets = self.role.targets(job.room)
            room = self.role.rooms.get(job.room)
            required = room.required if room is not None else 1
        sess = None
        try:
            if len(targets) < required:
                raise RuntimeError(f"{len(targets)} of {required} decode destinations known for the room "
                                   "(send() before poll() reached WaitingForInput?)")
            if job.ready_event is not None:
                job.ready_event.synchronize()
            for sess, req in targets:
                self._write_chunk(sess, req, job)
        except Exception as e:
            where = sess.reply_endpoint if sess is not None else "decode"
            reason = f"KV transfer to decode {where} failed: {e}"
            logger.warning("%s: room %d: %s", m.name, job.room, reason)
            m.update_status(job.room, KVPoll.Failed, reason)
            self.notify(job.room, targets, KVPoll.Failed, reason)
            return
        if job.last:
            self.notify(job.room, targets, KVPoll.Success)
            m.update_status(job.room, KVPoll.Success)

    def _write_chunk(self, sess, req: TransferRequest, job: Chunk) -> None:
        a, backend = self.mgr.kv_args, self.mgr.backend
        n = len(job.src_pages)
        dst_pages = req.dst_pages[job.page_offset:job.page_offset + n]
        if len(dst_pages) != n:
            raise RuntimeError(f"decode preallocated {len(req.dst_pages)} pages, prefill sends pages "
                               f"{job.page_offset}..{job.page_offset + n - 1}")
        if n:
            # one descriptor per (layer, K|V) and page run contiguous on both sides
            descs = region_descriptors(a.kv_data_ptrs, sess.dst_kv_ptrs, a.kv_item_lens, job.src_pages, dst_pages)
            backend.write(sess.session_id, *descs).wait(WRITE_TIMEOUT_S)
        if not job.last:
            return
        b = sess.reg.buffers
        if job.state_indices and req.state_indices:
            k = min(len(job.state_indices), len(req.state_indices))
            descs = region_descriptors(a.state_data_ptrs, b.state_data_ptrs, a.state_item_lens,
                                       job.state_indices[:k], req.state_indices[:k])
            backend.write(sess.session_id, *descs).wait(WRITE_TIMEOUT_S)
        if a.pp_rank == a.pp_size - 1 and job.aux_slot >= 0 and req.aux_slot >= 0 and a.aux_data_ptrs:
            # every metadata field, then bootstrap_room (the last field) in a later batch
            body = region_descriptors(a.aux_data_ptrs[:-1], b.aux_data_ptrs[:-1], a.aux_item_lens[:-1],
                                      [job.aux_slot], [req.aux_slot])
            backend.write(sess.session_id, *body).wait(WRITE_TIMEOUT_S)
            tail = region_descriptors(a.aux_data_ptrs[-1:], b.aux_data_ptrs[-1:], a.aux_item_lens[-1:],
                                      [job.aux_slot], [req.aux_slot])
            backend.write(sess.session_id, *tail).wait(WRITE_TIMEOUT_S)
