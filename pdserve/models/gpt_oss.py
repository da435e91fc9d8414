"""GPT-OSS (``GptOssForCausalLM``) on the MoE blocks of ``moe.py``, as HF transformers computes it:

- layers alternate sliding-window and full attention (``config.layer_types``; layer 0 slides):
  two cache groups;
- attention with q/k/v/o biases and a learned sink logit per query head (``attention sinks``:
  one more softmax column that takes probability mass and carries no value, so no KV); RoPE is
  YaRN (``rope_parameters``, ``layers/rotary.py``);
- RMSNorm with the weight's product in float32 before the one rounding (``GptOssRMSNorm``);
- every layer sparse: the router has a bias, takes the top-k logits and softmaxes over those k
  (``TopKSoftmax``); experts have biases and a clamped SwiGLU, ``(up + 1) * gate *
  sigmoid(1.702 * gate)`` with gate clamped above and up to ±``swiglu_limit``; the checkpoint
  stores each expert transposed with gate and up interleaved (``Experts``, format ``gpt_oss``).

Checkpoints: bf16 (or float32) weights, or the published ones with the experts in MXFP4
(``quantization_config.quant_method == "mxfp4"``, read in place: ``quantization/mxfp4.py``);
other quantizations are refused at load. The CPU decode stack is Llama's and is not offered.
"""

from __future__ import annotations

from pdserve.layers.moe.router import Router, TopKSoftmax
from pdserve.layers.norm import GptOssRMSNorm
from pdserve.models.llama import check_layer_types
from pdserve.models.moe import LocalExperts, MoEDecoderLayer, MoEForCausalLM, MoEModel

# HF's GptOssExperts fixes the SwiGLU's sigmoid scale
SWIGLU_ALPHA = 1.702


class GptOssDecoderLayer(MoEDecoderLayer):
    norm_cls = GptOssRMSNorm


class GptOssModel(MoEModel):
    layer_cls = GptOssDecoderLayer
    norm_cls = GptOssRMSNorm


def check_config(config) -> None:
    quant = getattr(config, "quantization_config", None)
    method = (
        quant.get("quant_method")
        if isinstance(quant, dict)
        else getattr(quant, "quant_method", None)
    )
    if method not in (None, "mxfp4"):
        raise ValueError(
            f"quantization_config: GPT-OSS checkpoints quantized with {str(method)!r} are not "
            "supported; supported: mxfp4 (as published) or unquantized weights"
        )
    check_layer_types(config)


class GptOssForCausalLM(LocalExperts, MoEForCausalLM):
    model_cls = GptOssModel
    expert_format = "gpt_oss"
    router_name = "router"

    def __init__(self, config, *args, **kwargs):
        check_config(config)
        super().__init__(config, *args, **kwargs)

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", True))
        return bias, bias

    def attention_options(self, config) -> dict:
        return {**super().attention_options(config), "sinks": True}

    def make_router(self, config) -> Router:
        return TopKSoftmax(
            config.hidden_size, config.num_local_experts, config.num_experts_per_tok, bias=True
        )

    def expert_options(self, config) -> dict:
        return dict(
            activation="swiglu_oai",
            bias=True,
            alpha=SWIGLU_ALPHA,
            limit=float(getattr(config, "swiglu_limit", 7.0)),
        )
