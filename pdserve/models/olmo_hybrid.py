"""OLMo-Hybrid (``OlmoHybridForCausalLM``): Gated DeltaNet layers (``linear_attention``:
``layers/gated_deltanet.py``) with an attention layer every few (``full_attention``), each with
a gated MLP. The attention layers are OLMo 3's: post-norm (``post_attention_layernorm`` and
``post_feedforward_layernorm`` on each branch's output), q/k norms over the whole projections,
RoPE; the linear layers are pre-norm (``input_layernorm``, ``post_attention_layernorm``). Every
RMSNorm multiplies its weight in float32 (OLMo's). The Gated DeltaNet's projections are stored
apart (``q_proj``, ``k_proj``, ``v_proj``, the gate ``g_proj``, ``a_proj``, ``b_proj``,
``o_proj``, the output norm ``o_norm`` with epsilon 1e-5, the convolution as ``q_conv1d`` /
``k_conv1d`` / ``v_conv1d``; the linear layers' norms ``attention_layer_norm`` /
``feedforward_layer_norm``), and with ``linear_allow_neg_eigval`` its beta is ``2 *
sigmoid(b)``: the delta rule's eigenvalues may go negative.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch
from torch import nn

from pdserve.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetDims
from pdserve.layers.linear import Linear
from pdserve.layers.norm import GptOssRMSNorm
from pdserve.models.bamba import HybridCausalLM
from pdserve.models.decoder import POST_NORM, run_mlp
from pdserve.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel
from pdserve.models.qwen3_next import gdn_dims
from pdserve.models.weights import TPShards

LINEAR, ATTENTION = "linear_attention", "full_attention"
GATE_NORM_EPS = 1e-5  # the Gated DeltaNet's output norm's (FLA's default, as HF keeps it)


def dims(config) -> GatedDeltaNetDims:
    return replace(gdn_dims(config), eps=GATE_NORM_EPS)


CONV_PARTS = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")


class OlmoGatedDeltaNet(GatedDeltaNet):
    """The Gated DeltaNet with its six input projections apart (the checkpoint's names) and its
    convolution stored in three parts (``q_conv1d``, ``k_conv1d``, ``v_conv1d``), whose
    concatenation is the convolution's q | k | v channels (as transformers joins them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._conv_parts: dict[str, torch.Tensor] = {}

    def checkpoint_names(self) -> list[str]:
        return [n for n in super().checkpoint_names() if n != "conv1d.weight"] + list(CONV_PARTS)

    def load_checkpoint(self, name: str, src: Any) -> None:
        if name not in CONV_PARTS:
            return super().load_checkpoint(name, src)
        self._conv_parts[name] = src[:]
        if len(self._conv_parts) == len(CONV_PARTS):
            whole = torch.cat([self._conv_parts.pop(n) for n in CONV_PARTS])
            super().load_checkpoint("conv1d.weight", whole)

    def make_input_projections(self, d: GatedDeltaNetDims) -> None:
        self.q_proj = Linear(d.hidden, d.keys, bias=False)
        self.k_proj = Linear(d.hidden, d.keys, bias=False)
        self.v_proj = Linear(d.hidden, d.values, bias=False)
        self.g_proj = Linear(d.hidden, d.values, bias=False)
        self.b_proj = Linear(d.hidden, d.value_heads, bias=False)
        self.a_proj = Linear(d.hidden, d.value_heads, bias=False)

    def input_projection_part(self, name: str, src: Any) -> Optional[torch.Tensor]:
        d, r = self.dims, self.tp.rank
        if name in ("q_proj.weight", "k_proj.weight"):
            return src[r * d.keys : (r + 1) * d.keys]
        if name in ("v_proj.weight", "g_proj.weight"):
            return src[r * d.values : (r + 1) * d.values]
        if name in ("b_proj.weight", "a_proj.weight"):
            return src[r * d.value_heads : (r + 1) * d.value_heads]
        return None

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        qkv = torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], dim=-1)
        return qkv, self.g_proj(h), self.b_proj(h), self.a_proj(h)


class OlmoHybridLinearLayer(nn.Module):
    rope_kind = "default"

    def __init__(self, config, layer_id: int, shards: TPShards):
        super().__init__()
        self.linear_attn = OlmoGatedDeltaNet(dims(config), layer_id - shards.layers[0], shards.attn)
        if config.linear_allow_neg_eigval:
            self.linear_attn.beta_scale = 2.0
        self.mlp = LlamaMLP(config, shards)
        self.input_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, residual, rope, fb):
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.linear_attn(h, fb)
        h, residual = self.post_attention_layernorm(h, residual)
        return run_mlp(self.mlp, h, fb), residual


def make_layer(config, layer_id: int, shards: TPShards, **attn_kwargs) -> nn.Module:
    kind = config.layer_types[layer_id]
    if kind == LINEAR:
        return OlmoHybridLinearLayer(config, layer_id, shards)
    if kind == ATTENTION:
        return LlamaDecoderLayer(
            config, layer_id, shards, block=POST_NORM, norm_cls=GptOssRMSNorm, **attn_kwargs
        )
    raise ValueError(
        f"layer_types[{layer_id}]: {kind!r} is not an OLMo-Hybrid layer kind ({LINEAR}, "
        f"{ATTENTION})"
    )


class OlmoHybridModel(LlamaModel):
    layer_cls = staticmethod(make_layer)
    norm_cls = GptOssRMSNorm


class OlmoHybridForCausalLM(HybridCausalLM):
    model_cls = OlmoHybridModel
    qk_norm = "projection"
    checkpoint_renames = {
        ".linear_attn.o_proj.": ".linear_attn.out_proj.",
        ".linear_attn.o_norm.": ".linear_attn.norm.",
        ".attention_layer_norm.": ".input_layernorm.",  # the linear layers' norms
        ".feedforward_layer_norm.": ".post_attention_layernorm.",
    }

    def __init__(self, config, *args, **kwargs):
        params = getattr(config, "rope_parameters", None) or {}
        if params.get("rope_theta") is None:
            raise ValueError("rope_parameters: OLMo-Hybrid without RoPE (NoPE) is not served")
        super().__init__(config, *args, **kwargs)
