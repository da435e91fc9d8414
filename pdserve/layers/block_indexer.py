"""The block indexer of block-sparse attention (MiniMax M3's lightning indexer): which blocks of
keys each token's KV head attends to.

Its queries (``index_n_heads``, one per KV head) and its key (one head) have ``index_head_dim``
dims, both from the layer's input, each normalised (Gemma's RMSNorm) and rotated: RoPE by halves on
their first ``min(index_head_dim, rotary dims)`` dims with the attention's tables. The key is
cached per token (``kv_spec.IndexKeys``: one vector, no head axis); the selection is the attention
backend's (``AttentionBackend.index_select_blocks``, the rule in ``attention/block_select.py``).
It has no value path and no output of its own. Replicated over tensor-parallel ranks (every rank
selects for every KV head, then keeps its own heads'), so every rank caches the same keys.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdserve.forward_batch import ForwardBatch
from pdserve.layers.attention.base import AttnLayer, KeyMask
from pdserve.layers.linear import Linear
from pdserve.layers.norm import GemmaRMSNorm
from pdserve.layers.rotary import apply_rotary

WEIGHTS = ("q_proj.weight", "k_proj.weight", "q_norm.weight", "k_norm.weight")


def rotate_leading(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE by halves on the first ``min(D, r)`` dims of ``x`` [T, heads, D] with the first
    columns of ``cos``/``sin`` [T, r]; the other dims pass unturned."""
    n = min(x.shape[-1], cos.shape[-1])
    turned = apply_rotary(x[..., :n], cos[:, :n].to(x.dtype), sin[:, :n].to(x.dtype))
    return turned if n == x.shape[-1] else torch.cat([turned, x[..., n:]], dim=-1)


class BlockIndexer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads, self.dim = config.index_n_heads, config.index_head_dim
        self.block_size = config.index_block_size
        self.topk, self.local = config.index_topk_blocks, config.index_local_blocks
        self.q_proj = Linear(config.hidden_size, self.heads * self.dim, bias=False)
        self.k_proj = Linear(config.hidden_size, self.dim, bias=False)
        self.q_norm = GemmaRMSNorm(self.dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.dim, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        fb: ForwardBatch,
        layer: AttnLayer,
    ) -> KeyMask:
        """The blocks every new token sees, per KV head of the model (``h`` [T, hidden]: the
        attention's input); stores the tokens' index keys in the layer's indexer cache."""
        t = h.shape[0]
        q = self.q_norm(self.q_proj(h).view(t, self.heads, self.dim))
        k = self.k_norm(self.k_proj(h).view(t, 1, self.dim))
        q, k = rotate_leading(q, *rope), rotate_leading(k, *rope)[:, 0]
        return fb.attn_backend.index_select_blocks(
            layer, q, k, fb, self.block_size, self.topk, self.local
        )

    # ---- weights: whole on every rank ----------------------------------------------------------
    def checkpoint_names(self) -> list[str]:
        return list(WEIGHTS)

    def load_checkpoint(self, name: str, src: Any) -> None:
        if name not in WEIGHTS:
            raise ValueError(f"unexpected indexer weight {name!r}")
        path, _, leaf = name.rpartition(".")
        target = getattr(self.get_submodule(path), leaf).data
        t = src[:]
        if target.shape != t.shape:
            raise ValueError(f"expected shape {tuple(target.shape)}, got {tuple(t.shape)}")
        target.copy_(t)
