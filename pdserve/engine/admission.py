"""Admission to a scheduler's queue: the queue cap (``--max-queued-requests``) and request
priorities (``--enable-priority-scheduling``), as SGLang's flags.

A request counts as queued from its arrival until it joins the running batch: the waiting queue
and the PD queues before it (prefill: bootstrapping; decode: waiting for pages, for its KV, then
for a running place). With the queue
full, a new request is refused with 429 (``QueueFull``), unless priority scheduling is on and a
queued request that has not started has a lower priority: that one is shed (429) and the new one
takes its place, so a high-priority stream keeps its latency while low-priority load is shed.
A larger ``priority`` goes first unless ``--schedule-low-priority-values-first``; a request
without one has priority 0. With every running place taken, a waiting request whose priority is
``--priority-scheduling-preemption-threshold`` or more above a running one's preempts it: that
one is retracted (its full pages stay in the prefix cache) and runs again after it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from pdserve.engine.request import FinishKind, FinishReason, Req

SHED_STATUS = 429
SHED_MESSAGE = "shed from the full request queue for a request of higher priority"


class QueueFull(ValueError):
    """The queue holds ``--max-queued-requests`` requests and none may give way."""

    status_code = SHED_STATUS


def rank_key(args: Any) -> Optional[Callable[[Req], int]]:
    """Sort key of a request's priority (smaller first), or None without priority scheduling."""
    if not args.enable_priority_scheduling:
        return None
    if args.schedule_low_priority_values_first:
        return lambda r: r.priority
    return lambda r: -r.priority


def make_room(req: Req, queued: list[Req], sheddable: list[Req], args: Any) -> Optional[Req]:
    """Check ``req`` against the queue cap: None when there is room, else the request of
    ``sheddable`` (queued, not started) that gives way to it, the one of lowest priority and
    latest arrival; raises ``QueueFull`` when none may."""
    cap = args.max_queued_requests
    if cap is None or len(queued) < cap:
        return None
    key = rank_key(args)
    if key is not None:
        candidates = [r for r in sheddable if key(r) > key(req)]
        if candidates:
            return max(candidates, key=lambda r: (key(r), r.arrival_time))
    raise QueueFull(
        f"the request queue is full: {len(queued)} requests wait to run "
        f"(--max-queued-requests {cap}); retry later"
    )


def preemptee(req: Req, running: list[Req], args: Any) -> Optional[Req]:
    """The running request the waiting ``req`` takes the place of when every place is taken: the
    one of lowest priority (the latest of them), when ``req``'s priority is above it by at least
    ``--priority-scheduling-preemption-threshold``; None otherwise."""
    key = rank_key(args)
    if key is None or args.disable_priority_preemption or not running:
        return None
    victim = max(running, key=lambda r: (key(r), r.arrival_time))
    if key(victim) - key(req) >= args.priority_scheduling_preemption_threshold:
        return victim
    return None


def shed_reason() -> FinishReason:
    return FinishReason(FinishKind.ABORT, message=SHED_MESSAGE, status_code=SHED_STATUS)
