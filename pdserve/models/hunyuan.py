"""Hunyuan's dense models (``HunYuanDenseV1ForCausalLM``): Llama's block with a per-head RMSNorm of
q and k after RoPE (``query_layernorm`` / ``key_layernorm``), and the published checkpoints' RoPE
"dynamic" with an ``alpha``: a fixed NTK stretch of the base, ``theta * alpha^(d / (d - 2))``,
whatever the sequence length (as HF computes it)."""

from __future__ import annotations

from pdserve.models.llama import LlamaForCausalLM


def ntk_alpha_rope(config) -> None:
    """RoPE "dynamic" with ``alpha`` as the default RoPE of the stretched base it amounts to."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type") != "dynamic" or not rope.get("alpha"):
        return
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = rope["rope_theta"] * rope["alpha"] ** (d / (d - 2))
    config.rope_parameters = {**rope, "rope_type": "default", "rope_theta": theta}


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    qk_norm = "head_after_rope"
    checkpoint_renames = {"query_layernorm": "q_norm", "key_layernorm": "k_norm"}

    def __init__(self, config, *args, **kwargs):
        ntk_alpha_rope(config)
        super().__init__(config, *args, **kwargs)
