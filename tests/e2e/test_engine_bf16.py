"""The engine in bfloat16 (prepacked matmuls, CPU kernels, bf16 KV) against HF transformers in bf16.

Both produce the logits in bf16 (the LM head's output dtype), so a logit is only known to one bf16
spacing: 2^(e - 7) for a value in [2^e, 2^(e + 1)), e.g. 0.016 at 2-4 and 0.125 at 16-32. Two
correct implementations that round in a different order (our kernels accumulate in float32 and
round once where HF's eager code rounds after each op; the matmuls sum in another order) differ
by about one spacing: measured 0 or exactly one spacing on every compared position of these
checkpoints. So, with ``ulp`` the spacing at HF's top logit:

- tokens must equal HF's; where HF's top two logits are within ``TIE_ULPS`` spacings a different
  pick is a legitimate tie, and the comparison of that prompt ends there (its continuation
  diverges); with a second faithful computation (``compare``'s ``other``), also where the margin
  between HF's token and ours is at most twice what that computation moves it by;
- the logprob of every compared token must be within ``LOGPROB_ULPS`` spacings of HF's;
- at least half of all positions must be compared (tiny random models have many near-ties), so
  the test cannot pass vacuously.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

import pdserve
from tests.e2e.test_engine import hf_generate_logits, prompts_for
from tests.helpers.checkpoints import QWEN2_SLIDING, build_tiny_checkpoint, hf_causal_lm

torch.set_num_threads(1)

TIE_ULPS = 2
LOGPROB_ULPS = 3
NEW_TOKENS = 12
_hf: dict = {}


def bf16_spacing(x: float) -> float:
    """Distance between adjacent bf16 values around ``x`` (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2.0**-126))) - 7)


def hf_bf16(path: str, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens and its raw logits at each step as float32 ([n, vocab])."""
    key = (path, tuple(ids), n)
    if key not in _hf:
        model = _hf.get(path)
        if model is None:
            model = _hf[path] = hf_causal_lm(path, torch.bfloat16).eval()
        _hf[key] = hf_generate_logits(model, ids, n)
    return _hf[key]


def compare(
    ours: dict,
    ref_tokens: list[int],
    ref_logits: torch.Tensor,
    logprob_ulps: float = LOGPROB_ULPS,
    other: Optional[tuple[list[int], torch.Tensor]] = None,
) -> int:
    """Positions compared; asserts the tie-aware equality described above. ``other``: a second
    faithful computation of the same bf16 network (HF in another precision, same tokens); where it
    and the reference already differ by d in a logprob (or in the margin between the reference's
    token and ours), ours may differ from the reference by up to 2d (a position where the network
    amplifies rounding, whichever arithmetic computes it)."""
    toks = ours["output_ids"]
    lps = ours["meta_info"]["output_token_logprobs"]
    ref_lp = torch.log_softmax(ref_logits, dim=-1)
    other_lp = None if other is None else torch.log_softmax(other[1], dim=-1)
    compared = 0
    for i, (tok, ref_tok) in enumerate(zip(toks, ref_tokens)):
        top2 = torch.topk(ref_logits[i], 2).values
        ulp = bf16_spacing(top2[0].item())
        gap = (top2[0] - top2[1]).item()
        if tok != ref_tok:
            tie, moved = gap <= TIE_ULPS * ulp, 0.0
            if not tie and other is not None and other[0][:i] == ref_tokens[:i]:
                margin = (ref_logits[i, ref_tok] - ref_logits[i, tok]).item()
                moved = abs((other[1][i, ref_tok] - other[1][i, tok]).item() - margin)
                tie = margin <= 2 * moved
            assert tie, (
                f"position {i}: ours {tok}, HF {ref_tok}, top-2 gap {gap:.4f} > {TIE_ULPS} x {ulp}"
                f" and > 2 x {moved:.4f} (the margin's shift in the other computation)"
            )
            break  # a legitimate tie: the continuations differ from here
        allowed = logprob_ulps * ulp
        if other_lp is not None and other[0][: i + 1] == ref_tokens[: i + 1]:
            allowed = max(allowed, 2 * abs(other_lp[i, tok].item() - ref_lp[i, tok].item()))
        diff = abs(lps[i][0] - ref_lp[i, tok].item())
        assert diff <= allowed, (
            f"position {i}: logprob {lps[i][0]:.4f} vs HF {ref_lp[i, tok].item():.4f} "
            f"(allowed {allowed:.4f})"
        )
        compared += 1
    return compared


def make_engine(path: str, **kw) -> pdserve.Engine:
    return pdserve.Engine(
        model_path=path, dtype="bfloat16", torch_num_threads=1, max_total_tokens=16384, **kw
    )


@pytest.mark.parametrize(
    "arch",
    ["llama", "qwen2", "qwen3", "mistral", "qwen2-sliding"]
    + ["smollm3", "granite", "olmo2", "olmo3", "glm4", "cohere2", "exaone4", "phi3"]
    + ["ernie4_5", "seed_oss", "hunyuan_dense", "stablelm", "stablelm_parallel", "starcoder2"],
)
def test_bf16_matches_hf_bf16_up_to_ties(arch):
    path = (
        build_tiny_checkpoint("qwen2", **QWEN2_SLIDING)
        if arch == "qwen2-sliding"
        else build_tiny_checkpoint(arch)
    )
    eng = make_engine(path, page_size=16, chunked_prefill_size=128)
    runner = eng.scheduler.runner
    assert runner.dtype == torch.bfloat16 and runner.kv_dtype == torch.bfloat16
    prompts = prompts_for(4)
    outs = eng.generate(
        input_ids=prompts,
        sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        return_logprob=True,
    )
    compared = sum(compare(out, *hf_bf16(path, ids, NEW_TOKENS)) for ids, out in zip(prompts, outs))
    total = NEW_TOKENS * len(prompts)
    assert compared >= total // 2, f"only {compared} of {total} positions compared"
    assert eng.check_integrity()["in_use_pages"] == 0


@pytest.mark.parametrize("gemv_max_rows", [None, 2])
def test_decode_stack_equals_layer_by_layer_path(monkeypatch, gemv_max_rows):
    """The C++ decoder stack runs the same kernels as the Python layers: identical tokens and
    logprobs (2: batches of 5 take oneDNN's matmuls on both paths, instead of the GEMV)."""
    if gemv_max_rows is not None:
        from pdserve.layers import linear
        from pdserve.models import cpu_paths

        monkeypatch.setattr(linear, "GEMV_MAX_ROWS", gemv_max_rows)
        monkeypatch.setattr(cpu_paths, "GEMV_MAX_ROWS", gemv_max_rows)
    path = build_tiny_checkpoint("qwen3")  # per-head q/k norms, GQA
    eng = make_engine(path, disable_radix_cache=True)
    model = eng.scheduler.runner.model.model
    assert model.decode_stack is not None
    prompts = prompts_for(6)[:5]
    sp = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with_stack = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
    stack, model.decode_stack = model.decode_stack, None
    try:
        without = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
    finally:
        model.decode_stack = stack
    for a, b in zip(with_stack, without):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
