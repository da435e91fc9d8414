"""``KVSender``: one room on a prefill rank, the scheduler's handle on it (``PrefillRole`` in
``prefill_role.py`` does the work). Writes happen on the transfer workers (``writer.py``), never
on the scheduler thread.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

from pdserve.disagg.messages import TransferStatus
from pdserve.disagg.poll import KVPoll
from pdserve.disagg.prefill_role import PrefillRole
from pdserve.disagg.writer import Chunk


class KVSender:
    """One room on a prefill rank. Call order: construct when the request arrives; ``poll()``
    until WaitingForInput; ``init(num_pages, aux_slot)``; ``send(pages)`` per chunk (the last
    one with ``last_chunk=True`` after the metadata row is filled); ``poll()`` until Success or
    Failed; ``clear()``. ``abort()`` at any time. Pages are given per cache group: ``num_pages[g]``
    pages of group g will be sent, ``send`` gets the next pages of each group (maybe none)."""

    def __init__(self, mgr, bootstrap_addr: str, room: int, **_: Any):
        self.mgr = mgr
        self.role: PrefillRole = mgr.role
        self.bootstrap_addr = bootstrap_addr
        self.room = room
        self.created = time.monotonic()
        self.num_pages: Optional[list[int]] = None
        self.aux_slot = -1
        self.sent_pages: list[int] = [0] * mgr.kv_args.num_groups  # per cache group
        self.role.add_sender(room)

    def poll(self) -> KVPoll:
        st = self.mgr.get_status(self.room)
        if st is None:
            return KVPoll.Failed
        if st == KVPoll.Bootstrapping:  # decode's request has not arrived
            waited = time.monotonic() - self.created
            if waited > self.mgr.bootstrap_timeout:
                self.role.fail(
                    self.room,
                    f"timed out after {waited:.1f}s waiting for decode's transfer request "
                    "(KVPoll.Bootstrapping)",
                )
                return KVPoll.Failed
        return st

    def decode_prefix_pages(self) -> int:
        """Leading pages decode already holds (skip them: page 0 of ``send`` is this page)."""
        with self.mgr.lock:
            return max(
                (q.decode_prefix_pages for q in self.role.destinations(self.room)), default=0
            )

    def init(self, num_pages: Sequence[int], aux_slot: int) -> None:
        self.num_pages, self.aux_slot = list(num_pages), aux_slot
        with self.mgr.lock:
            have = [
                [len(g) for g in q.dst_pages]
                for q in self.role.destinations(self.room, writing_only=True)
            ]
        short = next(
            (
                h
                for h in have
                if len(h) < len(num_pages) or any(a < b for a, b in zip(h, num_pages))
            ),
            None,
        )
        if short is not None:
            self.role.fail(
                self.room,
                f"decode preallocated {short} pages per cache group, prefill needs {num_pages}",
            )

    def send_layers(
        self, src_pages: Sequence[Sequence[int]], layers: frozenset[tuple[int, int]]
    ) -> None:
        """Queue the regions ``layers`` ((cache group, layer) pairs) of the next pages, whose
        forward has written them; the ``send`` of those pages later skips them."""
        if self.mgr.get_status(self.room) in (None, KVPoll.Failed):
            return
        self._submit(src_pages, False, only=layers)

    def send(
        self,
        src_pages: Sequence[Sequence[int]],
        last_chunk: bool = False,
        skip: frozenset[tuple[int, int]] = frozenset(),
    ) -> None:
        """Queue one chunk: ``src_pages[g]`` are the next pages of cache group g, in order;
        ``skip``: regions ((cache group, layer) pairs) ``send_layers`` already sent of them."""
        if self.mgr.get_status(self.room) in (None, KVPoll.Failed):
            return
        early = next(
            (
                g
                for g, p in enumerate(src_pages)
                if p and not last_chunk and self.mgr.kv_args.final_after_last_chunk(g)
            ),
            None,
        )
        if early is not None:
            self.role.fail(
                self.room,
                f"prefill sent pages of cache group {early} before the last chunk; that "
                "group's pages are final only after the last forward",
            )
            return
        after = [n + len(p) for n, p in zip(self.sent_pages, src_pages)]
        if len(src_pages) != len(self.sent_pages) or (
            self.num_pages is not None and any(a > b for a, b in zip(after, self.num_pages))
        ):
            self.role.fail(
                self.room,
                f"prefill sent {after} pages per cache group, init() said {self.num_pages}",
            )
            return
        self._submit(src_pages, last_chunk, skip=skip)
        self.sent_pages = after

    def _submit(self, src_pages, last_chunk: bool, **regions) -> None:
        event = None
        if self.mgr.kv_args.device.startswith("cuda"):
            import torch

            event = torch.cuda.Event()
            event.record()
        self.mgr.update_status(self.room, KVPoll.Transferring)
        self.role.workers.submit_chunk(
            Chunk(
                self.room,
                list(self.sent_pages),
                [[int(p) for p in g] for g in src_pages],
                last_chunk,
                self.aux_slot,
                event,
                **regions,
            )
        )

    def failure_reason(self) -> str:
        return self.mgr.failure_reason(self.room)

    def written(self) -> tuple[int, int, Optional[float]]:
        """(KV write descriptors, KV bytes, wall time its first KV write completed) this rank
        wrote for the room (once, after Success)."""
        return self.role.take_written(self.room)

    def failed_here(self) -> bool:
        """True when the room failed through this prefill's fault (its transfer), not decode's."""
        with self.mgr.lock:
            return self.room in self.role.failed_here

    def keepalive(self) -> None:
        """Tell decode the room is queued or in progress here, so its waiting timeout measures
        silence rather than queueing (a busy prefill is not a dead one)."""
        with self.mgr.lock:
            if self.mgr.status.get(self.room) not in (KVPoll.WaitingForInput, KVPoll.Transferring):
                return
            targets = [
                (sess.reply_endpoint, req.generation) for sess, req in self.role.targets(self.room)
            ]
        for endpoint, generation in targets:
            self.mgr.send(
                endpoint,
                TransferStatus(
                    room=self.room,
                    generation=generation,
                    state=int(KVPoll.Transferring),
                    prefill_rank=self.role.rank,
                ),
            )

    def abort(self, reason: str = "aborted by prefill") -> None:
        self.role.fail(self.room, reason)

    def clear(self) -> None:
        self.role.clear(self.room)
