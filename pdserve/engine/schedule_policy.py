"""Order of admission for waiting requests: ``fcfs`` or ``lpm`` (longest prefix match first)."""

from __future__ import annotations

from pdserve.engine.radix_cache import RadixCache
from pdserve.engine.request import Req

# Past this many waiting requests lpm degrades to fcfs: matching every request each step would
# cost more than the cache hits it wins.
LPM_MAX_QUEUE = 128


def order_waiting(waiting: list[Req], policy: str, tree: RadixCache, page_size: int) -> None:
    """Sort ``waiting`` in place. Retracted requests keep priority in both policies."""
    if policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE or tree.total_pages() == 0:
        waiting.sort(key=lambda r: (r.num_retractions == 0, r.arrival_time))
        return

    def prefix_pages(req: Req) -> int:
        # match_prefix only refreshes LRU times and may split nodes; it does not lock or free
        pages, _ = tree.match_prefix(req.all_ids, max_pages=(req.seq_len - 1) // page_size)
        return len(pages)

    matched = {id(r): prefix_pages(r) for r in waiting}
    waiting.sort(key=lambda r: (r.num_retractions == 0, -matched[id(r)], r.arrival_time))
