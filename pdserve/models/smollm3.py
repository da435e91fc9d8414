"""SmolLM3 (``SmolLM3ForCausalLM``): Llama's blocks, with no position encoding on the layers that
``no_rope_layers`` marks 0 (1: RoPE; HF's default leaves every fourth layer without) and, when
``use_sliding_window`` is set, a sliding window on the layers ``layer_types`` names
(HF's default: the NoPE layers)."""

from __future__ import annotations

from pdserve.models.llama import LlamaForCausalLM


def uses_rope(config, layer_id: int) -> bool:
    return bool(config.no_rope_layers[layer_id])


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, *args, **kwargs):
        marks = list(getattr(config, "no_rope_layers", None) or [])
        if len(marks) < config.num_hidden_layers or set(marks) - {0, 1}:
            raise ValueError(
                f"no_rope_layers: one 0 or 1 per layer ({config.num_hidden_layers}) expected, "
                f"got {marks!r}"
            )
        super().__init__(config, *args, **kwargs)

    def attention_options(self, config) -> dict:
        return {**super().attention_options(config), "uses_rope": uses_rope}
