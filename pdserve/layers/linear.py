"""Linear layers whose weight holds several HF projections stacked along the output dimension.

One matmul for q/k/v (and one for gate/up) instead of three (two) is a clear win on CPU, where
small matmuls are dominated by per-call overhead.
"""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """``nn.Linear`` with ``out_features = sum(output_sizes)``; shard ``i`` is rows
    ``[sum(output_sizes[:i]), sum(output_sizes[:i+1]))`` of the weight (and bias)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def load_shard(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        """Copy one projection's ``weight`` or ``bias`` (``name``) into its rows."""
        start = sum(self.output_sizes[:shard])
        rows = getattr(self, name).data[start:start + self.output_sizes[shard]]
        if rows.shape != tensor.shape:
            raise ValueError(f"shard {shard} {name}: expected shape {tuple(rows.shape)}, got {tuple(tensor.shape)}")
        rows.copy_(tensor)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(self.output_sizes, dim=-1)
