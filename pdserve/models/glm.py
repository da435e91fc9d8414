"""GLM-4.5 / GLM-4.6 (``Glm4MoeForCausalLM``): Llama-style attention with q/k/v biases
(``attention_bias``), optional per-head q/k RMSNorm (``use_qk_norm``) and RoPE on the first
``partial_rotary_factor`` of each head (rotate-half within that part); MoE layers from
``first_k_dense_replace`` on with DeepSeek-V3's grouped sigmoid routing (``e_score_correction_bias``
for the selection, ``n_group``/``topk_group``, renormalised, ``routed_scaling_factor``) and
``n_shared_experts`` shared experts. Checkpoint names are HF's (``mlp.experts.E.*``,
``mlp.gate.*``, ``mlp.shared_experts.*``); the MTP layers past ``num_hidden_layers`` are set aside.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from pdserve.forward_batch import ForwardBatch
from pdserve.layers.moe.router import GroupedSigmoidTopK, Router
from pdserve.layers.rotary import apply_rotary, rope_parameters
from pdserve.models.llama import LlamaAttention
from pdserve.models.moe import MoEDecoderLayer, MoEForCausalLM, MoEModel


def rotary_fraction(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0)


class PartialRotaryAttention(LlamaAttention):
    """``LlamaAttention`` whose RoPE turns only the first ``rotary_dim`` dims of each head."""

    def __init__(self, config, layer_id, shards, **kwargs):
        super().__init__(config, layer_id, shards, **kwargs)
        self.rotary_dim = int(self.head_dim * rotary_fraction(config))
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"partial_rotary_factor: {rotary_fraction(config)} of head_dim {self.head_dim} gives "
                             f"{self.rotary_dim} rotary dims; need an even number in [2, {self.head_dim}]")

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fb: ForwardBatch) -> torch.Tensor:
        t, r = h.shape[0], self.rotary_dim
        q, k, v = self.qkv_proj.split(self.qkv_proj(h))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = (x.to(q.dtype) for x in rope)
        q = torch.cat([apply_rotary(q[..., :r], cos, sin), q[..., r:]], dim=-1)
        k = torch.cat([apply_rotary(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        o = self.attn_forward(q, k, v, fb)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))

    def attn_forward(self, q, k, v, fb):
        return fb.attn_backend.forward(self.attn, q, k, v, fb, sinks=self.sinks)


class GlmDecoderLayer(MoEDecoderLayer):
    def __init__(self, config, layer_id, shards, make_mlp=None, mlp_name: str = "mlp", **attn_kwargs):
        super().__init__(config, layer_id, shards, make_mlp=make_mlp, mlp_name=mlp_name, **attn_kwargs)
        self.self_attn = PartialRotaryAttention(config, layer_id, shards, **attn_kwargs)


class GlmModel(MoEModel):
    layer_cls = GlmDecoderLayer

    @staticmethod
    def rope_settings(config) -> dict[str, dict]:
        params = rope_parameters(config)
        params.pop("partial_rotary_factor", None)
        return {"default": params}


class Glm4MoeForCausalLM(MoEForCausalLM):
    model_cls = GlmModel
    shared_name = "shared_experts"

    def __init__(self, config, *args, **kwargs):
        from pdserve.models.deepseek import refuse_unsupported

        refuse_unsupported(config, type(self).__name__, "sigmoid", ("noaux_tc",))  # DeepSeek-V3's routing
        super().__init__(config, *args, **kwargs)
        self.mtp_weights: dict[str, torch.Tensor] = {}

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return bool(getattr(config, "attention_bias", False)), False

    def attention_options(self, config) -> dict:
        return {**super().attention_options(config), "qk_norm": bool(getattr(config, "use_qk_norm", False))}

    @staticmethod
    def num_experts(config) -> int:
        return config.n_routed_experts or 0

    def is_sparse(self, config, layer_id: int) -> bool:
        return self.num_experts(config) > 0 and layer_id >= config.first_k_dense_replace

    def make_router(self, config) -> Router:
        return GroupedSigmoidTopK(config.hidden_size, config.n_routed_experts, config.num_experts_per_tok,
                                  config.n_group or 1, config.topk_group or 1,
                                  bool(getattr(config, "norm_topk_prob", True)), config.routed_scaling_factor)

    def make_shared(self, config, layer_id, tp):
        from pdserve.layers.mlp import GatedMLP

        n = getattr(config, "n_shared_experts", 0) or 0
        if not n:
            return None, None
        return GatedMLP(config.hidden_size, config.moe_intermediate_size * n, config.hidden_act, tp), None

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        from pdserve.models.deepseek import set_aside_mtp

        super().load_weights(set_aside_mtp(weights, self.total_layers, self.mtp_weights))
