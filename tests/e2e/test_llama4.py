"""Llama 4 (text) against HF transformers and through PD.

The tiny checkpoint (``tests/helpers/checkpoints.py``): layers R, R, R, N: RoPE, weightless q/k
norms and attention chunks of 16 positions on the first three, no RoPE and temperature-tuned
queries on the last; layers 1 and 3 sparse (4 experts, top 1, the sigmoid weight taken on the
expert's input, a shared expert), 0 and 2 dense. Float32 greedy tokens equal HF's with logprobs
within 1e-4 for prompts of 1 to 160 tokens prefilled in chunks of 5 and 23 (the attention chunks
cut at odd places) at page sizes 1 and 16; a second turn hits the prefix cache. Through PD (P tp1 ->
D tp2, and -> D with DP attention and experts split over 2 ranks by the torch all-to-all) the
tokens of a colocated server, and the bytes a request moves are the specs' prediction: every page
of the full layer, the chunked layers' pages from the one holding the start of the last chunk.
(``test_engine.py`` runs it at prompts up to 600 tokens with the prefix cache; ``test_engine_moe``
in bf16 by the tie rule.)
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.e2e.test_engine import make_engine, prompts_for
from tests.e2e.test_engine_moe import hf_reference
from tests.e2e.test_pd_groups import idle
from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.checkpoints import build_tiny_checkpoint

torch.set_num_threads(1)

NEW_TOKENS = 8
CHUNK = 16  # the tiny checkpoint's attention_chunk_size
GROUPS = [("chunked_attention", (0, 1, 2)), ("full_attention", (3,))]


def assert_matches_hf(path, prompts, outs, what: str) -> None:
    for ids, out in zip(prompts, outs):
        ref_tokens, ref_lp = hf_reference(path, ids, NEW_TOKENS)
        assert out["output_ids"] == ref_tokens, f"{what}: prompt of {len(ids)} tokens"
        for k, (v, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
            assert abs(v - ref_lp[len(ids) - 1 + k, tok].item()) < 1e-4, (what, len(ids), k)


@pytest.mark.parametrize("page_size, chunk", [(16, 23), (1, 5)])
def test_matches_hf_float32_and_continues_a_second_turn(page_size, chunk, request):
    path = build_tiny_checkpoint("llama4")
    eng = make_engine(path, page_size=page_size, chunked_prefill_size=chunk, dtype="float32")
    request.node._engine = eng
    runner = eng.scheduler.runner
    assert [(g.kind, g.layers) for g in runner.cache_groups] == GROUPS
    what = f"page {page_size}, chunk {chunk}"
    prompts = prompts_for(5)[:6]  # 1 to 160 tokens
    sp = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    outs = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
    assert_matches_hf(path, prompts, outs, what)
    second = prompts[4] + outs[4]["output_ids"] + [1234, 5678, 9101]
    again = eng.generate(input_ids=second, sampling_params=sp, return_logprob=True)
    assert again["meta_info"]["cached_tokens"] > 0
    assert_matches_hf(path, [second], [again], f"{what}, second turn")
    info = eng.check_integrity()
    assert info["in_use_pages"] == 0 and info["running"] == 0
    assert [g["free_pages"] + g["cached_pages"] for g in info["groups"]] == [
        g["total_pages"] for g in info["groups"]
    ]


# ---- PD -------------------------------------------------------------------------------------
PAGE = 4
PD_NEW = 20  # decode crosses a chunk boundary
COMMON = [
    "--dtype",
    "float32",
    "--max-total-tokens",
    "4096",
    "--page-size",
    str(PAGE),
    "--chunked-prefill-size",
    "22",
    "--disaggregation-bootstrap-timeout",
    "20",
    "--disaggregation-waiting-timeout",
    "20",
]
LENS = (1, 15, 16, 17, 40, 90)
DP_EP = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2"]


@pytest.fixture(scope="module")
def llama4_pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-llama4")
    path = build_tiny_checkpoint("llama4")
    yield from c.running(
        {
            "S": c.server("S", path, logs, *COMMON),
            "P": c.prefill("P", path, logs, *COMMON)[0],
            "Dtp2": c.decode("Dtp2", path, logs, *COMMON, "--tp-size", "2"),
            "Ddp": c.decode("Ddp", path, logs, *COMMON, *DP_EP, "--moe-a2a-backend", "torch"),
        }
    )


def predicted(info: dict, n: int) -> tuple[list[int], int]:
    """(pages per group, bytes) a prompt of ``n`` tokens moves from a one-rank prefill (float32):
    a chunked group's pages from the one holding the first key the next query (at ``n``) sees,
    every page of a full-attention group."""
    total = -(-n // PAGE)
    pages, nbytes = [], 0
    for g in info["cache_groups"]:
        first = n // g["chunk"] * g["chunk"] // PAGE if g["kind"] == "chunked_attention" else 0
        pages.append(total - first)
        per_page = 2 * g["num_kv_heads"] * PAGE * g["head_dim"] * 4
        nbytes += pages[-1] * len(g["layers"]) * per_page
    return pages, nbytes


@pytest.mark.parametrize("d", ["Dtp2", "Ddp"])
def test_pd_matches_colocated_and_moves_the_predicted_bytes(llama4_pd, d):
    P, D, S = llama4_pd["P"], llama4_pd[d], llama4_pd["S"]
    info = P.http.get("/server_info").json()["scheduler_info"]
    assert [(g["kind"], tuple(g["layers"])) for g in info["cache_groups"]] == GROUPS
    assert info["cache_groups"][0]["chunk"] == CHUNK
    rng = random.Random(len(d))
    for n in LENS:
        ids = [rng.randrange(100, 40000) for _ in range(n)]
        rp, rd = c.post_pd(P, D, c.greedy_body(ids, PD_NEW, P, rng.randrange(2**63)))
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        want = localhttp.post(S.url + "/generate", json=c.greedy_body(ids, PD_NEW), timeout=120)
        assert rd.json()["output_ids"] == want.json()["output_ids"], f"{d}: prompt of {n} tokens"
        last = P.http.get("/server_info").json()["internal_states"][0]["recent_transfers"][-1]
        pages, nbytes = predicted(info, n)
        assert last["pages_per_group"] == pages and last["kv_bytes"] == nbytes, (n, last)
    idle(P, D, S)
