"""Command R7B (``Cohere2ForCausalLM``): parallel blocks (attention and MLP both read one
``input_layernorm``, a bias-free LayerNorm in float32, and both join the stream); sliding-window
layers and global layers by ``layer_types``, RoPE (interleaved pairs) only on the window layers;
the logits times ``logit_scale``; tied embeddings."""

from __future__ import annotations

import torch

from pdserve.layers.norm import CohereLayerNorm
from pdserve.models.decoder import Block
from pdserve.models.llama import LlamaForCausalLM, check_layer_types, layer_sliding_window


def uses_rope(config, layer_id: int) -> bool:
    return layer_sliding_window(config, layer_id) is not None


class Cohere2ForCausalLM(LlamaForCausalLM):
    block = Block(mlp_in=None, parallel=True)
    norm_cls = CohereLayerNorm

    def __init__(self, config, *args, **kwargs):
        check_layer_types(config)
        super().__init__(config, *args, **kwargs)
        self.logit_scale = float(config.logit_scale)

    def attention_options(self, config) -> dict:
        return {**super().attention_options(config), "uses_rope": uses_rope, "interleaved": True}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.logit_scale
