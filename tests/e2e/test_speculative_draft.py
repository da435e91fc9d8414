"""Speculative decoding with a draft model (``--speculative-algorithm STANDALONE``) against the
same engine without it, on the tiny Llama with drafts made from it (its weights with noise, so
that it agrees on some tokens only; the exact copy, so that whole runs are accepted): greedy
tokens and logprobs identical, alone and in batches of different acceptance with chunked
prefill and a penalized request beside them; prefix-cache hits whose pages carry the draft's KV
(a warm run accepts what a cold one does); stops inside accepted runs; seeded sampling; the
target distribution (chi-square); retractions; TP 2 over HTTP; bad drafts refused naming them.
PD is in tests/unit/test_pd_queues.py (local) and tests/e2e/test_pd_speculative.py (Mooncake)."""

from __future__ import annotations

import pytest
import torch

import pdserve
from pdserve.config import ServerArgs
from tests.e2e.test_speculative import chi_square_at_speculative_rows, greedy, prompts
from tests.helpers import localhttp
from tests.helpers.checkpoints import build_draft_checkpoint, build_tiny_checkpoint

torch.set_num_threads(1)

NEW = 40


def target() -> str:
    return build_tiny_checkpoint("llama")


def engine(draft=None, **kw) -> pdserve.Engine:
    kw.setdefault("page_size", 4)
    kw.setdefault("max_total_tokens", 16384)
    if draft is not None:
        kw.update(speculative_algorithm="STANDALONE", speculative_draft_model_path=draft)
    return pdserve.Engine(
        model_path=kw.pop("model_path", target()),
        torch_num_threads=1,
        chunked_prefill_size=32,
        **kw,
    )


@pytest.fixture(scope="module")
def drafts():
    return {
        "noisy": build_draft_checkpoint(target(), noise=0.03),
        "exact": build_draft_checkpoint(target()),
    }


@pytest.fixture(scope="module")
def plain():
    return engine()


