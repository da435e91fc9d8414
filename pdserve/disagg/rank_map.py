"""Which prefill rank writes which KV heads into which decode rank, for any pair of TP sizes.

Every rank holds a range of KV heads (``distributed.kv_heads_for_rank``): split when there are at
least as many KV heads as ranks, one replicated head per rank when there are fewer. A decode
rank needs its range; for each of its heads it takes one prefill rank that holds it (among
replicas, the ones spread by decode rank, so replicated heads are read from different prefill
ranks), so every destination byte is written exactly once. Consecutive heads from the same
prefill rank form one ``HeadSlice``. The lowest prefill rank of a decode rank's sources writes
its metadata row (first token, room id).

A prefill rank whose heads are all read from other replicas (MQA, GQA with fewer KV heads than
prefill ranks, MLA's latent) still runs every room with the other prefill ranks, and their room
states are MIN-all-reduced, so it must conclude its part too. It gets one *empty* slice (no heads,
no metadata row) into decode rank ``prefill_rank % decode_tp``: that decode rank registers with
it and sends it a transfer request naming no page, and it reports Success without writing. So
every prefill rank has at least one destination per room, and a room never waits for a request
no decode rank sends.

With equal TP sizes (and any head counts) decode rank r reads everything from prefill rank r,
whole pages: the plain case.

The pool layout ``[layers, 2, pages, kv_heads, page_size, head_dim]`` keeps one head's part of a
page contiguous, so a slice of heads of one page is one contiguous run on both sides: a sliced
transfer costs one descriptor per (page, layer, K|V) where whole pages cost one per page run.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from pdserve.distributed import kv_heads_for_rank


@dataclass(frozen=True)
class HeadSlice:
    prefill_rank: int
    decode_rank: int
    heads: tuple[int, int]  # [start, end) of global KV heads
    src_offset: int  # first head's index in the prefill rank's local heads
    dst_offset: int  # ... in the decode rank's
    src_heads: int  # KV heads in the prefill rank's pool
    dst_heads: int  # ... in the decode rank's pool
    writes_metadata: bool

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def empty(self) -> bool:
        """No heads: the prefill rank writes nothing here and only concludes its part of the room."""
        return self.num_heads == 0

    @property
    def whole_pages(self) -> bool:
        """The slice is every head of a page on both sides: pages copy as they are."""
        return self.num_heads == self.src_heads == self.dst_heads


@lru_cache(maxsize=64)
def plan(prefill_tp: int, decode_tp: int, kv_heads: int, num_heads: int) -> tuple[HeadSlice, ...]:
    """Every (prefill rank -> decode rank) slice. Raises ValueError when a side's TP size cannot
    hold the model's heads (see ``kv_heads_for_rank``)."""
    num_heads = num_heads or kv_heads  # unknown query heads: MHA
    p_ranges = [kv_heads_for_rank(kv_heads, num_heads, p, prefill_tp) for p in range(prefill_tp)]
    out: list[HeadSlice] = []
    for d in range(decode_tp):
        d0, d1 = kv_heads_for_rank(kv_heads, num_heads, d, decode_tp)
        chosen: list[tuple[int, int]] = []  # (head, prefill rank)
        for h in range(d0, d1):
            holders = [p for p, (a, b) in enumerate(p_ranges) if a <= h < b]
            chosen.append((h, holders[d % len(holders)]))
        runs: list[list[int]] = []  # [prefill rank, first head, end head]
        for h, p in chosen:
            if runs and runs[-1][0] == p and runs[-1][2] == h:
                runs[-1][2] = h + 1
            else:
                runs.append([p, h, h + 1])
        meta_writer = min(p for p, _, _ in runs)
        for p, h0, h1 in runs:
            pa, pb = p_ranges[p]
            out.append(HeadSlice(p, d, (h0, h1), h0 - pa, h0 - d0, pb - pa, d1 - d0, p == meta_writer))
    writing = {s.prefill_rank for s in out}
    for p in range(prefill_tp):  # every replica of p's heads is read elsewhere: an empty slice
        if p not in writing:
            d = p % decode_tp
            (pa, pb), (d0, d1) = p_ranges[p], kv_heads_for_rank(kv_heads, num_heads, d, decode_tp)
            out.append(HeadSlice(p, d, (pa, pa), 0, 0, pb - pa, d1 - d0, False))
    return tuple(out)


def sources(prefill_tp: int, decode_tp: int, kv_heads: int, num_heads: int, decode_rank: int) -> list[HeadSlice]:
    """The slices decode rank ``decode_rank`` receives, by prefill rank: the prefill ranks it
    registers with and asks for every room (empty slices included)."""
    return sorted((s for s in plan(prefill_tp, decode_tp, kv_heads, num_heads) if s.decode_rank == decode_rank),
                  key=lambda s: s.prefill_rank)


def slice_for(prefill_tp: int, decode_tp: int, kv_heads: int, num_heads: int, prefill_rank: int,
              decode_rank: int) -> HeadSlice:
    """The one slice (maybe empty) prefill rank ``prefill_rank`` writes into decode rank
    ``decode_rank``; ValueError when that decode rank does not contact it."""
    found = [s for s in plan(prefill_tp, decode_tp, kv_heads, num_heads)
             if s.prefill_rank == prefill_rank and s.decode_rank == decode_rank]
    if len(found) != 1:
        raise ValueError(f"prefill rank {prefill_rank} writes {len(found)} slices into decode rank {decode_rank} "
                         f"(tp {prefill_tp} -> {decode_tp}, {kv_heads} KV heads); expected exactly one")
    return found[0]


def destinations_of(prefill_tp: int, decode_tp: int, kv_heads: int, num_heads: int, prefill_rank: int) -> int:
    """How many decode ranks ask prefill rank ``prefill_rank`` for each room (empty slices
    included: at least one)."""
    return sum(1 for s in plan(prefill_tp, decode_tp, kv_heads, num_heads) if s.prefill_rank == prefill_rank)
