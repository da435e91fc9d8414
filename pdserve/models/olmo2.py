"""OLMo 2 (``Olmo2ForCausalLM``): post-norm blocks (``post_attention_layernorm`` on attention's
output and ``post_feedforward_layernorm`` on the MLP's, before each joins the stream; no norm
before either) and q/k norms over the whole projections, before RoPE. Its RMSNorms multiply the
weight in float32 and round once, as GPT-OSS's do."""

from __future__ import annotations

from pdserve.layers.norm import GptOssRMSNorm
from pdserve.models.decoder import POST_NORM
from pdserve.models.llama import LlamaForCausalLM, check_layer_types


class Olmo2ForCausalLM(LlamaForCausalLM):
    block = POST_NORM
    norm_cls = GptOssRMSNorm
    qk_norm = "projection"


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3: OLMo 2 with sliding-window and global layers by ``layer_types`` and RoPE settings
    per layer type (the scaling only on the global layers)."""

    def __init__(self, config, *args, **kwargs):
        check_layer_types(config)
        super().__init__(config, *args, **kwargs)
