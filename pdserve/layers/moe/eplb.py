"""The expert-parallel load balancer: a placement (slot -> logical expert, ``placement.py``) for
one MoE layer from its measured tokens per logical expert (``--init-expert-location`` given a
recorded distribution, ``pdserve expert-placement``).

1. Replicate: the ``slots - experts`` redundant slots go one at a time to the expert with the
   highest load per copy (ties: fewer copies, then the lower id) among those with fewer copies
   than ranks. A copy is expected to carry ``load / copies`` (``to_physical`` deals an expert's
   tokens evenly over its copies).
2. Pack: the slots, heaviest first, go to the least-loaded rank that still has room (each rank
   gets exactly ``slots / ep_size``) and holds no copy of that expert yet; a second copy lands on
   a rank only when every rank with room holds one, and is then swapped away. When swaps cannot
   undo it although every expert has at most ``ep_size`` copies, the slots are dealt round-robin
   by expert instead (no rank then holds two copies).
3. Refine: swap a slot of the most-loaded rank with a lighter one of another rank while that
   lowers the larger of the two ranks' loads.
4. Keep the better: the trivial layout (slot i holds expert ``i % experts``) refined the same way
   replaces the result when its most-loaded rank carries less, so a computed placement is never
   expected to be worse than the trivial one.

Rank r's experts fill slots ``[r*S, (r+1)*S)`` in ascending expert order. This is the global
policy of DeepSeek's EPLB (replicas by load per replica, balanced packing) without its
node-level hierarchy.
"""

from __future__ import annotations

import bisect

from pdserve.layers.moe.placement import imbalance


def replicate(loads: list[float], num_slots: int, ep_size: int) -> list[int]:
    """Copies of each expert, ``num_slots`` in all. An expert with a copy on every rank gets no
    more while another can take one (a second copy on a rank moves no load off it)."""
    n = len(loads)
    if num_slots < n:
        raise ValueError(f"{num_slots} slots cannot hold {n} experts")
    copies = [1] * n
    for _ in range(num_slots - n):
        open_ = [i for i in range(n) if copies[i] < ep_size] or range(n)
        e = max(open_, key=lambda i: (loads[i] / copies[i], -copies[i], -i))
        copies[e] += 1
    return copies


def balance_layer(loads: list[float], num_slots: int, ep_size: int) -> list[int]:
    """Slot -> logical expert for one layer with ``loads`` tokens per expert."""
    if num_slots % ep_size:
        raise ValueError(f"ep_size: {ep_size} does not divide the {num_slots} expert slots")
    n = len(loads)
    copies = replicate(loads, num_slots, ep_size)
    weight = _per_copy(loads, copies)
    ranks = _pack(weight, copies, ep_size)
    if any(len(set(r)) < len(r) for r in ranks) and max(copies) <= ep_size:
        ranks = _deal(weight, copies, ep_size)
    _refine(ranks, weight)
    # the trivial layout (slot i holds expert i % n) improved by the same swaps, when it does better
    trivial = [i % n for i in range(num_slots)]
    weight_t = _per_copy(loads, [trivial.count(e) for e in range(n)])
    per = num_slots // ep_size
    ranks_t = [trivial[r * per : (r + 1) * per] for r in range(ep_size)]
    _refine(ranks_t, weight_t)
    if max(_load(r, weight_t) for r in ranks_t) < max(_load(r, weight) for r in ranks) - 1e-9:
        ranks = ranks_t
    return [e for r in ranks for e in sorted(r)]


def _per_copy(loads: list[float], copies: list[int]) -> list[float]:
    """Expected load of one copy of each expert."""
    return [loads[e] / copies[e] for e in range(len(loads))]


def expected_rank_loads(row: list[int], loads: list[float], ep_size: int) -> list[float]:
    """Per-rank load of placement ``row`` (slot -> expert) when each expert's ``loads`` are
    split evenly over its copies."""
    copies = [0] * len(loads)
    for e in row:
        copies[e] += 1
    per = len(row) // ep_size
    return [sum(loads[e] / copies[e] for e in row[r * per : (r + 1) * per]) for r in range(ep_size)]


