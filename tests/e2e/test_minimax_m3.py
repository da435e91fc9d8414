"""MiniMax M3's text model (``MiniMaxM3VLForCausalLM``) against HF transformers and through PD.

The tiny checkpoint (``tests/helpers/checkpoints.py``): layers 0 and 2 block-sparse (blocks of 4
keys, the 2 ending at the query's kept, the best up to 4 per KV head), 1 and 3 full attention;
MLPs dense, sparse, sparse, dense. Float32 greedy tokens equal HF's with logprobs within 1e-4 for
prompts of 3 to 160 tokens (up to 40 blocks), prefilled whole or in chunks of 7 and 23 (cutting
blocks and pages anywhere) at page sizes 16 and 1 on the ``cpu`` backend (its kernels for the
full layers, the torch path for the sparse ones) and the ``torch`` one, then decoded; a second
turn that hits the prefix cache too. HF with every block kept answers otherwise. Through PD (P
tp1 -> D tp2, P tp2 -> D tp1; local transfer) the colocated tokens, and each prefill rank writes
what the specs predict: every layer's K and V once, the sparse layers' index keys to every
decode rank.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.e2e.test_engine import hf_model, make_engine, prompts_for
from tests.e2e.test_engine_moe import compute_hf_reference
from tests.e2e.test_pd_groups import idle
from tests.helpers import cluster as c
from tests.helpers.checkpoints import build_tiny_checkpoint
from tests.helpers.layouts import assert_matches, hf_references, serve_layouts

torch.set_num_threads(1)

NEW_TOKENS = 8
GROUPS = [("full_attention", (0, 1, 2, 3)), ("index_keys", (0, 2))]
# (page size, chunked prefill size, attention backend)
LAYOUTS = [(16, 64, "cpu"), (1, 7, "cpu"), (16, 23, "torch")]
LAYOUT_IDS = [f"page{p}-chunk{n}-{b}" for p, n, b in LAYOUTS]
SP = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def path() -> str:
    return build_tiny_checkpoint("minimax_m3")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_for(3)[1:6]  # 3, 17, 40, 95 and 160 tokens


@pytest.fixture(scope="module")
def hf(path):
    return hf_references(path, NEW_TOKENS)


@pytest.fixture(scope="module")
def served(path, prompts) -> dict:
    return serve_layouts(path, prompts, LAYOUTS, SP, prompts[2])


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_matches_hf_float32(served, hf, prompts, layout):
    groups, outs, _, info = served[layout]
    assert groups == GROUPS  # the full-attention layers keep no index keys
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
    first = len(prompts[-1]) + NEW_TOKENS  # its prompt and output but the last token, in pages
    assert again["meta_info"]["cached_tokens"] == (first - 1) // page * page
    assert_matches(hf, follow, again, f"second turn, {layout}")


def test_the_selection_changes_the_outcome(path, served, prompts):
    """HF's model keeping every block answers otherwise for the prompts past 4 blocks: the
    comparisons above run the block selection."""
    indexers = [layer.self_attn.indexer for layer in hf_model(path).model.layers]
    sparse = [ix for ix in indexers if ix is not None]
    assert len(sparse) == 2
    topk = sparse[0].topk_blocks
    try:
        for ix in sparse:
            ix.topk_blocks = 4096
        dense = [compute_hf_reference(path, ids, NEW_TOKENS)[0] for ids in prompts[2:]]
    finally:
        for ix in sparse:
            ix.topk_blocks = topk
    selected = [out["output_ids"] for out in served[LAYOUTS[0]][1][2:]]
    assert sum(a != b for a, b in zip(dense, selected)) >= 2, (dense, selected)


def test_deterministic_inference_is_refused_by_name(path):
    """The block-sparse layers run on the torch path, whose decode rows share one SDPA call."""
    with pytest.raises(ValueError, match="enable_deterministic_inference: the block-sparse"):
        make_engine(path, dtype="bfloat16", enable_deterministic_inference=True)


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
    "23",
    "--disaggregation-bootstrap-timeout",
    "20",
    "--disaggregation-waiting-timeout",
    "20",
]
# pair -> (prefill, decode, per prefill rank: (its share of the K/V heads, copies of the index
# keys it writes))
PAIRS = {"tp1->tp2": ("P1", "D2", [(1.0, 2)]), "tp2->tp1": ("P2", "D1", [(0.5, 1), (0.5, 0)])}


@pytest.fixture(scope="module")
def pd(tmp_path_factory, path):
    yield from c.tp_pairs(path, tmp_path_factory.mktemp("pd-minimax-m3"), *COMMON)


def per_token(path: str) -> tuple[int, int]:
    """(K and V of every layer, the sparse layers' index keys): float32 bytes per token."""
    cfg = json.load(open(f"{path}/config.json"))
    kv = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    index = cfg["layer_types"].count("minimax_m3_sparse") * cfg["index_head_dim"] * 4
    return kv, index


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_pd_matches_colocated_and_moves_what_the_specs_predict(pd, path, served, prompts, pair):
    p, d, ranks = PAIRS[pair]
    P, D = pd[p], pd[d]
    for server in (P, D):
        info = server.http.get("/server_info").json()["scheduler_info"]
        assert [(g["kind"], tuple(g["layers"])) for g in info["cache_groups"]] == GROUPS
    kv, index = per_token(path)
    assert info["kv_bytes_per_token"] == kv + index
    colocated = served[LAYOUTS[0]][1]
    rng = random.Random(pair)
    for ids, want in list(zip(prompts, colocated))[2:]:  # 40 to 160 tokens
        before = c.kv_bytes_sent(P)
        rp, rd = c.post_pd(P, D, c.greedy_body(ids, NEW_TOKENS, P, rng.randrange(2**63)))
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        assert rd.json()["output_ids"] == want["output_ids"], f"{pair}: prompt of {len(ids)}"
        c.wait_for(lambda: sum(c.kv_bytes_sent(P)) > sum(before), 10, "the transfer counters")
        delta = [a - b for a, b in zip(c.kv_bytes_sent(P), before)]
        tokens = -(-len(ids) // PAGE) * PAGE
        assert delta == [round(tokens * (share * kv + n * index)) for share, n in ranks], (
            pair,
            len(ids),
        )
    idle(P, D)
