"""Granite 3 (``GraniteForCausalLM``, and its MoE form ``GraniteMoeForCausalLM``): Llama's
blocks scaled by four multipliers, as HF applies them: the embedding times
``embedding_multiplier``, each attention and MLP output times ``residual_multiplier`` before it
joins the stream, attention scores times ``attention_multiplier`` (instead of head_dim^-0.5), the
logits divided by ``logits_scaling``."""

from __future__ import annotations

import torch

from pdserve.layers.moe.router import Router, granite_router
from pdserve.layers.vocab import MultipliedEmbedding
from pdserve.models.decoder import Block
from pdserve.models.llama import LlamaForCausalLM, LlamaModel
from pdserve.models.moe import LocalExperts, MoEForCausalLM

# Granite's names of the MoE block's parts -> the shared MoE layers' (a name's middle)
MOE_NAMES = {
    ".block_sparse_moe.input_linear.": ".block_sparse_moe.experts.input_linear.",
    ".block_sparse_moe.output_linear.": ".block_sparse_moe.experts.output_linear.",
    ".block_sparse_moe.router.layer.": ".block_sparse_moe.router.",
}


class GraniteModel(LlamaModel):
    embedding_cls = MultipliedEmbedding

    def __init__(self, config, shards, **options):
        super().__init__(config, shards, **options)
        if self.embed_tokens is not None:
            self.embed_tokens.multiplier = float(config.embedding_multiplier)


class GraniteMultipliers:
    """The multipliers of the model class (mixed in before a Llama-based class): the residual
    scale of every block, the attention scale, the logits' divisor."""

    model_cls = GraniteModel

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.logits_scaling = float(config.logits_scaling)

    def layer_options(self, config) -> dict:
        block = Block(residual_scale=float(config.residual_multiplier))
        return {**super().layer_options(config), "block": block}

    def attention_options(self, config) -> dict:
        return {**super().attention_options(config), "scale": float(config.attention_multiplier)}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling


class GraniteForCausalLM(GraniteMultipliers, LlamaForCausalLM):
    pass


class GraniteMoeForCausalLM(GraniteMultipliers, LocalExperts, MoEForCausalLM):
    """Granite 3's MoE models (``GraniteMoeForCausalLM``): the same multipliers, every layer's MLP
    ``num_local_experts`` experts of ``intermediate_size`` (top k of the logits in float32, a
    softmax over those k), stored 3-D as ``block_sparse_moe.input_linear`` [E, 2I, H] (gate, then
    up) and ``output_linear`` [E, H, I], the router as ``router.layer``."""

    mlp_name = "block_sparse_moe"
    router_name = "router"
    expert_format = "granite"
    checkpoint_renames = MOE_NAMES

    def make_router(self, config) -> Router:
        return granite_router(config)
