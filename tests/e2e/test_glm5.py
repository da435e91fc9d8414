"""GLM-5 (``GlmMoeDsaForCausalLM``) against HF transformers and through PD.

The tiny checkpoint (``tests/helpers/checkpoints.py``): four layers of latent attention, indexers
on layers 0 and 2 (interleaved RoPE) whose 8 chosen keys layers 1 and 3 reuse, MLPs dense,
sparse, sparse, dense. Float32 greedy tokens equal HF's with logprobs within 1e-4 for prompts of 1
to 160 tokens (most queries see more than 8 keys), prefilled whole or in chunks of 7 at page
sizes 16 and 1, then decoded; a second turn that hits the prefix cache too. Through PD (P tp1 ->
D tp2, P tp2 -> D tp1; local transfer) the colocated tokens, and each prefill rank writes what
the specs predict: every layer's latent and only the full layers' index keys, per decode rank.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.e2e.test_engine import prompts_for
from tests.e2e.test_engine_moe import compute_hf_reference
from tests.e2e.test_pd_groups import idle
from tests.helpers import cluster as c
from tests.helpers.checkpoints import build_tiny_checkpoint
from tests.helpers.layouts import assert_matches, hf_references, serve_layouts

torch.set_num_threads(1)

NEW_TOKENS = 8
GROUPS = [("latent_attention", (0, 1, 2, 3)), ("index_keys", (0, 2))]
# (page size, chunked prefill size, attention backend): pdserve's kernels, and the torch path
# that CUDA runs
LAYOUTS = [(16, 64, "cpu"), (1, 7, "cpu"), (16, 24, "torch")]
LAYOUT_IDS = [f"page{p}-chunk{n}-{b}" for p, n, b in LAYOUTS]
SP = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def path() -> str:
    return build_tiny_checkpoint("glm5")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_for(3)[:6]  # 1 to 160 tokens


@pytest.fixture(scope="module")
def hf(path):
    return hf_references(path, NEW_TOKENS)


@pytest.fixture(scope="module")
def served(path, prompts) -> dict:
    return serve_layouts(path, prompts, LAYOUTS, SP, prompts[3])


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_matches_hf_float32(served, hf, prompts, layout):
    groups, outs, _, info = served[layout]
    assert groups == GROUPS  # the shared layers keep no index keys
    for ids, out in zip(prompts, outs):
        assert_matches(hf, ids, out, str(layout))
    assert info["in_use_pages"] == 0 and info["running"] == 0
    assert [g["free_pages"] + g["cached_pages"] for g in info["groups"]] == [
        g["total_pages"] for g in info["groups"]
    ]


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_a_second_turn_hits_the_prefix_cache(served, hf, prompts, layout):
    _, _, (follow, again), _ = served[layout]
    page = layout[0]
    # the first turn's prompt and output but its last token, in whole pages
    first = len(prompts[-1]) + NEW_TOKENS
    assert again["meta_info"]["cached_tokens"] == (first - 1) // page * page
    assert_matches(hf, follow, again, f"second turn, {layout}")


def test_the_selection_changes_the_outcome(path, served, prompts):
    """HF's model with every key selected (index_topk above every prompt, on the full layers and
    so on the shared ones) answers otherwise: the comparisons above run the sparse path."""
    from tests.e2e.test_engine import hf_model

    indexers = [layer.self_attn.indexer for layer in hf_model(path).model.layers]
    full = [ix for ix in indexers if ix is not None]
    assert len(full) == 2
    topk = full[0].index_topk
    try:
        for ix in full:
            ix.index_topk = 4096
        dense = [compute_hf_reference(path, ids, NEW_TOKENS)[0] for ids in prompts[2:]]
    finally:
        for ix in full:
            ix.index_topk = topk
    assert dense != [out["output_ids"] for out in served[LAYOUTS[0]][1][2:]]


# ---- PD -------------------------------------------------------------------------------------

PAGE = 16
COMMON = [
    "--dtype",
    "float32",
    "--max-total-tokens",
    "4096",
    "--page-size",
    str(PAGE),
    "--chunked-prefill-size",
    "24",
    "--disaggregation-bootstrap-timeout",
    "20",
    "--disaggregation-waiting-timeout",
    "20",
]
# pair -> (prefill, decode, each prefill rank's writes in copies of the request's cache)
PAIRS = {"tp1->tp2": ("P1", "D2", [2]), "tp2->tp1": ("P2", "D1", [1, 0])}


@pytest.fixture(scope="module")
def pd(tmp_path_factory, path):
    yield from c.tp_pairs(path, tmp_path_factory.mktemp("pd-glm5"), *COMMON)


def cache_bytes(path: str, n: int) -> int:
    """One copy of the cache of a prompt of ``n`` tokens, in whole pages (float32): every layer's
    latent, the index keys of the layers with an indexer."""
    cfg = json.load(open(f"{path}/config.json"))
    latent = cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    index = cfg["indexer_types"].count("full") * cfg["index_head_dim"]
    return -(-n // PAGE) * PAGE * (latent + index) * 4


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_pd_matches_colocated_and_moves_what_the_specs_predict(pd, path, served, prompts, pair):
    p, d, copies = PAIRS[pair]
    P, D = pd[p], pd[d]
    for server in (P, D):
        info = server.http.get("/server_info").json()["scheduler_info"]
        assert [(g["kind"], tuple(g["layers"])) for g in info["cache_groups"]] == GROUPS
    assert info["kv_bytes_per_token"] == (4 * (32 + 8) + 2 * 16) * 4
    colocated = served[LAYOUTS[0]][1]
    rng = random.Random(pair)
    for ids, want in list(zip(prompts, colocated))[2:]:  # 17 to 160 tokens
        before = c.kv_bytes_sent(P)
        rp, rd = c.post_pd(P, D, c.greedy_body(ids, NEW_TOKENS, P, rng.randrange(2**63)))
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        assert rd.json()["output_ids"] == want["output_ids"], f"{pair}: prompt of {len(ids)}"
        c.wait_for(lambda: sum(c.kv_bytes_sent(P)) > sum(before), 10, "the transfer counters")
        delta = [a - b for a, b in zip(c.kv_bytes_sent(P), before)]
        assert delta == [k * cache_bytes(path, len(ids)) for k in copies], (pair, len(ids))
    idle(P, D)
