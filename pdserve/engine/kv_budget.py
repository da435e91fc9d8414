"""The KV memory budget: how many pages each cache group's pool gets on this rank.

A page of a group holds its layers' KV and whatever rides with it (``PageRider``): the per-row
scales of a quantized cache, the routed experts' ids, a speculative draft model's KV in the same
page ids. One budget covers them all: per-request groups (a recurrent state) get a slot per running
request first (``--max-mamba-cache-size``); of the rest, full-attention groups get equal token
counts and windowed groups ``--swa-full-tokens-ratio`` of that (all of it when every paged group is
windowed); ``--max-total-tokens`` is the full groups' token count, else the memory available (a
GPU's free memory times ``--mem-fraction-static``; on a CPU, a share of the host's). Counts include
the padding page (slot) 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# Default share of available host memory for KV on CPU (servers often share one host).
CPU_DEFAULT_KV_FRACTION = 0.1
# A model whose only paged group holds no bytes (a pure state-space model's ``PositionLedger``):
# pages for every running request at this length (without ``--context-length``), at most this many
LEDGER_CONTEXT = 1 << 17
LEDGER_MAX_PAGES = 1 << 22


@dataclass
class PageRider:
    """``bytes`` stored with every page of cache group ``group`` besides its layers' KV."""

    group: int
    bytes: int
    what: str


# what a part of the server adds to pages, from the cache groups and the KV item size; called only
# when the budget comes from memory (``--max-total-tokens`` counts tokens, not bytes)
RiderSource = Callable[[list, int], PageRider]


def available_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def state_slots(args, groups) -> int:
    """Slots of a per-request group's pool: a running request's state, and with the prefix cache
    its snapshot (``cache_policy.py``), plus the padding slot."""
    per_request = 1 if args.disable_radix_cache else 2
    slots = (args.max_mamba_cache_size or args.max_running_requests * per_request) + 1
    if any(g.spec.per_request for g in groups) and slots - 1 < args.max_running_requests * (
        per_request
    ):
        raise ValueError(
            f"max_mamba_cache_size: {slots - 1} state slots cannot hold max_running_requests "
            f"({args.max_running_requests}) requests and the snapshots of their states that "
            "the prefix cache keeps (2 slots each); raise it, lower max_running_requests, or "
            "disable the radix cache"
        )
    return slots


def page_counts(args, groups, per_page: list[int], riders: list[PageRider], device) -> list[int]:
    """Pages of each group's pool; ``per_page``: the bytes of one page of each group's layers."""
    slots = state_slots(args, groups)
    state = [g.spec.per_request for g in groups]
    paged = [g.spec for g, st in zip(groups, state) if not st]
    mixed = any(not spec.drops_pages for spec in paged)
    # a group with items on some logical pages only (compressed entries) needs that share
    share = [
        0.0
        if st
        else (args.swa_full_tokens_ratio if mixed and g.spec.drops_pages else 1.0)
        * g.spec.page_share(args.page_size)
        for g, st in zip(groups, state)
    ]
    if args.max_total_tokens is not None:
        return [
            slots if st else int(-(-args.max_total_tokens * s // args.page_size)) + 1
            for s, st in zip(share, state)
        ]
    per_page = list(per_page)
    for rider in riders:
        per_page[rider.group] += rider.bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * args.mem_fraction_static)
    else:
        budget = int(
            available_host_bytes() * min(args.mem_fraction_static, CPU_DEFAULT_KV_FRACTION)
        )
    budget -= sum(slots * b for b, st in zip(per_page, state) if st)
    if budget <= 0:
        raise ValueError(
            f"max_mamba_cache_size: {slots - 1} state slots take more than the KV cache's "
            "memory budget; lower it (or max_running_requests) or raise mem_fraction_static"
        )
    paged_bytes = sum(s * b for s, b in zip(share, per_page))
    if paged_bytes == 0:  # only pages without bytes (``PositionLedger``): as many as requests use
        tokens = args.max_running_requests * (args.context_length or LEDGER_CONTEXT)
        pages = min(-(-tokens // args.page_size), LEDGER_MAX_PAGES)
        return [slots if st else pages + 1 for st in state]
    pages = budget / paged_bytes
    return [slots if st else max(2, int(pages * s) + 1) for s, st in zip(share, state)]


def scratch_pages(args, page_size: int) -> int:
    """Scratch pages a paged pool sets aside for tree rows (``BaseKVPool.scratch``): room for
    one row of the largest tree these settings build, each token's keys laid out from the page
    holding the row's first slot to its own position (a backend runs more rows in turns)."""
    drafts = args.speculative_num_draft_tokens
    depth = min(args.speculative_num_steps or drafts, drafts)
    tokens = max(drafts + 1, args.speculative_eagle_topk or 1)  # a verify row, a head's level
    return tokens * -(-(page_size - 1 + depth + 1) // page_size)
