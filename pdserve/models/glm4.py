"""GLM-4 (``Glm4ForCausalLM``, the dense GLM-4-0414 models): a sandwich block whose norms are
named ``input_layernorm``, ``post_self_attn_layernorm``, ``post_attention_layernorm`` (before the
MLP) and ``post_mlp_layernorm``; q/k/v biases without an o_proj bias; RoPE on interleaved pairs
of the first ``partial_rotary_factor`` of each head (HF's default 0.5); ``gate_up_proj`` stored
fused in the checkpoint (split by the loader)."""

from __future__ import annotations

from pdserve.models.decoder import Block
from pdserve.models.glm import rotary_fraction
from pdserve.models.llama import LlamaForCausalLM

GLM4_BLOCK = Block(
    attn_in="input_layernorm",
    attn_out="post_self_attn_layernorm",
    mlp_in="post_attention_layernorm",
    mlp_out="post_mlp_layernorm",
)


class Glm4ForCausalLM(LlamaForCausalLM):
    block = GLM4_BLOCK

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return bool(getattr(config, "attention_bias", True)), False

    def attention_options(self, config) -> dict:
        return {
            **super().attention_options(config),
            "rotary_fraction": rotary_fraction(config),
            "interleaved": True,
        }
