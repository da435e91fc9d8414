"""Snapshots of a request's recurrent state at page boundaries, for the prefix cache.

With the prefix cache on, a request of a hybrid model holds, besides its live state slot, a
snapshot slot (``engine/cache_policy.py``); the linear-attention mixers copy the live state into
it each time a forward ends a page, so it always holds the state at the last page boundary the
sequence crossed. An extend that crosses a boundary runs in two pieces, the first ending on the
last boundary it crosses; a decode step that ends a page copies after the step. When the request
ends, the tree takes the snapshot with the pages, and a later prompt sharing them continues from
it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


def extend_pieces(
    prefix: int, n: int, page_size: int, snapshot: int
) -> list[tuple[int, int, bool]]:
    """The pieces ``(lo, hi, snapshot after)`` in which to run ``n`` new tokens after ``prefix``
    tokens: cut at the last page boundary they cross when the request keeps a ``snapshot`` slot."""
    if not snapshot or page_size <= 0:
        return [(0, n, False)]
    cut = (prefix + n) // page_size * page_size - prefix
    if cut <= 0:
        return [(0, n, False)]
    return [(0, cut, True)] + ([(cut, n, False)] if cut < n else [])


def ended_pages(
    prefix_lens: list[int], rows: list[int], page_size: int, snapshots: Optional[list[int]]
) -> list[int]:
    """Of the decode ``rows`` (requests), those whose step ends a page and that keep a snapshot."""
    if snapshots is None or page_size <= 0:
        return []
    return [i for i in rows if snapshots[i] and (prefix_lens[i] + 1) % page_size == 0]


def save(pool: Any, index: int, live: torch.Tensor, snapshot: torch.Tensor) -> None:
    """Slots ``snapshot`` take the state of slots ``live`` (every part of layer ``index``)."""
    for part in pool.spec.parts:
        t = pool.state(part, index)
        t[snapshot] = t[live]
