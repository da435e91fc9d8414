"""Phi-3 / Phi-4-mini (``Phi3ForCausalLM``): Llama's blocks with ``qkv_proj`` and ``gate_up_proj``
stored fused in the checkpoint (split by the loader), RoPE on the first ``partial_rotary_factor``
of each head (Phi-4-mini: 0.75), LongRoPE scaling (``layers/rotary.py``: the tables per request,
the recompute past the original context), a sliding window on every layer when ``sliding_window``
is set."""

from __future__ import annotations

from pdserve.models.glm import rotary_fraction
from pdserve.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def attention_options(self, config) -> dict:
        return {**super().attention_options(config), "rotary_fraction": rotary_fraction(config)}
