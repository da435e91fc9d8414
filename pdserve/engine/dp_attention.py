"""Data-parallel attention (``--enable-dp-attention --dp-size D``): the ``tp_size`` ranks form D
attention groups, each with its own requests, scheduler state and KV pool, while the dense MLP
stays tensor-parallel over all ranks.

Every step the ranks exchange their groups' token counts (``sync_counts``). When any group has
tokens, every rank runs a forward, an idle group with no tokens of its own: before each MLP the
groups' hidden states are gathered (padded to the largest group's count, so one all-gather moves
them), the MLP runs on all of them (its down projection all-reduced over every rank) and each
group keeps its own rows (``DPGather.local``). Attention, the embedding and the logits stay inside
the group.
"""

from __future__ import annotations

import torch

from pdserve.distributed import Parallel


def sync_counts(par: Parallel, num_tokens: int, busy: int) -> tuple[list[int], int]:
    """Every attention group's token count this step, and the busiest group's ``busy`` level
    (2: requests to compute, 1: requests waiting on PD peers, 0: idle): one small all-gather."""
    import torch.distributed as dist

    tp = par.tp
    mine = torch.tensor([num_tokens, busy], dtype=torch.int64)
    parts = [torch.zeros(2, dtype=torch.int64) for _ in range(tp.size)]
    dist.all_gather(parts, mine, group=tp.cpu_group)
    per = par.attn.size
    return [int(parts[g * per][0].item()) for g in range(par.dp_size)], max(
        int(p[1].item()) for p in parts
    )


class DPGather:
    """One step's gather/scatter around the MLP, for the token counts of every group."""

    def __init__(self, par: Parallel, counts: list[int]):
        self.par = par
        self.counts = counts
        self.longest = max(counts)
        self.offset = sum(counts[: par.dp_rank])

    def gather(self, h: torch.Tensor) -> torch.Tensor:
        """[this group's tokens, H] -> [every group's tokens, H], in group order."""
        import torch.distributed as dist

        tp = self.par.tp
        buf = h.new_zeros((self.longest, h.shape[1]))
        buf[: h.shape[0]] = h
        wire = buf.view(torch.uint8)  # gloo moves bytes of any dtype (it has no bf16 all-gather)
        parts = [torch.empty_like(wire) for _ in range(tp.size)]
        dist.all_gather(parts, wire, group=tp.group)
        per = self.par.attn.size
        rows = [parts[g * per][:c] for g, c in enumerate(self.counts) if c]
        return (torch.cat(rows) if rows else wire[:0]).view(h.dtype)

    def local(self, y: torch.Tensor) -> torch.Tensor:
        """This group's rows of the MLP output (every rank holds all of them after the reduce)."""
        return y[self.offset : self.offset + self.counts[self.par.dp_rank]]
