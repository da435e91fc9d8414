"""Phi-3.5-MoE (``PhimoeForCausalLM``): Mixtral's layout (every layer sparse, experts
``block_sparse_moe.experts.E.{w1,w3,w2}``, the router ``block_sparse_moe.gate``) with LayerNorms
(weight and bias, their epsilon ``rms_norm_eps``), q/k/v/o biases with ``attention_bias``, a bias
on the LM head with ``lm_head_bias``, and the sparsemixer's top-2 routing as it runs at inference
(``layers/moe/router.SparseMixerTop2``: each expert weighted by a softmax over the experts within
``router_jitter_noise`` of it)."""

from __future__ import annotations

from pdserve.layers.linear import Linear
from pdserve.layers.moe.router import Router, SparseMixerTop2
from pdserve.layers.norm import LayerNorm
from pdserve.models.moe import MixtralForCausalLM, MixtralModel


class PhimoeLayerNorm(LayerNorm):
    eps_field = "rms_norm_eps"


class PhimoeForCausalLM(MixtralForCausalLM):
    model_cls = MixtralModel
    norm_cls = PhimoeLayerNorm

    def __init__(self, config, *args, **kwargs):
        if config.num_experts_per_tok != 2:
            raise ValueError(
                f"num_experts_per_tok: the sparsemixer routes to 2 experts, got "
                f"{config.num_experts_per_tok}"
            )
        super().__init__(config, *args, **kwargs)
        if getattr(config, "lm_head_bias", False) and self.lm_head is not None:
            self.lm_head = Linear(config.hidden_size, self.shards.vocab_rows, bias=True)

    def make_router(self, config) -> Router:
        return SparseMixerTop2(
            config.hidden_size, config.num_local_experts, float(config.router_jitter_noise)
        )
