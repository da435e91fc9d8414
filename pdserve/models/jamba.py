"""Jamba (``JambaForCausalLM``): a pre-norm decoder whose layers are Mamba (version 1) mixers
(``layers/mamba1.py``) except every ``attn_layer_period``-th from ``attn_layer_offset``, which is
attention without any positional encoding; every ``expert_layer_period``-th layer from
``expert_layer_offset`` has a sparse MoE (a softmax over the experts, the top k weights as they
are) instead of the gated MLP, both under ``feed_forward``. The attention layers keep KV pages, the
Mamba layers a recurrent state per request (``kv_spec.group_layers`` makes the pages the anchor
group). Checkpoint names are HF's, with ``model.final_layernorm`` for the final norm and
``feed_forward.router`` for the router.
"""

from __future__ import annotations

from pdserve.layers.mamba1 import Mamba1Dims, Mamba1Mixer
from pdserve.layers.moe.router import Router, qwen_router
from pdserve.models.bamba import HybridCausalLM, HybridDecoderLayer
from pdserve.models.llama import LlamaMLP, LlamaModel
from pdserve.models.moe import MoEForCausalLM
from pdserve.models.nemotron_h import NoRopeAttention


def jamba_dims(config) -> Mamba1Dims:
    return Mamba1Dims(
        hidden=config.hidden_size,
        inner=config.mamba_expand * config.hidden_size,
        state=config.mamba_d_state,
        conv_kernel=config.mamba_d_conv,
        dt_rank=config.mamba_dt_rank,
        eps=config.rms_norm_eps,
        proj_bias=bool(config.mamba_proj_bias),
        conv_bias=bool(config.mamba_conv_bias),
    )


class JambaDecoderLayer(HybridDecoderLayer):
    def __init__(self, config, layer_id: int, shards, make_mlp=None, mlp_name=None, **attn_kwargs):
        super().__init__(config)
        kind = config.layers_block_type[layer_id]
        if kind == "attention":
            self.self_attn = NoRopeAttention(config, layer_id, shards, **attn_kwargs)
        elif kind == "mamba":
            self.mamba = Mamba1Mixer(jamba_dims(config), layer_id - shards.layers[0], shards.attn)
        else:
            raise ValueError(f"layers_block_type[{layer_id}]: {kind!r} is not a Jamba layer kind")
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act: {config.hidden_act!r}; supported: silu")
        self.feed_forward = (
            make_mlp(config, layer_id, shards) if make_mlp else LlamaMLP(config, shards)
        )


class JambaModel(LlamaModel):
    layer_cls = JambaDecoderLayer

    @staticmethod
    def rope_settings(config) -> dict[str, dict]:
        return {}


class JambaForCausalLM(HybridCausalLM, MoEForCausalLM):
    model_cls = JambaModel
    mlp_name = "feed_forward"
    router_name = "router"
    checkpoint_prefixes = {"model.final_layernorm.": "model.norm."}

    @staticmethod
    def expert_intermediate(config) -> int:
        return config.intermediate_size

    def is_sparse(self, config, layer_id: int) -> bool:
        return config.layers_num_experts[layer_id] > 1

    def layer_options(self, config) -> dict:
        if config.num_experts <= 1:  # no sparse layer
            return self.attention_options(config)
        return super().layer_options(config)

    def make_router(self, config) -> Router:
        return qwen_router(config)  # no norm_topk_prob: the top k weights as they are
