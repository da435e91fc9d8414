"""A worker's ``GET /get_load`` answer, read: pdserve's (one dict, per-group ``dp`` entries) or
sglang's (a list of per-DP-rank dicts)."""

from __future__ import annotations


def parse_load(payload) -> tuple[int, int]:
    """Sum a ``GET /get_load`` answer: a list of per-DP-rank dicts (sglang) or one dict (pdserve:
    its top-level totals, per-group ``dp`` entries aside)."""
    ranks = payload if isinstance(payload, list) else [payload]
    reqs = tokens = 0
    for r in ranks:
        if not isinstance(r, dict):
            continue
        if "load" in r and "num_reqs" not in r:
            reqs += int(r["load"])
            continue
        reqs += int(r.get("num_reqs", 0)) + int(r.get("num_waiting_reqs", 0))
        tokens += int(r.get("num_tokens", 0))
    return reqs, tokens


def parse_bandwidth(payload) -> float | None:
    """A prefill's ``kv_transfer_bytes_per_s`` from its ``GET /get_load`` (the mean over groups that
    report one)."""
    ranks = payload if isinstance(payload, list) else [payload]
    rates = [
        r["kv_transfer_bytes_per_s"]
        for r in ranks
        if isinstance(r, dict)
        and isinstance(r.get("kv_transfer_bytes_per_s"), (int, float))
        and r["kv_transfer_bytes_per_s"] > 0
    ]
    return sum(rates) / len(rates) if rates else None


def parse_group_loads(payload) -> list[tuple[int, int]] | None:
    """(requests, tokens) per DP group of a ``GET /get_load`` answer, by ``dp_rank``: the ``dp``
    list of a dict (a dict without one is one group), or a list of per-rank dicts. None when
    the groups are not numbered 0..N-1. Raises ``ValueError``/``TypeError`` for bad numbers."""
    if isinstance(payload, dict) and payload.get("dp") is None:
        return [parse_load(payload)]
    groups = payload.get("dp") if isinstance(payload, dict) else payload
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        return None
    ranks = [g.get("dp_rank", i) for i, g in enumerate(groups)]
    if not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        return None
    if sorted(ranks) != list(range(len(ranks))):
        return None
    loads = [(0, 0)] * len(groups)
    for rank, group in zip(ranks, groups, strict=True):
        loads[rank] = parse_load(group)
    return loads
