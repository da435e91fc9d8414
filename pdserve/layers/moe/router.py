"""Expert routers: from a token's hidden state to its top-k experts and their weights.

Each router is the formula of one HF family, with its dtypes (they decide bf16 equality):

- ``SoftmaxTopK``: softmax over every expert's logit in float32, top-k, optionally renormalised
  to sum 1 (``norm_topk_prob``); Qwen2-MoE and Qwen3-MoE cast the weights back to the logits'
  dtype, Mixtral (always renormalised) keeps them in float32.
- ``TopKSoftmax``: top-k of the logits (with a bias), softmax over those k only (GPT-OSS).

A router owns the gate matrix (``weight`` [E, H], HF's name under the MoE block) and returns a
``Routing``. Grouped sigmoid routing with a correction bias and a routed scaling factor
(DeepSeek-V3) fits the same shape: its weights and logits are float32 (``fp32_logits``) and
``Routing.weights`` carries the scaling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Routing:
    """Logical expert ids [T, K] (int64) and their weights [T, K] (the dtype the experts' outputs
    are scaled in: float32 or the model's)."""

    ids: torch.Tensor
    weights: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]


class Router(nn.Module):
    """``weight`` [num_experts, hidden] (+ ``bias``); ``forward(h [T, H]) -> Routing``."""

    fp32_logits = False  # compute the logits in float32 whatever the model dtype (DeepSeek-V3)

    def __init__(self, hidden: int, num_experts: int, top_k: int, bias: bool = False):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok: {top_k} must be in [1, num_experts = {num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None

    def prepack(self, ops, batch_invariant: bool) -> int:
        """With ``batch_invariant``: the gate matmul on pdserve's kernels, whose rows do not depend on
        each other (``F.linear``'s do: BLAS blocks by shape); returns the packed bytes."""
        if not batch_invariant:
            return 0
        from pdserve.layers.linear import PackedBF16, PackedF32

        bias = None if self.bias is None else self.bias.data
        if self.fp32_logits or self.weight.dtype == torch.float32:
            self.invariant = PackedF32(self.weight.data, bias, ops)
        else:
            self.invariant = PackedBF16(self.weight.data, bias, ops, batch_invariant=True)
        return self.invariant.nbytes

    invariant = None  # the batch-invariant gate matmul, set by ``prepack``

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.invariant is not None:
            return self.invariant(h)
        if self.fp32_logits:
            return F.linear(h.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        return F.linear(h, self.weight, self.bias)

    def select(self, logits: torch.Tensor) -> Routing:
        raise NotImplementedError

    def forward(self, h: torch.Tensor) -> Routing:
        return self.select(self.logits(h))


class SoftmaxTopK(Router):
    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool, cast_back: bool):
        super().__init__(hidden, num_experts, top_k)
        self.renormalize = renormalize
        self.cast_back = cast_back

    def select(self, logits: torch.Tensor) -> Routing:
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.cast_back:
            weights = weights.to(logits.dtype)
        return Routing(ids, weights)


class TopKSoftmax(Router):
    def __init__(self, hidden: int, num_experts: int, top_k: int, bias: bool = True):
        super().__init__(hidden, num_experts, top_k, bias=bias)

    def select(self, logits: torch.Tensor) -> Routing:
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return Routing(ids, F.softmax(top, dim=-1, dtype=top.dtype))


def qwen_router(config, hidden: Optional[int] = None) -> SoftmaxTopK:
    """Qwen2-MoE / Qwen3-MoE: ``norm_topk_prob`` decides the renormalisation; weights cast back."""
    return SoftmaxTopK(hidden or config.hidden_size, config.num_experts, config.num_experts_per_tok,
                       renormalize=bool(getattr(config, "norm_topk_prob", False)), cast_back=True)


def mixtral_router(config) -> SoftmaxTopK:
    return SoftmaxTopK(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                       renormalize=True, cast_back=False)
