"""The offline engine against HF transformers (float32, greedy) on tiny random checkpoints."""

from __future__ import annotations

import random

import pytest
import torch

import pdserve
from tests.helpers.checkpoints import (
    LLAMA_MQA_TIED,
    QWEN2_SLIDING,
    build_tiny_checkpoint,
    hf_causal_lm,
)

torch.set_num_threads(1)

# the Llama family, then the families composed of the same blocks (models/decoder.py)
ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
ARCHS += ["smollm3", "granite", "olmo2", "olmo3", "glm4", "cohere2", "exaone4", "phi3"]
ARCHS += ["ernie4_5", "seed_oss", "hunyuan_dense"]
ARCHS += ["llama4"]  # chunked attention (chunks of 16), NoPE layers, MoE on every other layer
ARCHS += ["stablelm", "stablelm_parallel", "starcoder2"]
PROMPT_LENS = [1, 3, 17, 40, 95, 160, 333, 600]
NEW_TOKENS = 10
_hf_cache: dict = {}


def prompts_for(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in PROMPT_LENS]


def hf_model(path: str):
    if path not in _hf_cache:
        _hf_cache[path] = hf_causal_lm(path, torch.float32).eval()
    return _hf_cache[path]


def hf_greedy(path: str, ids: list[int], n: int) -> list[int]:
    key = (path, tuple(ids), n)
    if key not in _hf_cache:
        model = hf_model(path)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        _hf_cache[key] = out[0, len(ids) :].tolist()
    return _hf_cache[key]


def hf_output_logprobs(path: str, ids: list[int], out_ids: list[int]) -> list[float]:
    """HF's float32 logprobs of ``out_ids`` after ``ids``, from one forward over both."""
    key = ("lp", path, tuple(ids), tuple(out_ids))
    if key not in _hf_cache:
        with torch.no_grad():
            logits = hf_model(path)(torch.tensor([ids + out_ids])).logits[0, len(ids) - 1 : -1]
        lps = torch.log_softmax(logits.float(), dim=-1)
        _hf_cache[key] = [lps[k, t].item() for k, t in enumerate(out_ids)]
    return _hf_cache[key]


