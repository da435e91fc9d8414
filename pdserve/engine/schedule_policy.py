"""Order of admission for waiting requests: ``fcfs`` or ``lpm`` (longest prefix match first),
after their priority when the server schedules by priority (``engine/admission.py``)."""

from __future__ import annotations

from typing import Callable, Optional

from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.request import Req

# Past this many waiting requests lpm degrades to fcfs: matching every request each step would
# cost more than the cache hits it wins.
LPM_MAX_QUEUE = 128


def order_waiting(
    waiting: list[Req],
    policy: str,
    kv: KVCacheManager,
    rank: Optional[Callable[[Req], int]] = None,
) -> None:
    """Sort ``waiting`` in place: by ``rank`` (a request's priority, smaller first) when given,
    then retracted requests first, then by the policy."""
    first = rank or (lambda r: 0)
    if policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE or kv.tree.total_pages() == 0:
        waiting.sort(key=lambda r: (first(r), r.num_retractions == 0, r.arrival_time))
        return

    def prefix_pages(req: Req) -> int:
        # a match only refreshes LRU times and may split nodes; it does not lock or free
        return kv.cached_pages(req, (req.seq_len - 1) // kv.page_size)

    matched = {id(r): prefix_pages(r) for r in waiting}
    waiting.sort(key=lambda r: (first(r), r.num_retractions == 0, -matched[id(r)], r.arrival_time))
