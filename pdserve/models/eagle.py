"""EAGLE heads (``--speculative-algorithm EAGLE``, ``EAGLE3``): one decoder layer over the
target's hidden states, as EAGLE's authors publish them for Llama-family targets; EAGLE-3's
(``Eagle3LlamaForCausalLM``) below.

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
from pdserve.layers.linear import Linear, RowParallelLinear
from pdserve.layers.norm import RMSNorm
from pdserve.models.decoder import Block, run_mlp
from pdserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from pdserve.models.weights import load_weights

# the names a head's checkpoint may hold that it does not use (the target's stand in)
_UNUSED = ("embed_tokens.weight", "norm.weight", "lm_head.weight")


class TargetHead:
    """A draft head that reads the served model's embedding and computes its logits with the
    served model's head (``share_target``). The model is kept outside the module tree, so the
    head's parameters, prepacking and dtype moves never reach it."""

    head_name = "draft head"
    target = None

    def share_target(self, target) -> None:
        if target.hidden_size != self.hidden_size:
            raise ValueError(
                f"speculative_draft_model_path: the {self.head_name}'s hidden size "
                f"{self.hidden_size} is not the target's {target.hidden_size}"
            )
        self.__dict__["target"] = target  # not a submodule

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)

    def enable_decode_stack(self, ops, batch_invariant: bool = False) -> bool:
        return False  # the C++ stack computes the served model's pre-norm layers


class EagleLlamaForCausalLM(TargetHead, LlamaForCausalLM):
    head_name = "EAGLE head"
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

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        embeds = self.target.embed(fb.input_ids)
        h = self.fc(torch.cat((embeds, fb.spec_hidden.to(embeds.dtype)), dim=-1))
        h, residual = self.model.forward_layers(fb, h, None)
        return h if residual is None else h + residual

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        def ours():
            for name, w in weights:
                if name.startswith("model."):
                    name = name[len("model.") :]
                if name in _UNUSED:
                    continue
                yield (f"model.{name}" if name.startswith("layers.") else name), w

        load_weights(self, ours(), self.shards, tied_head=True)


class Eagle3Layer(LlamaDecoderLayer):
    """EAGLE-3's layer: its attention reads [input_layernorm(embedding); hidden_norm(hidden)]
    (twice the hidden size wide), the hidden state is the residual stream it adds to."""

    def __init__(self, config, layer_id: int, shards, **attn_kwargs):
        super().__init__(config, layer_id, shards, **attn_kwargs)
        wide = copy.copy(config)
        wide.hidden_size = 2 * config.hidden_size
        kwargs = {k: v for k, v in attn_kwargs.items() if k not in ("block", "norm_cls")}
        attn = self.attn_cls(wide, layer_id, shards, **kwargs)
        attn.o_proj = RowParallelLinear(
            attn.num_heads * attn.head_dim,
            config.hidden_size,
            bias=kwargs.get("o_bias", False),
            tp=shards.attn,
        )
        self.self_attn = attn
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, residual, rope, fb: ForwardBatch):
        width = h.shape[-1] // 2
        embeds, hidden = h[:, :width], h[:, width:]
        x = torch.cat((self.norm_at("attn_in")(embeds), self.hidden_norm(hidden)), dim=-1)
        attn = self.self_attn(x, rope, fb)
        x, residual = self.norm_at("mlp_in")(attn, hidden)
        return run_mlp(self.mlp, x, fb), residual


class Eagle3Model(LlamaModel):
    layer_cls = Eagle3Layer


