"""Qwen3-Next (``Qwen3NextForCausalLM``): Gated DeltaNet layers (``layers/gated_deltanet.py``)
with a gated attention layer every ``full_attention_interval`` (``config.layer_types``), and
Qwen2-MoE's sparse MLP (softmax top-k, renormalised when ``norm_topk_prob``, a shared expert gated
by ``sigmoid(shared_expert_gate(x))``) on the layers ``decoder_sparse_step`` / ``mlp_only_layers``
make sparse, a dense MLP elsewhere.

What differs from Qwen3-MoE, as HF computes it:
- every RMSNorm (the blocks', the final one, the per-head q/k norms) scales by (1 + w), Gemma's;
- the attention's ``q_proj`` gives each head's query and then its output gate (2 x head_dim
  rows per head); the output is ``o * sigmoid(gate)`` before ``o_proj``; RoPE turns the first
  ``partial_rotary_factor`` (0.25) of each head;
- the GDN layers keep a recurrent state per request; the attention layers keep KV pages (the
  anchor group).
Checkpoint names are HF's; the multi-token-prediction weights (``mtp.*``) are set aside.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdserve.forward_batch import ForwardBatch
from pdserve.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetDims
from pdserve.layers.linear import MATRIX_KINDS, MergedLinear
from pdserve.layers.norm import GemmaRMSNorm
from pdserve.models.bamba import HybridCausalLM
from pdserve.models.decoder import run_mlp
from pdserve.models.glm import PartialRotaryAttention
from pdserve.models.llama import partial_rope_settings
from pdserve.models.moe import MoEModel, Qwen2MoeForCausalLM
from pdserve.models.weights import TPShards

LINEAR, ATTENTION = "linear_attention", "full_attention"


def gdn_dims(config) -> GatedDeltaNetDims:
    return GatedDeltaNetDims(
        hidden=config.hidden_size,
        key_heads=config.linear_num_key_heads,
        value_heads=config.linear_num_value_heads,
        key_dim=config.linear_key_head_dim,
        value_dim=config.linear_value_head_dim,
        conv_kernel=config.linear_conv_kernel_dim,
        eps=config.rms_norm_eps,
    )


class GatedAttention(PartialRotaryAttention):
    """Qwen3-Next's attention: per-head q/k norms (Gemma's), partial RoPE and a sigmoid gate on
    each head's output, which ``q_proj`` gives after the head's query. It loads its own weights
    (``q_proj`` rows are 2 x head_dim per head, so its shard is not a plain query shard)."""

    def __init__(self, config, layer_id: int, shards: TPShards, **kwargs):
        super().__init__(config, layer_id, shards, qk_norm=True, norm=GemmaRMSNorm, **kwargs)
        self.shards = shards
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = self.qkv_proj.bias is not None
        self.qkv_proj = MergedLinear(config.hidden_size, [2 * q_size, kv_size, kv_size], bias=bias)

    def forward(self, h: torch.Tensor, rope, fb: ForwardBatch) -> torch.Tensor:
        t, n, dim = h.shape[0], self.num_heads, self.head_dim
        q2, k, v = self.qkv_proj.split(self.qkv_proj(h))
        q, gate = q2.view(t, n, 2, dim).unbind(2)
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.reshape(t, self.num_kv_heads, dim))
        q, k = self.rotate(q, k, rope)
        v = v.reshape(t, self.num_kv_heads, dim)
        o = fb.attn_backend.forward(self.attn, q, k, v, fb, sinks=None).reshape(t, n, dim)
        return self.o_proj((o * torch.sigmoid(gate)).reshape(t, n * dim))

    # ---- weights -----------------------------------------------------------------------------
    def checkpoint_names(self) -> list[str]:
        names = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
        if self.qkv_proj.bias is not None:
            names += ["q_proj.bias", "k_proj.bias", "v_proj.bias"]
        if self.o_proj.bias is not None:
            names.append("o_proj.bias")
        if hasattr(self.qkv_proj, MATRIX_KINDS[1]):  # FP8 blocks (quantization/fp8_block.py)
            names += [f"{p}.{MATRIX_KINDS[1]}" for p in ("q_proj", "k_proj", "v_proj")]
        if hasattr(self.o_proj, MATRIX_KINDS[1]):
            names.append(f"o_proj.{MATRIX_KINDS[1]}")
        return names + ["q_norm.weight", "k_norm.weight"]

    def load_checkpoint(self, name: str, src: Any) -> None:
        s, dim = self.shards, self.head_dim
        proj, _, leaf = name.partition(".")
        if proj == "q_proj":
            self.qkv_proj.load_shard(0, leaf, src[s.heads[0] * 2 * dim : s.heads[1] * 2 * dim])
        elif proj in ("k_proj", "v_proj"):
            part = src[s.kv_heads[0] * dim : s.kv_heads[1] * dim]
            self.qkv_proj.load_shard(1 if proj == "k_proj" else 2, leaf, part)
        elif proj == "o_proj" and leaf in MATRIX_KINDS:
            getattr(self.o_proj, leaf).data.copy_(src[:, s.heads[0] * dim : s.heads[1] * dim])
        elif name in ("o_proj.bias", "q_norm.weight", "k_norm.weight"):
            dict(self.named_parameters())[name].data.copy_(src[:])
        else:
            raise ValueError(f"unexpected attention weight {name!r}")


class Qwen3NextDecoderLayer(nn.Module):
    rope_kind = "default"

    def __init__(
        self, config, layer_id: int, shards: TPShards, make_mlp=None, mlp_name="mlp", **attn_kwargs
    ):
        super().__init__()
        kind = config.layer_types[layer_id]
        if kind == ATTENTION:
            attn_kwargs.pop("qk_norm", None)
            self.self_attn = GatedAttention(config, layer_id, shards, **attn_kwargs)
        elif kind == LINEAR:
            self.linear_attn = self.make_linear_attention(config, layer_id, shards)
        else:
            raise ValueError(f"layer_types[{layer_id}]: {kind!r} is not a Qwen3-Next layer kind")
        self.mlp = make_mlp(config, layer_id, shards)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    @staticmethod
    def make_linear_attention(config, layer_id: int, shards: TPShards) -> GatedDeltaNet:
        return GatedDeltaNet(gdn_dims(config), layer_id - shards.layers[0], shards.attn)

    def forward(self, h, residual, rope, fb):
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        if hasattr(self, "linear_attn"):
            h = self.linear_attn(h, fb)
        else:
            h = self.self_attn(h, rope, fb)
        h, residual = self.post_attention_layernorm(h, residual)
        return run_mlp(self.mlp, h, fb), residual


class Qwen3NextModel(MoEModel):
    layer_cls = Qwen3NextDecoderLayer
    norm_cls = GemmaRMSNorm

    rope_settings = staticmethod(partial_rope_settings)


class Qwen3NextForCausalLM(HybridCausalLM, Qwen2MoeForCausalLM):
    model_cls = Qwen3NextModel
    qk_norm = True

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def layer_options(self, config) -> dict:
        self.check_layer_types(config)
        return super().layer_options(config)

    @staticmethod
    def check_layer_types(config) -> None:
        unknown = sorted(set(config.layer_types) - {LINEAR, ATTENTION})
        if len(config.layer_types) != config.num_hidden_layers or unknown:
            raise ValueError(
                f"layer_types: one of {LINEAR!r} or {ATTENTION!r} per layer expected, got "
                f"{config.layer_types!r}"
            )

    def load_weights(self, weights) -> None:
        super().load_weights((n, w) for n, w in weights if not n.startswith("mtp."))
