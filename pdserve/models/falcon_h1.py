"""Falcon-H1 (``FalconH1ForCausalLM``): every layer runs a Mamba2 mixer and attention side by side
on the same normed input, their outputs summed into the residual, then a gated MLP. So every layer
keeps both a recurrent state (``layers/mamba2.py``) and KV pages: its cache spec is the pair, the
layer is in both cache groups, and PD moves its pages with each chunk and its state once.

Its µP multipliers, each where HF applies it: the embedding (``embedding_multiplier``) and the
logits (``lm_head_multiplier``); the mixer's input (``ssm_in_multiplier``), the rows of its input
projection (``ssm_multipliers``: z, x, B, C, dt) and its output (``ssm_out_multiplier``); the
attention's input (``attention_in_multiplier``), keys (``key_multiplier``, before RoPE) and output
(``attention_out_multiplier``); the MLP's gate before the activation and its output
(``mlp_multipliers``). The mixer's inner size is ``mamba_d_ssm`` when set; its gated norm is
optional (``mamba_rms_norm``) and may come before the gate (``mamba_norm_before_gate``); its output
projection's bias is ``projectors_bias``. Checkpoint names are HF's, with ``model.final_layernorm``
for the final norm.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pdserve.layers.mamba2 import Mamba2Dims, Mamba2Mixer
from pdserve.layers.vocab import MultipliedEmbedding
from pdserve.models.bamba import HybridCausalLM, HybridDecoderLayer, bamba_dims
from pdserve.models.llama import LlamaAttention, LlamaMLP, LlamaModel, attention_spec


def falcon_h1_dims(config) -> Mamba2Dims:
    """Bamba's Mamba2 fields, with Falcon-H1's gated-norm form and output bias."""
    if not config.mamba_rms_norm:
        norm = "gate"
    else:
        norm = "norm_gate_f32" if config.mamba_norm_before_gate else "gate_norm_f32"
    return replace(bamba_dims(config), norm=norm, out_bias=bool(config.projectors_bias))


class FalconH1Attention(LlamaAttention):
    """Llama's attention with the keys times ``key_multiplier`` before RoPE."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.key_multiplier = float(config.key_multiplier)

    def rotate(self, q, k, rope):
        return super().rotate(q, k * self.key_multiplier, rope)


class FalconH1MLP(LlamaMLP):
    """``down(act(gate(x) * g) * up(x)) * d`` with ``(g, d)`` = ``mlp_multipliers``."""

    def __init__(self, config, shards):
        super().__init__(config, shards)
        self.gate_multiplier, self.down_multiplier = (float(m) for m in config.mlp_multipliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(self.act(gate * self.gate_multiplier) * up) * self.down_multiplier


class FalconH1DecoderLayer(HybridDecoderLayer):
    def __init__(self, config, layer_id: int, shards, **attn_kwargs):
        super().__init__(config)
        self.mamba = Mamba2Mixer(falcon_h1_dims(config), layer_id - shards.layers[0], shards.attn)
        self.mamba.set_multipliers(config.ssm_in_multiplier, tuple(config.ssm_multipliers))
        self.self_attn = FalconH1Attention(config, layer_id, shards, **attn_kwargs)
        self.feed_forward = FalconH1MLP(config, shards)
        self.ssm_out = float(config.ssm_out_multiplier)
        self.attention_in = float(config.attention_in_multiplier)
        self.attention_out = float(config.attention_out_multiplier)

    def mix(self, h, rope, fb):
        """The mixer and attention side by side on the same normed input."""
        mixed = self.mamba(h, fb) * self.ssm_out
        return mixed + self.self_attn(h * self.attention_in, rope, fb) * self.attention_out


class FalconH1Model(LlamaModel):
    layer_cls = FalconH1DecoderLayer
    embedding_cls = MultipliedEmbedding

    def __init__(self, config, shards, **attn_kwargs):
        super().__init__(config, shards, **attn_kwargs)
        if self.embed_tokens is not None:
            self.embed_tokens.multiplier = float(config.embedding_multiplier)


class FalconH1ForCausalLM(HybridCausalLM):
    model_cls = FalconH1Model
    checkpoint_prefixes = {"model.final_layernorm.": "model.norm."}

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.lm_head_multiplier = float(config.lm_head_multiplier)

    def kv_cache_specs(self) -> list:
        """Each layer's pair: its attention's pages and its mixer's state."""
        dtype = str(self.model.norm.weight.dtype).replace("torch.", "")
        return [
            (attention_spec(layer.self_attn), layer.mamba.state_spec(dtype))
            for layer in self.model.own_layers
        ]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.lm_head_multiplier
