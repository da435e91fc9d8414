"""Qwen3.5 (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``): Qwen3-Next's layer plan (Gated
DeltaNet layers with a gated attention layer every ``full_attention_interval``) with:

- the Gated DeltaNet's input projections stored apart, in the order the convolution takes them:
  ``in_proj_qkv`` (all queries, all keys, all values), ``in_proj_z`` (the gates of every value
  head), ``in_proj_b`` and ``in_proj_a`` (one row per value head), where Qwen3-Next groups them by
  key head (``SplitGatedDeltaNet``);
- a dense MLP on every layer (``Qwen3_5ForCausalLM``), or Qwen3-Next's sparse MLP on every layer,
  its top-k always renormalised (``Qwen3_5MoeForCausalLM``);
- M-RoPE settings (``mrope_section``, ``mrope_interleaved``): a text token's three position axes
  are its one position, so every section turns by it and M-RoPE is the plain partial RoPE.

The multimodal checkpoints (``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``) are served with their images: the classes at the end add
the vision tower (``layers/qwen_vision.Qwen35VisionTower``) and multimodal RoPE
(``models/vision_language.py``); their language model's tensors are read under the text
checkpoint's names (``models/multimodal.py``). The multi-token-prediction weights (``mtp.*``) are
set aside.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pdserve.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetDims
from pdserve.layers.linear import Linear
from pdserve.layers.moe.router import SoftmaxTopK
from pdserve.layers.qwen_vision import Qwen35VisionTower
from pdserve.models.llama import LlamaMLP
from pdserve.models.qwen3_next import (
    Qwen3NextDecoderLayer,
    Qwen3NextForCausalLM,
    Qwen3NextModel,
    gdn_dims,
)
from pdserve.models.vision_language import VisionLanguageMixin, with_images
from pdserve.models.weights import TPShards

MROPE_FIELDS = ("mrope_section", "mrope_interleaved")


class SplitGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's Gated DeltaNet: Qwen3-Next's mixer with its four input projections apart."""

    def make_input_projections(self, d: GatedDeltaNetDims) -> None:
        self.in_proj_qkv = Linear(d.hidden, d.conv_dim, bias=False)
        self.in_proj_z = Linear(d.hidden, d.values, bias=False)
        self.in_proj_b = Linear(d.hidden, d.value_heads, bias=False)
        self.in_proj_a = Linear(d.hidden, d.value_heads, bias=False)

    def input_projection_part(self, name: str, src: Any) -> Optional[torch.Tensor]:
        d, r = self.dims, self.tp.rank
        if name == "in_proj_qkv.weight":
            return self.qkv_part(src)
        if name == "in_proj_z.weight":
            return src[r * d.values : (r + 1) * d.values]
        if name in ("in_proj_b.weight", "in_proj_a.weight"):
            return src[r * d.value_heads : (r + 1) * d.value_heads]
        return None

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.in_proj_qkv(h), self.in_proj_z(h), self.in_proj_b(h), self.in_proj_a(h)


class Qwen3_5DecoderLayer(Qwen3NextDecoderLayer):
    @staticmethod
    def make_linear_attention(config, layer_id: int, shards: TPShards) -> GatedDeltaNet:
        return SplitGatedDeltaNet(gdn_dims(config), layer_id - shards.layers[0], shards.attn)


class Qwen3_5Model(Qwen3NextModel):
    layer_cls = Qwen3_5DecoderLayer

    @staticmethod
    def rope_settings(config) -> dict[str, dict]:
        settings = Qwen3NextModel.rope_settings(config)
        for field in MROPE_FIELDS:  # text positions: M-RoPE is the plain RoPE (module docstring)
            settings["default"].pop(field, None)
        return settings


def dense_mlp(config, layer_id: int, shards: TPShards) -> LlamaMLP:
    return LlamaMLP(config, shards)


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    model_cls = Qwen3_5Model

    def is_sparse(self, config, layer_id: int) -> bool:
        return True

    def make_router(self, config) -> SoftmaxTopK:  # HF's always renormalises the top k
        return SoftmaxTopK(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            renormalize=True,
            cast_back=True,
        )


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    model_cls = Qwen3_5Model

    def layer_options(self, config) -> dict:
        self.check_layer_types(config)
        return {**self.attention_options(config), "make_mlp": dense_mlp}

    def is_sparse(self, config, layer_id: int) -> bool:
        return False


# ---- with images (models/vision_language.py): the multimodal checkpoints as published -----------
class Qwen3_5VLForConditionalGeneration(VisionLanguageMixin, Qwen3_5ForCausalLM):
    """``Qwen3_5ForConditionalGeneration``: the dense model with its vision tower; its M-RoPE
    interleaves the axes (``mrope_section`` [11, 11, 10] of the 64 rotary dims)."""

    model_cls = with_images(Qwen3_5Model, section=(11, 11, 10), interleaved=True)
    tower_cls = Qwen35VisionTower


class Qwen3_5MoeVLForConditionalGeneration(VisionLanguageMixin, Qwen3_5MoeForCausalLM):
    """``Qwen3_5MoeForConditionalGeneration``: the MoE model with its vision tower."""

    model_cls = with_images(Qwen3_5Model, section=(11, 11, 10), interleaved=True)
    tower_cls = Qwen35VisionTower
