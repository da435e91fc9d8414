"""What prefill/decode disaggregation and the scheduler see of each other: ``PDQueues``, which the
scheduler owns and ``disagg/prefill.py`` and ``disagg/decode.py`` implement, and ``SchedulerPort``,
the little of the scheduler those queues may use (the KV cache manager, the settings, the clock,
and a few moves of a request between the scheduler's queues and theirs). The queues never touch
the scheduler's lists or counters themselves: a change to what a running request is (speculative
rows, several samples per step) stays inside the scheduler."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional, Protocol

from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.request import FinishReason, Req
from pdserve.engine.step_participant import StepParticipant


class SchedulerPort(Protocol):
    """The scheduler as the PD queues see it (``engine/scheduler.Scheduler`` implements it)."""

    kv: KVCacheManager  # every page and slot; the queues change KV only through it
    args: Any  # the server's settings (read only)
    page_size: int

    def now(self) -> float:
        """The loop clock: every rank takes time-based decisions alike."""

    def num_running(self) -> int:
        """Requests in the running batch."""

    def scheduled(self) -> list[Req]:
        """Requests the scheduler holds (waiting or running)."""

    def enqueue(self, req: Req) -> None:
        """Compute ``req``'s prompt here (prefill: its room is bootstrapped; decode: nothing was
        transferred, e.g. the fake backend)."""

    def start_decoding(self, req: Req, failure: Optional[FinishReason] = None) -> None:
        """``req``'s prompt KV and first token came from prefill (``kv_len`` and ``output_ids``
        set): it joins the running batch, or ends at once with ``failure``."""

    def hand_off(self, req: Req) -> None:
        """Prefill: ``req``'s first token is sampled and its KV goes to decode; it leaves the
        batch, keeping its KV until the queues finish it."""

    def resume(self, req: Req) -> None:
        """A request ``hand_off`` took out (its KV kept) joins the running batch again."""

    def finish(self, req: Req, reason: FinishReason) -> None:
        """End ``req`` wherever it is and release everything it holds."""

    def count(self, stat: str, n: int) -> None:
        """Add ``n`` to one of the scheduler's counters (``cache_hit_tokens``, ...)."""


class PDQueues(StepParticipant, ABC):
    """What prefill/decode disaggregation plugs into the scheduler (``disagg/prefill.py`` and
    ``disagg/decode.py`` implement it; ``disagg/setup.py`` builds it). Every method runs on the
    scheduler thread, every rank calling them in the same order. Around each forward the queues
    are a ``StepParticipant`` after the speculator: prefill sends a forward's pages layer by layer
    (``before_forward``) or the full pages a chunk completed (``after_forward``), and takes a
    request whose first token is committed to send its last pages and hand it to decode
    (``takes_over``); decode does none of it. Both subclass it."""

    @property
    @abstractmethod
    def has_work(self) -> bool:
        """Requests in the PD queues (waiting on a peer or a transfer)."""

    @abstractmethod
    def accepts(self, req: Req) -> bool:
        """Whether ``req`` goes to the PD queues rather than the scheduler's waiting queue."""

    @abstractmethod
    def add(self, req: Req) -> None: ...

    @abstractmethod
    def reject(self, host: Optional[str], port: Optional[int], room: int, reason: str) -> None:
        """Tell the PD peer that a request this scheduler refused will not come (best effort)."""

    @abstractmethod
    def all_reqs(self) -> list[Req]:
        """Requests held in the PD queues."""

    @abstractmethod
    def queued(self) -> list[Req]:
        """Requests of the PD queues that wait before they run (``engine/admission.py``)."""

    @abstractmethod
    def extra_pages(self) -> list[int]:
        """KV pages held by the queues outside requests (drained rooms), for the accounting."""

    @abstractmethod
    def discard(self, req: Req) -> None:
        """Forget ``req`` (it finished or was aborted), releasing what the queues hold for it."""

    @abstractmethod
    def process_queues(self) -> None:
        """Advance every queue once; called at the start of each scheduler step."""

    @abstractmethod
    def close(self) -> None:
        """Release the KV manager and every thread and port of the queues (a role switch; only
        when ``has_work`` is false)."""

    @abstractmethod
    def integrity(self) -> dict: ...

    @abstractmethod
    def stats(self) -> dict: ...
