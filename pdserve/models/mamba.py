"""Pure state-space models: stacks of pre-norm mixers without attention or MLPs. Mamba2
(``Mamba2ForCausalLM``, e.g. Codestral Mamba: ``layers/mamba2.py``), Mamba and FalconMamba
(``MambaForCausalLM``, ``FalconMambaForCausalLM``: ``layers/mamba1.py``, FalconMamba with weightless
RMS norms on the time step, B and C).

Such a model keeps no per-token cache, only a state per request and layer. So that its requests
still hold pages counting their positions (the page table, the prefix tree whose state snapshots
hang on page boundaries, the PD queues), layer 0 also keeps a ``kv_spec.PositionLedger``: pages
without bytes, the anchor group. PD then moves the states alone. Checkpoint names are HF's:
``backbone.embeddings``, ``backbone.layers.N.{norm,mixer}``, ``backbone.norm_f``.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.kv_spec import PositionLedger
from pdserve.layers.mamba1 import Mamba1Dims, Mamba1Mixer
from pdserve.layers.mamba2 import Mamba2Dims, Mamba2Mixer
from pdserve.layers.norm import RMSNorm
from pdserve.models.bamba import HybridCausalLM
from pdserve.models.llama import LlamaModel
from pdserve.models.nemotron_h import BACKBONE_NAMES


def mamba2_dims(config) -> Mamba2Dims:
    inner = int(config.expand * config.hidden_size)
    if inner != config.num_heads * config.head_dim:
        raise ValueError(
            f"num_heads: {config.num_heads} heads of head_dim {config.head_dim} are not the "
            f"mixer's expand * hidden_size = {inner} channels (a gated-MLP share of in_proj is "
            "not served)"
        )
    return Mamba2Dims(
        hidden=config.hidden_size,
        heads=config.num_heads,
        head_dim=config.head_dim,
        groups=config.n_groups,
        state=config.state_size,
        conv_kernel=config.conv_kernel,
        chunk_size=config.chunk_size,
        eps=config.layer_norm_epsilon,
        proj_bias=bool(config.use_bias),
        conv_bias=bool(config.use_conv_bias),
        dt_limit=tuple(config.time_step_limit or (0.0, float("inf"))),
    )


def mamba1_dims(config, norms: str) -> Mamba1Dims:
    return Mamba1Dims(
        hidden=config.hidden_size,
        inner=config.intermediate_size,
        state=config.state_size,
        conv_kernel=config.conv_kernel,
        dt_rank=config.time_step_rank,
        eps=getattr(config, "mixer_rms_eps", None) or config.layer_norm_epsilon,
        proj_bias=bool(config.use_bias),
        conv_bias=bool(config.use_conv_bias),
        bcdt_norms=norms,
    )


def fp32_residual(config) -> bool:
    """Whether the residual stream stays float32 in a bf16 / fp16 model (``residual_in_fp32``,
    True by default in the Mamba configs)."""
    return bool(getattr(config, "residual_in_fp32", False))


class MambaBlock(nn.Module):
    """``h + mixer(norm(h))``; the mixer by the config's ``model_type``. With
    ``residual_in_fp32`` the stream is float32 (HF's: each mixer's output added to it in float32,
    the norm reading it rounded to the model's dtype), so a deep stack does not round it at every
    layer."""

    rope_kind = "default"

    def __init__(self, config, layer_id: int, shards, **attn_kwargs):
        super().__init__()
        self.fp32_residual = fp32_residual(config)
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        kv_layer, tp = layer_id - shards.layers[0], shards.attn
        if config.model_type == "mamba2":
            self.mixer = Mamba2Mixer(mamba2_dims(config), kv_layer, tp)
        else:
            norms = "weightless" if config.model_type == "falcon_mamba" else "none"
            self.mixer = Mamba1Mixer(mamba1_dims(config, norms), kv_layer, tp)

    @property
    def dp_mlps(self) -> list[nn.Module]:
        return []

    def forward(self, h, residual, rope, fb):
        if self.fp32_residual and h.dtype != torch.float32:
            stream = h.float() if residual is None else residual + h
            return self.mixer(self.norm(stream.to(h.dtype)), fb), stream
        if residual is None:
            residual, h = h, self.norm(h)
        else:
            h, residual = self.norm(h, residual)
        return self.mixer(h, fb), residual


class FinalNorm(RMSNorm):
    """``norm_f``; over a float32 stream (``residual_in_fp32``) in float32, the result rounded to
    the last mixer's dtype for the head, as HF rounds it."""

    eps_field = "layer_norm_epsilon"  # the Mamba configs' (``llama.norm_eps``)

    def forward(self, x, residual=None):
        if residual is None or residual.dtype == x.dtype:
            return super().forward(x, residual)
        stream = residual + x
        return self._norm(stream).to(x.dtype), stream


class MambaModel(LlamaModel):
    layer_cls = MambaBlock
    norm_cls = FinalNorm

    @staticmethod
    def rope_settings(config) -> dict[str, dict]:
        return {}


class Mamba2ForCausalLM(HybridCausalLM):
    model_cls = MambaModel
    checkpoint_prefixes = BACKBONE_NAMES

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        # what a pipeline stage sends on besides the hidden states (engine/pipeline.py)
        self.residual_dtype = torch.float32 if fp32_residual(config) else None

    def kv_cache_specs(self) -> list:
        dtype = str(self.model.norm.weight.dtype).replace("torch.", "")
        specs: list = [layer.mixer.state_spec(dtype) for layer in self.model.own_layers]
        if specs:  # each pipeline stage's first layer
            specs[0] = (PositionLedger(), specs[0])
        return specs


class MambaForCausalLM(Mamba2ForCausalLM):
    pass


class FalconMambaForCausalLM(Mamba2ForCausalLM):
    pass
