"""Llama 4's text decoder (``Llama4ForCausalLM``): Llama's pre-norm blocks with two kinds of
attention layer and sparse MLPs that take their router weight on the input.

- Attention on the layers ``no_rope_layers`` marks 1: RoPE by interleaved pairs (HF's complex
  rotation), then, with ``use_qk_norm``, q and k normed per head without a weight; with
  ``attention_chunk_size`` these layers attend within their chunk only (``layer_types``
  "chunked_attention": a query at i sees C*floor(i/C) .. i, a ``ChunkedAttention`` cache that keeps
  only the current chunk's pages). The other layers (NoPE) see every key, their queries scaled by
  ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1`` in float32
  (``attn_temperature_tuning``).
- MLP: the ``moe_layers`` are sparse: ``num_local_experts`` experts of ``intermediate_size``, the
  top k of the router's logits, each chosen expert taking the token times the sigmoid of its
  logit (``SparseMoE.weights_on_input``), plus a shared expert of the same size; the other layers
  have a dense MLP of ``intermediate_size_mlp``.

Module names are the checkpoint's: ``feed_forward.{router, experts, shared_expert}``, the experts
as ``gate_up_proj`` [E, H, 2I] and ``down_proj`` [E, I, H] (``Experts`` format ``llama4``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
from torch import nn

from pdserve.distributed import SINGLE
from pdserve.forward_batch import ForwardBatch
from pdserve.layers.linear import Linear
from pdserve.layers.mlp import GatedMLP
from pdserve.layers.moe.router import Router, TopKSigmoid
from pdserve.layers.norm import UnitRMSNorm
from pdserve.models.llama import LlamaAttention
from pdserve.models.moe import LocalExperts, MoEDecoderLayer, MoEForCausalLM, MoEModel
from pdserve.models.weights import TPShards

LAYER_TYPES = ("full_attention", "chunked_attention")


def uses_rope(config, layer_id: int) -> bool:
    return bool(config.no_rope_layers[layer_id])


class Llama4Attention(LlamaAttention):
    """Llama's attention as Llama 4 runs it on each layer (the module docstring)."""

    def __init__(self, config, layer_id: int, shards: TPShards, **kwargs):
        super().__init__(config, layer_id, shards, **kwargs)
        chunked = config.layer_types[layer_id] == "chunked_attention"
        self.attention_chunk: Optional[int] = config.attention_chunk_size if chunked else None
        if chunked:
            self.attn = replace(self.attn, attention_chunk=self.attention_chunk)
        if not self.use_rope:  # the NoPE layers keep their queries and keys as projected
            self.qk_norm, self.q_norm, self.k_norm = None, None, None
        self.floor_scale = float(config.floor_scale)
        self.attn_scale = float(config.attn_scale)
        self.tuned = bool(config.attn_temperature_tuning) and not self.use_rope

    def temperature(self, positions: torch.Tensor) -> torch.Tensor:
        """[T] float32: the NoPE layers' query scale at each position."""
        pos = positions.float()
        return torch.log1p(torch.floor((pos + 1.0) / self.floor_scale)) * self.attn_scale + 1.0

    def forward(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fb: ForwardBatch
    ) -> torch.Tensor:
        t = h.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(h))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            q, k = self.rotate(q, k, rope)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
        elif self.tuned:
            q = (q * self.temperature(fb.positions)[:, None, None]).to(q.dtype)
        o = fb.attn_backend.forward(self.attn, q, k, v, fb)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class Llama4DecoderLayer(MoEDecoderLayer):
    attn_cls = Llama4Attention


class Llama4Model(MoEModel):
    layer_cls = Llama4DecoderLayer


class Llama4ForCausalLM(LocalExperts, MoEForCausalLM):
    model_cls = Llama4Model
    mlp_name = "feed_forward"
    router_name = "router"
    expert_format = "llama4"

    def __init__(self, config, *args, **kwargs):
        layer_types = list(getattr(config, "layer_types", None) or [])
        if len(layer_types) != config.num_hidden_layers or set(layer_types) - set(LAYER_TYPES):
            raise ValueError(
                f"layer_types: one of {LAYER_TYPES} per layer expected, got {layer_types!r}"
            )
        if "chunked_attention" in layer_types and not config.attention_chunk_size:
            raise ValueError("attention_chunk_size: chunked_attention layers need one (got none)")
        super().__init__(config, *args, **kwargs)

    def attention_options(self, config) -> dict:
        return {
            **super().attention_options(config),
            "qk_norm": "head_after_rope" if config.use_qk_norm else False,
            "norm": UnitRMSNorm,
            "uses_rope": uses_rope,
            "interleaved": True,
        }

    def is_sparse(self, config, layer_id: int) -> bool:
        return layer_id in config.moe_layers

    def make_router(self, config) -> Router:
        return TopKSigmoid(config.hidden_size, config.num_local_experts, config.num_experts_per_tok)

    def make_shared(
        self, config, layer_id: int, tp
    ) -> tuple[Optional[nn.Module], Optional[Linear]]:
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp), None

    def make_mlp(self, config, layer_id: int, shards: TPShards) -> nn.Module:
        if self.is_sparse(config, layer_id):
            block = super().make_mlp(config, layer_id, shards)
            block.weights_on_input = True
            return block
        tp = SINGLE if self._moe_ctx.options.dense_tp_size == 1 else shards.tp
        return GatedMLP(config.hidden_size, config.intermediate_size_mlp, config.hidden_act, tp)
