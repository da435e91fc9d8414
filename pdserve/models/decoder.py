"""The decoder layer as a composition: an attention block, an MLP block and up to four norms around
them, placed as the family's ``Block`` says.

Families differ in where their norms sit, and name them differently in their checkpoints:

- pre-norm (Llama, Qwen, Mistral, SmolLM3, Granite, Phi-3): ``input_layernorm`` before attention,
  ``post_attention_layernorm`` before the MLP;
- sandwich (Gemma 2/3, GLM-4): a norm on both sides of each, named per family;
- post-norm (OLMo 2, EXAONE 4): a norm after each and none before;
- parallel (Cohere): one norm, attention and MLP both read its output.

The residual add is deferred, as everywhere in pdserve: a layer returns ``(h, residual)`` and the
stream entering the next one is ``h + residual``, added inside the next norm (one kernel with the
norm on CPU) or by the layer itself where no norm sits there. ``residual_scale`` multiplies each
branch's output before its add (Granite's ``residual_multiplier``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from pdserve.forward_batch import ForwardBatch

PLACES = ("attn_in", "attn_out", "mlp_in", "mlp_out")


@dataclass(frozen=True)
class Block:
    """Where a decoder layer's norms sit, by the names its checkpoint gives them (None: no norm
    there); ``parallel``: attention and MLP read the same normed input and their outputs are both
    added to the stream (only ``attn_in`` may be set); ``residual_scale``: each branch's output is
    multiplied by it before its add."""

    attn_in: Optional[str] = "input_layernorm"
    attn_out: Optional[str] = None
    mlp_in: Optional[str] = "post_attention_layernorm"
    mlp_out: Optional[str] = None
    parallel: bool = False
    residual_scale: float = 1.0

    def __post_init__(self):
        names = [n for n in (getattr(self, p) for p in PLACES) if n]
        if len(set(names)) != len(names):
            raise ValueError(f"Block: a norm name used at two places: {self}")
        if self.parallel and (self.attn_out or self.mlp_in or self.mlp_out):
            raise ValueError(f"Block: a parallel block has one norm (attn_in): {self}")


PRE_NORM = Block()
SANDWICH = Block(
    attn_out="post_attention_layernorm",
    mlp_in="pre_feedforward_layernorm",
    mlp_out="post_feedforward_layernorm",
)  # Gemma's names
POST_NORM = Block(
    attn_in=None,
    attn_out="post_attention_layernorm",
    mlp_in=None,
    mlp_out="post_feedforward_layernorm",
)


def run_mlp(mlp: nn.Module, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
    """The MLP over ``h``; under DP attention it runs tensor-parallel over every group's tokens.
    A block with its own communication (MoE, replicated MLPs) has ``run(h, dp)``."""
    run = getattr(mlp, "run", None)
    if run is not None:
        return run(h, fb.dp)
    if fb.dp is None:
        return mlp(h)
    return fb.dp.local(mlp(fb.dp.gather(h)))


class DecoderLayer(nn.Module):
    """``self_attn``, the MLP (registered under ``mlp_name``, the checkpoint's) and the norms of
    ``block``, each under its checkpoint name. ``rope_kind`` is the key of its RoPE table in the
    model's ``rotaries``."""

    rope_kind = "default"

    def __init__(
        self,
        attn: nn.Module,
        mlp: nn.Module,
        block: Block,
        make_norm: Callable[[], nn.Module],
        mlp_name: str = "mlp",
    ):
        super().__init__()
        self.block = block
        self.self_attn = attn
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp)
        self._norms: dict[str, Optional[str]] = {}
        for place in PLACES:
            name = getattr(block, place)
            if name:
                self.add_module(name, make_norm())
            self._norms[place] = name

    @property
    def mlp(self) -> nn.Module:
        try:
            return self._modules[self.__dict__.get("mlp_name", "mlp")]
        except KeyError:
            raise AttributeError("mlp") from None

    def norm_at(self, place: str) -> Optional[nn.Module]:
        name = self._norms[place]
        return None if name is None else getattr(self, name)

    def forward(self, h, residual, rope, fb: ForwardBatch):
        """``residual`` is the stream before this layer's first add (None for the first layer:
        ``h`` is the embedding). Returns (last branch's output, residual), their sum being the
        stream after this layer."""
        h, residual = self._enter(self.norm_at("attn_in"), h, residual)
        if self.block.parallel:
            attn = self._leave(None, self.self_attn(h, rope, fb))
            # HF adds the attention first: (stream + attn) + mlp
            return self._leave(None, run_mlp(self.mlp, h, fb)), residual + attn
        h = self._leave(self.norm_at("attn_out"), self.self_attn(h, rope, fb))
        h, residual = self._enter(self.norm_at("mlp_in"), h, residual)
        return self._leave(self.norm_at("mlp_out"), run_mlp(self.mlp, h, fb)), residual

    @staticmethod
    def _enter(norm: Optional[nn.Module], h: torch.Tensor, residual: Optional[torch.Tensor]):
        """Add ``h`` to the stream and normalise it for the branch: (branch input, stream)."""
        if residual is None:
            return (h if norm is None else norm(h)), h
        if norm is None:
            stream = h + residual
            return stream, stream
        return norm(h, residual)

    def _leave(self, norm: Optional[nn.Module], h: torch.Tensor) -> torch.Tensor:
        """A branch's output as it is added to the stream."""
        if norm is not None:
            h = norm(h)
        scale = self.block.residual_scale
        return h if scale == 1.0 else h * scale
