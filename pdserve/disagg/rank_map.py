"""Which prefill rank writes what into which decode rank, for any pair of TP sizes, per split of
the regions (``kv_region.Region.split``) the two sides hold.

- ``heads``: every rank holds a range of KV heads (``distributed.kv_heads_for_rank``): split when
  there are at least as many KV heads as ranks, one replicated head per rank when there are
  fewer. A decode rank needs its range; for each of its heads it takes one prefill rank that
  holds it (among replicas, the ones spread by decode rank, so replicated heads are read from
  different prefill ranks). Consecutive heads from the same prefill rank form one run.
- ``segments``: each segment of an item is sharded evenly along its own axis; a decode rank reads
  from every prefill rank whose share overlaps its own the overlap (in parts of
  ``lcm(prefill_tp, decode_tp)`` of each segment). A segment of whole units that a side has fewer
  of than ranks (a Mamba2 layer's one group, held by every rank: ``kv_spec.piece_range``) is read
  unit by unit, each from the lowest of the decode rank's sources that holds it
  (``piece_source``).
- ``replicated``: every rank holds the same bytes; a decode rank reads them from one prefill rank:
  the lowest of those it already reads from, or, when nothing else is split, prefill rank
  ``decode_rank % prefill_tp`` (so the decode ranks spread over the prefill ranks).

So every destination byte is written exactly once. The lowest prefill rank of a decode rank's
sources writes its metadata row (first token, room id).

A prefill rank that writes nothing into any decode rank (MQA, GQA with fewer KV heads than
prefill ranks, a latent read from another rank) still runs every room with the other prefill
ranks, and their room states are MIN-all-reduced, so it must conclude its part too. It gets one
*empty* pair (nothing to write, no metadata row) with decode rank ``prefill_rank % decode_tp``:
that decode rank registers with it and sends it a transfer request naming no page, and it
reports Success without writing. So every prefill rank has at least one destination per room,
and a room never waits for a request no decode rank sends.

With equal TP sizes (and any head counts) decode rank r reads everything from prefill rank r,
whole pages: the plain case.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import lcm
from typing import Optional

from pdserve.distributed import kv_heads_for_rank
from pdserve.kv_spec import piece_range


@dataclass(frozen=True)
class PairPlan:
    """What prefill rank ``prefill_rank`` writes into decode rank ``decode_rank``."""

    prefill_rank: int
    decode_rank: int
    writes_metadata: bool = False
    # "heads" regions: global KV heads [start, end), their first index in each side's local heads,
    # and the KV heads each side's pool holds
    heads: tuple[int, int] = (0, 0)
    src_offset: int = 0
    dst_offset: int = 0
    src_heads: int = 0
    dst_heads: int = 0
    # "segments" regions: parts [start, end) of ``num_parts`` of every segment (None: none)
    parts: Optional[tuple[int, int]] = None
    num_parts: int = 1
    replicated: bool = False  # "replicated" regions: written by this rank

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def empty(self) -> bool:
        """Nothing to write: the prefill rank only concludes its part of the room."""
        return self.num_heads == 0 and self.parts is None and not self.replicated

    @property
    def whole_pages(self) -> bool:
        """The heads are every head of a page on both sides: pages copy as they are."""
        return self.num_heads > 0 and self.num_heads == self.src_heads == self.dst_heads

    def part_range(self, rank: int, tp: int) -> tuple[int, int]:
        """The parts (of ``num_parts``) of each segment that rank ``rank`` of ``tp`` holds."""
        n = self.num_parts // tp
        return rank * n, (rank + 1) * n


def _head_runs(
    prefill_tp: int, decode_tp: int, kv_heads: int, num_heads: int, d: int
) -> dict[int, dict]:
    p_ranges = [kv_heads_for_rank(kv_heads, num_heads, p, prefill_tp) for p in range(prefill_tp)]
    d0, d1 = kv_heads_for_rank(kv_heads, num_heads, d, decode_tp)
    runs: list[list[int]] = []  # [prefill rank, first head, end head]
    for h in range(d0, d1):
        holders = [p for p, (a, b) in enumerate(p_ranges) if a <= h < b]
        p = holders[d % len(holders)]
        if runs and runs[-1][0] == p and runs[-1][2] == h:
            runs[-1][2] = h + 1
        else:
            runs.append([p, h, h + 1])
    out: dict[int, dict] = {}
    for p, h0, h1 in runs:
        if p in out:
            raise ValueError(
                f"decode rank {d} would read two runs of KV heads from prefill rank {p}"
            )
        pa, pb = p_ranges[p]
        out[p] = {
            "heads": (h0, h1),
            "src_offset": h0 - pa,
            "dst_offset": h0 - d0,
            "src_heads": pb - pa,
            "dst_heads": d1 - d0,
        }
    return out


def segment_sources(prefill_tp: int, decode_tp: int, decode_rank: int) -> list[int]:
    """The prefill ranks whose share of every evenly split segment overlaps decode rank
    ``decode_rank``'s: the ranks it reads "segments" regions from."""
    parts = lcm(prefill_tp, decode_tp)
    d0, d1 = decode_rank * parts // decode_tp, (decode_rank + 1) * parts // decode_tp
    return [
        p
        for p in range(prefill_tp)
        if max(d0, p * parts // prefill_tp) < min(d1, (p + 1) * parts // prefill_tp)
    ]


def piece_source(unit: int, pieces: int, prefill_tp: int, decode_tp: int, decode_rank: int) -> int:
    """The prefill rank that writes unit ``unit`` of a segment of ``pieces`` whole units into
    decode rank ``decode_rank``: the lowest of its sources holding it."""
    for p in segment_sources(prefill_tp, decode_tp, decode_rank):
        start, end = piece_range(pieces, prefill_tp, p)
        if start <= unit < end:
            return p
    raise ValueError(
        f"decode rank {decode_rank} of tp {decode_tp} reads no prefill rank of tp {prefill_tp} "
        f"holding unit {unit} of {pieces}"
    )


@lru_cache(maxsize=64)
def plan(
    prefill_tp: int,
    decode_tp: int,
    kv_heads: int,
    num_heads: int,
    splits: tuple[str, ...] = ("heads",),
) -> tuple[PairPlan, ...]:
    """Every (prefill rank -> decode rank) pair, for regions of the given ``splits``. Raises
    ValueError when a side's TP size cannot hold the model's heads (see ``kv_heads_for_rank``)."""
    num_heads = num_heads or kv_heads  # unknown query heads: MHA
    parts = lcm(prefill_tp, decode_tp)
    out: list[PairPlan] = []
    for d in range(decode_tp):
        pairs: dict[int, dict] = {}
        if "heads" in splits:
            pairs.update(_head_runs(prefill_tp, decode_tp, kv_heads, num_heads, d))
        if "segments" in splits:
            d0, d1 = d * parts // decode_tp, (d + 1) * parts // decode_tp
            for p in segment_sources(prefill_tp, decode_tp, d):
                a, b = max(d0, p * parts // prefill_tp), min(d1, (p + 1) * parts // prefill_tp)
                pairs.setdefault(p, {})["parts"] = (a, b)
        if "replicated" in splits:
            pairs.setdefault(min(pairs) if pairs else d % prefill_tp, {})["replicated"] = True
        if not pairs:  # nothing at all to move (no regions): the plain pairing, empty
            pairs[d % prefill_tp] = {}
        meta = min(pairs)
        out += [
            PairPlan(p, d, writes_metadata=p == meta, num_parts=parts, **f)
            for p, f in sorted(pairs.items())
        ]
    writing = {s.prefill_rank for s in out}
    for p in range(prefill_tp):  # everything p holds is read from other ranks: an empty pair
        if p not in writing:
            out.append(PairPlan(p, p % decode_tp, num_parts=parts))
    return tuple(out)


def sources(
    prefill_tp: int,
    decode_tp: int,
    kv_heads: int,
    num_heads: int,
    decode_rank: int,
    splits: tuple[str, ...] = ("heads",),
) -> list[PairPlan]:
    """The pairs decode rank ``decode_rank`` receives, by prefill rank: the prefill ranks it
    registers with and asks for every room (empty pairs included)."""
    return sorted(
        (
            s
            for s in plan(prefill_tp, decode_tp, kv_heads, num_heads, splits)
            if s.decode_rank == decode_rank
        ),
        key=lambda s: s.prefill_rank,
    )


def pair_for(
    prefill_tp: int,
    decode_tp: int,
    kv_heads: int,
    num_heads: int,
    prefill_rank: int,
    decode_rank: int,
    splits: tuple[str, ...] = ("heads",),
) -> PairPlan:
    """The one pair (maybe empty) of prefill rank ``prefill_rank`` and decode rank
    ``decode_rank``; ValueError when that decode rank does not contact it."""
    found = [
        s
        for s in plan(prefill_tp, decode_tp, kv_heads, num_heads, splits)
        if s.prefill_rank == prefill_rank and s.decode_rank == decode_rank
    ]
    if len(found) != 1:
        raise ValueError(
            f"prefill rank {prefill_rank} writes {len(found)} pairs into decode rank {decode_rank} "
            f"(tp {prefill_tp} -> {decode_tp}, {kv_heads} KV heads, splits {list(splits)}); "
            "expected exactly one"
        )
    return found[0]


def destinations_of(
    prefill_tp: int,
    decode_tp: int,
    kv_heads: int,
    num_heads: int,
    prefill_rank: int,
    splits: tuple[str, ...] = ("heads",),
) -> int:
    """How many decode ranks ask prefill rank ``prefill_rank`` for each room (empty pairs
    included: at least one)."""
    return sum(
        1
        for s in plan(prefill_tp, decode_tp, kv_heads, num_heads, splits)
        if s.prefill_rank == prefill_rank
    )