def test_greedy_tokens_and_logprobs_equal_plain_decoding(drafts, request):
    # Same bits across batchings only under deterministic inference: a verify step's rows are
    # another matmul shape than a plain step's, and MKL's float32 kernels on Intel AVX-512 CPUs
    # round them differently (a greedy token flipped at a near tie there without it).
    plain = engine(enable_deterministic_inference=True)
    spec = engine(drafts["noisy"], enable_deterministic_inference=True)
    request.node._engine = spec
    ps = prompts(0) + prompts(4)[2:]  # 27..87 tokens: several chunks of 32
    sampled = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 20, "ignore_eos": True}
    sampled.update(seed=11, frequency_penalty=0.5)  # penalties count the drafts before a row
    params = [greedy(NEW)] * len(ps) + [sampled]
    ids = ps + [ps[2]]
    ref = plain.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    before = dict(spec.scheduler.stats)
    out = spec.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    for k, (r, o) in enumerate(zip(ref, out)):
        assert o["output_ids"] == r["output_ids"], f"prompt {k}"
        a = [v for v, _, _ in o["meta_info"]["output_token_logprobs"]]
        b = [v for v, _, _ in r["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, f"prompt {k}"
    lengths = [o["meta_info"]["spec_accept_length"] for o in out[:-1]]
    assert max(lengths) > 1.5 and len(set(lengths)) > 1, lengths
    stats = spec.scheduler.stats
    assert stats["spec_accepted_tokens"] - before["spec_accepted_tokens"] == sum(
        round(o["meta_info"]["spec_verify_ct"] * (o["meta_info"]["spec_accept_length"] - 1))
        for o in out
    )
    # alone (a batch of one row per step) as in the batch
    alone = spec.generate(input_ids=ps[3], sampling_params=greedy(NEW))
    assert alone["output_ids"] == ref[3]["output_ids"]
    info = spec.check_integrity()
    assert info["in_use_pages"] == 0 and info["running"] == 0


def poisoned(spec: pdserve.Engine) -> pdserve.Engine:
    """``spec`` with its draft's KV pool filled with 1e4: a draft that attends to a position it
    never wrote proposes garbage, and its acceptance moves."""
    for pool in spec.scheduler.runner.draft.pools:
        pool.buffer.fill_(1e4)
    return spec


def test_prefix_hits_carry_the_drafts_kv(drafts, request):
    """A prompt computed again from the prefix cache: the hit's pages hold the draft's KV too, so
    the warm run proposes and accepts exactly what the cold run did (page sizes 1 and 16; the
    cache stops where the draft's KV does: positions of a step that kept all its drafts, whose
    last token the draft has not computed yet, are not cached; the draft's pool starts poisoned,
    so reading a position it never wrote would show)."""
    for page_size in (1, 16):
        spec = poisoned(engine(drafts["noisy"], page_size=page_size))
        request.node._engine = spec
        for ids in prompts(1)[:3]:
            cold = spec.generate(input_ids=ids, sampling_params=greedy(NEW))
            warm = spec.generate(input_ids=ids, sampling_params=greedy(NEW))
            assert warm["meta_info"]["cached_tokens"] >= len(ids) - page_size
            assert warm["output_ids"] == cold["output_ids"]
            assert [warm["meta_info"][k] for k in ("spec_verify_ct", "spec_accept_length")] == [
                cold["meta_info"][k] for k in ("spec_verify_ct", "spec_accept_length")
            ]
            # a follow-up turn: the first turn's output is cached with the draft's KV up to it
            follow = ids + cold["output_ids"] + ids[:5]
            a = spec.generate(input_ids=follow, sampling_params=greedy(16))
            assert a["meta_info"]["cached_tokens"] >= len(ids)
            b = poisoned(
                engine(drafts["noisy"], page_size=page_size, disable_radix_cache=True)
            ).generate(input_ids=follow, sampling_params=greedy(16))
            assert a["output_ids"] == b["output_ids"]
            assert a["meta_info"]["spec_accept_length"] == b["meta_info"]["spec_accept_length"]
        info = spec.check_integrity()
        assert info["in_use_pages"] == 0 and info["running"] == 0


def test_stops_inside_an_accepted_run(plain, drafts, request):
    """With the exact draft every draft is kept: stop tokens and strings at each output position
    end the request at the plain run's token, inside runs of accepted drafts."""
    spec = engine(drafts["exact"])
    request.node._engine = spec
    ids = prompts(2)[2]
    tokens = plain.generate(input_ids=ids, sampling_params=greedy(30))["output_ids"]
    inside = 0
    for i in range(3, 28, 3):
        stop = greedy(30, stop_token_ids=[tokens[i]])
        stop["ignore_eos"] = False
        a = plain.generate(input_ids=ids, sampling_params=stop)
        b = spec.generate(input_ids=ids, sampling_params=stop)
        assert (a["output_ids"], a["text"]) == (b["output_ids"], b["text"]), i
        word = plain.tokenizer.decode(tokens[: i + 1])[-4:]
        if word.strip():
            a = plain.generate(input_ids=ids, sampling_params=greedy(30, stop=[word]))
            b = spec.generate(input_ids=ids, sampling_params=greedy(30, stop=[word]))
            assert (a["output_ids"], a["text"]) == (b["output_ids"], b["text"]), (i, word)
        inside += b["meta_info"].get("spec_accept_length", 1) > 1
    assert inside > 0
    info = spec.check_integrity()
    assert info["in_use_pages"] == 0 and info["running"] == 0


def test_seeded_sampling_gives_the_plain_tokens(plain, drafts, request):
    spec = engine(drafts["noisy"])
    request.node._engine = spec
    ps = prompts(3)[:2]
    params = [
        {"temperature": 0.3, "top_k": 3, "max_new_tokens": 24, "seed": s, "ignore_eos": True}
        for s in range(8)
    ]
    ids = [ps[s % 2] for s in range(8)]
    ref = plain.generate(input_ids=ids, sampling_params=params)
    out = spec.generate(input_ids=ids, sampling_params=params)
    assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
    assert any(o["meta_info"].get("spec_accept_length", 1) > 1 for o in out)


def test_unseeded_sampling_follows_the_target_distribution(request):
    """The draft proposes its argmax (a deterministic proposal), so the rule that keeps a draft
    while the target's draw equals it keeps the target's distribution: chi-square on a
    16-token model with a noisy copy of it as the draft."""
    path = build_tiny_checkpoint("llama", vocab_size=16)
    common = dict(model_path=path, max_total_tokens=65536, page_size=4)
    plain = engine(**common)
    spec = engine(build_draft_checkpoint(path, noise=0.3), random_seed=1234, **common)
    request.node._engine = spec
    chi_square_at_speculative_rows(plain, spec)


def test_retractions_under_a_small_kv_budget(plain, drafts, request):
    """More speculating requests than the pool holds: retracted ones are computed again (the
    draft too, from the start) and still give the plain tokens."""
    spec = engine(drafts["noisy"], max_total_tokens=512, disable_radix_cache=True)
    request.node._engine = spec
    ps = (prompts(6)[:2] + prompts(7)[:2]) * 2
    outs = spec.generate(input_ids=ps, sampling_params=greedy(NEW))
    assert spec.scheduler.stats["retractions"] > 0
    assert spec.scheduler.stats["spec_accepted_tokens"] > 0
    ref = plain.generate(input_ids=ps, sampling_params=greedy(NEW))
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]
    info = spec.check_integrity()
    assert info["in_use_pages"] == 0 and info["running"] == 0


def test_aborts_leave_the_pools_whole(drafts, request):
    from pdserve.engine.request import Req, SamplingParams

    spec = engine(drafts["noisy"])
    request.node._engine = spec
    sched = spec.scheduler
    reqs = [
        Req(rid=f"a{i}", input_ids=ids, sampling=SamplingParams.from_dict(greedy(200)))
        for i, ids in enumerate(prompts(9) * 2)
    ]
    for r in reqs:
        sched.add_request(r)
    for _ in range(6):
        sched.step()
    assert sched.stats["spec_verify_steps"] > 0
    sched.abort("")
    sched.drain()
    info = spec.check_integrity()
    assert info["in_use_pages"] == 0 and info["running"] == 0 and info["waiting"] == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(speculative_algorithm="STANDALONE"),
            "speculative_draft_model_path: is required with speculative_algorithm 'STANDALONE'",
        ),
        (
            dict(speculative_algorithm="NGRAM", speculative_draft_model_path="/d"),
            r"used by speculative_algorithm \('STANDALONE', 'EAGLE', 'EAGLE3', 'MTP'\), "
            r"not 'NGRAM'",
        ),
        (
            dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="/d")
            | dict(speculative_eagle_topk=4),
            r"speculative_eagle_topk: 4 builds a tree of a draft head's proposals .* 'STANDALONE'",
        ),
        (
            dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="/d")
            | dict(speculative_num_steps=0),
            r"speculative_num_steps: must be in \[1, 16\], got 0",
        ),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path="unused", **kwargs)


