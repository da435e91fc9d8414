"""StarCoder 2 (``Starcoder2ForCausalLM``): Llama's pre-norm blocks with LayerNorms (weight and
bias, ``norm_epsilon``), biases on every projection (``use_bias``), an MLP without a gate
(``c_fc``, ``hidden_act``, ``c_proj``: ``layers/mlp.PlainMLP``), and a sliding window on every
layer when ``sliding_window`` is set; the embeddings tied to the LM head by default."""

from __future__ import annotations

from pdserve.layers.mlp import PlainMLP
from pdserve.layers.norm import LayerNorm
from pdserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from pdserve.models.weights import TPShards


class Starcoder2LayerNorm(LayerNorm):
    eps_field = "norm_epsilon"


def plain_mlp(config, layer_id: int, shards: TPShards) -> PlainMLP:
    return PlainMLP(
        config.hidden_size,
        config.intermediate_size,
        config.hidden_act,
        shards.tp,
        bias=bool(config.use_bias),
    )


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    norm_cls = Starcoder2LayerNorm


class Starcoder2Model(LlamaModel):
    layer_cls = Starcoder2DecoderLayer
    norm_cls = Starcoder2LayerNorm


class Starcoder2ForCausalLM(LlamaForCausalLM):
    model_cls = Starcoder2Model

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        bias = bool(config.use_bias)
        return bias, bias

    def layer_options(self, config) -> dict:
        return {**super().layer_options(config), "make_mlp": plain_mlp}
