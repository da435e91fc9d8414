"""LFM2 (``Lfm2ForCausalLM``): a pre-norm decoder whose layers are gated short convolutions
(``layer_types`` "conv": ``layers/short_conv.py``, a state of the last ``conv_L_cache`` - 1 inputs
per request) or attention (per-head q/k RMSNorm before RoPE), each followed by a gated MLP. The
attention layers keep KV pages, the convolutions a recurrent state per request that PD moves
once after the last chunk (``kv_spec.group_layers`` makes the pages the anchor group).

The MLP's width is HF's: with ``block_auto_adjust_ff_dim``, 2/3 of ``intermediate_size``, times
``block_ffn_dim_multiplier``, rounded up to a multiple of ``block_multiple_of``. Checkpoint names
are HF's, read through renames: ``self_attn.out_proj`` (our ``o_proj``),
``{q,k}_layernorm`` (``{q,k}_norm``), ``feed_forward.w1/w3/w2`` (gate, up, down), the norms
``operator_norm`` / ``ffn_norm`` and the final ``model.embedding_norm``.
"""

from __future__ import annotations

from torch import nn

from pdserve.layers.mlp import GatedMLP
from pdserve.layers.norm import RMSNorm
from pdserve.layers.short_conv import ShortConvMixer
from pdserve.models.bamba import HybridCausalLM
from pdserve.models.decoder import run_mlp
from pdserve.models.llama import LlamaAttention, LlamaModel

CONV, ATTENTION = "conv", "full_attention"


def mlp_width(config) -> int:
    width = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        width = int(2 * width / 3)
        if config.block_ffn_dim_multiplier is not None:
            width = int(config.block_ffn_dim_multiplier * width)
            step = config.block_multiple_of
            width = step * ((width + step - 1) // step)
    return width


class Lfm2DecoderLayer(nn.Module):
    rope_kind = "default"
    attn_cls: type[nn.Module] = LlamaAttention
    attention_kinds: tuple[str, ...] = (ATTENTION,)

    def __init__(self, config, layer_id: int, shards, **attn_kwargs):
        super().__init__()
        kind = config.layer_types[layer_id]
        if kind in self.attention_kinds:
            self.self_attn = self.attn_cls(config, layer_id, shards, **attn_kwargs)
        elif kind == CONV:
            self.conv = ShortConvMixer(
                config.hidden_size,
                config.conv_L_cache,
                bool(config.conv_bias),
                layer_id - shards.layers[0],
                shards.attn,
            )
        else:
            kinds = ", ".join((CONV,) + self.attention_kinds)
            raise ValueError(
                f"layer_types[{layer_id}]: {kind!r} is not a layer kind here ({kinds})"
            )
        self.feed_forward = GatedMLP(config.hidden_size, self.mlp_width(config), "silu", shards.tp)
        self.operator_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps)

    @staticmethod
    def mlp_width(config) -> int:
        return mlp_width(config)

    @property
    def dp_mlps(self) -> list[nn.Module]:
        return [self.feed_forward]

    def forward(self, h, residual, rope, fb):
        if residual is None:
            residual, h = h, self.operator_norm(h)
        else:
            h, residual = self.operator_norm(h, residual)
        h = self.conv(h, fb) if hasattr(self, "conv") else self.self_attn(h, rope, fb)
        h, residual = self.ffn_norm(h, residual)
        return run_mlp(self.feed_forward, h, fb), residual


class Lfm2Model(LlamaModel):
    layer_cls = Lfm2DecoderLayer


class Lfm2ForCausalLM(HybridCausalLM):
    model_cls = Lfm2Model
    qk_norm = "head"
    checkpoint_prefixes = {"model.embedding_norm.": "model.norm."}
    checkpoint_renames = {
        "self_attn.out_proj.": "self_attn.o_proj.",
        "self_attn.q_layernorm.": "self_attn.q_norm.",
        "self_attn.k_layernorm.": "self_attn.k_norm.",
        "feed_forward.w1.": "feed_forward.gate_proj.",
        "feed_forward.w3.": "feed_forward.up_proj.",
        "feed_forward.w2.": "feed_forward.down_proj.",
    }

    def __init__(self, config, *args, **kwargs):
        if getattr(config, "rms_norm_eps", None) is None:  # the attention's q/k norms read it
            config.rms_norm_eps = config.norm_eps
        super().__init__(config, *args, **kwargs)
