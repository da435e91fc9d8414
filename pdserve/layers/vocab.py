"""The vocabulary-parallel embedding: each tensor-parallel rank holds a contiguous slice of the
vocabulary's rows (the last slice padded), looks up the tokens that fall in it, and the ranks'
rows are summed (every token's row is non-zero on exactly one rank)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed import SINGLE, TPGroup


class VocabParallelEmbedding(nn.Module):
    """``weight``: [rows of this rank, hidden]; rows ``start .. start + rows`` of the vocabulary."""

    def __init__(self, rows: int, hidden: int, start: int = 0, tp: TPGroup = SINGLE):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.start = start
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class MultipliedEmbedding(VocabParallelEmbedding):
    """Rows times ``multiplier`` (Granite's ``embedding_multiplier``, a Python float as HF applies
    it), set by the model after construction."""

    multiplier = 1.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.multiplier
