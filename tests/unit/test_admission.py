"""The queue cap and priorities (``engine/admission.py``) and the waiting queue's order under them
(``engine/schedule_policy.py``), on requests alone; the server's answers are
``tests/e2e/test_admission.py``'s."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.config import ServerArgs
from pdserve.engine import admission
from pdserve.engine.request import Req, SamplingParams
from pdserve.engine.schedule_policy import order_waiting


def req(rid: str, priority: int = 0, arrival: float = 0.0) -> Req:
    r = Req(rid=rid, input_ids=[1, 2, 3], sampling=SamplingParams(), priority=priority)
    r.arrival_time = arrival
    return r


def args(cap=2, priority=True, low_first=False):
    return SimpleNamespace(
        max_queued_requests=cap,
        enable_priority_scheduling=priority,
        schedule_low_priority_values_first=low_first,
    )


def test_room_below_the_cap_and_without_one():
    queued = [req("a"), req("b")]
    assert admission.make_room(req("c"), queued[:1], queued[:1], args()) is None
    assert admission.make_room(req("c"), queued, queued, args(cap=None)) is None


def test_a_full_queue_refuses_the_same_priority_and_without_priority_scheduling():
    queued = [req("a", 0, 1.0), req("b", 0, 2.0)]
    with pytest.raises(admission.QueueFull, match="--max-queued-requests 2") as e:
        admission.make_room(req("c", 0), queued, queued, args())
    assert e.value.status_code == 429
    with pytest.raises(admission.QueueFull):  # priorities ignored when not scheduled by
        admission.make_room(req("c", 9), queued, queued, args(priority=False))


def test_a_higher_priority_sheds_the_lowest_latest_sheddable_request():
    a, b, c, d = req("a", 1, 1.0), req("b", 0, 2.0), req("c", 0, 3.0), req("d", 2, 4.0)
    queued = [a, b, c, d]
    assert admission.make_room(req("new", 5), queued, queued, args(cap=4)) is c
    # only what has not started may go; none of lower priority left: refused
    assert admission.make_room(req("new", 5), queued, [a, d], args(cap=4)) is a
    with pytest.raises(admission.QueueFull):
        admission.make_room(req("new", 1), queued, [a, d], args(cap=4))
    # low values first: the largest value is the lowest priority
    assert admission.make_room(req("new", 0), queued, queued, args(cap=4, low_first=True)) is d


def test_the_waiting_queue_runs_by_priority_then_retracted_then_arrival():
    kv = SimpleNamespace(tree=SimpleNamespace(total_pages=lambda: 0))
    a, b, c, d = req("a", 0, 1.0), req("b", 3, 2.0), req("c", 3, 3.0), req("d", 0, 4.0)
    d.num_retractions = 1
    waiting = [a, b, c, d]
    order_waiting(waiting, "fcfs", kv, admission.rank_key(args()))
    assert [r.rid for r in waiting] == ["b", "c", "d", "a"]
    order_waiting(waiting, "fcfs", kv, admission.rank_key(args(low_first=True)))
    assert [r.rid for r in waiting] == ["d", "a", "b", "c"]
    order_waiting(waiting, "fcfs", kv, admission.rank_key(args(priority=False)))
    assert [r.rid for r in waiting] == ["d", "a", "b", "c"]  # retracted first, then arrival


def test_the_flags_are_checked():
    with pytest.raises(ValueError, match="max_queued_requests"):
        ServerArgs(model_path="m", max_queued_requests=0)
    with pytest.raises(ValueError, match="needs --enable-priority-scheduling"):
        ServerArgs(model_path="m", schedule_low_priority_values_first=True)
    ServerArgs(model_path="m", max_queued_requests=1, enable_priority_scheduling=True)


def test_a_far_higher_priority_preempts_the_lowest_latest_running_request():
    a, b, c = req("a", 0, 1.0), req("b", 0, 2.0), req("c", 4, 3.0)
    running = [a, b, c]
    threshold = SimpleNamespace(priority_scheduling_preemption_threshold=10)

    def flags(**kw):
        return SimpleNamespace(
            **vars(args(**kw)), **vars(threshold), disable_priority_preemption=False
        )

    assert admission.preemptee(req("w", 10), running, flags()) is b
    assert admission.preemptee(req("w", 9), running, flags()) is None  # below the threshold
    assert admission.preemptee(req("w", 50), running, flags(priority=False)) is None
    off = SimpleNamespace(**{**vars(flags()), "disable_priority_preemption": True})
    assert admission.preemptee(req("w", 50), running, off) is None
    # low values first: c (4) is the lowest priority; -6 is 10 below it
    assert admission.preemptee(req("w", -6), running, flags(low_first=True)) is c
    assert admission.preemptee(req("w", -5), running, flags(low_first=True)) is None
