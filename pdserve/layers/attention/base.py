"""Attention backends: attention of new tokens against the paged KV pool.

A backend stores the new tokens' K/V in the pool and attends each new token to its request's
prefix plus the new tokens before it (causal), optionally within a sliding window.
"""

from __future__ import annotations

import abc
import importlib
from typing import Optional

import torch

from pdserve.engine.forward_batch import ForwardBatch

_REGISTRY = {
    "torch": ("pdserve.layers.attention.torch_backend", "TorchAttnBackend"),
    "cpu": ("pdserve.layers.attention.cpu_backend", "CpuAttnBackend"),
}



class AttentionBackend(abc.ABC):
    """Contract: ``forward`` is called once per layer per forward, from the scheduler thread only.

    ``q``: [T, num_heads, head_dim]; ``k``/``v``: [T, kv_heads, head_dim] for the flattened new
    tokens of ``fb``. It must write k/v into ``fb.kv_pool`` at ``fb.out_pages/out_offsets`` and
    return [T, num_heads, head_dim].
    """

    def init_forward(self, fb: ForwardBatch) -> None:
        """Precompute per-forward metadata shared by all layers (optional)."""

    @abc.abstractmethod
    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        scale: float,
        sliding_window: Optional[int] = None,
    ) -> torch.Tensor: ...


def get_attention_backend(name: str, **kwargs) -> AttentionBackend:
    if name not in _REGISTRY:
        raise ValueError(f"attention_backend: unknown {name!r}; available: {sorted(_REGISTRY)}")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)(**kwargs)
