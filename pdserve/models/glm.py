"""GLM-4.5 / GLM-4.6 (``Glm4MoeForCausalLM``): Llama-style attention with q/k/v biases
(``attention_bias``), optional per-head q/k RMSNorm (``use_qk_norm``) and RoPE on the first
``partial_rotary_factor`` of each head (rotate-half within that part); MoE layers from
``first_k_dense_replace`` on with DeepSeek-V3's grouped sigmoid routing (``e_score_correction_bias``
for the selection, ``n_group``/``topk_group``, renormalised, ``routed_scaling_factor``) and
``n_shared_experts`` shared experts. Checkpoint names are HF's (``mlp.experts.E.*``,
``mlp.gate.*``, ``mlp.shared_experts.*``); the MTP layers past ``num_hidden_layers`` are set aside.
"""

from __future__ import annotations

import torch

from pdserve.layers.moe.router import Router
from pdserve.layers.rotary import apply_rotary, rope_parameters
from pdserve.models.deepseek import DeepseekMoE, sigmoid_router
from pdserve.models.llama import LlamaAttention
from pdserve.models.moe import MoEDecoderLayer, MoEModel


def rotary_fraction(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(
        params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    )


class PartialRotaryAttention(LlamaAttention):
    """``LlamaAttention`` whose RoPE turns only the first ``rotary_dim`` dims of each head."""

    def __init__(self, config, layer_id, shards, **kwargs):
        super().__init__(config, layer_id, shards, **kwargs)
        self.rotary_dim = int(self.head_dim * rotary_fraction(config))
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"partial_rotary_factor: {rotary_fraction(config)} of head_dim {self.head_dim} gives "
                f"{self.rotary_dim} rotary dims; need an even number in [2, {self.head_dim}]"
            )

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        r = self.rotary_dim
        cos, sin = (x.to(q.dtype) for x in rope)
        return (
            torch.cat([apply_rotary(q[..., :r], cos, sin), q[..., r:]], dim=-1),
            torch.cat([apply_rotary(k[..., :r], cos, sin), k[..., r:]], dim=-1),
        )


class GlmDecoderLayer(MoEDecoderLayer):
    attn_cls = PartialRotaryAttention


class GlmModel(MoEModel):
    layer_cls = GlmDecoderLayer

    @staticmethod
    def rope_settings(config) -> dict[str, dict]:
        params = rope_parameters(config)
        params.pop("partial_rotary_factor", None)
        return {"default": params}


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
