"""ERNIE 4.5 (``Ernie4_5ForCausalLM``, the dense models): Llama's block with RoPE on interleaved
pairs of each head, and one ``use_bias`` for every projection (q/k/v, o and the MLP's)."""

from __future__ import annotations

from pdserve.models.llama import LlamaForCausalLM


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, *args, **kwargs):
        config.mlp_bias = bool(getattr(config, "use_bias", False))  # what ``LlamaMLP`` reads
        super().__init__(config, *args, **kwargs)

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        bias = bool(getattr(config, "use_bias", False))
        return bias, bias

    def attention_options(self, config) -> dict:
        return {**super().attention_options(config), "interleaved": True}
