"""The KV transfer layout: which prefill region lands in which decode region, and the write
descriptors of one chunk, per cache group and per split.

A rank's regions (``KVArgs.regions``, ``kv_region.Region``) say their cache group, layer and
part; a prefill region is paired with the decode region of the same key, which is how a
pipeline stage writes only its own layers, and how a model with several cache groups (full
attention next to a sliding window) moves each group's pages with that group's page ids. The
bytes of a page that a prefill rank writes into a decode rank follow from the region's split and
the ranks' ``rank_map.PairPlan``. Nothing here knows what a group or a part is.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from pdserve.disagg.descriptors import head_slice_descriptors, region_descriptors
from pdserve.disagg.rank_map import piece_source
from pdserve.kv_region import Region
from pdserve.kv_spec import held, piece_range


def pair_regions(src: Sequence[Region], dst: Sequence[Region]) -> tuple[list[int], str]:
    """For every source region the index of its destination region, and "" — or [] and why not."""
    where = {r.key: i for i, r in enumerate(dst)}
    out = []
    for r in src:
        j = where.get(r.key)
        if j is None:
            return [], f"decode registered no region for {r.name}"
        out.append(j)
    return out, ""


def dst_item_bytes(r: Region, pair, prefill_tp: int, decode_tp: int) -> int:
    """Bytes of one item of the decode region paired with prefill region ``r``."""
    if r.split == "heads":
        return r.item_bytes // pair.src_heads * pair.dst_heads if pair.src_heads else r.item_bytes
    if r.split == "segments":
        return sum(dst_segments(r, prefill_tp, decode_tp))
    return r.item_bytes


def dst_segments(r: Region, prefill_tp: int, decode_tp: int) -> tuple[int, ...]:
    """A decode rank's bytes of each segment of prefill region ``r``'s items."""
    return tuple(
        n // held(k, prefill_tp) * held(k, decode_tp) if k else n * prefill_tp // decode_tp
        for n, k in zip(r.segments, r.pieces or (0,) * len(r.segments))
    )


def _units_split_evenly(pieces: int, prefill_tp: int, decode_tp: int) -> bool:
    """A segment whose units (``Region.pieces``) both sides split evenly, as any channels."""
    return not pieces or (pieces % prefill_tp == 0 and pieces % decode_tp == 0)


def group_rows(regions: Sequence[Region], num_groups: int) -> list[Optional[int]]:
    """Pages each group's regions hold (the smallest region's count); None for a group without
    regions (pages that hold no bytes, ``kv_spec.PositionLedger``: nothing is written there)."""
    rows: list[Optional[int]] = [None] * num_groups
    for r in regions:
        if r.item_bytes > 0 and r.group < num_groups:
            n = rows[r.group]
            rows[r.group] = r.items if n is None else min(n, r.items)
    return rows


def chunk_descriptors(
    src: Sequence[Region],
    dst: Sequence[Region],
    pair,
    src_pages: Sequence[Sequence[int]],
    dst_pages: Sequence[Sequence[int]],
    prefill_tp: int = 1,
    decode_tp: int = 1,
) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Descriptors writing ``src_pages[g]`` of every group g of a prefill rank's regions ``src``
    into ``dst_pages[g]`` of the paired decode regions ``dst`` (``dst[i]`` pairs ``src[i]``).
    ``pair``: the ``rank_map.PairPlan`` between the two ranks (None: everything, whole pages).
    Regions of equal shape go through one vectorised call. None when nothing is to be written."""
    buckets: dict[tuple, list[int]] = {}
    for i, r in enumerate(src):
        g = r.group
        if g >= len(src_pages) or not src_pages[g]:
            continue
        if pair is not None and not writes(r, pair):
            continue
        key = (g, r.split, r.item_bytes, dst[i].item_bytes, r.segments, r.pieces)
        buckets.setdefault(key, []).append(i)
    parts = []
    for (g, split, item, dst_item, segments, _), idx in buckets.items():
        sp, dp = [src[i].ptr for i in idx], [dst[i].ptr for i in idx]
        s_pages, d_pages = src_pages[g], dst_pages[g]
        whole = (
            pair is None
            or split == "replicated"
            or (split == "heads" and pair.whole_pages)
            or (split == "segments" and prefill_tp == decode_tp)
        )
        if whole:
            # the same bytes on both sides: one descriptor per region and page run contiguous on
            # both
            parts.append(region_descriptors(sp, dp, [item] * len(idx), s_pages, d_pages))
        elif split == "heads":
            # this rank's slice of heads into the decode rank's pages at their offset: one
            # descriptor per (region, page)
            head = item // pair.src_heads  # bytes of one head's part of a page
            parts.append(
                head_slice_descriptors(
                    sp,
                    dp,
                    item,
                    dst_item,
                    s_pages,
                    d_pages,
                    pair.src_offset * head,
                    pair.dst_offset * head,
                    pair.num_heads * head,
                )
            )
        elif split == "segments":
            a, b = pair.parts
            p0, d0 = (
                pair.part_range(pair.prefill_rank, prefill_tp)[0],
                pair.part_range(pair.decode_rank, decode_tp)[0],
            )
            src_off = dst_off = 0
            pieces = src[idx[0]].pieces or (0,) * len(segments)
            for seg, k in zip(segments, pieces):

                def piece(at_src: int, at_dst: int, nbytes: int) -> None:
                    parts.append(
                        head_slice_descriptors(
                            sp, dp, item, dst_item, s_pages, d_pages, at_src, at_dst, nbytes
                        )
                    )

                if _units_split_evenly(k, prefill_tp, decode_tp):
                    unit = seg * prefill_tp // pair.num_parts  # bytes of one part of it
                    piece(src_off + (a - p0) * unit, dst_off + (a - d0) * unit, (b - a) * unit)
                    dst_off += seg * prefill_tp // decode_tp
                else:  # whole units, each from one of the decode rank's sources
                    ps, pe = piece_range(k, prefill_tp, pair.prefill_rank)
                    ds, de = piece_range(k, decode_tp, pair.decode_rank)
                    unit = seg // (pe - ps)
                    for u in range(max(ps, ds), min(pe, de)):
                        src_rank = piece_source(u, k, prefill_tp, decode_tp, pair.decode_rank)
                        if src_rank == pair.prefill_rank:
                            piece(src_off + (u - ps) * unit, dst_off + (u - ds) * unit, unit)
                    dst_off += unit * (de - ds)
                src_off += seg
    if not parts:
        return None
    return tuple(np.concatenate([p[k] for p in parts]) for k in range(3))


def writes(r: Region, pair) -> bool:
    """Whether prefill region ``r``'s bytes go into the decode rank of ``pair``."""
    if r.split == "heads":
        return pair.num_heads > 0
    if r.split == "segments":
        return pair.parts is not None
    return pair.replicated
