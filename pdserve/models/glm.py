"""GLM-4.5 / GLM-4.6 (``Glm4MoeForCausalLM``): Llama-style attention with q/k/v biases
(``attention_bias``), optional per-head q/k RMSNorm (``use_qk_norm``) and RoPE on the first
``partial_rotary_factor`` of each head (rotate-half within that part); MoE layers from
``first_k_dense_replace`` on with DeepSeek-V3's grouped sigmoid routing (``e_score_correction_bias``
for the selection, ``n_group``/``topk_group``, renormalised, ``routed_scaling_factor``) and
``n_shared_experts`` shared experts. Checkpoint names are HF's (``mlp.experts.E.*``,
``mlp.gate.*``, ``mlp.shared_experts.*``); the MTP layers past ``num_hidden_layers`` are set aside.
"""

from __future__ import annotations

from pdserve.layers.moe.router import Router
from pdserve.models.deepseek import DeepseekMoE, sigmoid_router
from pdserve.models.llama import LlamaAttention, partial_rope_settings
from pdserve.models.moe import MoEDecoderLayer, MoEModel


def rotary_fraction(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(
        params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    )


class PartialRotaryAttention(LlamaAttention):
    """``LlamaAttention`` whose RoPE turns only the config's ``partial_rotary_factor`` of each
    head (by halves)."""

    def __init__(self, config, layer_id, shards, **kwargs):
        kwargs.setdefault("rotary_fraction", rotary_fraction(config))
        super().__init__(config, layer_id, shards, **kwargs)


class GlmDecoderLayer(MoEDecoderLayer):
    attn_cls = PartialRotaryAttention


class GlmModel(MoEModel):
    layer_cls = GlmDecoderLayer

    rope_settings = staticmethod(partial_rope_settings)


class Glm4MoeForCausalLM(DeepseekMoE):
    model_cls = GlmModel
    SCORING = "sigmoid"
    TOPK_METHODS = ("noaux_tc",)  # DeepSeek-V3's routing

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return bool(getattr(config, "attention_bias", False)), False

    def attention_options(self, config) -> dict:
        return {
            **super().attention_options(config),
            "qk_norm": bool(getattr(config, "use_qk_norm", False)),
        }

    def make_router(self, config) -> Router:
        return sigmoid_router(config)
