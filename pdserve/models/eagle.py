"""EAGLE heads (``--speculative-algorithm EAGLE``): one decoder layer over the target's hidden
states, as EAGLE's authors publish them for Llama-family targets.

A head's checkpoint is a Llama config with one layer and the weights ``fc.weight`` (and
``fc.bias``) of shape [hidden, 2 * hidden] and ``layers.0.*`` (attention, MLP and
``post_attention_layernorm``; the first layer has no input norm); an ``embed_tokens.weight``,
``norm.weight`` or ``lm_head.weight`` beside them is not used: the head reads the target's
embedding and computes its logits with the target's head, without a final norm.

At position p the head reads the embedding of token p + 1 and the target's final hidden state
(after its norm) at p, concatenated and projected by ``fc``, and its output predicts token
p + 2: ``ForwardBatch.spec_hidden`` holds the hidden states, ``input_ids`` the tokens one ahead
(``engine/speculative/eagle.py`` arranges both).
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Optional

import torch

from pdserve.distributed import SINGLE, Parallel, TPGroup
from pdserve.forward_batch import ForwardBatch
from pdserve.layers.linear import Linear
from pdserve.models.decoder import Block
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.weights import load_weights

# the names a head's checkpoint may hold that it does not use (the target's stand in)
_UNUSED = ("embed_tokens.weight", "norm.weight", "lm_head.weight")


class EagleLlamaForCausalLM(LlamaForCausalLM):
    block = Block(attn_in=None)  # EAGLE's layer 0 has no input norm

    def __init__(
        self, config, tp: TPGroup = SINGLE, par: Optional[Parallel] = None, moe: Any = None
    ):
        if config.num_hidden_layers != 1:
            raise ValueError(
                f"speculative_draft_model_path: an EAGLE head has one decoder layer, this one "
                f"has {config.num_hidden_layers} (num_hidden_layers)"
            )
        config = copy.copy(config)
        config.tie_word_embeddings = True  # no head of its own: the target's computes the logits
        super().__init__(config, tp, par, moe)
        # the target's embedding, head and final hidden states stand in for these
        self.model.embed_tokens = None
        self.model.norm = None
        self.tie_word_embeddings = False  # nothing of its own to pack for logits
        self.fc = Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        self.target: Optional[torch.nn.Module] = None

    def share_target(self, target) -> None:
        """Read the embedding and compute the logits with ``target`` (the served model)."""
        if target.hidden_size != self.hidden_size:
            raise ValueError(
                f"speculative_draft_model_path: the EAGLE head's hidden size {self.hidden_size} "
                f"is not the target's {target.hidden_size}"
            )
        self.target = target

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        embeds = self.target.embed(fb.input_ids)
        h = self.fc(torch.cat((embeds, fb.spec_hidden.to(embeds.dtype)), dim=-1))
        h, residual = self.model.forward_layers(fb, h, None)
        return h if residual is None else h + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)

    def enable_decode_stack(self, ops, batch_invariant: bool = False) -> bool:
        return False  # the C++ stack computes pre-norm layers

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        def ours():
            for name, w in weights:
                if name.startswith("model."):
                    name = name[len("model.") :]
                if name in _UNUSED:
                    continue
                yield (f"model.{name}" if name.startswith("layers.") else name), w

        load_weights(self, ours(), self.shards, tied_head=True)
