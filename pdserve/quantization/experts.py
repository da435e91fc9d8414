"""An MoE layer's experts (``layers/moe/experts.py``) on quantized weights: the layer's reference
loop, each expert's two matmuls a format's linear over the expert's slice of ``w13`` / ``w2`` and
their ``*_scale``.

Once ``use_kernels`` gave the matmuls pdserve's panel kernels (FP8 blocks, MXFP4, int4), the loop
runs in C++ (``ops.PanelExperts``, ``kernels/csrc/moe_panels.cpp``): the same matmuls in the same
expert order, the activation in float32 rounded once to the activations' dtype, without Python
between the experts. Activations other than ``silu`` / ``swiglu_oai``, experts summed as HF's
eager loop rounds them, and FP8 bf16 calls past the panel kernel's row limit (where each expert's
matmul may take oneDNN) keep the Python loop."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from pdserve.hostmem import huge_copies

FUSED_ACTIVATIONS = ("silu", "swiglu_oai")


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
        self.fused: Any = None  # ops.PanelExperts over the packed panels, once use_kernels ran
        self.fused_max_rows = 0
        self.amx_min_rows = -1

    def use_kernels(self, ops, *args, **kwargs) -> None:
        """Every matmul's ``use_kernels(ops, *args, **kwargs)``, then the C++ loop over them where
        the format's panels allow it."""
        for w13, w2 in self.linears:
            w13.use_kernels(ops, *args, **kwargs)
            w2.use_kernels(ops, *args, **kwargs)
        # the layer's packed weights in one buffer of 2 MiB pages: the stream of a decode step's
        # experts without a TLB miss every 4 KiB (W4A8 at one row read 1.4x faster so here)
        held = [lin for pair in self.linears for lin in pair]
        packed = [
            lin.packed for lin in held if isinstance(getattr(lin, "packed", None), torch.Tensor)
        ]
        if len(packed) == len(held):
            for lin, copy in zip(held, huge_copies(packed)):
                lin.packed = copy
        self.fused = self._panel_experts(ops)

    def _panel_experts(self, ops) -> Any:
        e = self.experts
        if (
            e.activation not in FUSED_ACTIVATIONS
            or e.round_each_expert
            or not self.linears
            or not hasattr(ops, "PanelExperts")
        ):
            return None
        # formats of other kernels (int8 channels) have no panels
        parts = [(a.panels(), b.panels()) for a, b in self.linears]
        if any(p is None or q is None for p, q in parts):
            return None
        kinds = {(p.codes, p.block_k, q.codes, q.block_k, p.amx_min_rows) for p, q in parts}
        if len(kinds) != 1 or parts[0][0].codes != parts[0][1].codes:
            return None
        first, second = parts[0]
        self.fused_max_rows = min(min(p.max_rows, q.max_rows) for p, q in parts)
        self.amx_min_rows = first.amx_min_rows

        def biases(index: int) -> list[torch.Tensor]:
            held = [pair[index].bias for pair in self.linears]
            if any(b is None for b in held):
                return []
            return [b.detach().float().contiguous() for b in held]

        return ops.PanelExperts(
            first.codes,
            [p.packed for p, _ in parts],
            [p.scale for p, _ in parts],
            [q.packed for _, q in parts],
            [q.scale for _, q in parts],
            biases(0),
            biases(1),
            first.block_k,
            second.block_k,
            e.hidden,
            e.intermediate,
            e.activation,
            e.alpha,
            e.limit,
        )

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((x.shape[0], self.experts.hidden), dtype=torch.float32)
        if x.shape[0] == 0 or not bool((ids >= 0).any()):
            return out
        if (
            self.fused is not None
            and x.dtype in (torch.float32, torch.bfloat16)
            and (x.dtype == torch.float32 or x.shape[0] <= self.fused_max_rows)
        ):
            self.fused.forward(
                out,
                x.contiguous(),
                ids.to(torch.int32).contiguous(),
                weights.to(torch.float32).contiguous(),
                self.amx_min_rows,
            )
            return out
        return self.experts._loop(x, ids, weights, out, self.linears)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.linears)
