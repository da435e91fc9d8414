"""LFM3 (``Lfm3ForCausalLM``): LFM2's layers (gated short convolutions beside attention with
per-head q/k norms, ``models/lfm2.py``) with a third kind, ``sliding_attention`` (a window of
``sliding_window`` keys), RoPE parameters per attention kind (the full layers' ``proportional``
RoPE turns part of each head), RoPE computed in float32 and rounded once, a sigmoid gate per query
head on the attention's output (``use_attention_gate``: ``g_proj``, stored as
``self_attn.gate_proj``), and with
``use_sandwich_norm`` a norm after each mixer and MLP as well (``post_operator_norm``,
``post_ffn_norm``). The MLP is ``intermediate_size`` wide as configured."""

from __future__ import annotations

import torch

from pdserve.forward_batch import ForwardBatch
from pdserve.layers.linear import Linear
from pdserve.layers.norm import RMSNorm
from pdserve.layers.rotary import apply_rotary, rope_parameters
from pdserve.models.decoder import run_mlp
from pdserve.models.lfm2 import ATTENTION, Lfm2DecoderLayer, Lfm2ForCausalLM
from pdserve.models.llama import LlamaAttention, LlamaModel
from pdserve.models.weights import TPShards

SLIDING = "sliding_attention"


class Lfm3Attention(LlamaAttention):
    def __init__(self, config, layer_id: int, shards: TPShards, **kwargs):
        super().__init__(config, layer_id, shards, **kwargs)
        self.g_proj = (
            Linear(config.hidden_size, self.num_heads, bias=False)
            if config.use_attention_gate
            else None
        )

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        cos, sin = (t.float() for t in rope)  # float32 tables where the kernels run
        return apply_rotary(q.float(), cos, sin).to(q.dtype), apply_rotary(k.float(), cos, sin).to(
            k.dtype
        )

    def forward(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fb: ForwardBatch
    ) -> torch.Tensor:
        t = h.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(h))
        q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
        q, k = self.rotate(q, k, rope)
        o = fb.attn_backend.forward(
            self.attn, q, k, v.view(t, self.num_kv_heads, self.head_dim), fb
        )
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(h))[..., None]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class Lfm3DecoderLayer(Lfm2DecoderLayer):
    attn_cls = Lfm3Attention
    attention_kinds = (ATTENTION, SLIDING)

    def __init__(self, config, layer_id: int, shards, **attn_kwargs):
        super().__init__(config, layer_id, shards, **attn_kwargs)
        self.rope_kind = config.layer_types[layer_id]  # its kind's RoPE table (none: conv)
        self.sandwich = bool(config.use_sandwich_norm)
        if self.sandwich:
            self.post_operator_norm = RMSNorm(config.hidden_size, config.norm_eps)
            self.post_ffn_norm = RMSNorm(config.hidden_size, config.norm_eps)

    @staticmethod
    def mlp_width(config) -> int:
        return config.intermediate_size

    def forward(self, h, residual, rope, fb):
        if not self.sandwich:
            return super().forward(h, residual, rope, fb)
        if residual is None:
            residual, h = h, self.operator_norm(h)
        else:
            h, residual = self.operator_norm(h, residual)
        h = self.conv(h, fb) if hasattr(self, "conv") else self.self_attn(h, rope, fb)
        h, residual = self.ffn_norm(self.post_operator_norm(h), residual)
        return self.post_ffn_norm(run_mlp(self.feed_forward, h, fb)), residual


class Lfm3Model(LlamaModel):
    layer_cls = Lfm3DecoderLayer

    @staticmethod
    def rope_settings(config) -> dict[str, dict]:
        """A table per attention kind the layers use (the conv layers have none)."""
        params = config.rope_parameters
        kinds = [k for k in (ATTENTION, SLIDING) if k in config.layer_types]
        missing = [k for k in kinds if k not in params]
        if missing:
            raise ValueError(f"rope_parameters: no settings for the layer type(s) {missing}")
        return {k: rope_parameters({"rope_parameters": params[k]}) for k in kinds}


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    model_cls = Lfm3Model
    # the checkpoints name the output gate ``gate_proj`` (transformers' module: ``g_proj``)
    checkpoint_renames = {
        **Lfm2ForCausalLM.checkpoint_renames,
        "self_attn.gate_proj.": "self_attn.g_proj.",
    }
