"""DeepSeek-V3 (latent attention, grouped routing, a shared expert) across TP layouts and PD on
the tiny checkpoint, every layout against one offline one-rank engine (float32; the only
difference is the order of partial sums over the ranks).

PD: prefill tp1 -> decode tp2, tp2 -> tp1 and tp2 -> (tp2, dp2, DP attention, EP2 with
``--moe-dense-tp-size 1``), through pdserve's router and the real sglang-router: the layouts run
prefill and decode steps (tp2: query heads split, the latent replicated; DP attention with EP),
each server a layout, so no colocated server of each is needed besides. The latent is a replicated
region: each decode rank reads it from exactly one prefill rank, which the prefill ranks' transfer
counters show, and the bytes a request moves are layers x (kv_lora_rank + qk_rope_head_dim) x 4 per
token, counted once."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_moe_parallel import (
    check_behind_sglang_router,
    check_outputs,
    one_rank_reference,
)
from tests.e2e.test_tp import COMMON, generate, idle, prompts
from tests.helpers import cluster as c
from tests.helpers.checkpoints import build_tiny_checkpoint
from tests.helpers.sglang_router import sglang_router_available

DP_EP = [
    "--tp-size",
    "2",
    "--dp-size",
    "2",
    "--enable-dp-attention",
    "--ep-size",
    "2",
    "--moe-dense-tp-size",
    "1",
]
F32 = ["--dtype", "float32"]


@pytest.fixture(scope="module")
def ds_model():
    return build_tiny_checkpoint("deepseek_v3")


@pytest.fixture(scope="module")
def reference(ds_model):
    yield from one_rank_reference(ds_model, dtype="float32")


@pytest.fixture(scope="module")
def ds(tmp_path_factory, ds_model):
    logs = tmp_path_factory.mktemp("deepseek")
    small = [*COMMON, *F32, "--max-total-tokens", "4096"]
    S = {"P1": c.prefill("P1", ds_model, logs, *small)[0]}
    S["P2"] = c.prefill("P2", ds_model, logs, "--tp-size", "2", *small)[0]
    S["D1"] = c.decode("D1", ds_model, logs, *small)
    S["D2"] = c.decode("D2", ds_model, logs, "--tp-size", "2", *small)
    S["Ddp"] = c.decode("Ddp", ds_model, logs, *DP_EP, *small)
    try:
        c.start_all(S.values())
        routers = {
            "tp1 -> tp2": c.router("R_12", [S["P1"]], [S["D2"]], logs),
            "tp2 -> tp1": c.router("R_21", [S["P2"]], [S["D1"]], logs),
            "tp2 -> dp2 ep2": c.router("R_dp", [S["P2"]], [S["Ddp"]], logs),
        }
        for r in routers.values():
            r.start()
        yield {"servers": S, "routers": routers}
    finally:
        c.stop_all(list(locals().get("routers", {}).values()) + list(S.values()))


PAIRS = {"tp1 -> tp2": ("P1", "D2"), "tp2 -> tp1": ("P2", "D1"), "tp2 -> dp2 ep2": ("P2", "Ddp")}
# bytes each prefill rank writes for one request, in units of one copy of its latent pages
COPIES = {"tp1 -> tp2": [2], "tp2 -> tp1": [1, 0], "tp2 -> dp2 ep2": [1, 0]}


def _sent(server) -> list[int]:
    ranks = server.http.get("/debug/integrity").json()["integrity"].get("ranks")
    return (
        [r["kv_bytes_sent"] for r in ranks]
        if ranks
        else [server.http.get("/debug/integrity").json()["integrity"]["kv_bytes_sent"]]
    )


@pytest.mark.parametrize("pairing", sorted(PAIRS))
def test_pd_matches_one_rank_and_reads_the_latent_from_one_prefill_rank(ds, reference, pairing):
    p_name, d_name = PAIRS[pairing]
    P, D = ds["servers"][p_name], ds["servers"][d_name]
    url = ds["routers"][pairing].url
    check_outputs(url, reference, prompts(6, seed=70 + sorted(PAIRS).index(pairing)), pairing)
    idle(P)
    ids = prompts(1, seed=80)[0]
    before = _sent(P)
    assert generate(url, ids)["output_ids"] == reference(ids)["output_ids"]
    c.wait_for(lambda: sum(_sent(P)) > sum(before), 10, "the transfer counters")
    delta = [a - b for a, b in zip(_sent(P), before)]
    cfg = json.load(open(P.http.get("/server_info").json()["model_path"] + "/config.json"))
    pages = -(-len(ids) // 16)
    copy = (
        pages * 16 * cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4
    )
    assert delta == [n * copy for n in COPIES[pairing]], (pairing, delta, copy)
    per_token = P.http.get("/server_info").json()["scheduler_info"]["kv_bytes_per_token"]
    assert (
        per_token == cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4
    )
    for s in (P, D):
        idle(s)  # every rank's, on a TP server


@pytest.mark.skipif(not sglang_router_available(), reason="sglang-router is not installed")
def test_pd_behind_the_real_sglang_router(ds, reference, tmp_path):
    check_behind_sglang_router(
        ds["servers"], ("P2", "P1"), ("D1", "D2"), reference, prompts(6, seed=90), tmp_path
    )
