"""Granite 4 hybrids (``GraniteMoeHybridForCausalLM``, dense form): Bamba's layer plan (Mamba2
mixers except ``layers_block_type``'s attention layers) with Granite's multipliers: the embedding
times ``embedding_multiplier``, each block's output times ``residual_multiplier`` before it joins
the residual stream, attention scaled by ``attention_multiplier``, logits divided by
``logits_scaling``; RoPE only with ``position_embedding_type: rope``; the MLP is
``shared_mlp`` (``input_linear`` holds gate and up, ``output_linear`` maps back). The MoE form
(``num_local_experts`` > 0) adds ``block_sparse_moe`` beside it: a router that takes the top k
logits (float32) and a softmax over them, and the experts stored as Granite does (3-D
``input_linear`` / ``output_linear``, ``router.layer``; renamed at load to the MoE block's
``experts`` and ``router``), on the shared MoE layers (EP, the fused kernel).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.linear import Linear, RowParallelLinear
from pdserve.layers.mamba2 import Mamba2Mixer
from pdserve.layers.moe.router import Router, granite_router
from pdserve.layers.norm import RMSNorm
from pdserve.layers.rotary import rope_parameters
from pdserve.layers.vocab import MultipliedEmbedding
from pdserve.models.bamba import HybridCausalLM, bamba_dims
from pdserve.models.decoder import run_mlp
from pdserve.models.granite import MOE_NAMES
from pdserve.models.llama import LlamaAttention, LlamaModel
from pdserve.models.moe import LocalExperts, MoEForCausalLM
from pdserve.models.nemotron_h import NoRopeAttention


class GraniteSharedMLP(nn.Module):
    """``output(silu(gate) * up)`` with gate and up the two halves of ``input_linear``; each TP
    rank holds its columns of both halves (it reads its HF weights itself)."""

    def __init__(self, config, shards):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act: {config.hidden_act!r}; supported: silu")
        self.whole = config.shared_intermediate_size
        self.rank, n = shards.tp.rank, shards.tp.size
        if self.whole % n:
            raise ValueError(
                f"tp_size: {n} ranks cannot split shared_intermediate_size {self.whole}"
            )
        self.part = self.whole // n
        self.input_linear = Linear(config.hidden_size, 2 * self.part, bias=False)
        self.output_linear = RowParallelLinear(self.part, config.hidden_size, False, tp=shards.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up)

    def checkpoint_names(self) -> list[str]:
        return ["input_linear.weight", "output_linear.weight"]

    def load_checkpoint(self, name: str, src: Any) -> None:
        lo, hi = self.rank * self.part, (self.rank + 1) * self.part
        if name == "input_linear.weight":
            t, target = (
                torch.cat([src[lo:hi], src[self.whole + lo : self.whole + hi]]),
                self.input_linear,
            )
        elif name == "output_linear.weight":
            t, target = src[:, lo:hi], self.output_linear
        else:
            raise ValueError(f"unexpected shared MLP weight {name!r}")
        if tuple(t.shape) != tuple(target.weight.shape):
            raise ValueError(
                f"expected {tuple(target.weight.shape)} for this rank, got {tuple(t.shape)}"
            )
        target.weight.data.copy_(t)


class GraniteHybridLayer(nn.Module):
    rope_kind = "default"

    def __init__(self, config, layer_id: int, shards, make_mlp=None, mlp_name=None, **attn_kwargs):
        super().__init__()
        kind = config.layers_block_type[layer_id]
        if kind == "linear_attention":
            self.mamba = Mamba2Mixer(bamba_dims(config), layer_id - shards.layers[0], shards.attn)
        elif kind == "full_attention":
            cls = LlamaAttention if config.position_embedding_type == "rope" else NoRopeAttention
            self.self_attn = cls(
                config, layer_id, shards, scale=config.attention_multiplier, **attn_kwargs
            )
        else:
            raise ValueError(f"layers_block_type[{layer_id}]: {kind!r} is not a Granite layer kind")
        self.shared_mlp = GraniteSharedMLP(config, shards)
        if make_mlp is not None:  # the MoE form
            self.block_sparse_moe = make_mlp(config, layer_id, shards)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = float(config.residual_multiplier)

    @property
    def dp_mlps(self) -> list[nn.Module]:
        moe = getattr(self, "block_sparse_moe", None)
        return [self.shared_mlp] + ([moe] if moe is not None else [])

    def forward(self, h, residual, rope, fb):
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.mamba(h, fb) if hasattr(self, "mamba") else self.self_attn(h, rope, fb)
        h, residual = self.post_attention_layernorm(h * self.residual_multiplier, residual)
        out = run_mlp(self.shared_mlp, h, fb)
        if hasattr(self, "block_sparse_moe"):
            out = run_mlp(self.block_sparse_moe, h, fb) + out
        return out * self.residual_multiplier, residual


class GraniteHybridModel(LlamaModel):
    layer_cls = GraniteHybridLayer
    embedding_cls = MultipliedEmbedding

    def __init__(self, config, shards, **attn_kwargs):
        super().__init__(config, shards, **attn_kwargs)
        if self.embed_tokens is not None:
            self.embed_tokens.multiplier = float(config.embedding_multiplier)

    @staticmethod
    def rope_settings(config) -> dict[str, dict]:
        return (
            {"default": rope_parameters(config)} if config.position_embedding_type == "rope" else {}
        )


class GraniteMoeHybridForCausalLM(HybridCausalLM, LocalExperts, MoEForCausalLM):
    model_cls = GraniteHybridModel
    mlp_name = "block_sparse_moe"
    router_name = "router"
    expert_format = "granite"
    checkpoint_renames = MOE_NAMES

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.logits_scaling = float(config.logits_scaling)

    def layer_options(self, config) -> dict:
        if not getattr(config, "num_local_experts", 0):  # the dense form
            return self.attention_options(config)
        return super().layer_options(config)

    def make_router(self, config) -> Router:
        return granite_router(config)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling
