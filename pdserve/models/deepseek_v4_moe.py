"""DeepSeek-V4's MoE block: ``n_routed_experts`` SwiGLU experts with ``swiglu_limit`` clamps and a
shared one; expert scores ``sqrt(softplus(x W^T))``; ``hash_moe`` layers take the experts of a
fixed token-id table (``tid2eid``), the others the top-k of the scores plus a correction bias; the
chosen scores renormalised and scaled by ``routed_scaling_factor``. Under tensor parallelism each
rank holds its share of every expert's intermediate columns (``shard``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed import SINGLE, TPGroup, shard_range
from pdserve.layers.linear import Linear


class Expert(nn.Module):
    """A SwiGLU expert (or the shared one) whose intermediate columns ``inter`` this rank holds;
    its output is this rank's part of the sum."""

    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.w1 = Linear(hidden, inter, bias=False)  # gate
        self.w3 = Linear(hidden, inter, bias=False)  # up
        self.w2 = Linear(inter, hidden, bias=False)  # down
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class Gate(nn.Module):
    def __init__(self, config, hashed: bool):
        super().__init__()
        self.hashed, self.top_k = hashed, config.num_experts_per_tok
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        if hashed:
            self.register_buffer(
                "tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long)
            )
        else:
            self.bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor):
        scores = F.softplus(F.linear(x, self.weight)).sqrt()
        if self.hashed:
            idx = self.tid2eid[input_ids].long()
        else:
            idx = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        return idx, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling


class MoE(nn.Module):
    """Routed experts and the shared one; under tensor parallelism each rank holds its share of
    every expert's intermediate columns and the partial sums are added over the ranks."""

    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        kind = config.mlp_layer_types[layer_id]
        if kind not in ("moe", "hash_moe"):
            raise ValueError(
                f"mlp_layer_types[{layer_id}]: {kind!r} not supported; supported: moe, hash_moe"
            )
        hidden, inter, limit = config.hidden_size, config.moe_intermediate_size, config.swiglu_limit
        shared = inter * config.n_shared_experts
        try:
            self.inter = shard_range(inter, tp.rank, tp.size)
            self.shared = shard_range(shared, tp.rank, tp.size)
        except ValueError:
            raise ValueError(
                f"moe_intermediate_size: {inter} is not divisible by tp_size {tp.size}"
            ) from None
        self.gate = Gate(config, kind == "hash_moe")
        self.experts = nn.ModuleList(
            Expert(hidden, inter // tp.size, limit) for _ in range(config.n_routed_experts)
        )
        self.shared_experts = Expert(hidden, shared // tp.size, limit)

    def shard(self, leaf: str, src):
        """This rank's part of the published weight ``ffn.<leaf>``."""
        if not leaf.startswith(("experts.", "shared_experts.")):
            return src[:]
        a, b = self.shared if leaf.startswith("shared_experts.") else self.inter
        return src[:, a:b] if leaf.endswith("w2.weight") else src[a:b]

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        idx, w = self.gate(x, input_ids)
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            rows, slot = torch.where(idx == e)
            y = self.experts[e](x[rows]) * w[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        out = out + self.shared_experts(x)
        if self.tp.size == 1:
            return out
        return self.tp.all_reduce(out.float()).to(out.dtype)  # the partials summed in float32
