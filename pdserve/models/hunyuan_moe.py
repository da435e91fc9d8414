"""Hunyuan's MoE models (``HunYuanMoEV1ForCausalLM``: Hunyuan-A13B): the dense form's attention
(q/k norms per head after RoPE, RoPE "dynamic" with an NTK alpha; ``models/hunyuan.py``) with a
sparse MLP in every layer: ``num_experts`` experts of ``intermediate_size``, the top
``moe_topk`` of a float32 softmax (the gate ``mlp.gate.wg`` kept in float32), renormalised, plus
a shared MLP of the same width (``mlp.shared_mlp``)."""

from __future__ import annotations

from typing import Optional

from torch import nn

from pdserve.layers.linear import Linear
from pdserve.layers.mlp import GatedMLP
from pdserve.layers.moe.router import Float32SoftmaxTopK, Router
from pdserve.models.hunyuan import HunYuanDenseV1ForCausalLM, ntk_alpha_rope
from pdserve.models.moe import MoEForCausalLM


class HunYuanMoEV1ForCausalLM(MoEForCausalLM):
    qk_norm = HunYuanDenseV1ForCausalLM.qk_norm
    shared_name = "shared_mlp"
    checkpoint_renames = {
        **HunYuanDenseV1ForCausalLM.checkpoint_renames,
        ".mlp.gate.wg.": ".mlp.gate.",
    }

    def __init__(self, config, *args, **kwargs):
        for field in ("num_experts", "moe_topk"):
            if not isinstance(getattr(config, field), int):
                raise ValueError(
                    f"{field}: one value for every layer is served, got {getattr(config, field)!r}"
                )
        ntk_alpha_rope(config)
        super().__init__(config, *args, **kwargs)

    @staticmethod
    def expert_intermediate(config) -> int:
        return config.intermediate_size

    def is_sparse(self, config, layer_id: int) -> bool:
        return True

    def make_router(self, config) -> Router:
        return Float32SoftmaxTopK(config.hidden_size, config.num_experts, config.moe_topk)

    def make_shared(
        self, config, layer_id: int, tp
    ) -> tuple[Optional[nn.Module], Optional[Linear]]:
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp), None
