"""Tiny PEFT LoRA adapters over the tests' checkpoints, written by PEFT itself, and HF PEFT's
merged model as the reference."""

from __future__ import annotations

import json
import os
import tempfile

import torch

from pdserve.models.demo import is_complete, publish_dir

# name -> (seed, LoraConfig fields): attention only, every linear layer, MLP and output with
# rsLoRA's scaling
ADAPTERS = {
    "attn": (1, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}),
    "all": (
        2,
        {
            "r": 8,
            "lora_alpha": 16,
            "target_modules": [
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ],
        },
    ),
    "mlp": (
        3,
        {
            "r": 16,
            "lora_alpha": 8,
            "use_rslora": True,
            "target_modules": ["o_proj", "up_proj", "down_proj"],
        },
    ),
}


def build_adapter(base: str, name: str) -> str:
    """The adapter ``name`` of ADAPTERS for the checkpoint ``base``, saved by PEFT (kept in the
    test cache next to the checkpoint)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    seed, fields = ADAPTERS[name]
    out = f"{base.rstrip('/')}-lora-{name}"
    if is_complete(out):
        return out
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(
        model, LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, **fields)
    )
    with torch.no_grad():  # deltas the size of the base weights: they change tokens, not chaos
        for pname, p in peft.named_parameters():
            if "lora_B" in pname:
                p.mul_(0.1)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out) or ".")
    peft.save_pretrained(tmp)
    with open(os.path.join(tmp, "adapter_config.json")) as f:
        assert json.load(f)["r"] == fields["r"]
    publish_dir(tmp, out)
    return out


_merged: dict[str, torch.nn.Module] = {}


def merged_model(base: str, adapter: str | None) -> torch.nn.Module:
    """HF PEFT's model with ``adapter`` merged into ``base`` (float32), or the base model."""
    key = f"{base}|{adapter}"
    if key not in _merged:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        _merged[key] = model.eval()
    return _merged[key]


def unmerged_model(base: str, adapter: str | None, dtype: torch.dtype) -> torch.nn.Module:
    """HF PEFT's model in ``dtype`` with ``adapter`` beside the base weights (not merged)."""
    key = f"{base}|{adapter}|{dtype}"
    if key not in _merged:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter, torch_dtype=dtype)
            model = model.to(dtype)
        _merged[key] = model.eval()
    return _merged[key]


def reference(base: str, adapter: str | None, ids: list[int], n: int) -> tuple[list, list]:
    """Greedy tokens and their logprobs of the merged model."""
    from tests.e2e.test_engine import hf_generate_logits

    tokens, logits = hf_generate_logits(merged_model(base, adapter), ids, n)
    lps = torch.log_softmax(logits, -1)[torch.arange(n), tokens].tolist()
    return tokens, lps
