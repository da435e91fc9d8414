"""OLMoE (``OlmoeForCausalLM``): Llama's pre-norm blocks with a sparse MLP in every layer
(``num_experts`` experts of ``intermediate_size``, softmax top-k, renormalised only with
``norm_topk_prob``, HF's default off) and q/k norms over the whole projections, rounded before
the weight multiplies (Llama's way). Experts as the checkpoints store them:
``mlp.experts.E.{gate,up,down}_proj``."""

from __future__ import annotations

from pdserve.models.moe import MoEForCausalLM


class OlmoeForCausalLM(MoEForCausalLM):
    qk_norm = "projection"

    def __init__(self, config, *args, **kwargs):
        if getattr(config, "clip_qkv", None) is not None:
            raise ValueError(f"clip_qkv: {config.clip_qkv} not supported (only null)")
        super().__init__(config, *args, **kwargs)

    @staticmethod
    def expert_intermediate(config) -> int:
        return config.intermediate_size

    def attention_options(self, config) -> dict:
        return {**super().attention_options(config), "qk_norm_rounds_late": False}