def hf_generate_logits(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """``model``'s greedy continuation of ``ids`` (``n`` tokens) and its logits at each, float32
    [n, vocab], as HF generates them (with its cache)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(ids) :].tolist(), torch.cat(out.logits).float()


def make_engine(path: str, **kw) -> "pdserve.Engine":
    kw.setdefault("torch_num_threads", 1)
    kw.setdefault("max_total_tokens", 16384)
    return pdserve.Engine(model_path=path, **kw)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_matches_hf_batched_chunked(arch, page_size, request):
    path = build_tiny_checkpoint(arch)
    eng = make_engine(path, page_size=page_size, chunked_prefill_size=256)
    request.node._engine = eng
    prompts = prompts_for()
    outs = eng.generate(
        input_ids=prompts,
        sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        return_logprob=True,
    )
    for ids, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy(path, ids, NEW_TOKENS), f"prompt of {len(ids)} tokens"
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        # the logprobs too (Phi-3's LongRoPE: a forward over the whole sequence is not what HF
        # generates with; test_engine_longrope.py compares with HF's generation)
        if arch != "phi3":
            got = [v for v, _, _ in out["meta_info"]["output_token_logprobs"]]
            ref = hf_output_logprobs(path, ids, out["output_ids"])
            assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-4, f"prompt of {len(ids)}"
    # prefix-cache hit: a follow-up of an earlier conversation reuses its pages and gives HF's
    # tokens (sliding-window layers kept only the conversation's last window, which suffices)
    earlier = prompts[6] + outs[6]["output_ids"]
    longer = earlier + prompts[3]
    out = eng.generate(
        input_ids=longer,
        sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
    )
    assert (
        out["meta_info"]["cached_tokens"]
        >= ((len(earlier) - 1) // page_size) * page_size - page_size
    )
    assert out["meta_info"]["cached_tokens"] > 0
    assert out["output_ids"] == hf_greedy(path, longer, NEW_TOKENS)
    info = eng.check_integrity()
    assert info["in_use_pages"] == 0 and info["running"] == 0


@pytest.mark.parametrize("variant", ["llama-mqa-tied-sharded", "qwen2-sliding"])
def test_variants_match_hf(variant, request):
    # MQA + tied embeddings + biases, loaded from a sharded checkpoint; Qwen2 sliding window
    if variant == "qwen2-sliding":
        path = build_tiny_checkpoint("qwen2", **QWEN2_SLIDING)
    else:
        path = build_tiny_checkpoint("llama", max_shard_size="4MB", **LLAMA_MQA_TIED)
    eng = make_engine(path, page_size=4, chunked_prefill_size=64)
    request.node._engine = eng
    prompts = prompts_for(1)[:6]
    outs = eng.generate(
        input_ids=prompts,
        sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
    )
    for ids, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy(path, ids, NEW_TOKENS)


@pytest.mark.parametrize("page_size", [1, 16])
def test_qwen2_window_layers_match_hf_past_the_window(page_size, request):
    """Qwen2 with max_window_layers: layer 0 full, layer 1 sliding (window 16) in its own cache
    group that keeps only the window; prompts several windows long, prefilled in chunks of 24
    (across the window boundary), then 24 tokens decoded past it; logprobs as HF's."""
    path = build_tiny_checkpoint("qwen2", **QWEN2_SLIDING)
    eng = make_engine(path, page_size=page_size, chunked_prefill_size=24)
    request.node._engine = eng
    assert [g.kind for g in eng.scheduler.runner.cache_groups] == [
        "full_attention",
        "sliding_window",
    ]
    for ids in prompts_for(3)[3:6]:  # 40, 95, 160 tokens
        out = eng.generate(
            input_ids=ids,
            sampling_params={"temperature": 0, "max_new_tokens": 24, "ignore_eos": True},
            return_logprob=True,
        )
        assert out["output_ids"] == hf_greedy(path, ids, 24)
        full = ids + out["output_ids"]
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(path)(torch.tensor([full])).logits[0].float(), dim=-1)
        for k, (v, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
            assert abs(v - ref[len(ids) - 1 + k, tok].item()) < 1e-4


def test_logprobs_match_hf(request):
    path = build_tiny_checkpoint("qwen2")
    eng = make_engine(path, page_size=16, chunked_prefill_size=32)
    request.node._engine = eng
    ids = prompts_for(2)[4]  # 95 tokens: three chunks
    out = eng.generate(
        input_ids=ids,
        sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
        return_logprob=True,
        top_logprobs_num=3,
        logprob_start_len=0,
    )
    full = ids + out["output_ids"]
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([full])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    meta = out["meta_info"]
    inp = meta["input_token_logprobs"]
    assert len(inp) == len(ids) and inp[0][0] is None and inp[0][1] == ids[0]
    for i in range(1, len(ids)):
        assert inp[i][1] == ids[i]
        assert abs(inp[i][0] - ref[i - 1, ids[i]].item()) < 1e-4
    outlp = meta["output_token_logprobs"]
    for k, (v, tok, _) in enumerate(outlp):
        pos = len(ids) - 1 + k
        assert tok == full[pos + 1]
        assert abs(v - ref[pos, tok].item()) < 1e-4
        top = meta["output_top_logprobs"][k]
        ref_top = torch.topk(ref[pos], 3)
        assert [t for _, t, _ in top] == ref_top.indices.tolist()
        assert max(abs(a[0] - b) for a, b in zip(top, ref_top.values.tolist())) < 1e-4
    # a later start: entries only from that token on, none is None
    out2 = eng.generate(
        input_ids=ids,
        sampling_params={"temperature": 0, "max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=50,
    )
    inp2 = out2["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in inp2] == ids[50:]
    assert abs(inp2[0][0] - ref[49, ids[50]].item()) < 1e-4


def test_seeded_sampling_is_reproducible(request):
    path = build_tiny_checkpoint("llama")
    eng = make_engine(path)
    request.node._engine = eng
    sp = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 16, "seed": 1234, "ignore_eos": True}
    ids = prompts_for(3)[3]
    a = eng.generate(input_ids=ids, sampling_params=sp)["output_ids"]
    # same seed inside a batch of other sampled requests
    others = [dict(sp, seed=None) for _ in range(3)]
    outs = eng.generate(input_ids=[ids] * 4, sampling_params=[sp] + others)
    assert outs[0]["output_ids"] == a
    c = eng.generate(input_ids=ids, sampling_params=dict(sp, seed=99))["output_ids"]
    assert c != a


def test_retraction_under_small_kv_budget(request):
    path = build_tiny_checkpoint("llama")
    prompts = [p for p in prompts_for(4) if 40 <= len(p) <= 160][:3] * 2
    # 6 requests x (~160 + 40) tokens cannot all hold KV at once in 512 tokens
    eng = make_engine(
        path, page_size=4, max_total_tokens=512, chunked_prefill_size=128, disable_radix_cache=True
    )
    request.node._engine = eng
    outs = eng.generate(
        input_ids=prompts,
        sampling_params={"temperature": 0, "max_new_tokens": 40, "ignore_eos": True},
    )
    assert eng.scheduler.stats["retractions"] > 0
    for ids, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy(path, ids, 40)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"input_ids": []}, "prompt"),
        ({"input_ids": [5] * 5000}, "prompt"),
        ({"input_ids": [5, 6], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [5, 6], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [5, 6], "sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [5, 6], "sampling_params": {"stop": 5}}, "stop"),
        ({"input_ids": [5, 6], "sampling_params": {"stop": ["a", 3]}}, "stop"),
        ({"input_ids": [5, 6], "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
        ({"input_ids": [5, 6], "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"input_ids": [5, 10**9]}, "input_ids"),
    ],
)
def test_bad_input_raises_and_leaks_nothing(kwargs, field, request):
    path = build_tiny_checkpoint("llama", max_position_embeddings=4096)
    eng = _shared_engine(path)
    request.node._engine = eng
    before = eng.check_integrity()
    with pytest.raises(ValueError, match=field):
        eng.generate(**kwargs)
    after = eng.check_integrity()
    assert (
        after["free_pages"] + after["cached_pages"] == before["free_pages"] + before["cached_pages"]
    )
    assert after["running"] == after["waiting"] == 0


_engines: dict = {}


def _shared_engine(path):
    if path not in _engines:
        _engines[path] = make_engine(path, context_length=4096)
    return _engines[path]


def test_stop_strings_and_stop_tokens(request):
    path = build_tiny_checkpoint("llama")
    eng = make_engine(path)
    request.node._engine = eng
    ids = prompts_for(5)[4]
    base = eng.generate(
        input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    )
    toks = base["output_ids"]
    # stop token id: generation ends at its first occurrence, which is included in output_ids
    out = eng.generate(
        input_ids=ids,
        sampling_params={"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [toks[4]]},
    )
    assert out["output_ids"] == toks[: toks.index(toks[4]) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": toks[4]}
    # stop string: taken from the decoded text of a later token; not part of the returned text
    piece = eng.tokenizer.decode(toks[6:8])
    if piece.strip():
        out = eng.generate(
            input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 12, "stop": [piece]}
        )
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        assert piece not in out["text"]
        assert base["text"].startswith(out["text"])
