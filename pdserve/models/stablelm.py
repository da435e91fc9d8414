"""StableLM (``StableLmForCausalLM``: StableLM 2, StableLM-3B-4E1T, StableCode): Llama's blocks
with LayerNorms (weight and bias), RoPE on the first ``partial_rotary_factor`` of each head,
q/k/v biases with ``use_qkv_bias``, optionally a LayerNorm per head and per query and KV head
on q and k before RoPE (``qk_layernorm``: StableLM 2 12B; ``q_layernorm.norms.{h}``), and with
``use_parallel_residual`` one norm whose output both attention and MLP read."""

from __future__ import annotations

from pdserve.layers.norm import HeadLayerNorms, LayerNorm
from pdserve.layers.rotary import rope_parameters
from pdserve.models.decoder import PRE_NORM, Block
from pdserve.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    partial_rope_settings,
)
from pdserve.models.weights import TPShards


def rotary_fraction(config) -> float:
    return float(rope_parameters(config).get("partial_rotary_factor", 1.0))


class StableLmAttention(LlamaAttention):
    def __init__(self, config, layer_id: int, shards: TPShards, **kwargs):
        super().__init__(
            config, layer_id, shards, rotary_fraction=rotary_fraction(config), **kwargs
        )
        if config.qk_layernorm:  # run where the per-head norms go (``LlamaAttention.forward``)
            self.qk_norm = "head"
            self.q_norm = HeadLayerNorms(shards.heads, self.head_dim, config.layer_norm_eps)
            self.k_norm = HeadLayerNorms(shards.kv_heads, self.head_dim, config.layer_norm_eps)


class StableLmDecoderLayer(LlamaDecoderLayer):
    attn_cls = StableLmAttention
    norm_cls = LayerNorm


class StableLmModel(LlamaModel):
    layer_cls = StableLmDecoderLayer
    norm_cls = LayerNorm

    rope_settings = staticmethod(partial_rope_settings)


class StableLmForCausalLM(LlamaForCausalLM):
    model_cls = StableLmModel
    checkpoint_renames = {
        "self_attn.q_layernorm.": "self_attn.q_norm.",
        "self_attn.k_layernorm.": "self_attn.k_norm.",
    }

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return bool(config.use_qkv_bias), False

    def layer_options(self, config) -> dict:
        block = Block(mlp_in=None, parallel=True) if config.use_parallel_residual else PRE_NORM
        return {**super().layer_options(config), "block": block}
