"""Speculative decoding with n-gram drafts (``--speculative-algorithm NGRAM``) against the same
engine without it, on the tiny Llama: greedy tokens identical (and their logprobs), in batches
where requests accept different numbers of drafts and penalized requests decode beside them, with
chunked prefill, prefix-cache hits and stop strings ending inside an accepted run; seeded sampled
requests give their plain tokens, and unseeded ones follow the target distribution (chi-square);
the pools consistent afterwards; bad settings refused naming the value.

Both engines run with ``--enable-deterministic-inference``: a verify forward computes several
positions of a row in one matmul where plain decoding computes one, and without batch-invariant
kernels the libraries sum in another order for the other shape, so a seeded draw near a boundary
of the distribution can take the neighbouring token (seen on an AVX2-only AMD EPYC at a sampled
row's 10th token). With them the bits are the same, which is what these tests compare."""

from __future__ import annotations

import random

import pytest
import torch

import pdserve
from pdserve.config import ServerArgs
from tests.helpers import localhttp
from tests.helpers.checkpoints import build_tiny_checkpoint

torch.set_num_threads(1)

NEW = 40


def engine(spec: bool, **kw) -> pdserve.Engine:
    kw.setdefault("page_size", 4)
    kw.setdefault("max_total_tokens", 16384)
    kw.setdefault("enable_deterministic_inference", True)  # see the module's docstring
    if spec:
        kw.update(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    return pdserve.Engine(
        model_path=build_tiny_checkpoint("llama"),
        torch_num_threads=1,
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
    # penalties and min_new_tokens count a row's earlier drafts as output: a seeded penalized
    # request and a greedy one with a repetition penalty and an EOS ban get their plain tokens
    sampled = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 20, "ignore_eos": True}
    sampled.update(seed=11, frequency_penalty=0.5, presence_penalty=0.3)
    banned = greedy(repetition_penalty=1.3, min_new_tokens=30) | {"ignore_eos": False}
    params = [greedy()] * len(ps) + [sampled, banned]
    ids = ps + [ps[0], ps[1]]
    ref = plain.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    before = dict(spec.scheduler.stats)
    out = spec.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    for k, (r, o) in enumerate(zip(ref, out)):
        assert o["output_ids"] == r["output_ids"], f"prompt {k}"
        a = [v for v, _, _ in o["meta_info"]["output_token_logprobs"]]
        b = [v for v, _, _ in r["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, f"prompt {k}"
    # the repeating prompts accept drafts, by different amounts; the sampled one never drafts
    lengths = [o["meta_info"].get("spec_accept_length") for o in out]
    assert lengths[0] > 1.5 and lengths[1] > 1.2 and lengths[0] != lengths[1], lengths
    assert out[-2]["meta_info"]["spec_verify_ct"] > 0 and out[-1]["meta_info"]["spec_verify_ct"] > 0
    accepted = spec.scheduler.stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    steps = spec.scheduler.stats["spec_verify_steps"] - before["spec_verify_steps"]
    assert accepted == sum(
        round(o["meta_info"]["spec_verify_ct"] * (o["meta_info"]["spec_accept_length"] - 1))
        for o in out
    )
    assert steps == sum(o["meta_info"]["spec_verify_ct"] for o in out)


def test_seeded_sampling_gives_the_plain_tokens(pair, request):
    """A seeded request's draw at an output position depends on its seed and that position
    only, and the rejection rule keeps a draft exactly when the draw equals it: the speculative
    run samples the plain run's tokens, seed by seed."""
    plain, spec = pair
    request.node._engine = spec
    ps = prompts(3)[:2]
    params = [
        {"temperature": 0.3, "top_p": 0.95, "top_k": 3, "max_new_tokens": 24, "seed": s}
        | {"ignore_eos": True}
        for s in range(12)
    ]
    ids = [ps[s % 2] for s in range(12)]
    ref = plain.generate(input_ids=ids, sampling_params=params)
    out = spec.generate(input_ids=ids, sampling_params=params)
    assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
    assert sum(o["meta_info"].get("spec_verify_ct", 0) for o in out) > 0
    assert any(o["meta_info"].get("spec_accept_length", 1) > 1 for o in out)


def test_unseeded_sampling_follows_the_target_distribution(request):
    """Chi-square on a model of 16 tokens: the token after a fixed first token, drawn at a
    speculative row (a draft was proposed there: the prompt holds every token), against the
    target's distribution at that position (temperature 1, from a plain engine's logprobs). The
    shared generator is seeded, so the run is the same every time."""
    path = build_tiny_checkpoint("llama", vocab_size=16)
    common = dict(model_path=path, torch_num_threads=1, max_total_tokens=65536, page_size=4)
    plain = pdserve.Engine(**common)
    spec = pdserve.Engine(**common, speculative_algorithm="NGRAM", random_seed=1234)
    request.node._engine = spec
    chi_square_at_speculative_rows(plain, spec)


def chi_square_at_speculative_rows(plain, spec, new: int = 3) -> None:
    """The second token of 1500 temperature-1 requests of ``new`` tokens (drawn in a speculative
    row: ``new`` - 2 drafts fit before the limit) against the target's distribution after the
    most common first token."""
    import math
    from collections import Counter

    ids = [3, 7, 1, 12, 5, 9, 14, 0, 2, 11, 4, 8, 13, 6, 10, 15] * 2
    sp = {"temperature": 1.0, "max_new_tokens": new, "ignore_eos": True}
    outs = spec.generate(input_ids=[ids] * 1500, sampling_params=sp)
    first = Counter(o["output_ids"][0] for o in outs).most_common(1)[0][0]
    given = [o for o in outs if o["output_ids"][0] == first]
    # the second token's step is a request's first decode step, which always drafts
    assert all(o["meta_info"].get("spec_verify_ct", 0) >= 1 for o in given), "no draft proposed"
    seconds = Counter(o["output_ids"][1] for o in given)
    ref = plain.generate(
        input_ids=ids + [first],
        sampling_params={"temperature": 0, "max_new_tokens": 1},
        return_logprob=True,
        top_logprobs_num=16,
    )
    probs = {tok: math.exp(lp) for lp, tok, _ in ref["meta_info"]["output_top_logprobs"][0]}
    n = len(given)
    expected = {t: n * p for t, p in probs.items()}
    # bins expecting fewer than 5 draws pooled into one
    small = [t for t, e in expected.items() if e < 5]
    observed = {t: seconds[t] for t in expected if t not in small}
    pooled = {t: e for t, e in expected.items() if t not in small}
    if small:
        observed["rest"] = sum(seconds[t] for t in small)
        pooled["rest"] = sum(expected[t] for t in small)
    chi2 = sum((observed[t] - e) ** 2 / e for t, e in pooled.items())
    df = len(pooled) - 1
    # the 0.001 critical values of the chi-square distribution, by degrees of freedom
    critical = {4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59}
    critical |= {11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}
    assert n > 150 and df in critical, (n, df)
    assert chi2 < critical[df], (chi2, df, n, observed, pooled)
    # the rule was exercised: some drafts kept, some rejected
    kept = sum(o["meta_info"]["spec_accept_length"] > 1 for o in given)
    assert 0 < kept < n


def test_deterministic_mode_gives_the_same_bits(request):
    """``--enable-deterministic-inference`` in bf16: a verify row of 1 + k tokens computes each
    position's logits bit for bit as a one-token step does, so the logprobs are equal, not
    close."""
    plain = engine(False, enable_deterministic_inference=True, dtype="bfloat16")
    spec = engine(True, enable_deterministic_inference=True, dtype="bfloat16")
    request.node._engine = spec
    ps = prompts(0)
    a = plain.generate(input_ids=ps, sampling_params=greedy(), return_logprob=True)
    b = spec.generate(input_ids=ps, sampling_params=greedy(), return_logprob=True)
    assert [o["meta_info"]["output_token_logprobs"] for o in b] == [
        o["meta_info"]["output_token_logprobs"] for o in a
    ]
    assert sum(o["meta_info"]["spec_verify_ct"] for o in b) < len(ps) * (NEW - 1)


def test_retractions_under_a_small_kv_budget(pair, request):
    """More speculating requests than the pool holds: some are retracted (their drafts dropped)
    and computed again, and every one still gives the plain tokens; the pool is whole after."""
    plain, _ = pair
    spec = engine(True, max_total_tokens=512, disable_radix_cache=True)
    request.node._engine = spec
    ps = (prompts(6)[:2] + prompts(7)[:2]) * 2
    outs = spec.generate(input_ids=ps, sampling_params=greedy())
    assert spec.scheduler.stats["retractions"] > 0
    assert spec.scheduler.stats["spec_accepted_tokens"] > 0
    ref = plain.generate(input_ids=ps, sampling_params=greedy())
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]


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


def test_served_speculation_reports_and_counts(pair, tmp_path):
    """``pdserve serve --speculative-algorithm NGRAM --tp-size 2``: the plain engine's tokens over
    HTTP (both ranks draft and accept alike), ``spec_verify_ct`` / ``spec_accept_length`` in
    ``meta_info``, the Prometheus histograms."""

    from tests.helpers import cluster as c

    plain, _ = pair
    args = ["--speculative-algorithm", "NGRAM", "--page-size", "4", "--max-total-tokens", "8192"]
    args += ["--tp-size", "2"]
    server = c.server("Sngram", build_tiny_checkpoint("llama"), tmp_path, *args)
    try:
        c.start_all([server])
        ids = prompts(5)[0]
        body = {"input_ids": ids, "sampling_params": greedy(32)}
        r = localhttp.post(server.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert (
            r.json()["output_ids"]
            == plain.generate(input_ids=ids, sampling_params=greedy(32))["output_ids"]
        )
        assert meta["spec_verify_ct"] > 0 and meta["spec_accept_length"] > 1
        # a seeded sampled request: its plain tokens, both ranks drawing alike
        sampled = {"temperature": 0.3, "top_k": 3, "max_new_tokens": 24, "seed": 5}
        sampled["ignore_eos"] = True
        r = localhttp.post(server.url + "/generate", json={**body, "sampling_params": sampled})
        want = plain.generate(input_ids=ids, sampling_params=sampled)["output_ids"]
        assert r.json()["output_ids"] == want
        text = localhttp.get(server.url + "/metrics", timeout=10).text
        count = [
            ln for ln in text.splitlines() if ln.startswith("pdserve:spec_accept_length_count")
        ]
        assert count and float(count[0].split()[-1]) >= 1.0, count
        from tests.e2e.test_tp import all_ranks_idle

        all_ranks_idle(server)
    finally:
        server.stop()


def test_cache_events_and_pools_after_rejections_and_aborts(request):
    """Rejected drafts never reach the prefix cache: every block the KV events report stored
    holds tokens some request really has (prompt and accepted output); requests aborted between
    speculative steps leave every page free or cached."""
    from pdserve.engine.request import Req, SamplingParams
    from pdserve.kv_events import BlockStored

    spec = engine(True)
    request.node._engine = spec
    sched = spec.scheduler
    sched.tree.events = []
    ps = prompts(8)
    outs = spec.generate(input_ids=ps, sampling_params=greedy())
    assert sched.stats["spec_draft_tokens"] > sched.stats["spec_accepted_tokens"] > 0
    seqs = [p + o["output_ids"] for p, o in zip(ps, outs)]
    paths: dict = {None: []}
    for e in sched.tree.events:
        if isinstance(e, BlockStored):
            path = paths[e.parent_block_hash] + list(e.token_ids)
            for i, h in enumerate(e.block_hashes):  # a later branch may start after any block
                paths[h] = path[: len(path) - len(e.token_ids) + (i + 1) * e.block_size]
            assert any(seq[: len(path)] == path for seq in seqs), "a block of rejected drafts"
    assert len(paths) > 1
    # aborted between steps: some rows verified, others mid-prefill
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


def test_drafting_follows_acceptance():
    """The n-gram index proposes the continuation of the longest earlier match; the draft count
    grows while drafts are kept, falls to the accepted count plus one after a rejection, and
    after steps that keep nothing no drafts come for 2, 4, ... 16 steps."""
    from pdserve.engine.request import Req, SamplingParams
    from pdserve.engine.speculative import Speculator
    from pdserve.engine.speculative.ngram import NgramIndex

    index = NgramIndex(1, 3)
    assert index.propose([5, 6, 7, 8, 5, 6], 4) == [7, 8, 5, 6]  # after the earlier "5 6"
    assert index.propose([5, 6, 7, 8, 5, 6, 9], 4) == []  # "9" was never seen before
    args = ServerArgs(model_path="unused", speculative_algorithm="NGRAM")
    spec = Speculator(args)
    req = Req(rid="r", input_ids=[1, 2, 3, 1, 2, 3, 1, 2], sampling=SamplingParams())
    assert spec.drafts(req, 10) == [3, 1, 2]  # what followed the earlier "3 1 2"
    spec.observe(req, 4, 4)
    assert req.spec.budget == 4  # at most --speculative-num-draft-tokens
    spec.observe(req, 4, 1)
    assert req.spec.budget == 2 and len(spec.drafts(req, 10)) == 2
    spec.observe(req, 2, 2)
    assert req.spec.budget == 3
    waits = []
    for _ in range(5):
        spec.observe(req, 1, 0)
        waits.append(req.spec.cooldown)
        req.spec.cooldown = 0
    assert waits == [2, 4, 8, 16, 16]
    spec.observe(req, 1, 0)
    assert spec.drafts(req, 10) == [] and req.spec.cooldown == 15  # a step of 16 waited


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_grammar_request_speculates_with_the_tokens_of_plain_decoding(backend):
    """A constrained request speculates: each verify position is masked by the grammar advanced
    over the drafts before it (and rolled back), so greedy and seeded sampled requests give the
    tokens of constrained decoding without drafts. Digits are single tokens here, so a digits
    regex forces every token: the n-gram drafts are accepted (a mask at the wrong position, or
    none, would draw a token the grammar refuses and end the request with an error)."""
    import re

    digits, words = r"(0123456789){6}", r"(one|two|three)( (one|two|three)){5,9}"
    plain, spec = (engine(s, grammar_backend=backend) for s in (False, True))
    for prompt, regex, accepted in (
        ("Digits: 0123456789 and 01234", digits, True),
        ("Count: one two three one two", words, False),
    ):
        ids = plain.tokenizer.encode(prompt)
        for params in (
            {"temperature": 0, "max_new_tokens": 80, "regex": regex},
            {"temperature": 0.9, "seed": 11, "max_new_tokens": 80, "regex": regex},
        ):
            want = plain.generate(input_ids=ids, sampling_params=params)
            got = spec.generate(input_ids=ids, sampling_params=params)
            assert got["output_ids"] == want["output_ids"], params
            assert re.fullmatch(regex, got["text"]), got["text"]
            meta = got["meta_info"]
            assert meta["spec_verify_ct"] > 0, meta
            if accepted:
                assert meta["spec_accept_length"] > 2, meta
    for eng in (plain, spec):
        eng.check_integrity()
