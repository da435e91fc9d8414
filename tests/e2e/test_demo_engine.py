"""The real demo model (SmolLM2-135M-Instruct, built from the PyPI package) through the engine."""

from __future__ import annotations

import torch

import pdserve
from pdserve.models.demo import ensure_demo_model

torch.set_num_threads(1)


def test_demo_model_answers_paris():
    path = ensure_demo_model()
    eng = pdserve.Engine(model_path=path, torch_num_threads=1, max_total_tokens=4096)
    ids = eng.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    if not isinstance(ids, list):  # a BatchEncoding in some transformers versions
        ids = ids["input_ids"]
    out = eng.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 32})
    assert "Paris" in out["text"], out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    info = eng.check_integrity()
    assert info["in_use_pages"] == 0
