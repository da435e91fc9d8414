"""Gemma 2 and Gemma 3 (text) through the offline engine against HF transformers (float32,
greedy): two cache groups (sliding window 16, global), prompts up to six windows long prefilled
in chunks smaller than the prompt, decode well past the window, a multi-turn follow-up that hits
the prefix cache."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GenerationConfig

from tests.e2e.test_engine import hf_model, make_engine
from tests.helpers.checkpoints import build_tiny_checkpoint

torch.set_num_threads(1)

PROMPT_LENS = [5, 17, 40, 70, 100]
NEW_TOKENS = 24


def hf_greedy(path: str, ids: list[int], n: int) -> list[int]:
    """HF's greedy continuation, with nothing suppressed or stopped on (the engine runs with
    ``ignore_eos``)."""
    gen = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        t = torch.tensor([ids])
        out = hf_model(path).generate(t, attention_mask=torch.ones_like(t), generation_config=gen)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_matches_hf(arch, page_size):
    path = build_tiny_checkpoint(arch)
    eng = make_engine(path, page_size=page_size, chunked_prefill_size=32, max_total_tokens=4096)
    # auto: Gemma 2's soft-cap needs the torch backend; Gemma 3 gets the CPU kernels where they
    # build
    if arch == "gemma2":
        assert eng.scheduler.runner.attn_backend_name == "torch"
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in PROMPT_LENS]
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    for ids, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy(path, ids, NEW_TOKENS), f"prompt of {len(ids)} tokens"
    # the next turn of the longest conversation: its whole first turn is cached in both groups
    follow = prompts[-1] + outs[-1]["output_ids"] + prompts[1]
    out = eng.generate(input_ids=follow, sampling_params=params)
    assert (
        out["meta_info"]["cached_tokens"]
        >= ((len(follow) - len(prompts[1]) - 1) // page_size) * page_size
    )
    assert out["output_ids"] == hf_greedy(path, follow, NEW_TOKENS)
    info = eng.check_integrity()
    assert info["in_use_pages"] == 0 and info["running"] == 0
    assert [(g["kind"], g["in_use_pages"]) for g in info["groups"]] == [
        ("sliding_window", 0),
        ("full_attention", 0),
    ]


def test_cpu_attention_backend_refuses_gemma2():
    with pytest.raises(ValueError, match="soft-capping of Gemma2ForCausalLM"):
        make_engine(build_tiny_checkpoint("gemma2"), attention_backend="cpu", max_total_tokens=4096)
