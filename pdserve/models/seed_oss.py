"""Seed-OSS (``SeedOssForCausalLM``): Llama's block with q/k/v biases (``attention_bias``) apart
from the output projection's (``attention_out_bias``)."""

from __future__ import annotations

from pdserve.models.llama import LlamaForCausalLM


class SeedOssForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        qkv = bool(getattr(config, "attention_bias", True))
        return qkv, bool(getattr(config, "attention_out_bias", False))
