"""What prefill/decode disaggregation plugs into the scheduler: the ``PDQueues`` protocol, which
the scheduler owns and ``disagg/prefill.py`` and ``disagg/decode.py`` implement."""

from __future__ import annotations

from typing import Optional, Protocol

from pdserve.engine.request import Req


class PDQueues(Protocol):
    """What prefill/decode disaggregation plugs into the scheduler (``disagg/prefill.py`` and
    ``disagg/decode.py`` implement it; ``disagg/setup.py`` builds it). Every method runs on the
    scheduler thread, every rank calling them in the same order."""

    @property
    def has_work(self) -> bool:
        """Requests in the PD queues (waiting on a peer or a transfer)."""

    def accepts(self, req: Req) -> bool:
        """Whether ``req`` goes to the PD queues rather than the scheduler's waiting queue."""

    def add(self, req: Req) -> None: ...

    def reject(self, host: Optional[str], port: Optional[int], room: int, reason: str) -> None:
        """Tell the PD peer that a request this scheduler refused will not come (best effort)."""

    def all_reqs(self) -> list[Req]:
        """Requests held in the PD queues."""

    def extra_pages(self) -> list[int]:
        """KV pages held by the queues outside requests (drained rooms), for the accounting."""

    def discard(self, req: Req) -> None:
        """Forget ``req`` (it finished or was aborted), releasing what the queues hold for it."""

    def process_queues(self) -> None:
        """Advance every queue once; called at the start of each scheduler step."""

    def close(self) -> None:
        """Release the KV manager and every thread and port of the queues (a role switch; only
        when ``has_work`` is false)."""

    def integrity(self) -> dict: ...

    def stats(self) -> dict: ...
