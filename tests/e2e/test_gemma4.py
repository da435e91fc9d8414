"""Gemma 4 (text) on its two cache groups against HF transformers and through PD.

The tiny checkpoints (``tests/helpers/checkpoints.py``): layers S, F, S, F, S, F with windows of
16; the full layers of another head_dim and fewer KV heads, their keys also their values; layers 4
and 5 read the caches of layers 2 and 3 and keep none; per-layer inputs; ``gemma4_moe`` adds the
MoE block beside every MLP. Float32 greedy tokens equal HF's with logprobs within 1e-4 for prompts
of 1 to 160 tokens, prefilled whole and in chunks of 5, 7 and 23 (the window cut at odd places) at
page sizes 1 and 16, then decoded; a second turn hits the prefix cache and continues as HF does.
Through PD (P tp1 -> D tp1, tp1 -> tp2, tp2 -> tp1; local transfer) the tokens of a colocated
server, and the bytes a request moves are the specs' prediction (the window's last pages and every
full-attention page of the four layers that keep a cache; nothing for the shared ones).
"""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

from tests.e2e.test_engine import make_engine, prompts_for
from tests.e2e.test_engine_moe import hf_reference
from tests.e2e.test_pd_groups import idle
from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.checkpoints import build_tiny_checkpoint, hf_causal_lm

torch.set_num_threads(1)

NEW_TOKENS = 8
GROUPS = [("sliding_window", (0, 2)), ("full_attention", (1, 3))]  # 4 and 5 keep no cache


