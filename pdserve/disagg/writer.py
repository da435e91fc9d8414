"""Prefill-side transfer workers: turn queued chunks into backend writes and tell decode.

Every job of a room (chunks, abort acknowledgements, failure notices) goes to the same worker
queue (picked by room), in submission order. So a notice to decode leaves only after all earlier
writes of the room finished: an ``AbortAck`` or a Failed status means "this rank will not write
for the room again", and Success is sent after the metadata row's ``bootstrap_room`` landed.
Before any of the three leaves, the room's destination claims are released (``destinations.py``).

Supervision: a worker thread that dies (a bug, or the ``kill_transfer_thread`` fault) is found
by the manager's I/O thread within one tick; the room it was working on and every room queued
behind it fail with a reason, decode is told, and a fresh thread takes over the queue. A dead
thread never leaves rooms hanging until a timeout.

Fault injection (``faults.py``) happens here, where the real failures would.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Optional

from pdserve.disagg import faults as f
from pdserve.disagg.descriptors import held_pairs, region_descriptors
from pdserve.disagg.layout import chunk_descriptors
from pdserve.disagg.messages import AbortAck, TransferRequest, TransferStatus, completion_notice
from pdserve.disagg.poll import KVPoll
from pdserve.disagg.transfer.base import TransferError

logger = logging.getLogger(__name__)

WRITE_TIMEOUT_S = 60.0


@dataclass
class Chunk:
    room: int
    page_offsets: list[int]  # per cache group: index (among its pages to send) of src_pages[g][0]
    src_pages: list[list[int]]  # per cache group
    last: bool
    aux_slot: int
    ready_event: Any = None  # CUDA event recorded at send(): the KV is written once it fires
    # which regions, by (cache group, layer): only these (a layer group sent during the forward),
    # or all but ``skip`` (the rest of pages whose layers went earlier)
    only: Optional[frozenset[tuple[int, int]]] = None
    skip: frozenset[tuple[int, int]] = frozenset()

    def wants(self, group: int, layer: int) -> bool:
        key = (group, layer)
        return key in self.only if self.only is not None else key not in self.skip


class TransferWorkers:
    def __init__(self, role, num_workers: int = 2):
        self.role = role
        self.mgr = role.mgr
        self.faults = role.mgr.faults
        self._stop = threading.Event()
        self._queues: list[queue.Queue] = [queue.Queue() for _ in range(num_workers)]
        self._current: list[Any] = [None] * num_workers  # the job each worker is running
        self._deaths: list[str] = [""] * num_workers
        self.restarts = 0
        self._threads = [self._start(i) for i in range(num_workers)]

    def _start(self, i: int) -> threading.Thread:
        t = threading.Thread(
            target=self._loop, args=(i,), daemon=True, name=f"pd-xfer-{self.mgr.name}-{i}"
        )
        t.start()
        return t

    def submit_chunk(self, chunk: Chunk) -> None:
        self._queue(chunk.room).put(chunk)

    def submit_abort_ack(self, room: int, generation: int, endpoint: str) -> None:
        self._queue(room).put(("abort_ack", room, generation, endpoint))

    def submit_failure(self, room: int, reason: str, targets: list[tuple[Any, int]]) -> None:
        """``targets``: (session, generation) pairs to tell, after the room's earlier jobs."""
        self._queue(room).put(("notify_failed", room, reason, targets))

    def close(self) -> None:
        self._stop.set()
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=5)

    def _queue(self, room: int) -> queue.Queue:
        return self._queues[room % len(self._queues)]

    def _loop(self, i: int) -> None:
        q = self._queues[i]
        try:
            while True:
                job = self._current[i] = q.get()
                if job is None:
                    return
                try:
                    self._run(job)
                except Exception:  # a bad job fails its room, never the worker
                    logger.exception("%s: transfer worker error", self.mgr.name)
                self._current[i] = None
        except f.InjectedThreadDeath as e:  # the thread ends here, as after a real crash
            self._deaths[i] = repr(e)
        except BaseException as e:
            self._deaths[i] = repr(e)
            raise

    def _run(self, job) -> None:
        if isinstance(job, Chunk):
            live = self.mgr.get_status(job.room) not in (None, KVPoll.Failed)
            if live and self.faults.is_(
                job.room, f.KILL_TRANSFER_THREAD
            ):  # once per room: it fails
                raise f.InjectedThreadDeath(
                    f"injected fault: transfer thread killed on room {job.room}"
                )
            self._run_chunk(job)
        elif job[0] == "abort_ack":
            _, room, gen, endpoint = job
            self.role.release(room)
            self.mgr.send(
                endpoint, AbortAck(room=room, generation=gen, prefill_rank=self.role.rank)
            )
        elif job[0] == "notify_failed":
            _, room, reason, targets = job
            self.notify(room, targets, KVPoll.Failed, reason)

    def supervise(self) -> None:
        """Called from the I/O thread: replace dead workers, failing what they held."""
        for i, t in enumerate(self._threads):
            if t.is_alive() or self._stop.is_set():
                continue
            why = self._deaths[i] or "unknown cause"
            jobs = [self._current[i]]
            while True:
                try:
                    jobs.append(self._queues[i].get_nowait())
                except queue.Empty:
                    break
            self._current[i], self._deaths[i] = None, ""
            self.restarts += 1
            self._threads[i] = self._start(i)
            rooms = {j.room for j in jobs if isinstance(j, Chunk)}
            logger.error(
                "%s: transfer worker %s died (%s); failing %d room(s) it held and restarting it",
                self.mgr.name,
                t.name,
                why,
                len(rooms),
            )
            for room in rooms:
                self.role.fail(room, f"prefill transfer worker died ({why})", here=True)
            for job in jobs:  # acknowledgements and notices still go out, after the failures
                if job is not None and not isinstance(job, Chunk):
                    self._queues[i].put(job)

    def notify(
        self,
        room: int,
        targets: list[tuple[Any, int]],
        state: KVPoll,
        reason: str = "",
        unsettled: bool = False,
    ) -> None:
        self.role.release(room)
        if state == KVPoll.Success and self.faults.is_(room, f.DROP_STATUS):
            logger.warning(
                "%s: room %d: injected fault: Success status not sent", self.mgr.name, room
            )
            return
        for sess, generation in targets:
            self.mgr.send(
                sess.reply_endpoint,
                TransferStatus(
                    room=room,
                    generation=generation,
                    state=int(state),
                    prefill_rank=self.role.rank,
                    reason=reason,
                    unsettled=unsettled,
                ),
            )

    def _run_chunk(self, job: Chunk) -> None:
        m = self.mgr
        with m.lock:
            if m.status.get(job.room) in (None, KVPoll.Failed):
                return  # cleared, aborted or failed: write nothing more
            targets = self.role.targets(job.room)
            required = self.role.required_destinations(job.room)
        sess = None
        pairs = [(s, req.generation) for s, req in targets]
        writing = False  # a backend write was submitted: a failure may leave bytes under way
        try:
            if len(targets) < required:
                raise RuntimeError(
                    f"{len(targets)} of {required} decode destinations known for the room "
                    "(send() before poll() reached WaitingForInput?)"
                )
            if job.ready_event is not None:
                job.ready_event.synchronize()
            fault = self.faults.mode(job.room) if self.faults.enabled else None
            if fault == f.DELAY_TRANSFER:
                self._stop.wait(self.faults.delay_s)
            for sess, req in targets:
                if fault == f.FAIL_TRANSFER:
                    raise TransferError("injected fault: the backend reported a failed write")
                writing = True
                self._write_chunk(sess, req, job, corrupt_room=fault == f.CORRUPT_AUX_ROOM)
        except Exception as e:
            where = sess.peer if sess is not None else "decode"
            reason = f"KV transfer to decode {where} failed: {e}"
            logger.warning("%s: room %d: %s", m.name, job.room, reason)
            if m.update_status(job.room, KVPoll.Failed, reason):
                with m.lock:
                    self.role.mark_failed_here(job.room)
            self.notify(
                job.room,
                pairs,
                KVPoll.Failed,
                reason,
                unsettled=writing and isinstance(e, TransferError),
            )
            return
        if job.last:
            self.notify(job.room, pairs, KVPoll.Success)
            m.update_status(job.room, KVPoll.Success)

    def _write_chunk(
        self, sess, req: TransferRequest, job: Chunk, corrupt_room: bool = False
    ) -> None:
        if sess.pair is not None and sess.pair.empty:
            # decode reads none of this rank's bytes (rank_map): the room only concludes here
            return
        a, backend = self.mgr.kv_args, self.mgr.backend
        src_pages, dst_pages = [], []
        for g, (src, off) in enumerate(zip(job.src_pages, job.page_offsets)):
            have = req.dst_pages[g] if g < len(req.dst_pages) else []
            dst = have[off : off + len(src)]
            if len(dst) != len(src):
                raise RuntimeError(
                    f"decode preallocated {len(have)} pages of cache group {g}, prefill sends its "
                    f"pages {off}..{off + len(src) - 1}"
                )
            src, dst = held_pairs(src, dst, g, off)
            src_pages.append(src)
            dst_pages.append(dst)
        b = sess.reg.buffers
        src, dst = a.regions, sess.dst_regions
        if job.only is not None or job.skip:
            keep = [i for i, r in enumerate(src) if job.wants(r.group, r.layer)]
            src, dst = [src[i] for i in keep], [dst[i] for i in keep]
        # one batch: every region of a page (the KV, the ids of its tokens, ...) lands together
        descs = chunk_descriptors(
            src,
            dst,
            sess.pair,
            src_pages,
            dst_pages,
            a.tp_size,
            sess.reg.decode_tp_size,
        )
        if descs is not None:
            backend.write(sess.session_id, *descs).wait(WRITE_TIMEOUT_S)
            self.role.count_written(job.room, len(descs[0]), int(descs[2].sum()))
        if not job.last:
            return
        if (
            a.pp_rank == a.pp_size - 1
            and job.aux_slot >= 0
            and req.aux_slot >= 0
            and a.aux_data_ptrs
        ):
            # every metadata field, then bootstrap_room (the last field) in a later batch
            body = region_descriptors(
                a.aux_data_ptrs[:-1],
                b.aux_data_ptrs[:-1],
                a.aux_item_lens[:-1],
                [job.aux_slot],
                [req.aux_slot],
            )
            backend.write(sess.session_id, *body).wait(WRITE_TIMEOUT_S)
            src_slot = job.aux_slot
            if corrupt_room:  # fault: the room id comes from another (empty or foreign) row
                src_slot = (job.aux_slot + 1) % (a.aux_data_lens[-1] // a.aux_item_lens[-1])
                logger.warning(
                    "%s: room %d: injected fault: metadata row lands with row %d's room id",
                    self.mgr.name,
                    job.room,
                    src_slot,
                )
            tail = region_descriptors(
                a.aux_data_ptrs[-1:],
                b.aux_data_ptrs[-1:],
                a.aux_item_lens[-1:],
                [src_slot],
                [req.aux_slot],
            )
            # on backends that can, the last write itself tells decode the room is complete
            done = completion_notice(job.room, req.generation, self.role.rank)
            backend.write(sess.session_id, *tail, notify=done).wait(WRITE_TIMEOUT_S)
