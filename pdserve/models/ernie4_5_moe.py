"""ERNIE 4.5's MoE models (``Ernie4_5_MoeForCausalLM``): the dense form's attention (RoPE on
interleaved pairs; ``models/ernie4_5.py``) with sparse MLPs on the layers from
``moe_layer_start_index`` to ``moe_layer_end_index`` every ``moe_layer_interval``:
``moe_num_experts`` experts of ``moe_intermediate_size``, the top ``moe_k`` by float32 softmax plus
a selection bias (``mlp.moe_statics.e_score_correction_bias``), weighted by their softmax
renormalised, and ``moe_num_shared_experts`` shared experts as one MLP of that many times the
width. The other layers have a dense MLP of ``intermediate_size``."""

from __future__ import annotations

from typing import Optional

from torch import nn

from pdserve.layers.linear import Linear
from pdserve.layers.mlp import GatedMLP
from pdserve.layers.moe.router import BiasedSoftmaxTopK, Router
from pdserve.models.ernie4_5 import Ernie4_5ForCausalLM
from pdserve.models.moe import MoEForCausalLM


class Ernie4_5_MoeForCausalLM(MoEForCausalLM):
    shared_name = "shared_experts"
    checkpoint_renames = {".mlp.moe_statics.": ".mlp.gate."}

    def __init__(self, config, *args, **kwargs):
        if getattr(config, "use_bias", False):
            raise ValueError("use_bias: ERNIE 4.5's MoE models are served without biases")
        super().__init__(config, *args, **kwargs)

    attention_biases = staticmethod(Ernie4_5ForCausalLM.attention_biases)

    def attention_options(self, config) -> dict:
        return {**super().attention_options(config), "interleaved": True}

    def is_sparse(self, config, layer_id: int) -> bool:
        return (
            (layer_id + 1) % config.moe_layer_interval == 0
            and config.moe_layer_start_index <= layer_id <= config.moe_layer_end_index
            and self.num_experts(config) > 0
        )

    def make_router(self, config) -> Router:
        return BiasedSoftmaxTopK(
            config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_norm_min
        )

    def make_shared(
        self, config, layer_id: int, tp
    ) -> tuple[Optional[nn.Module], Optional[Linear]]:
        n = config.moe_num_shared_experts or 0
        if not n:
            return None, None
        width = config.moe_intermediate_size * n
        return GatedMLP(config.hidden_size, width, config.hidden_act, tp), None
