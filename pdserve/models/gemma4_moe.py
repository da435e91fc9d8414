"""Gemma 4's MoE block, run beside the dense MLP of every layer (``enable_moe_block``), on the
shared MoE layers (``layers/moe/``: expert parallelism, the dispatch backends, the recorder).

HF's formulas: the router reads the stream after attention, ``x / rms(x) * scale * hidden**-0.5``
(no weight in the norm, a learned ``scale``), softmax over all ``num_experts`` logits in float32,
the ``top_k_experts`` best renormalised to sum 1, then each multiplied by its expert's
``per_expert_scale``; the experts read the same stream through their own norm
(``pre_feedforward_layernorm_2``, the block's ``expert_norm``) and run ``gelu_tanh(gate) * up``
(the checkpoint's 3-D ``gate_up_proj`` [E, 2I, H], gate rows first, and ``down_proj``
[E, H, I]). The decoder layer adds the block's output, after ``post_feedforward_layernorm_2``, to
the MLP's, after ``post_feedforward_layernorm_1`` (``gemma4.py``).

Checkpoint names are HF's at the decoder layer (``router.proj.weight``, ``router.scale``,
``experts.gate_up_proj``, ``pre_feedforward_layernorm_2.weight``); the block's modules sit under
``moe`` (``CHECKPOINT_RENAMES``).
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.layers.moe.router import Routing, SoftmaxTopK
from pdserve.layers.norm import Gemma4RMSNorm

# checkpoint name part -> ours (the first that matches, once; ``models/weights.renamed_part``)
CHECKPOINT_RENAMES = {
    ".router.proj.weight": ".moe.router.weight",
    ".router.": ".moe.router.",
    ".experts.": ".moe.experts.",
    ".pre_feedforward_layernorm_2.": ".moe.expert_norm.",
}


class Gemma4Router(SoftmaxTopK):
    """``weight`` is HF's ``router.proj.weight`` [E, H]; ``scale`` [H] multiplies the normalised
    input, ``per_expert_scale`` [E] the chosen experts' weights."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float):
        super().__init__(hidden, num_experts, top_k, renormalize=True, cast_back=False)
        self.norm = Gemma4RMSNorm(hidden, eps, scale=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))
        self.root = hidden**-0.5

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return super().logits(self.norm(h) * self.scale * self.root)

    def forward(self, h: torch.Tensor) -> Routing:
        r = super().forward(h)  # float32 weights, renormalised over the top k
        return Routing(r.ids, r.weights * self.per_expert_scale[r.ids])


def check_moe_config(config) -> None:
    if not config.enable_moe_block:
        return
    missing = [
        f
        for f in ("num_experts", "top_k_experts", "moe_intermediate_size")
        if not getattr(config, f, None)
    ]
    if missing:
        raise ValueError(f"enable_moe_block: set, but {', '.join(missing)} not")
    if config.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(
            f"hidden_activation: {config.hidden_activation!r} with enable_moe_block; the experts "
            "run gelu_pytorch_tanh only"
        )
