"""Bamba (``BambaForCausalLM``): a Llama-style decoder whose layers are Mamba2 mixers except those
``attn_layer_indices`` names, which are attention with RoPE on the first half of each head
(``partial_rotary_factor`` 0.5); every layer has a gated MLP (``feed_forward``) after
``pre_ff_layernorm``. The attention layers keep KV pages, the Mamba2 layers a recurrent state
per request (``layers/mamba2.py``); ``kv_spec.group_layers`` makes the pages the anchor group.
Checkpoint names are HF's, with ``model.final_layernorm`` for the final norm.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from pdserve.kv_spec import CacheSpec
from pdserve.layers.attention.base import AttnLayer
from pdserve.layers.mamba2 import Mamba2Dims, Mamba2Mixer
from pdserve.layers.norm import RMSNorm
from pdserve.models.decoder import run_mlp
from pdserve.models.glm import PartialRotaryAttention
from pdserve.models.llama import (
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    attention_spec,
    partial_rope_settings,
)

LINEAR, ATTENTION = "linear_attention", "full_attention"


def bamba_dims(config) -> Mamba2Dims:
    return Mamba2Dims(
        hidden=config.hidden_size,
        heads=config.mamba_n_heads,
        head_dim=config.mamba_d_head,
        groups=config.mamba_n_groups,
        state=config.mamba_d_state,
        conv_kernel=config.mamba_d_conv,
        chunk_size=config.mamba_chunk_size,
        eps=config.rms_norm_eps,
        proj_bias=bool(config.mamba_proj_bias),
        conv_bias=bool(config.mamba_conv_bias),
        dt_limit=tuple(config.time_step_limit or (0.0, float("inf"))),
    )


class HybridDecoderLayer(nn.Module):
    """``input_layernorm``, the layer's mixer (``mamba``) or attention (``self_attn``; ``mix``),
    ``pre_ff_layernorm``, ``feed_forward``, each joining the residual stream: the subclass makes
    the mixer, the attention and the MLP."""

    rope_kind = "default"

    def __init__(self, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def dp_mlps(self) -> list[nn.Module]:
        return [self.feed_forward]

    def mix(self, h, rope, fb):
        return self.mamba(h, fb) if hasattr(self, "mamba") else self.self_attn(h, rope, fb)

    def forward(self, h, residual, rope, fb):
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h, residual = self.pre_ff_layernorm(self.mix(h, rope, fb), residual)
        return run_mlp(self.feed_forward, h, fb), residual


class BambaDecoderLayer(HybridDecoderLayer):
    def __init__(self, config, layer_id: int, shards, **attn_kwargs):
        super().__init__(config)
        kind = config.layers_block_type[layer_id]
        if kind == ATTENTION:
            self.self_attn = PartialRotaryAttention(config, layer_id, shards, **attn_kwargs)
        elif kind == LINEAR:
            self.mamba = Mamba2Mixer(bamba_dims(config), layer_id - shards.layers[0], shards.attn)
        else:
            raise ValueError(f"layers_block_type[{layer_id}]: {kind!r} is not a Bamba layer kind")
        self.feed_forward = LlamaMLP(config, shards)


class BambaModel(LlamaModel):
    layer_cls = BambaDecoderLayer

    rope_settings = staticmethod(partial_rope_settings)


# the attribute of a layer's state-keeping mixer (Mamba2, Gated DeltaNet, LFM2's short
# convolution), by family
STATE_MIXERS = ("mamba", "linear_attn", "conv")


class HybridCausalLM(LlamaForCausalLM):
    """A decoder whose layers each keep a recurrent state (a linear-attention mixer, one of
    ``STATE_MIXERS``), attention pages (``layer.self_attn``) or nothing (an MLP-only layer): the
    hybrids' cache specs and attention layers, read off the layers."""

    block = None  # each layer composes its mixer, MLP and norms itself

    def kv_cache_specs(self) -> list[Optional[CacheSpec]]:
        dtype = str(self.model.norm.weight.dtype).replace("torch.", "")
        specs: list[Optional[CacheSpec]] = []
        for layer in self.model.own_layers:
            mixer = next((getattr(layer, a) for a in STATE_MIXERS if hasattr(layer, a)), None)
            attn = getattr(layer, "self_attn", None)
            if mixer is not None:
                specs.append(mixer.state_spec(dtype))
            elif attn is not None:  # latent attention names its own caches
                specs.append(getattr(attn, "cache_specs", None) or attention_spec(attn))
            else:
                specs.append(None)
        return specs

    def attention_layers(self) -> list[AttnLayer]:
        layers = (getattr(layer, "self_attn", None) for layer in self.model.own_layers)
        return [a.attn for a in layers if a is not None]


class BambaForCausalLM(HybridCausalLM):
    model_cls = BambaModel
    checkpoint_prefixes = {"model.final_layernorm.": "model.norm."}

    def __init__(self, config, *args, **kwargs):
        if getattr(config, "num_experts", 1) not in (None, 1):
            raise ValueError(f"num_experts: Bamba's MoE form ({config.num_experts}) is not served")
        super().__init__(config, *args, **kwargs)
