"""Speculative decoding with n-gram drafts (``--speculative-algorithm NGRAM``) against the same
engine without it, on the tiny Llama: greedy tokens identical (and their logprobs), in batches
where requests accept different numbers of drafts and sampled requests decode beside them, with
chunked prefill, prefix-cache hits and stop strings ending inside an accepted run; the pools
consistent afterwards; bad settings refused naming the value."""

from __future__ import annotations

import random

import pytest
import torch

import pdserve
from pdserve.config import ServerArgs
from tests.helpers.checkpoints import build_tiny_checkpoint

torch.set_num_threads(1)

NEW = 40


def engine(spec: bool, **kw) -> pdserve.Engine:
    kw.setdefault("page_size", 4)
    if spec:
        kw.update(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    return pdserve.Engine(
        model_path=build_tiny_checkpoint("llama"),
        torch_num_threads=1,
        max_total_tokens=16384,
        chunked_prefill_size=32,
        **kw,
    )


@pytest.fixture(scope="module")
def pair():
    return engine(False), engine(True)


def prompts(seed: int) -> list[list[int]]:
    """Texts that repeat themselves (the drafts' source), and random ones."""
    rng = random.Random(seed)
    part = [rng.randrange(100, 40000) for _ in range(23)]
    return [
        part * 3,
        part[:9] * 6 + [7, 8, 9],
        [rng.randrange(100, 40000) for _ in range(45)],
        part[5:] + [rng.randrange(100, 40000) for _ in range(70)] + part[:12],
    ]


def greedy(n: int = NEW, **kw) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **kw}


def test_greedy_tokens_and_logprobs_equal_plain_decoding(pair, request):
    plain, spec = pair
    request.node._engine = spec
    ps = prompts(0)
    # a seeded sampled request decodes one token a step beside the speculating ones
    sampled = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 20, "ignore_eos": True}
    sampled["seed"] = 11
    params = [greedy()] * len(ps) + [sampled]
    ref = plain.generate(input_ids=ps + [ps[2]], sampling_params=params, return_logprob=True)
    before = dict(spec.scheduler.stats)
    out = spec.generate(input_ids=ps + [ps[2]], sampling_params=params, return_logprob=True)
    for k, (r, o) in enumerate(zip(ref, out)):
        assert o["output_ids"] == r["output_ids"], f"prompt {k}"
        a = [v for v, _, _ in o["meta_info"]["output_token_logprobs"]]
        b = [v for v, _, _ in r["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, f"prompt {k}"
    # the repeating prompts accept drafts, by different amounts; the sampled one never drafts
    lengths = [o["meta_info"].get("spec_accept_length") for o in out]
    assert lengths[0] > 1.5 and lengths[1] > 1.2 and lengths[0] != lengths[1], lengths
    assert "spec_verify_ct" not in out[-1]["meta_info"]
    accepted = spec.scheduler.stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    steps = spec.scheduler.stats["spec_verify_steps"] - before["spec_verify_steps"]
    assert accepted == sum(
        o["meta_info"]["spec_verify_ct"] * (o["meta_info"]["spec_accept_length"] - 1)
        for o in out[:4]
    )
    assert steps == sum(o["meta_info"]["spec_verify_ct"] for o in out[:4])


def test_prefix_cache_hits_and_page_sizes(request):
    """A follow-up that shares a conversation's prefix hits the cache and still decodes the plain
    tokens, at page sizes 1 and 16."""
    for page_size in (1, 16):
        plain, spec = engine(False, page_size=page_size), engine(True, page_size=page_size)
        request.node._engine = spec
        first = prompts(1)[0]
        done = spec.generate(input_ids=first, sampling_params=greedy())
        follow = first + done["output_ids"] + prompts(1)[2][:20]
        out = spec.generate(input_ids=follow, sampling_params=greedy())
        assert out["meta_info"]["cached_tokens"] >= len(first) - page_size
        assert (
            out["output_ids"]
            == plain.generate(input_ids=follow, sampling_params=greedy())["output_ids"]
        )
        assert out["meta_info"]["spec_accept_length"] > 1.0
        info = spec.check_integrity()
        assert info["in_use_pages"] == 0 and info["running"] == 0


def test_stops_inside_an_accepted_run(pair, request):
    """Stop strings and stop tokens placed at every token of a plain run's output: the
    speculative run stops at the same token with the same text, also where the stop falls inside
    a run of accepted drafts (the step yields several tokens, the stop is checked after each)."""
    plain, spec = pair
    request.node._engine = spec
    ids = prompts(2)[0]
    full = plain.generate(input_ids=ids, sampling_params=greedy(30))
    tokens = full["output_ids"]
    inside = 0
    for i in range(3, 28, 2):
        stop_tok = greedy(30, stop_token_ids=[tokens[i]])
        stop_tok["ignore_eos"] = False
        a = plain.generate(input_ids=ids, sampling_params=stop_tok)
        b = spec.generate(input_ids=ids, sampling_params=stop_tok)
        assert (a["output_ids"], a["text"]) == (b["output_ids"], b["text"]), i
        assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"]
        text = plain.tokenizer.decode(tokens[: i + 1])
        word = text[-4:]
        if word.strip():
            a = plain.generate(input_ids=ids, sampling_params=greedy(30, stop=[word]))
            b = spec.generate(input_ids=ids, sampling_params=greedy(30, stop=[word]))
            assert (a["output_ids"], a["text"]) == (b["output_ids"], b["text"]), (i, word)
        # the step that reached the stop yielded more than one token
        inside += b["meta_info"].get("spec_accept_length", 1) > 1
    assert inside > 0
    info = spec.check_integrity()
    assert info["in_use_pages"] == 0 and info["running"] == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(speculative_algorithm="MEDUSA"), "speculative_algorithm: must be one of"),
        (dict(speculative_algorithm="EAGLE"), "'EAGLE' is not available yet"),
        (
            dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=0),
            r"speculative_num_draft_tokens: must be in \[1, 16\], got 0",
        ),
        (
            dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=17),
            "got 17",
        ),
        (
            dict(
                speculative_algorithm="NGRAM",
                speculative_ngram_min_match_window_size=5,
                speculative_ngram_max_match_window_size=3,
            ),
            r"speculative_ngram_min_match_window_size: must be in \[1, .*\(3\)\], got 5",
        ),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path="unused", **kwargs)


def test_a_recurrent_state_model_is_refused():
    with pytest.raises(ValueError, match="cache group 1 keeps a recurrent state"):
        pdserve.Engine(
            model_path=build_tiny_checkpoint("bamba"),
            torch_num_threads=1,
            max_total_tokens=4096,
            speculative_algorithm="NGRAM",
        )
