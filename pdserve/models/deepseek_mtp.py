"""DeepSeek-V3's multi-token-prediction layer as a draft head (``--speculative-algorithm MTP``).

A V3 checkpoint carries ``num_nextn_predict_layers`` (one) layers past ``num_hidden_layers``:
``model.layers.N.*`` with N = ``num_hidden_layers``, a decoder layer like the model's sparse ones
(latent attention, MoE) plus ``enorm`` and ``hnorm`` (RMSNorms), ``eh_proj`` ([hidden,
2 * hidden], no bias) and ``shared_head.norm``; its ``embed_tokens`` and ``shared_head.head``
repeat the model's, whose embedding and head the layer uses instead.

At position p it reads the embedding of token p + 1 and the model's final hidden state at p:
``eh_proj([enorm(embedding); hnorm(hidden)])``, the decoder layer, ``shared_head.norm``, the
model's head; its output predicts token p + 2 (``engine/speculative/eagle.py`` runs it as it runs
an EAGLE head).
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Optional

import torch

from pdserve.distributed import SINGLE, Parallel, TPGroup
from pdserve.forward_batch import ForwardBatch
from pdserve.layers.linear import Linear
from pdserve.layers.norm import RMSNorm
from pdserve.models.deepseek import DeepseekV3ForCausalLM
from pdserve.models.eagle import TargetHead

_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # the model's stand in
_OWN = {"enorm.weight", "hnorm.weight", "eh_proj.weight"}


class DeepseekV3MTP(TargetHead, DeepseekV3ForCausalLM):
    head_name = "MTP layer"

    def __init__(
        self, config, tp: TPGroup = SINGLE, par: Optional[Parallel] = None, moe: Any = None
    ):
        if not (getattr(config, "num_nextn_predict_layers", 0) or 0):
            raise ValueError(
                "speculative_algorithm: 'MTP' needs the checkpoint's next-token-prediction "
                "layers, and its config has none (num_nextn_predict_layers)"
            )
        self.mtp_layer = config.num_hidden_layers  # its index in the checkpoint
        config = copy.copy(config)
        config.num_hidden_layers = 1
        super().__init__(config, tp, par, moe)
        self.model.embed_tokens = None
        self.lm_head = None
        self.tie_word_embeddings = False
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False)

    def is_sparse(self, config, layer_id: int) -> bool:
        # the layer's place in the checkpoint, past every dense one
        index = getattr(self, "mtp_layer", 0) + layer_id
        return self.num_experts(config) > 0 and index >= config.first_k_dense_replace

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        embeds = self.enorm(self.target.embed(fb.input_ids))
        hidden = self.hnorm(fb.spec_hidden.to(embeds.dtype))
        h = self.eh_proj(torch.cat((embeds, hidden), dim=-1))
        h, residual = self.model.forward_layers(fb, h, None)
        return self.model.norm(h, residual)[0]  # shared_head.norm

    def head_weight_name(self, name: str) -> Optional[str]:
        """The name checkpoint weight ``name`` loads under in this head; None for the model's own
        layers and for what the model's embedding and head stand in for."""
        prefix = f"model.layers.{self.mtp_layer}."
        if not name.startswith(prefix):
            return None
        rest = name[len(prefix) :]
        if rest in _SHARED:
            return None
        if rest in _OWN:
            return rest
        return (
            "model.norm.weight" if rest == "shared_head.norm.weight" else "model.layers.0." + rest
        )

    def quantized_weight_name(self, name: str) -> Optional[str]:
        """For the weight format (``quantization/``): ``own_weight_name`` of the name ``name``
        loads under, None for a weight this head does not load."""
        mine = self.head_weight_name(name)
        return None if mine is None else self.own_weight_name(mine)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        prefix = f"model.layers.{self.mtp_layer}."
        found = []

        def ours():
            for name, w in weights:
                if name.startswith(prefix):
                    found.append(name)
                mine = self.head_weight_name(name)
                if mine is not None:
                    yield mine, w

        try:
            super().load_weights(ours())
        except ValueError:
            if not found:
                raise ValueError(
                    "speculative_algorithm: 'MTP' needs the checkpoint's next-token-prediction "
                    f"layer, and it holds no {prefix}* weights (its config says "
                    "num_nextn_predict_layers, but the weights were not saved with it)"
                ) from None
            raise