def expected_imbalance(row: list[int], loads: list[float], ep_size: int) -> float:
    return imbalance(expected_rank_loads(row, loads, ep_size))


# ---- the steps ------------------------------------------------------------------------------
def _pack(weight: list[float], copies: list[int], ep_size: int) -> list[list[int]]:
    slots = sorted(
        ((weight[e], e) for e in range(len(weight)) for _ in range(copies[e])),
        key=lambda s: (-s[0], s[1]),
    )
    room = len(slots) // ep_size
    ranks: list[list[int]] = [[] for _ in range(ep_size)]
    load = [0.0] * ep_size
    for w, e in slots:
        free = [r for r in range(ep_size) if len(ranks[r]) < room]
        fresh = [r for r in free if e not in ranks[r]] or free
        r = min(fresh, key=lambda r: (load[r], r))
        ranks[r].append(e)
        load[r] += w
    _undo_duplicates(ranks, weight)
    return ranks


def _undo_duplicates(ranks: list[list[int]], weight: list[float]) -> None:
    """Swap a second copy on a rank with an expert of another rank that neither rank would then
    hold twice; each swap removes one duplicate."""
    while True:
        dup = next(
            ((r, e) for r, held in enumerate(ranks) for e in set(held) if held.count(e) > 1), None
        )
        if dup is None:
            return
        r, e = dup
        best = None
        for q, other in enumerate(ranks):
            if q == r or e in other:
                continue
            for j, f in enumerate(other):
                if f in ranks[r]:
                    continue
                lr = _load(ranks[r], weight) - weight[e] + weight[f]
                lq = _load(other, weight) - weight[f] + weight[e]
                if best is None or max(lr, lq) < best[0]:
                    best = (max(lr, lq), q, j)
        if best is None:
            return
        _, q, j = best
        i = ranks[r].index(e)
        ranks[r][i], ranks[q][j] = ranks[q][j], ranks[r][i]


def _deal(weight: list[float], copies: list[int], ep_size: int) -> list[list[int]]:
    """Slots grouped by expert (heaviest first) dealt to ranks in turn: a group of at most
    ``ep_size`` copies never meets a rank twice."""
    order = sorted(range(len(weight)), key=lambda e: (-weight[e], e))
    slots = [e for e in order for _ in range(copies[e])]
    return [slots[r::ep_size] for r in range(ep_size)]


def _load(held: list[int], weight: list[float]) -> float:
    return sum(weight[e] for e in held)


def _refine(ranks: list[list[int]], weight: list[float], max_swaps: int = 1000) -> None:
    """Lower the heaviest rank by swapping one of its slots for a lighter slot of another rank
    (the swap that brings the pair's loads closest together), while one helps."""
    for _ in range(max_swaps):
        load = [_load(r, weight) for r in ranks]
        hi = max(range(len(ranks)), key=lambda r: (load[r], -r))
        swap = None
        for q in sorted(range(len(ranks)), key=lambda r: load[r]):
            if q != hi:
                swap = _best_swap(ranks[hi], ranks[q], load[hi] - load[q], weight)
                if swap is not None:
                    break
        if swap is None:
            return
        i, j = swap
        ranks[hi][i], ranks[q][j] = ranks[q][j], ranks[hi][i]


def _best_swap(
    heavy: list[int], light: list[int], gap: float, weight: list[float]
) -> tuple[int, int] | None:
    """(i, j): swapping heavy[i] with light[j] moves d = w_i - w_j, 0 < d < gap, closest to
    gap / 2; neither rank may end up with two copies of one expert."""
    if gap <= 1e-9:
        return None
    by_weight = sorted(range(len(light)), key=lambda j: weight[light[j]])
    ws = [weight[light[j]] for j in by_weight]
    best, best_err = None, None
    for i, a in enumerate(heavy):
        k = bisect.bisect_left(ws, weight[a] - gap / 2)
        for idx in range(max(0, k - 4), min(len(ws), k + 4)):
            b = light[by_weight[idx]]
            d = weight[a] - weight[b]
            if not 1e-9 < d < gap - 1e-9 or a == b or a in light or b in heavy:
                continue
            err = abs(d - gap / 2)
            if best_err is None or err < best_err:
                best, best_err = (i, by_weight[idx]), err
    return best
