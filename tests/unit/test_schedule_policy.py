"""Admission order: fcfs keeps arrival order, lpm puts the longest cached prefix first (within the
request's prefix namespace); retracted requests go first in both."""

from __future__ import annotations

import torch

from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.request import Req, SamplingParams
from pdserve.engine.schedule_policy import order_waiting
from pdserve.kv_spec import FullAttention, group_layers


def _req(rid, ids, t, retracted=0):
    r = Req(rid=rid, input_ids=ids, sampling=SamplingParams())
    r.arrival_time, r.num_retractions = t, retracted
    return r


def _manager(namespace=None) -> KVCacheManager:
    groups = group_layers([FullAttention(1, 4)])
    pools = [KVPool(1, 64, 4, 1, 4, torch.float32, "cpu")]
    return KVCacheManager(groups, pools, 4, namespace=namespace)


def test_fcfs_and_lpm_orders():
    kv = _manager()
    tree = kv.tree
    shared = list(range(100, 116))  # 4 pages cached
    tree.insert(shared, tree.allocator.alloc(4))
    a = _req("a", list(range(500, 520)), 1.0)  # no match
    b = _req("b", shared[:8] + [1, 2, 3, 4, 5], 2.0)  # 2 pages
    c = _req("c", shared + [7, 8, 9], 3.0)  # 4 pages
    d = _req("d", [9, 9, 9, 9, 9], 4.0, retracted=1)
    waiting = [c, a, d, b]
    order_waiting(waiting, "fcfs", kv)
    assert [r.rid for r in waiting] == ["d", "a", "b", "c"]
    order_waiting(waiting, "lpm", kv)
    assert [r.rid for r in waiting] == ["d", "c", "b", "a"]
    tree.check_integrity(0)


def test_lpm_counts_hits_in_the_request_namespace_only():
    # prompts longer than 18 tokens live in namespace 1 (as LongRoPE's long prompts)
    kv = _manager(namespace=lambda n: int(n > 18))
    shared = list(range(100, 116))
    kv.tree.insert(shared, kv.tree.allocator.alloc(4))  # namespace 0
    short = _req("short", shared + [7, 8], 2.0)  # 18 tokens: namespace 0, 4 pages cached
    long = _req("long", shared + [7, 8, 9, 10, 11], 1.0)  # 21 tokens: namespace 1, no hit
    waiting = [long, short]
    order_waiting(waiting, "lpm", kv)
    assert [r.rid for r in waiting] == ["short", "long"]
    assert kv.cached_pages(long, 5) == 0 and kv.cached_pages(short, 5) == 4
    kv.tree.check_integrity(0)
