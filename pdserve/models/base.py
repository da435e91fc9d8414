"""The model interface: what the engine reads of a model, and nothing more.

A model file (one per family, e.g. ``llama.py``, ``gemma.py``) provides a class that satisfies
``CausalLM`` and registers it under its HF architecture names (``registry.py``). A new model kind
is a cache spec (``kv_spec.py``), a pool if the kind is new (``engine/kv_pool.py``) and a model
file; the scheduler and the PD queues never see the difference.

Shapes: every activation is [T, ...] for the T flattened new tokens of a ``ForwardBatch``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Iterable, Optional, Protocol, runtime_checkable

import torch

from pdserve.forward_batch import ForwardBatch
from pdserve.layers.attention.base import AttnLayer


@runtime_checkable
class CausalLM(Protocol):
    vocab_size: int
    hidden_size: int
    total_layers: int  # layers of the whole model
    first_layer: int  # the first layer this rank runs (pipeline stage), global id
    total_kv_heads: int  # KV heads of the whole model (head slicing between TP sizes in PD)
    num_attention_heads: int  # query heads of the whole model

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states after the final norm: [T, hidden_size]."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N, vocab_size] float32, the whole vocabulary on every rank."""

    def prefix_namespace(self, seq_len: int) -> int:
        """The prefix-cache namespace of KV computed for a sequence of ``seq_len`` tokens:
        requests share cached KV only within one, and a request whose sequence grows into
        another namespace is recomputed (0 for every length, except where a model computes a
        sequence's KV differently by its length, as LongRoPE does)."""

    def kv_cache_specs(self) -> list:
        """Per layer this rank runs, in layer order, its cache spec, or a tuple of specs when the
        layer keeps several caches (``kv_spec.group_layers`` groups them; such a layer is in
        several groups)."""

    def attention_layers(self) -> list[AttnLayer]:
        """The attention layers this rank runs (the backend checks it supports them)."""

    # pipeline parallelism: a stage runs embed (first stage), its layers, final_norm (last stage)
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def forward_layers(
        self, fb: ForwardBatch, h: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]: ...

    def final_norm(self, h: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor: ...

    def idle_forward(self, dp: Any) -> None:
        """DP attention: this group has no tokens; join every layer's MLP collectives."""

    # weights
    def checkpoint_weight_names(self) -> set[str]: ...

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None: ...

    # CPU fast paths (optional work; a model may do nothing in them)
    def use_cpu_kernels(self, ops: ModuleType) -> None: ...

    def prepack(
        self,
        ops: Optional[ModuleType],
        quantization: Optional[str] = None,
        batch_invariant: bool = False,
    ) -> int:
        """Prepack matmul weights for bf16 (or int8) on CPU, and with ``batch_invariant`` for any
        dtype, on matmuls whose rows do not depend on each other; returns the packed bytes."""

    # MoE facets (a dense model has no blocks and no recorder)
    expert_recorder: Any  # the expert-distribution recorder (``layers/moe/recorder.py``) or None

    def moe_blocks(self) -> list:
        """The sparse MoE blocks (``layers/moe/layer.SparseMoE``) this rank runs, by layer."""

    def enable_decode_stack(self, ops: ModuleType, batch_invariant: bool = False) -> bool:
        """Offer a fused decode-step implementation (e.g. the C++ Llama stack); False when the
        model has none for its configuration."""
