"""The KV transfer layout: which prefill region lands in which decode region, and the write
descriptors of one chunk, per cache group.

A rank's KV regions (``KVArgs.kv_data_*``) are tagged with their cache group and layer
(``kv_region_group`` / ``kv_region_layer``); K comes before V within a layer. A prefill region is
paired with the decode region of the same group, layer and position within the layer, which is
how a pipeline stage writes only its own layers, and how a model with several cache groups (full
attention next to a sliding window) moves each group's pages with that group's page ids. Nothing
here knows what a group is; a group is an index space of pages with regions that share it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from pdserve.disagg.descriptors import head_slice_descriptors, region_descriptors


def region_keys(groups: Sequence[int], layers: Sequence[int]) -> list[tuple[int, int, int]]:
    """(group, layer, ordinal within the layer) of each region."""
    seen: dict[tuple[int, int], int] = {}
    out = []
    for g, layer in zip(groups, layers):
        k = seen.get((g, layer), 0)
        seen[(g, layer)] = k + 1
        out.append((g, layer, k))
    return out


def pair_regions(src_groups: Sequence[int], src_layers: Sequence[int], dst_groups: Sequence[int],
                 dst_layers: Sequence[int]) -> tuple[list[int], str]:
    """For every source region the index of its destination region, and "" — or [] and why not."""
    where = {key: i for i, key in enumerate(region_keys(dst_groups, dst_layers))}
    out = []
    for g, layer, k in region_keys(src_groups, src_layers):
        j = where.get((g, layer, k))
        if j is None:
            return [], (f"decode registered no KV region for cache group {g}, layer {layer} "
                        f"({'K' if k == 0 else 'V' if k == 1 else f'entry {k}'})")
        out.append(j)
    return out, ""


def group_rows(data_lens: Sequence[int], item_lens: Sequence[int], groups: Sequence[int],
               num_groups: int) -> list[int]:
    """Pages each group's regions hold (the smallest region's count)."""
    rows = [-1] * num_groups
    for n, item, g in zip(data_lens, item_lens, groups):
        if item > 0 and g < num_groups:
            r = n // item
            rows[g] = r if rows[g] < 0 else min(rows[g], r)
    return [max(r, 0) for r in rows]


def chunk_descriptors(a, dst_ptrs: Sequence[int], sl, src_pages: Sequence[Sequence[int]],
                      dst_pages: Sequence[Sequence[int]]) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Descriptors writing ``src_pages[g]`` of every group g of prefill rank ``a`` (its
    ``KVArgs``) into ``dst_pages[g]`` of a decode rank whose paired region pointers are
    ``dst_ptrs`` (in ``a``'s region order). ``sl``: the ``rank_map.HeadSlice`` between them
    (None: whole pages). None when nothing is to be written."""
    parts = []
    for g, (src, dst) in enumerate(zip(src_pages, dst_pages)):
        if not src:
            continue
        idx = [i for i, rg in enumerate(a.kv_region_group) if rg == g]
        sp = [a.kv_data_ptrs[i] for i in idx]
        dp = [dst_ptrs[i] for i in idx]
        items = [a.kv_item_lens[i] for i in idx]
        if sl is None or sl.whole_pages:
            # one descriptor per region and page run contiguous on both sides
            parts.append(region_descriptors(sp, dp, items, src, dst))
        else:
            # this rank's slice of heads into the decode rank's pages at their offset: one
            # descriptor per (region, page)
            head = items[0] // sl.src_heads  # bytes of one head's part of a page
            parts.append(head_slice_descriptors(sp, dp, items[0], head * sl.dst_heads, src, dst,
                                                sl.src_offset * head, sl.dst_offset * head, sl.num_heads * head))
    if not parts:
        return None
    return tuple(np.concatenate([p[k] for p in parts]) for k in range(3))


def routed_descriptors(a, dst_ptrs: Sequence[int], src_pages: Sequence[Sequence[int]],
                       dst_pages: Sequence[Sequence[int]]) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Descriptors writing the routed experts' rows of the pages of group ``a.routed_group`` that
    this chunk sends into the decode region at ``dst_ptrs`` (whole pages: every rank of an
    attention group holds the same ids). None when there is nothing to write."""
    g = a.routed_group
    if not a.routed_data_ptrs or not dst_ptrs or g < 0 or g >= len(src_pages) or not src_pages[g]:
        return None
    return region_descriptors(a.routed_data_ptrs, dst_ptrs, a.routed_item_lens, src_pages[g], dst_pages[g])
