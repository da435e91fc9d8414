"""Gemma 2 and Gemma 3 (text-only ``Gemma3ForCausalLM``) decoders, built on ``llama.py``'s blocks
(fused q/k/v attention, gated MLP, vocabulary-parallel embedding, ``TPShards`` loading and
sharding), whole or as one tensor-parallel rank.

What differs from Llama, as HF transformers computes it:

- layers alternate between sliding-window and global attention (``config.layer_types``; the
  configs fill it in: Gemma 2 slides on even layers, Gemma 3 on all but every
  ``sliding_window_pattern``-th): two cache groups (``kv_cache_specs``);
- four norms per block (around attention and around the MLP), each Gemma's RMSNorm
  (``layers/norm.py``: weight applied as (1 + w), in float32);
- the embedding is multiplied by sqrt(hidden_size), that factor first rounded to the weight's
  dtype; the LM head is tied to it (``tie_word_embeddings``, Gemma's default);
- GeGLU MLP (``hidden_activation``, gelu with the tanh approximation);
- attention scale ``query_pre_attn_scalar ** -0.5`` instead of head_dim ** -0.5;
- Gemma 2: attention logits soft-capped (``attn_logit_softcapping``; the ``cpu`` attention
  backend has no soft-cap and refuses the model at start-up), final logits soft-capped
  (``final_logit_softcapping``) in ``compute_logits``;
- Gemma 3: per-head q/k norms (Gemma's RMSNorm), RoPE per layer type (``rope_parameters`` holds
  one set for ``sliding_attention`` layers, from the old ``rope_local_base_freq``, and one for
  ``full_attention`` layers, with the scaling); HF's Gemma 3 attention ignores
  ``attn_logit_softcapping``, so this one does too; the final soft-cap applies when set.

The CPU fast paths: the matmuls prepack as for Llama; the norms and the GeGLU stay in PyTorch
(their kernels round the Llama way or compute SiLU); there is no C++ decode stack.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from pdserve.distributed import SINGLE, Parallel, TPGroup
from pdserve.layers.norm import GemmaRMSNorm
from pdserve.layers.vocab import VocabParallelEmbedding
from pdserve.models.decoder import SANDWICH
from pdserve.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    check_layer_types,
)


class ScaledEmbedding(VocabParallelEmbedding):
    """Rows times sqrt(hidden), the factor rounded to the weight's dtype as HF does (sqrt(3072)
    becomes 55.5 in bf16); applied after the ranks' rows are summed."""

    def __init__(self, rows: int, hidden: int, start: int = 0, tp: TPGroup = SINGLE):
        super().__init__(rows, hidden, start, tp)
        self.scale = hidden**0.5

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.scale, dtype=torch.float32)  # HF's buffer is float32
        return super().forward(ids) * scale.to(self.weight.dtype)


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Gemma's RMSNorm at the four places of ``SANDWICH``, the GeGLU MLP."""

    norm_cls = GemmaRMSNorm
    activation_field = "hidden_activation"


class GemmaModel(LlamaModel):
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm
    embedding_cls = ScaledEmbedding


def check_config(config) -> None:
    """What the HF configs allow but this implementation does not do."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention: only causal attention is supported")
    check_layer_types(config)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: soft-capped attention logits, no q/k norms, one RoPE table."""

    model_cls = GemmaModel
    block = SANDWICH
    attn_softcap = True  # HF's Gemma 3 attention drops the config's soft-cap

    def attention_options(self, config) -> dict:
        cap = getattr(config, "attn_logit_softcapping", None) if self.attn_softcap else None
        return {
            **super().attention_options(config),
            "logit_softcap": cap,
            "scale": config.query_pre_attn_scalar**-0.5,
            "norm": GemmaRMSNorm,
        }

    def __init__(self, config, tp: TPGroup = SINGLE, par: Optional[Parallel] = None, moe=None):
        check_config(config)
        super().__init__(config, tp, par, moe)
        self.final_logit_softcap: Optional[float] = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcap
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap  # HF's order of operations (exact in float32)

    def enable_decode_stack(self, ops: ModuleType, batch_invariant: bool = False) -> bool:
        return False  # the C++ stack is the Llama block (two norms, SiLU, no soft-cap)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text: q/k norms, RoPE per layer type, no attention soft-cap."""

    qk_norm = True
    attn_softcap = False
