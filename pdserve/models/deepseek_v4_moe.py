"""DeepSeek-V4's MoE block on the shared MoE layer (``layers/moe/``): ``n_routed_experts`` SwiGLU
experts with ``swiglu_limit`` clamps (``Experts`` activation ``silu_clamped``, the published
``experts.E.w1/w3/w2`` names: Mixtral's) and a shared one; expert scores ``sqrt(softplus(x W^T))``;
``hash_moe`` layers take the experts of a fixed token-id table (``HashTopK``), the others the top-k
of the scores plus a correction bias (``SqrtSoftplusTopK``); the chosen scores renormalised and
scaled by ``routed_scaling_factor``; the experts' weighted outputs added in the model dtype, one
expert after another, as HF adds them (``Experts.round_each_expert``).

Under tensor parallelism each rank holds its share of every expert's intermediate columns; with
``--ep-size`` the experts are placed by rank (``placement.py``, redundant slots included) and a
token's hidden state meets its experts where they live, as for every MoE family.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed import SINGLE, TPGroup, shard_range
from pdserve.layers.linear import Linear, RowParallelLinear
from pdserve.layers.moe.context import MoEContext
from pdserve.layers.moe.experts import Experts
from pdserve.layers.moe.layer import SparseMoE
from pdserve.layers.moe.router import HashTopK, Router, SqrtSoftplusTopK

MLP_KINDS = ("moe", "hash_moe")


class SharedExpert(nn.Module):
    """The shared SwiGLU expert with the routed ones' clamps; under tensor parallelism a rank holds
    its intermediate columns ``inter`` and the down projection sums over the ranks."""

    def __init__(self, hidden: int, inter: int, limit: float, tp: TPGroup = SINGLE):
        super().__init__()
        try:
            self.cols = shard_range(inter, tp.rank, tp.size)
        except ValueError:
            raise ValueError(
                f"moe_intermediate_size: the shared expert's {inter} columns are not divisible "
                f"by {tp.size} ranks"
            ) from None
        n = self.cols[1] - self.cols[0]
        self.w1 = Linear(hidden, n, bias=False)  # gate
        self.w3 = Linear(hidden, n, bias=False)  # up
        self.w2 = RowParallelLinear(n, hidden, bias=False, tp=tp)  # down
        self.limit = limit

    def shard(self, leaf: str, src):
        """This rank's part of the published weight ``shared_experts.<leaf>``."""
        a, b = self.cols
        return src[:, a:b] if leaf == "w2.weight" else src[a:b]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


def make_router(config, layer_id: int) -> Router:
    kind = config.mlp_layer_types[layer_id]
    if kind not in MLP_KINDS:
        raise ValueError(
            f"mlp_layer_types[{layer_id}]: {kind!r} not supported; supported: "
            f"{', '.join(MLP_KINDS)}"
        )
    args = (
        config.hidden_size,
        config.n_routed_experts,
        config.num_experts_per_tok,
        config.routed_scaling_factor,
    )
    return HashTopK(*args, config.vocab_size) if kind == "hash_moe" else SqrtSoftplusTopK(*args)


def make_moe(config, layer_id: int, ctx: MoEContext, runner: str) -> SparseMoE:
    """Layer ``layer_id``'s MoE block: this rank's expert slots and intermediate columns."""
    inter, limit = config.moe_intermediate_size, config.swiglu_limit
    try:
        cols = shard_range(inter, ctx.moe_tp_rank, ctx.moe_tp_size)
    except ValueError:
        raise ValueError(
            f"moe_intermediate_size: {inter} is not divisible by the {ctx.moe_tp_size} ranks "
            f"that split each expert (--tp-size {ctx.tp.size} / --ep-size {ctx.ep_size})"
        ) from None
    experts = Experts(
        config.hidden_size,
        cols,
        ctx.placement.rank_slots(layer_id, ctx.ep_rank),
        activation="silu_clamped",
        limit=limit,
        fmt="mixtral",
        down_bias_here=ctx.moe_tp_rank == 0,
        runner=runner,
        round_each_expert=True,
    )
    shared = SharedExpert(
        config.hidden_size,
        inter * config.n_shared_experts,
        limit,
        SINGLE if ctx.a2a else ctx.tp,
    )
    return SparseMoE(
        layer_id,
        make_router(config, layer_id),
        experts,
        ctx,
        router_name="gate",
        shared=shared,
        shared_name="shared_experts",
    )
