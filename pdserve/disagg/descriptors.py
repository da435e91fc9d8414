"""Pages -> (src, dst, len) write descriptors.

A region is one (layer, K|V) buffer (or one metadata field, or one state tensor) whose item i
starts at ``ptr + i * item_len``. Runs of pages contiguous on BOTH sides become one descriptor
per region, so a request whose pages are contiguous costs ``num_regions`` descriptors whatever
its length.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def page_runs(
    src_pages: Sequence[int], dst_pages: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split at every position where either side is not consecutive.
    Returns (src_run_starts, dst_run_starts, run_lengths)."""
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    if len(src) != len(dst):
        raise ValueError(f"page lists differ in length: {len(src)} src, {len(dst)} dst")
    if len(src) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(src)])))
    return src[starts], dst[starts], lengths


def region_descriptors(
    src_ptrs: Sequence[int],
    dst_ptrs: Sequence[int],
    item_lens: Sequence[int],
    src_items: Sequence[int],
    dst_items: Sequence[int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Descriptors copying items ``src_items[i]`` -> ``dst_items[i]`` in every region.
    Region e: src ``src_ptrs[e]``, dst ``dst_ptrs[e]``, item size ``item_lens[e]`` (same on both
    sides). Ordered region-major."""
    if not (len(src_ptrs) == len(dst_ptrs) == len(item_lens)):
        raise ValueError(
            f"region lists differ: {len(src_ptrs)} src, {len(dst_ptrs)} dst, "
            f"{len(item_lens)} item lens"
        )
    s_start, d_start, n = page_runs(src_items, dst_items)
    sp = np.asarray(src_ptrs, dtype=np.int64)[:, None]  # [E, 1]
    dp = np.asarray(dst_ptrs, dtype=np.int64)[:, None]
    il = np.asarray(item_lens, dtype=np.int64)[:, None]
    src = (sp + s_start[None, :] * il).reshape(-1)  # [E * R]
    dst = (dp + d_start[None, :] * il).reshape(-1)
    lens = np.broadcast_to(n[None, :] * il, (len(sp), len(n))).reshape(-1)
    return src, dst, lens


def head_slice_descriptors(
    src_ptrs: Sequence[int],
    dst_ptrs: Sequence[int],
    src_item: int,
    dst_item: int,
    src_items: Sequence[int],
    dst_items: Sequence[int],
    src_offset: int,
    dst_offset: int,
    length: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Descriptors copying ``length`` bytes at ``src_offset`` of each source item to ``dst_offset``
    of the matching destination item, in every region (item sizes differ between the sides: a
    slice of a page's heads, for tensor-parallel ranks holding different heads). One descriptor per
    (region, page): the slice of consecutive pages is not contiguous. Ordered region-major."""
    if len(src_ptrs) != len(dst_ptrs):
        raise ValueError(f"region lists differ: {len(src_ptrs)} src, {len(dst_ptrs)} dst")
    s_items = np.asarray(src_items, dtype=np.int64)
    d_items = np.asarray(dst_items, dtype=np.int64)
    if len(s_items) != len(d_items):
        raise ValueError(f"page lists differ in length: {len(s_items)} src, {len(d_items)} dst")
    sp = np.asarray(src_ptrs, dtype=np.int64)[:, None]
    dp = np.asarray(dst_ptrs, dtype=np.int64)[:, None]
    src = (sp + s_items[None, :] * src_item + src_offset).reshape(-1)
    dst = (dp + d_items[None, :] * dst_item + dst_offset).reshape(-1)
    return src, dst, np.full(src.shape, length, dtype=np.int64)


def held_pairs(
    src_pages: Sequence[int], dst_pages: Sequence[int], group: int = 0, offset: int = 0
) -> tuple[list[int], list[int]]:
    """The (src, dst) items that move of one cache group's pages: a group with items only on
    some logical pages lists 0 on the others, on both sides alike (the same page size and
    policy); such pairs move nothing. One side holding an item where the other has none is a
    disagreement between prefill and decode, refused naming the page."""
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    held = (src != 0) & (dst != 0)
    if held.all():  # every page holds an item (every kind but compressed entries)
        return src.tolist(), dst.tolist()
    odd = np.flatnonzero(held != ((src != 0) | (dst != 0)))
    if odd.size:
        i = int(odd[0])
        s, d = int(src[i]), int(dst[i])
        raise ValueError(
            f"cache group {group}, page {offset + i}: prefill "
            f"{'holds item ' + str(s) if s else 'holds none'}, decode "
            f"{'holds item ' + str(d) if d else 'holds none'}; both lay a group's items out "
            "by the same rule"
        )
    return src[held].tolist(), dst[held].tolist()
