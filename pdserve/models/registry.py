"""HF ``architectures`` name -> model class, imported only when chosen."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS = {
    "LlamaForCausalLM": ("pdserve.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("pdserve.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("pdserve.models.llama", "Qwen3ForCausalLM"),
    "MistralForCausalLM": ("pdserve.models.llama", "MistralForCausalLM"),
    "SmolLM3ForCausalLM": ("pdserve.models.smollm3", "SmolLM3ForCausalLM"),
    "GraniteForCausalLM": ("pdserve.models.granite", "GraniteForCausalLM"),
    "GraniteMoeForCausalLM": ("pdserve.models.granite", "GraniteMoeForCausalLM"),
    "Olmo2ForCausalLM": ("pdserve.models.olmo2", "Olmo2ForCausalLM"),
    "Olmo3ForCausalLM": ("pdserve.models.olmo2", "Olmo3ForCausalLM"),
    "OlmoHybridForCausalLM": ("pdserve.models.olmo_hybrid", "OlmoHybridForCausalLM"),
    "KimiLinearForCausalLM": ("pdserve.models.kimi_linear", "KimiLinearForCausalLM"),
    "Glm4ForCausalLM": ("pdserve.models.glm4", "Glm4ForCausalLM"),
    "Ernie4_5ForCausalLM": ("pdserve.models.ernie4_5", "Ernie4_5ForCausalLM"),
    "Ernie4_5_MoeForCausalLM": ("pdserve.models.ernie4_5_moe", "Ernie4_5_MoeForCausalLM"),
    "SeedOssForCausalLM": ("pdserve.models.seed_oss", "SeedOssForCausalLM"),
    "StableLmForCausalLM": ("pdserve.models.stablelm", "StableLmForCausalLM"),
    "Starcoder2ForCausalLM": ("pdserve.models.starcoder2", "Starcoder2ForCausalLM"),
    "HunYuanDenseV1ForCausalLM": ("pdserve.models.hunyuan", "HunYuanDenseV1ForCausalLM"),
    "HunYuanMoEV1ForCausalLM": ("pdserve.models.hunyuan_moe", "HunYuanMoEV1ForCausalLM"),
    "Cohere2ForCausalLM": ("pdserve.models.cohere2", "Cohere2ForCausalLM"),
    "Exaone4ForCausalLM": ("pdserve.models.exaone4", "Exaone4ForCausalLM"),
    "Phi3ForCausalLM": ("pdserve.models.phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("pdserve.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("pdserve.models.gemma", "Gemma3ForCausalLM"),
    "Gemma4ForCausalLM": ("pdserve.models.gemma4", "Gemma4ForCausalLM"),
    "Qwen3MoeForCausalLM": ("pdserve.models.moe", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("pdserve.models.moe", "Qwen2MoeForCausalLM"),
    "MixtralForCausalLM": ("pdserve.models.moe", "MixtralForCausalLM"),
    "PhimoeForCausalLM": ("pdserve.models.phimoe", "PhimoeForCausalLM"),
    "Llama4ForCausalLM": ("pdserve.models.llama4", "Llama4ForCausalLM"),
    "OlmoeForCausalLM": ("pdserve.models.olmoe", "OlmoeForCausalLM"),
    "MiniMaxM2ForCausalLM": ("pdserve.models.minimax_m2", "MiniMaxM2ForCausalLM"),
    "MiniMaxM3VLForCausalLM": ("pdserve.models.minimax_m3", "MiniMaxM3VLForCausalLM"),
    "GptOssForCausalLM": ("pdserve.models.gpt_oss", "GptOssForCausalLM"),
    "DeepseekV2ForCausalLM": ("pdserve.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("pdserve.models.deepseek", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("pdserve.models.deepseek", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("pdserve.models.glm5", "GlmMoeDsaForCausalLM"),
    "DeepseekV4ForCausalLM": ("pdserve.models.deepseek_v4", "DeepseekV4ForCausalLM"),
    "Mistral4ForCausalLM": ("pdserve.models.deepseek", "Mistral4ForCausalLM"),
    "Glm4MoeForCausalLM": ("pdserve.models.glm", "Glm4MoeForCausalLM"),
    "BambaForCausalLM": ("pdserve.models.bamba", "BambaForCausalLM"),
    "JambaForCausalLM": ("pdserve.models.jamba", "JambaForCausalLM"),
    "FalconH1ForCausalLM": ("pdserve.models.falcon_h1", "FalconH1ForCausalLM"),
    "Mamba2ForCausalLM": ("pdserve.models.mamba", "Mamba2ForCausalLM"),
    "MambaForCausalLM": ("pdserve.models.mamba", "MambaForCausalLM"),
    "FalconMambaForCausalLM": ("pdserve.models.mamba", "FalconMambaForCausalLM"),
    "NemotronHForCausalLM": ("pdserve.models.nemotron_h", "NemotronHForCausalLM"),
    "Qwen3NextForCausalLM": ("pdserve.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Lfm2ForCausalLM": ("pdserve.models.lfm2", "Lfm2ForCausalLM"),
    "Lfm3ForCausalLM": ("pdserve.models.lfm3", "Lfm3ForCausalLM"),
    "Qwen3_5ForCausalLM": ("pdserve.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("pdserve.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5ForConditionalGeneration": (
        "pdserve.models.qwen3_5",
        "Qwen3_5VLForConditionalGeneration",
    ),
    "Qwen3_5MoeForConditionalGeneration": (
        "pdserve.models.qwen3_5",
        "Qwen3_5MoeVLForConditionalGeneration",
    ),
    "Qwen3VLForConditionalGeneration": (
        "pdserve.models.qwen3_vl",
        "Qwen3VLForConditionalGeneration",
    ),
    "Qwen2_5_VLForConditionalGeneration": (
        "pdserve.models.qwen2_5_vl",
        "Qwen2_5_VLForConditionalGeneration",
    ),
    "GraniteMoeHybridForCausalLM": (
        "pdserve.models.granite_hybrid",
        "GraniteMoeHybridForCausalLM",
    ),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(hf_config) -> type[nn.Module]:
    """The class for the config's ``architectures[0]``; ``ValueError`` listing the supported ones
    when it has none we know."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            module, cls = _MODELS[arch]
            return getattr(importlib.import_module(module), cls)
    raise ValueError(
        f"architectures: {archs or 'none given'} not supported; supported: "
        f"{', '.join(supported_architectures())}"
    )