def test_num_steps_sets_the_drafts_per_row():
    args = ServerArgs(
        model_path="unused",
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path="/d",
        speculative_num_steps=3,
    )
    assert args.speculative_num_draft_tokens == 3


def test_a_draft_of_another_vocabulary_or_with_a_state_is_refused():
    other = build_tiny_checkpoint("llama", vocab_size=16)
    with pytest.raises(ValueError, match=r"has a vocabulary of 16 tokens and the target .* one of"):
        engine(other)
    with pytest.raises(ValueError, match=r"keeps a per-request state \(recurrent"):
        engine(build_tiny_checkpoint("bamba"))


def test_served_with_tp2(plain, drafts, tmp_path):
    """``pdserve serve --speculative-algorithm STANDALONE --tp-size 2``: both ranks run their
    shard of the draft and accept alike; the plain engine's tokens over HTTP."""

    from tests.helpers import cluster as c

    args = ["--speculative-algorithm", "STANDALONE"]
    args += ["--speculative-draft-model-path", drafts["noisy"], "--speculative-num-steps", "3"]
    args += ["--page-size", "4", "--max-total-tokens", "8192", "--tp-size", "2"]
    server = c.server("Sdraft", target(), tmp_path, *args)
    try:
        c.start_all([server])
        for ids in prompts(5)[:2]:
            body = {"input_ids": ids, "sampling_params": greedy(32)}
            r = localhttp.post(server.url + "/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            want = plain.generate(input_ids=ids, sampling_params=greedy(32))["output_ids"]
            assert r.json()["output_ids"] == want
            meta = r.json()["meta_info"]
            assert meta["spec_verify_ct"] > 0 and meta["spec_accept_length"] <= 4
        from tests.e2e.test_tp import all_ranks_idle

        all_ranks_idle(server)
    finally:
        server.stop()


def test_the_drafts_kv_is_within_the_memory_budget(monkeypatch):
    """Without --max-total-tokens the pools are sized from memory: the draft's KV comes out of
    the same budget (fewer pages, the same bytes), not on top of it."""
    from pdserve.engine import kv_budget

    monkeypatch.setattr(kv_budget, "available_host_bytes", lambda: 4 << 30)
    draft = build_draft_checkpoint(target(), layers=1)
    runners = [
        pdserve.Engine(model_path=target(), torch_num_threads=1, **kw).scheduler.runner
        for kw in ({}, dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=draft))
    ]
    plain, spec = (sum(p.nbytes for p in r.pools) for r in runners)
    spec += sum(p.nbytes for p in runners[1].draft.pools)
    page = plain // runners[0].pools[0].num_pages
    assert abs(spec - plain) <= 2 * page, (plain, spec)
    # the tiny Llama has 2 layers, the draft 1: two thirds of the pages
    assert abs(runners[1].pools[0].num_pages / runners[0].pools[0].num_pages - 2 / 3) < 0.01
