"""Nemotron-H (``NemotronHForCausalLM``): every layer is one pre-norm block of one kind
(``layers_block_type``): a Mamba2 mixer, attention without RoPE, or a non-gated MLP with a
squared-ReLU activation; the MLP layers keep no cache. Checkpoint names are HF's on-disk ones
(``backbone.embeddings``, ``backbone.layers.N.mixer.*``, ``backbone.norm_f``); the MoE block kind
is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.linear import Linear, RowParallelLinear
from pdserve.layers.mamba2 import Mamba2Dims, Mamba2Mixer
from pdserve.layers.norm import RMSNorm
from pdserve.models.bamba import HybridCausalLM
from pdserve.models.decoder import run_mlp
from pdserve.models.llama import LlamaAttention, LlamaModel

MAMBA, ATTENTION, MLP = "linear_attention", "full_attention", "mlp"


def nemotron_h_dims(config) -> Mamba2Dims:
    if config.mamba_hidden_act != "silu":
        raise ValueError(f"mamba_hidden_act: {config.mamba_hidden_act!r}; the mixer's is silu")
    return Mamba2Dims(
        hidden=config.hidden_size,
        heads=config.mamba_num_heads,
        head_dim=config.mamba_head_dim,
        groups=config.n_groups,
        state=config.ssm_state_size,
        conv_kernel=config.conv_kernel,
        chunk_size=config.chunk_size,
        eps=config.layer_norm_epsilon,
        proj_bias=bool(config.use_bias),
        conv_bias=bool(config.use_conv_bias),
        dt_limit=(float(config.time_step_min), float("inf")),
    )


# the Mamba-style checkpoints' names (``backbone.*``) -> ours
BACKBONE_NAMES = {
    "backbone.embeddings.": "model.embed_tokens.",
    "backbone.norm_f.": "model.norm.",
    "backbone.": "model.",
}


class NoRopeAttention(LlamaAttention):
    def rotate(self, q, k, rope):
        return q, k


class Relu2MLP(nn.Module):
    """``down(relu(up(x))^2)``, column- then row-parallel."""

    def __init__(self, config, shards):
        super().__init__()
        if config.mlp_hidden_act != "relu2":
            raise ValueError(f"mlp_hidden_act: {config.mlp_hidden_act!r}; supported: relu2")
        bias = bool(getattr(config, "mlp_bias", False))
        self.up_proj = Linear(config.hidden_size, shards.intermediate, bias=bias)
        self.down_proj = RowParallelLinear(
            shards.intermediate, config.hidden_size, bias=bias, tp=shards.tp
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))


class NemotronHBlock(nn.Module):
    rope_kind = None  # no RoPE anywhere

    def __init__(self, config, layer_id: int, shards, **attn_kwargs):
        super().__init__()
        self.kind = config.layers_block_type[layer_id]
        if self.kind == MAMBA:
            self.mixer = Mamba2Mixer(
                nemotron_h_dims(config), layer_id - shards.layers[0], shards.attn
            )
        elif self.kind == ATTENTION:
            self.mixer = NoRopeAttention(config, layer_id, shards, **attn_kwargs)
        elif self.kind == MLP:
            self.mixer = Relu2MLP(config, shards)
        else:
            raise ValueError(
                f"layers_block_type[{layer_id}]: {self.kind!r} is not served; served: "
                f"{MAMBA}, {ATTENTION}, {MLP}"
            )
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)

    # what the layer keeps, as HybridCausalLM reads it: its mixer under the kind's name
    @property
    def self_attn(self) -> nn.Module:
        if self.kind != ATTENTION:
            raise AttributeError("self_attn")
        return self.mixer

    @property
    def mamba(self) -> nn.Module:
        if self.kind != MAMBA:
            raise AttributeError("mamba")
        return self.mixer

    @property
    def dp_mlps(self) -> list[nn.Module]:
        return [self.mixer] if self.kind == MLP else []

    def forward(self, h, residual, rope, fb):
        if residual is None:
            residual, h = h, self.norm(h)
        else:
            h, residual = self.norm(h, residual)
        if self.kind == MAMBA:
            return self.mixer(h, fb), residual
        if self.kind == ATTENTION:
            return self.mixer(h, rope, fb), residual
        return run_mlp(self.mixer, h, fb), residual


class NemotronHModel(LlamaModel):
    layer_cls = NemotronHBlock

    @staticmethod
    def rope_settings(config) -> dict[str, dict]:
        return {}


class NemotronHForCausalLM(HybridCausalLM):
    model_cls = NemotronHModel
    checkpoint_prefixes = BACKBONE_NAMES

    def __init__(self, config, *args, **kwargs):
        config.rms_norm_eps = config.layer_norm_epsilon  # the final norm's (LlamaModel reads it)
        super().__init__(config, *args, **kwargs)