def assert_matches_hf(path, prompts, outs, what: str) -> None:
    for ids, out in zip(prompts, outs):
        ref_tokens, ref_lp = hf_reference(path, ids, NEW_TOKENS)
        assert out["output_ids"] == ref_tokens, f"{what}: prompt of {len(ids)} tokens"
        for k, (v, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
            assert abs(v - ref_lp[len(ids) - 1 + k, tok].item()) < 1e-4, (what, len(ids), k)


@pytest.mark.parametrize(
    "arch, page_size, chunk",
    [("gemma4", 16, 23), ("gemma4", 1, 5), ("gemma4_moe", 16, 64), ("gemma4_moe", 1, 7)],
)
def test_matches_hf_float32_and_continues_a_second_turn(arch, page_size, chunk, request):
    path = build_tiny_checkpoint(arch)
    eng = make_engine(path, page_size=page_size, chunked_prefill_size=chunk, dtype="float32")
    request.node._engine = eng
    runner = eng.scheduler.runner
    assert [(g.kind, g.layers) for g in runner.cache_groups] == GROUPS
    assert [(g.spec.num_kv_heads, g.spec.head_dim) for g in runner.cache_groups] == [
        (4, 16),
        (2, 32),
    ]
    what = f"{arch}, page {page_size}, chunk {chunk}"
    prompts = prompts_for(3)[:6]  # 1 to 160 tokens
    sp = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    outs = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
    assert_matches_hf(path, prompts, outs, what)
    # the next turn of the 40-token conversation: its prompt and answer are cached in both groups
    second = prompts[3] + outs[3]["output_ids"] + [1234, 5678, 9101]
    again = eng.generate(input_ids=second, sampling_params=sp, return_logprob=True)
    turn1 = len(prompts[3]) + NEW_TOKENS - 1  # the tokens whose KV was computed
    assert again["meta_info"]["cached_tokens"] >= turn1 // page_size * page_size > 0
    assert_matches_hf(path, [second], [again], f"{what}, second turn")
    info = eng.check_integrity()
    assert info["in_use_pages"] == 0 and info["running"] == 0
    assert [g["free_pages"] + g["cached_pages"] for g in info["groups"]] == [
        g["total_pages"] for g in info["groups"]
    ]


# ---- PD -------------------------------------------------------------------------------------

PAGE = 4
PD_NEW = 20  # decode runs past the window of 16
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
LENS = (1, 15, 17, 40, 90)


@pytest.fixture(scope="module")
def gemma4_pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-gemma4")
    path = build_tiny_checkpoint("gemma4")
    tp2 = ["--tp-size", "2"]
    yield from c.running(
        {
            "S": c.server("S", path, logs, *COMMON),
            "P": c.prefill("P", path, logs, *COMMON)[0],
            "D": c.decode("D", path, logs, *COMMON),
            "Ptp2": c.prefill("Ptp2", path, logs, *COMMON, *tp2)[0],
            "Dtp2": c.decode("Dtp2", path, logs, *COMMON, *tp2),
        }
    )


def body(ids, prefill=None, room: int = 0) -> dict:
    return c.greedy_body(ids, PD_NEW, prefill, room)


def stats(p: c.Proc) -> dict:
    return p.http.get("/server_info").json()["internal_states"][0]


def predicted(info: dict, n: int) -> tuple[list[int], int]:
    """(pages per group, bytes) a prompt of ``n`` tokens moves from a one-rank prefill (float32),
    from the groups the server describes: a window's pages from the one holding the first key the
    next query sees, every page of a full-attention group."""
    total = -(-n // PAGE)
    pages, nbytes = [], 0
    for g in info["cache_groups"]:
        first = max(0, n - g["window"] + 1) // PAGE if g["kind"] == "sliding_window" else 0
        pages.append(total - first)
        per_page = 2 * g["num_kv_heads"] * PAGE * g["head_dim"] * 4
        nbytes += pages[-1] * len(g["layers"]) * per_page
    return pages, nbytes


PAIRS = [("tp1", "P", "D"), ("tp1->tp2", "P", "Dtp2"), ("tp2->tp1", "Ptp2", "D")]


@pytest.mark.parametrize("name, p, d", PAIRS, ids=[x[0] for x in PAIRS])
def test_pd_matches_colocated_and_moves_the_predicted_bytes(gemma4_pd, name, p, d):
    """The full layers' fewer KV heads are sliced in the windows' proportion between TP sizes
    (both kinds split over two ranks); a one-rank prefill's record covers the whole request,
    each head written once."""
    P, D, S = gemma4_pd[p], gemma4_pd[d], gemma4_pd["S"]
    info = P.http.get("/server_info").json()["scheduler_info"]
    assert [(g["kind"], tuple(g["layers"])) for g in info["cache_groups"]] == GROUPS
    # per token of a long prompt: the full layers' K and V (2 heads of 32) on any TP size
    assert info["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 4
    rng = random.Random(hash(name) % 1000)
    for n in LENS:
        ids = [rng.randrange(100, 40000) for _ in range(n)]
        rp, rd = c.post_pd(P, D, body(ids, P, rng.randrange(2**63)))
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        want = localhttp.post(S.url + "/generate", json=body(ids), timeout=120).json()["output_ids"]
        assert rd.json()["output_ids"] == want, f"{name}: prompt of {n} tokens"
        if "tp2" not in p:
            last = stats(P)["recent_transfers"][-1]
            pages, nbytes = predicted(info, n)
            assert last["pages_per_group"] == pages and last["kv_bytes"] == nbytes, (n, last)
    idle(P, D, S)


def test_a_second_turn_hits_the_prefill_prefix_cache(gemma4_pd):
    """Turn 2 extends turn 1 and its answer: prefill computes only what it has not cached (its
    window pages of turn 1 kept), and decode's tokens are the colocated server's."""
    P, D, S = gemma4_pd["P"], gemma4_pd["D"], gemma4_pd["S"]
    rng = random.Random(7)
    turn1 = [rng.randrange(100, 40000) for _ in range(30)]
    rp, rd = c.post_pd(P, D, body(turn1, P, rng.randrange(2**63)))
    assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
    idle(P, D)
    hits = stats(P)["cache_hit_tokens"]
    turn2 = turn1 + rd.json()["output_ids"] + [rng.randrange(100, 40000) for _ in range(5)]
    rp, rd = c.post_pd(P, D, body(turn2, P, rng.randrange(2**63)))
    assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
    want = localhttp.post(S.url + "/generate", json=body(turn2), timeout=120).json()["output_ids"]
    assert rd.json()["output_ids"] == want
    assert stats(P)["cache_hit_tokens"] - hits == 28  # turn 1's 30 tokens, in whole pages
    idle(P, D, S)


def test_the_multimodal_checkpoint_serves_its_text_model(tmp_path, request):
    """Gemma 4 is published as ``Gemma4ForConditionalGeneration``: the text model's configuration
    nested, its tensors under ``model.language_model.`` beside a vision tower. Served as the text
    model: the text checkpoint's tokens and logprobs, no vision tensor loaded."""
    import transformers

    text_path = build_tiny_checkpoint("gemma4")
    text = transformers.AutoConfig.from_pretrained(text_path).to_dict()
    text.pop("architectures")
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        patch_size=4,
        position_embedding_size=64,
    )
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    config.architectures = ["Gemma4ForConditionalGeneration"]
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(config)
    model.model.language_model.load_state_dict(
        hf_causal_lm(text_path, torch.float32).model.state_dict()
    )
    model.save_pretrained(tmp_path)
    for name in os.listdir(text_path):
        if name not in ("config.json", "model.safetensors") and not name.startswith("."):
            shutil.copy(os.path.join(text_path, name), tmp_path)
    eng = make_engine(str(tmp_path), dtype="float32", page_size=16, chunked_prefill_size=32)
    request.node._engine = eng
    model = eng.scheduler.runner.model
    assert type(model).__name__ == "Gemma4ForCausalLM"
    assert not any("vision" in n for n, _ in model.named_parameters())
    prompts = prompts_for(3)[2:5]  # 17 to 95 tokens
    sp = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    outs = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
    assert_matches_hf(text_path, prompts, outs, "the multimodal checkpoint")
