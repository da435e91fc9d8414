"""The text model of a multimodal checkpoint, as its family publishes it (Qwen3.5's every size is
``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``): the configuration
nests the language model's, whose tensors sit under ``model.language_model.`` beside a vision
tower. pdserve serves the text model (``models/multimodal.py``): HF's multimodal model's greedy
tokens on text, logprobs within 1e-4 (float32), the tokens the text-only checkpoint of the same
weights gives; the vision tower's tensors are set aside (Qwen3.5's are read: it is served with its
images, ``tests/e2e/test_vision_language.py``), and a configuration without its text model is
refused by name."""

from __future__ import annotations

import types

import pytest
import torch

from pdserve.models.multimodal import TEXT_MODELS, VISION_LANGUAGE, text_model_config
from tests.e2e.test_engine import hf_generate_logits, make_engine, prompts_for
from tests.helpers.checkpoints import MULTIMODAL, build_multimodal_checkpoint, build_tiny_checkpoint

torch.set_num_threads(1)
NEW_TOKENS = 8


@pytest.mark.parametrize("arch", sorted(MULTIMODAL))
def test_multimodal_checkpoint_serves_its_text_model(arch):
    import transformers

    path = build_multimodal_checkpoint(arch)
    hf = getattr(transformers, MULTIMODAL[arch][1]).from_pretrained(path, dtype=torch.float32)
    eng = make_engine(path, dtype="float32", page_size=16, chunked_prefill_size=32)
    text = make_engine(build_tiny_checkpoint(arch), dtype="float32", page_size=16)
    try:
        model = eng.scheduler.runner.model
        outer = MULTIMODAL[arch][1]
        if outer in VISION_LANGUAGE:  # served with its images (tests/e2e/test_vision_language.py)
            assert model.visual is not None
        else:  # the text model alone, the tower's tensors set aside
            assert type(model).__name__ == TEXT_MODELS[outer]
            assert not any("visual" in n for n, _ in model.named_parameters())
        prompts = prompts_for(3)[2:5]  # 17 to 95 tokens: past the chunk of 32
        sp = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        outs = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
        plain = text.generate(input_ids=prompts, sampling_params=sp)
        for ids, out, other in zip(prompts, outs, plain):
            want, logits = hf_generate_logits(hf, ids, NEW_TOKENS)
            assert out["output_ids"] == want == other["output_ids"], len(ids)
            ref = torch.log_softmax(logits, dim=-1)
            for k, (v, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
                assert abs(v - ref[k, tok].item()) < 1e-4, (len(ids), k)
    finally:
        eng.shutdown()
        text.shutdown()


def test_a_multimodal_configuration_without_its_text_model_is_refused():
    config = types.SimpleNamespace(architectures=["Qwen3_5ForConditionalGeneration"])
    with pytest.raises(
        ValueError, match="Qwen3_5ForConditionalGeneration: the configuration has no text_config"
    ):
        text_model_config(config)
    plain = types.SimpleNamespace(architectures=["Qwen3_5ForCausalLM"])
    assert text_model_config(plain) is plain
