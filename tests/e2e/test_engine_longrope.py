"""Phi-3's LongRoPE (Phi-3 128k, Phi-4-mini) against HF transformers in float32: a prompt longer
than the original context runs on the long frequencies throughout, a short one on the short ones
until its decode passes that length; chunked prefill, page sizes 1 and 16, a batch mixing both;
and the prefix cache keeps the two kinds of KV apart (a mutation check shows why it must)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.e2e.test_engine import hf_generate_logits, make_engine
from tests.helpers import localhttp
from tests.helpers.checkpoints import build_tiny_checkpoint

torch.set_num_threads(1)

ORIGINAL = 48  # the tiny Phi-3's original context (tests/helpers/checkpoints.py)
SAMPLING = {"temperature": 0, "ignore_eos": True}
_hf: dict = {}


@pytest.fixture(scope="module")
def path() -> str:
    return build_tiny_checkpoint("phi3")


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def hf_generate(path: str, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and their logprobs (HF picks the frequencies per forward)."""
    key = (tuple(ids), n)
    if key not in _hf:
        from transformers import AutoModelForCausalLM

        if "model" not in _hf:
            _hf["model"] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tokens, logits = hf_generate_logits(_hf["model"], ids, n)
        lps = torch.log_softmax(logits, -1)[torch.arange(n), tokens].tolist()
        _hf[key] = (tokens, lps)
    return _hf[key]


def check(out: dict, ref: tuple[list[int], list[float]], what: str) -> None:
    tokens, lps = ref
    assert out["output_ids"] == tokens, what
    got = [v for v, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-4, what


@pytest.mark.parametrize("page_size", [1, 16])
def test_longrope_matches_hf_chunked_and_batched(path, page_size, request):
    eng = make_engine(path, page_size=page_size, chunked_prefill_size=16)
    request.node._engine = eng
    # (prompt, new tokens): short prompts decoding past the original length, the lengths around
    # it, long ones; all in one batch, prefilled 16 tokens at a time
    cases = [(prompt(10, 1), 50), (prompt(47, 2), 6), (prompt(48, 3), 6), (prompt(49, 4), 6)]
    cases += [(prompt(100, 5), 12), (prompt(30, 6), 30)]
    outs = eng.generate(
        input_ids=[ids for ids, _ in cases],
        sampling_params=[{**SAMPLING, "max_new_tokens": n} for _, n in cases],
        return_logprob=True,
    )
    for (ids, n), out in zip(cases, outs):
        check(out, hf_generate(path, ids, n), f"prompt of {len(ids)}, {n} new tokens")
    # the prompts of 10, 47, 48 and 30 tokens outgrew their short KV and were computed again
    assert eng.scheduler.stats["recomputed"] == 4
    # the rule per request, not per batch: the short prompt alone gives the same
    alone = eng.generate(input_ids=cases[0][0], sampling_params={**SAMPLING, "max_new_tokens": 50})
    assert alone["output_ids"] == outs[0]["output_ids"]


def test_prefix_cache_keeps_short_and_long_prompts_apart(path, request):
    eng = make_engine(path, page_size=4, chunked_prefill_size=16)
    request.node._engine = eng
    head = prompt(40, 8)

    def run(ids: list[int]) -> dict:
        return eng.generate(
            input_ids=ids, sampling_params={**SAMPLING, "max_new_tokens": 6}, return_logprob=True
        )

    run(head)  # short: its pages go to the default namespace
    long = head + prompt(20, 9)  # 60 tokens: computed with the long frequencies throughout
    out = run(long)
    assert out["meta_info"]["cached_tokens"] == 0, "a short prompt's KV reused by a long one"
    check(out, hf_generate(path, long, 6), "long after short")
    longer = long + prompt(8, 10)
    out = run(longer)  # long after long: a hit in the long prompts' namespace
    assert out["meta_info"]["cached_tokens"] >= 56
    check(out, hf_generate(path, longer, 6), "long after long")
    short = head[:36] + prompt(6, 11)  # 42 tokens: a hit on the first short prompt's pages
    out = run(short)
    assert out["meta_info"]["cached_tokens"] == 36
    check(out, hf_generate(path, short, 6), "short after long")
    info = eng.check_integrity()
    assert info["in_use_pages"] == 0 and info["running"] == 0

    # mutation: one namespace for all reuses the short prompt's KV for a long one, which HF
    # does not compute so
    eng.flush_cache()
    eng.scheduler.kv.namespace = lambda prompt_len: 0
    run(head)
    out = run(long)
    assert out["meta_info"]["cached_tokens"] == 40
    got = [v for v, _, _ in out["meta_info"]["output_token_logprobs"]]
    _, lps = hf_generate(path, long, 6)
    assert max(abs(a - b) for a, b in zip(got, lps)) > 1e-3


@pytest.fixture(scope="module")
def pd_cluster(path, tmp_path_factory):
    """Prefill on 1 rank, decode on 2, and a router."""
    from tests.helpers import cluster as c

    logs = tmp_path_factory.mktemp("longrope-pd")
    common = ["--max-total-tokens", "4096", "--page-size", "16", "--chunked-prefill-size", "32"]
    prefill = c.prefill("P1phi3", path, logs, *common)[0]
    decode = c.decode("D2phi3", path, logs, *common, "--tp-size", "2")
    router = None
    try:
        c.start_all([prefill, decode])
        router = c.router("Rphi3", [prefill], [decode], logs).start()
        yield router, prefill, decode
    finally:
        for p in (router, decode, prefill):
            if p is not None:
                p.stop()


def test_pd_matches_hf_and_recomputes_on_decode(path, pd_cluster):
    """Prefill picks the tables by the prompt, decode (2 ranks) recomputes a sequence that grows
    past the original context, as HF does; every pool free afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.e2e.test_tp import all_ranks_idle

    router, prefill, decode = pd_cluster
    # decoding past 48; a prompt of exactly 48 (decode's first step recomputes it); long ones
    cases = [(prompt(30, 21), 30), (prompt(48, 22), 6), (prompt(49, 23), 6), (prompt(120, 24), 8)]

    def run(case):
        ids, n = case
        body = {"input_ids": ids, "sampling_params": {**SAMPLING, "max_new_tokens": n}}
        r = localhttp.post(router.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(run, cases))
    for (ids, n), out in zip(cases, outs):
        assert out == hf_generate(path, ids, n)[0], f"prompt of {len(ids)}, {n} new tokens"
    # the prompts of 30 and 48 tokens outgrew their short KV on the decode server
    info = localhttp.get(decode.url + "/server_info", timeout=10).json()
    assert info["internal_states"][0]["recomputed"] == 2
    all_ranks_idle(decode)
    prefill.wait_idle()
