"""EXAONE 4.0 (``Exaone4ForCausalLM``): post-norm blocks as OLMo 2's, per-head q/k norms before
RoPE, sliding-window and global layers by ``layer_types``; with a window configured, RoPE only on
the window layers (the global ones have none), else on every layer."""

from __future__ import annotations

from pdserve.models.decoder import POST_NORM
from pdserve.models.llama import LlamaForCausalLM, check_layer_types, layer_sliding_window


def uses_rope(config, layer_id: int) -> bool:
    if getattr(config, "sliding_window", None) is None:
        return True
    return layer_sliding_window(config, layer_id) is not None


class Exaone4ForCausalLM(LlamaForCausalLM):
    block = POST_NORM
    qk_norm = "head"

    def __init__(self, config, *args, **kwargs):
        check_layer_types(config)
        super().__init__(config, *args, **kwargs)

    def attention_options(self, config) -> dict:
        return {**super().attention_options(config), "uses_rope": uses_rope}