class Eagle3LlamaForCausalLM(TargetHead, LlamaForCausalLM):
    """An EAGLE-3 head as its authors publish them: ``fc`` ([hidden, 3 * target hidden]) over
    three of the target's layer outputs (``eagle_config.eagle_aux_hidden_state_layer_ids``,
    default layers 1, N/2 - 1 and N - 4 of N), ``midlayer.*`` (``Eagle3Layer``), ``norm`` and an
    ``lm_head`` over ``draft_vocab_size`` tokens, mapped to the target's by ``d2t`` (target id =
    draft id + d2t[draft id]); the embedding is the target's. Its own output stream (before
    ``norm``) is the next draft step's hidden state."""

    model_cls = Eagle3Model

    def __init__(
        self, config, tp: TPGroup = SINGLE, par: Optional[Parallel] = None, moe: Any = None
    ):
        if config.num_hidden_layers != 1:
            raise ValueError(
                f"speculative_draft_model_path: an EAGLE-3 head has one decoder layer "
                f"(midlayer), this one has {config.num_hidden_layers} (num_hidden_layers)"
            )
        self.target_vocab = config.vocab_size
        self.draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
        config = copy.copy(config)
        config.vocab_size = self.draft_vocab
        config.tie_word_embeddings = False
        super().__init__(config, tp, par, moe)
        self.model.embed_tokens = None  # the target's
        self.vocab_size = self.target_vocab
        target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.fc = Linear(
            3 * target_hidden, config.hidden_size, bias=bool(getattr(config, "bias", False))
        )
        self.register_buffer("hot_ids", torch.empty(self.draft_vocab, dtype=torch.long))
        eagle = getattr(config, "eagle_config", None) or {}
        self.aux_layers = eagle.get("eagle_aux_hidden_state_layer_ids")

    def share_target(self, target) -> None:
        n = target.total_layers
        layers = list(self.aux_layers or [1, n // 2 - 1, n - 4])
        if len(layers) != 3 or self.fc.weight.shape[1] != 3 * target.hidden_size:
            raise ValueError(
                f"speculative_draft_model_path: the EAGLE-3 head reads {len(layers)} target "
                f"layers {layers} through fc of {self.fc.weight.shape[1]} inputs; the target's "
                f"hidden size is {target.hidden_size} (3 layers of it expected)"
            )
        if not hasattr(target, "capture_aux"):
            raise ValueError(
                f"speculative_algorithm: 'EAGLE3' reads the target's layer outputs, which "
                f"{type(target).__name__} does not keep"
            )
        try:
            target.capture_aux(layers)
        except ValueError as e:
            raise ValueError(
                f"speculative_draft_model_path: eagle_aux_hidden_state_layer_ids: {e}"
            ) from None
        self.__dict__["target"] = target  # not a submodule

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        embeds = self.target.embed(fb.input_ids)
        hidden = fb.spec_hidden.to(embeds.dtype)
        if hidden.shape[-1] != embeds.shape[-1]:  # the target's layers (the first step)
            hidden = self.fc(hidden)
        h, residual = self.model.forward_layers(fb, torch.cat((embeds, hidden), dim=-1), None)
        return h + residual  # the stream: the next step's hidden state; the logits norm it

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.lm_head(self.model.norm(hidden)).float()
        if self.tp.size > 1:
            local = self.tp.all_gather_last_dim(local)[:, : self.draft_vocab]
        out = local.new_full((local.shape[0], self.target_vocab), float("-inf"))
        out[:, self.hot_ids] = local
        return out

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        offsets = None

        def ours():
            nonlocal offsets
            for name, w in weights:
                if name.startswith("model."):
                    name = name[len("model.") :]
                if name == "d2t":
                    offsets = w[:]
                    continue
                if name in ("t2d", "embed_tokens.weight"):
                    continue
                if name.startswith("midlayer."):
                    name = "model.layers.0." + name[len("midlayer.") :]
                elif name == "norm.weight":
                    name = "model.norm.weight"
                yield name, w

        load_weights(self, ours(), self.shards, tied_head=False)
        ids = torch.arange(self.draft_vocab)
        self.hot_ids.copy_(ids if offsets is None else ids + offsets.to(torch.long))
        if int(self.hot_ids.min()) < 0 or int(self.hot_ids.max()) >= self.target_vocab:
            raise ValueError(
                f"d2t: maps draft tokens outside the target's vocabulary of {self.target_vocab}"
            )
