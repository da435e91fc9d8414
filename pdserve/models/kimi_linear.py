"""Kimi-Linear (``KimiLinearForCausalLM``): Kimi Delta Attention layers (``layers/kimi_delta.py``)
with a latent-attention layer every few (``config.layer_types``: ``linear_attention`` /
``full_attention``), and DeepSeek-V3's MoE (grouped sigmoid routing with a correction bias,
shared experts, the routed scaling factor) on the layers ``mlp_layer_types`` marks ``sparse``, a
dense MLP on the others.

What differs from DeepSeek-V3's blocks, as HF computes them:
- the latent attention has no positions: its ``qk_rope_head_dim`` channels are kept and shared by
  every head but never turned (``NoPELatentAttention``);
- every layer's mixer is ``self_attn`` in the checkpoint, the KDA layers' included; pdserve keeps
  those as ``linear_attn`` (the hybrids' name for a mixer with a recurrent state), so a linear
  layer's ``self_attn.`` is read as ``linear_attn.``;
- the MLPs, dense and sparse, are ``block_sparse_moe``, its experts ``experts.E.w1/w2/w3``.

The cache: the KDA layers keep the Gated DeltaNet's state per request (convolution window and
[H, dk, dv] recurrent state), the latent layers the latent pages (the anchor group).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pdserve.distributed import SINGLE, TPGroup
from pdserve.layers.float32_params import Float32Params
from pdserve.layers.gated_deltanet import GatedDeltaNetDims
from pdserve.layers.kimi_delta import CHUNK, KimiDeltaGates, KimiGatedNorm
from pdserve.layers.linear import Linear
from pdserve.layers.moe.router import GroupedSigmoidTopK, Router
from pdserve.layers.norm import RMSNorm
from pdserve.models.bamba import HybridCausalLM
from pdserve.models.decoder import PRE_NORM, DecoderLayer, run_mlp
from pdserve.models.deepseek import DeepseekModel, DeepseekV3ForCausalLM, MLAttention
from pdserve.models.olmo_hybrid import OlmoGatedDeltaNet
from pdserve.models.weights import TPShards

LINEAR, ATTENTION = "linear_attention", "full_attention"
SPARSE, DENSE = "sparse", "dense"


def kda_dims(config) -> GatedDeltaNetDims:
    heads, dim = config.linear_num_heads, config.linear_head_dim
    return GatedDeltaNetDims(
        hidden=config.hidden_size,
        key_heads=heads,
        value_heads=heads,
        key_dim=dim,
        value_dim=dim,
        conv_kernel=config.linear_conv_kernel_dim,
        eps=config.rms_norm_eps,
        chunk_size=CHUNK,
    )


class KimiDeltaAttention(Float32Params, KimiDeltaGates, OlmoGatedDeltaNet):
    """A KDA layer in Kimi-Linear's checkpoint layout: q, k and v apart with their convolutions
    (``OlmoGatedDeltaNet``'s), the forget gate's ``f_a_proj`` / ``f_b_proj``, ``dt_bias`` (one per
    channel) and ``A_log`` ([1, 1, H, 1]), ``b_proj``, the output gate's ``g_a_proj`` /
    ``g_b_proj``, ``o_norm`` and ``o_proj``."""

    NAMES = {"o_proj.weight": "out_proj.weight", "o_norm.weight": "norm.weight"}
    float32_params = ("dt_bias",)  # as HF keeps it

    def __init__(self, dims: GatedDeltaNetDims, kv_layer: int, tp: TPGroup = SINGLE):
        super().__init__(dims, kv_layer, tp)
        d = self.dims
        self.dt_bias = nn.Parameter(torch.empty(d.keys))
        self.norm = KimiGatedNorm(d.value_dim, d.eps)

    def make_input_projections(self, d: GatedDeltaNetDims) -> None:
        w = self.whole
        self.q_proj = Linear(d.hidden, d.keys, bias=False)
        self.k_proj = Linear(d.hidden, d.keys, bias=False)
        self.v_proj = Linear(d.hidden, d.values, bias=False)
        self.b_proj = Linear(d.hidden, d.value_heads, bias=False)
        self.f_a_proj = Linear(d.hidden, w.key_dim, bias=False)
        self.f_b_proj = Linear(w.key_dim, d.keys, bias=False)
        self.g_a_proj = Linear(d.hidden, w.value_dim, bias=False)
        self.g_b_proj = Linear(w.value_dim, d.values, bias=False)

    def input_projection_part(self, name: str, src: Any) -> Optional[torch.Tensor]:
        d, r = self.dims, self.tp.rank
        if name in ("q_proj.weight", "k_proj.weight", "f_b_proj.weight"):
            return src[r * d.keys : (r + 1) * d.keys]
        if name in ("v_proj.weight", "g_b_proj.weight"):
            return src[r * d.values : (r + 1) * d.values]
        if name == "b_proj.weight":
            return src[r * d.value_heads : (r + 1) * d.value_heads]
        if name in ("f_a_proj.weight", "g_a_proj.weight"):
            return src[:]
        return None

    def rank_part(self, name: str, src: Any) -> torch.Tensor:
        d, r = self.dims, self.tp.rank
        if name == "dt_bias":
            return src[r * d.keys : (r + 1) * d.keys]
        if name == "A_log":
            return src[:].reshape(-1)[r * d.value_heads : (r + 1) * d.value_heads]
        return super().rank_part(name, src)

    def checkpoint_names(self) -> list[str]:
        back = {ours: theirs for theirs, ours in self.NAMES.items()}
        return [back.get(n, n) for n in super().checkpoint_names()]

    def load_checkpoint(self, name: str, src: Any) -> None:
        super().load_checkpoint(self.NAMES.get(name, name), src)


class NoPELatentAttention(MLAttention):
    """Latent attention whose shared key channels carry no positions (Kimi-Linear's)."""

    def rotate(self, q_rope, k_rope, rope) -> tuple[torch.Tensor, ...]:
        return q_rope, k_rope


class KimiLinearDecoderLayer(DecoderLayer):
    """Pre-norm: a KDA layer (``linear_attn``) or latent attention (``self_attn``), then the
    layer's MLP (``block_sparse_moe``)."""

    def __init__(self, config, layer_id: int, shards: TPShards, make_mlp=None, **_):
        kind = config.layer_types[layer_id]
        attn = NoPELatentAttention(config, layer_id, shards) if kind == ATTENTION else None
        super().__init__(
            attn,
            make_mlp(config, layer_id, shards),
            PRE_NORM,
            lambda: RMSNorm(config.hidden_size, config.rms_norm_eps),
            KimiLinearForCausalLM.mlp_name,
        )
        if kind == LINEAR:
            kv_layer = layer_id - shards.layers[0]
            self.linear_attn = KimiDeltaAttention(kda_dims(config), kv_layer, shards.attn)

    def forward(self, h, residual, rope, fb):
        if self.self_attn is not None:
            return super().forward(h, residual, rope, fb)
        h, residual = self._enter(self.norm_at("attn_in"), h, residual)
        h, residual = self._enter(self.norm_at("mlp_in"), self.linear_attn(h, fb), residual)
        return run_mlp(self.mlp, h, fb), residual


class KimiLinearModel(DeepseekModel):
    layer_cls = KimiLinearDecoderLayer


class KimiLinearForCausalLM(HybridCausalLM, DeepseekV3ForCausalLM):
    model_cls = KimiLinearModel
    mlp_name = "block_sparse_moe"
    expert_format = "mixtral"  # experts.E.w1 (gate), w3 (up), w2 (down)

    def __init__(self, config, *args, **kwargs):
        self.check_layer_types(config)
        super().__init__(config, *args, **kwargs)
        # a linear layer's mixer is ``self_attn`` in the checkpoint, ``linear_attn`` here
        self.checkpoint_prefixes = {
            f"model.layers.{i}.self_attn.": f"model.layers.{i}.linear_attn."
            for i, kind in enumerate(config.layer_types)
            if kind == LINEAR
        }

    @staticmethod
    def check_layer_types(config) -> None:
        n = config.num_hidden_layers
        for field, kinds in (
            ("layer_types", (LINEAR, ATTENTION)),
            ("mlp_layer_types", (SPARSE, DENSE)),
        ):
            value = list(getattr(config, field, None) or [])
            if len(value) != n or set(value) - set(kinds):
                raise ValueError(
                    f"{field}: one of {kinds[0]!r} or {kinds[1]!r} per layer expected, got "
                    f"{value!r}"
                )

    @staticmethod
    def num_experts(config) -> int:
        return config.num_local_experts or 0

    def is_sparse(self, config, layer_id: int) -> bool:
        return self.num_experts(config) > 0 and config.mlp_layer_types[layer_id] == SPARSE

    def make_router(self, config) -> Router:
        return GroupedSigmoidTopK(
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.n_group or 1,
            config.topk_group or 1,
            bool(getattr(config, "norm_topk_prob", True)),
            config.routed_scaling_factor,
        )
