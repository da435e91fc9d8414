"""Granite 3 (``GraniteForCausalLM``): Llama's blocks scaled by four multipliers, as HF applies
them: the embedding times ``embedding_multiplier``, each attention and MLP output times
``residual_multiplier`` before it joins the stream, attention scores times ``attention_multiplier``
(instead of head_dim^-0.5), the logits divided by ``logits_scaling``."""

from __future__ import annotations

import torch

from pdserve.layers.vocab import MultipliedEmbedding
from pdserve.models.decoder import Block
from pdserve.models.llama import LlamaForCausalLM, LlamaModel


class GraniteModel(LlamaModel):
    embedding_cls = MultipliedEmbedding

    def __init__(self, config, shards, **options):
        super().__init__(config, shards, **options)
        if self.embed_tokens is not None:
            self.embed_tokens.multiplier = float(config.embedding_multiplier)


class GraniteForCausalLM(LlamaForCausalLM):
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
