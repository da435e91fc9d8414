"""Admission order: fcfs keeps arrival order, lpm puts the longest cached prefix first; retracted
requests go first in both."""

from __future__ import annotations

from pdserve.engine.kv_pool import PageAllocator
from pdserve.engine.radix_cache import RadixCache
from pdserve.engine.request import Req, SamplingParams
from pdserve.engine.schedule_policy import order_waiting


def _req(rid, ids, t, retracted=0):
    r = Req(rid=rid, input_ids=ids, sampling=SamplingParams())
    r.arrival_time, r.num_retractions = t, retracted
    return r


def test_fcfs_and_lpm_orders():
    alloc = PageAllocator(64)
    tree = RadixCache(alloc, page_size=4)
    shared = list(range(100, 116))  # 4 pages cached
    tree.insert(shared, alloc.alloc(4))
    a = _req("a", list(range(500, 520)), 1.0)  # no match
    b = _req("b", shared[:8] + [1, 2, 3, 4, 5], 2.0)  # 2 pages
    c = _req("c", shared + [7, 8, 9], 3.0)  # 4 pages
    d = _req("d", [9, 9, 9, 9, 9], 4.0, retracted=1)
    waiting = [c, a, d, b]
    order_waiting(waiting, "fcfs", tree, 4)
    assert [r.rid for r in waiting] == ["d", "a", "b", "c"]
    order_waiting(waiting, "lpm", tree, 4)
    assert [r.rid for r in waiting] == ["d", "c", "b", "a"]
    tree.check_integrity(0)
