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

from typing import Any, Callable, Optional

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


def run(
    fb: Any,
    layer: int,
    kind: str,
    extend: Callable[[slice, int, int], None],
    step: Callable[[torch.Tensor, torch.Tensor], None],
) -> None:
    """A state mixer's pass over the requests of ``fb`` (its layer ``layer``, state kind ``kind``),
    each snapshot taken on the way. ``extend(rows, position, slot)`` runs a piece of a request's
    new tokens: its token rows (a slice), the position of its first token (0: the state starts
    from zeros), the request's live slot; the pieces are cut at the page boundary whose snapshot
    the request keeps. ``step(rows, slots)`` runs, once, the requests that decode one token: their
    token rows and live slots (tensors)."""
    pool, index, slots = fb.state(layer, kind)
    snap = fb.snapshots(layer, kind)
    snap_ids = None if snap is None else snap.tolist()
    slot_ids = slots.tolist()
    steps, starts = [], fb.extend_starts
    for i, (prefix, n) in enumerate(zip(fb.prefix_lens, fb.extend_lens)):
        if n == 0:
            continue
        if n == 1 and prefix > 0:
            steps.append(i)
            continue
        for lo, hi, ends in extend_pieces(prefix, n, fb.page_size, snap_ids[i] if snap_ids else 0):
            extend(slice(starts[i] + lo, starts[i] + hi), prefix + lo, slot_ids[i])
            if ends:
                save(pool, index, slots[i : i + 1], snap[i : i + 1])
    if steps:
        step(torch.tensor([starts[i] for i in steps], device=slots.device), slots[steps])
        ended = ended_pages(fb.prefix_lens, steps, fb.page_size, snap_ids)
        if ended:
            save(pool, index, slots[ended], snap[ended])
