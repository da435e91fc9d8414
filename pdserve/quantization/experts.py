"""An MoE layer's experts (``layers/moe/experts.py``) on quantized weights: the layer's reference
loop, each expert's two matmuls a format's linear over the expert's slice of ``w13`` / ``w2`` and
their ``*_scale``."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn


class QuantizedExperts:
    def __init__(self, experts: nn.Module, linear: Callable[..., Any]):
        """``linear(weight, scale, bias)``: the format's matmul over one expert's slices."""
        self.experts = experts

        def make(slot: int, weight: str, bias: str):
            b: Optional[torch.Tensor] = getattr(experts, bias)
            return linear(
                getattr(experts, weight)[slot],
                getattr(experts, f"{weight}_scale")[slot],
                None if b is None else b[slot],
            )

        self.linears = [
            (make(s, "w13", "b13"), make(s, "w2", "b2")) for s in range(experts.num_slots)
        ]

    def use_kernels(self, ops, *args, **kwargs) -> None:
        """Every matmul's ``use_kernels(ops, *args, **kwargs)``."""
        for w13, w2 in self.linears:
            w13.use_kernels(ops, *args, **kwargs)
            w2.use_kernels(ops, *args, **kwargs)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((x.shape[0], self.experts.hidden), dtype=torch.float32)
        if x.shape[0] == 0 or not bool((ids >= 0).any()):
            return out
        return self.experts._loop(x, ids, weights, out, self.linears)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.linears)
