"""MiniMax-M2 (``MiniMaxM2ForCausalLM``): Llama's pre-norm blocks with a sparse MLP in every layer
(``num_local_experts`` experts, Mixtral's checkpoint layout
``block_sparse_moe.experts.E.w1/w2/w3``); sigmoid routing whose selection adds
``e_score_correction_bias`` (stored beside the gate), the chosen scores renormalised; q/k norms over
the whole projections, rounded Llama's way; RoPE on the first ``rotary_dim`` dims of each head.
FP8-quantized checkpoints are refused."""

from __future__ import annotations

from pdserve.layers.moe.router import GroupedSigmoidTopK, Router
from pdserve.models.glm import rotary_fraction
from pdserve.models.moe import LocalExperts, MixtralModel, MoEForCausalLM


class MiniMaxRouter(GroupedSigmoidTopK):
    """The grouped sigmoid router with one group (a plain biased top-k), its gate, bias and logits
    in the model's dtype as HF's ``MiniMaxM2TopKRouter`` keeps them (the sigmoid in float32)."""

    fp32_logits = False
    float32_params = ()  # the gate and the bias in the model's dtype


class MiniMaxM2ForCausalLM(LocalExperts, MoEForCausalLM):
    model_cls = MixtralModel
    mlp_name = "block_sparse_moe"
    expert_format = "mixtral"
    qk_norm = "projection"
    checkpoint_renames = {
        ".block_sparse_moe.e_score_correction_bias": (
            ".block_sparse_moe.gate.e_score_correction_bias"
        )
    }

    def make_router(self, config) -> Router:
        # one group: the grouped router's selection is then a plain biased top-k
        n = config.num_local_experts
        return GroupedSigmoidTopK(
            config.hidden_size, n, config.num_experts_per_tok, 1, 1, True, 1.0
        )

    def attention_options(self, config) -> dict:
        return {
            **super().attention_options(config),
            "qk_norm_rounds_late": False,
            "rotary_fraction": rotary_fraction(config),
        }
