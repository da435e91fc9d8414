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


def test_demo_model_in_both_dtypes_against_hf():
    """float32 (forced) equals HF float32 token for token; bf16 (what ``--dtype auto`` picks on a
    host where prepacked bf16 is faster) equals HF bf16 up to ties (see test_engine_bf16.py)."""
    from transformers import AutoModelForCausalLM

    from tests.e2e.test_engine_bf16 import NEW_TOKENS, compare, hf_bf16

    path = ensure_demo_model()
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(1000, 1100))]
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for dtype in ("float32", "bfloat16"):
        eng = pdserve.Engine(
            model_path=path, torch_num_threads=1, max_total_tokens=4096, dtype=dtype
        )
        assert eng.scheduler.runner.dtype == getattr(torch, dtype)
        for ids in prompts:
            out = eng.generate(
                input_ids=ids,
                return_logprob=True,
                sampling_params={
                    "temperature": 0,
                    "max_new_tokens": NEW_TOKENS,
                    "ignore_eos": True,
                },
            )
            if dtype == "float32":
                with torch.no_grad():
                    ref = hf32.generate(
                        torch.tensor([ids]),
                        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        max_new_tokens=NEW_TOKENS,
                        min_new_tokens=NEW_TOKENS,
                        do_sample=False,
                    )
                assert out["output_ids"] == ref[0, len(ids) :].tolist()
            else:
                assert compare(out, *hf_bf16(path, ids, NEW_TOKENS)) >= NEW_TOKENS // 2


def readme_answers(eng) -> tuple:
    """The README's example on ``eng``: its (text, logprobs) fresh, with the whole prompt cached and
    with its first 32 tokens cached."""
    ids = eng.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    sp = {"temperature": 0, "max_new_tokens": 16}

    def answer() -> tuple:
        out = eng.generate(input_ids=ids, sampling_params=sp, return_logprob=True)
        return out["text"], [lp for lp, *_ in out["meta_info"]["output_token_logprobs"]]

    fresh = answer()
    warm = answer()
    eng.flush_cache()
    eng.generate(input_ids=ids[:32] + [5], sampling_params={"max_new_tokens": 1})
    return fresh, warm, answer()


def test_readme_example_answers_one_way_fresh_and_warm():
    """The README's example under --enable-deterministic-inference, in bf16: the same tokens and
    logprobs on a fresh engine, with the whole prompt cached and with its first 32 tokens cached
    (the default's answer shifts between these: on an AMX host its first word flipped)."""
    path = ensure_demo_model()
    eng = pdserve.Engine(
        model_path=path,
        torch_num_threads=1,
        max_total_tokens=4096,
        dtype="bfloat16",
        enable_deterministic_inference=True,
    )
    try:
        fresh, warm, partial = readme_answers(eng)
    finally:
        eng.shutdown()
    assert "Paris" in fresh[0], fresh[0]
    assert warm == fresh and partial == fresh
