"""Data-parallel attention and pipeline-parallel prefill end to end.

Colocated ``--tp-size 2 --dp-size 2 --enable-dp-attention`` and ``--pp-size 2`` against one rank;
PD with P pp2 -> D tp1, P tp1 -> D (tp2, dp2) and P (tp2, dp2) -> D (tp2, dp2) through pdserve's
router, with and without ``--dp-aware`` (without it the decode asks the prefill's bootstrap server
which group holds each room); every rank's pool and metadata slots free afterwards; a fault in one
prefill DP group fails that group's rooms only.

Reference outputs come from the offline engine (one rank, float32), itself checked against HF.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.disagg.bootstrap import fetch_rank_info
from tests.e2e.test_tp import (  # noqa: F401  (session fixtures)
    COMMON,
    NEW_TOKENS,
    all_ranks_idle,
    generate,
    prompts,
    reference,
    tp_models,
)
from tests.helpers import cluster as c
from tests.helpers import localhttp

DP = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]


@pytest.fixture(scope="module")
def par(tmp_path_factory, tp_models):  # noqa: F811
    logs = tmp_path_factory.mktemp("dp_pp")
    llama = tp_models["llama"]
    S = {
        # its groups publish KV events (port + group) for the cache-aware, DP-aware router below
        "Cdp": c.server(
            "Cdp",
            llama,
            logs,
            *DP,
            *COMMON,
            "--kv-events-endpoint",
            f"tcp://127.0.0.1:{c.free_port()}",
        ),
        "Cpp": c.server("Cpp", llama, logs, "--pp-size", "2", *COMMON),
        # two attention groups of two ranks each: heads split inside a group, MLP over all four
        "Cdp42": c.server(
            "Cdp42",
            llama,
            logs,
            "--tp-size",
            "4",
            "--dp-size",
            "2",
            "--enable-dp-attention",
            *COMMON,
        ),
        # bf16 moves hidden states between ranks as bytes (gloo has no bf16 collectives)
        "Cdp16": c.server("Cdp16", llama, logs, *DP, "--dtype", "bfloat16", *COMMON),
        "Cpp16": c.server("Cpp16", llama, logs, "--pp-size", "2", "--dtype", "bfloat16", *COMMON),
        "Ppp": c.prefill("Ppp", llama, logs, "--pp-size", "2", *COMMON)[0],
        "P1": c.prefill("Pdp1", llama, logs, *COMMON)[0],
        "Pdp": c.prefill("Pdp", llama, logs, *DP, *COMMON)[0],
        "D1": c.decode("Ddp1", llama, logs, *COMMON),
        "Ddp": c.decode("Ddp", llama, logs, *DP, *COMMON),
    }
    try:
        c.start_all(S.values())
        routers = {
            "pp2->1": c.router("Rpp", [S["Ppp"]], [S["D1"]], logs),
            "1->dp": c.router("R1dp", [S["P1"]], [S["Ddp"]], logs),
            "dp->dp": c.router("Rdpdp", [S["Pdp"]], [S["Ddp"]], logs),
            "dp->dp aware": c.router("Rdpdpa", [S["Pdp"]], [S["Ddp"]], logs, "--dp-aware"),
            "cache dp": c.router(
                "Rcdp",
                [],
                [],
                logs,
                "--worker",
                S["Cdp"].url,
                "--dp-aware",
                "--policy",
                "cache_aware",
                "--load-poll-interval",
                "0.05",
            ),
        }
        for r in routers.values():
            r.start()
        yield {"servers": S, "routers": routers, "logs": logs}
    finally:
        c.stop_all(list(locals().get("routers", {}).values()) + list(S.values()))


def group_prompt_tokens(server: c.Proc) -> list[int]:
    """Prompt tokens each DP group has taken so far (its scheduler's counter)."""
    return [g["prompt_tokens"] for g in server.http.get("/server_info").json()["internal_states"]]


@pytest.mark.parametrize("name", ["Cdp", "Cpp", "Cdp42"])
def test_colocated_matches_one_rank(par, reference, name):  # noqa: F811
    server = par["servers"][name]
    before = group_prompt_tokens(server)
    ps = prompts(12, seed=40 + len(name))
    with ThreadPoolExecutor(6) as ex:
        outs = list(ex.map(lambda ids: generate(server.url, ids, logprobs=True), ps))
    for ids, out in zip(ps, outs):
        ref = reference("llama", ids)
        # float32 on both: only the order of the MLP's partial sums over the ranks differs
        assert out["output_ids"] == ref["output_ids"], f"{name}: prompt of {len(ids)} tokens"
        for a, b in zip(
            out["meta_info"]["output_token_logprobs"], ref["meta_info"]["output_token_logprobs"]
        ):
            assert abs(a[0] - b[0]) < 1e-4
    after = group_prompt_tokens(server)
    if name.startswith("Cdp"):  # the front end spread the concurrent requests over both groups
        assert len(after) == 2 and all(a > b for a, b in zip(after, before)), (before, after)
    all_ranks_idle(server)


@pytest.mark.parametrize("name", ["Cdp16", "Cpp16"])
def test_bf16_ranks_serve(par, name):
    """bf16 across ranks: the requests complete on every group/stage (greedy tokens of bf16 are
    compared against HF tie-aware in test_engine_bf16.py; here the transport is what is new)."""
    server = par["servers"][name]
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda ids: generate(server.url, ids), prompts(8, seed=45)))
    assert all(len(o["output_ids"]) == NEW_TOKENS for o in outs)
    if name == "Cdp16":
        assert all(g > 0 for g in group_prompt_tokens(server))
    all_ranks_idle(server)


def test_routed_dp_rank_pins_the_group(par, reference):  # noqa: F811
    server = par["servers"]["Cdp"]
    ids = prompts(1, seed=50)[0]
    for group in (0, 1):
        before = group_prompt_tokens(server)
        body = {
            "input_ids": ids,
            "routed_dp_rank": group,
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        }
        r = localhttp.post(server.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == reference("llama", ids)["output_ids"]
        after = group_prompt_tokens(server)
        assert [a - b for a, b in zip(after, before)] == [
            len(ids) if g == group else 0 for g in (0, 1)
        ]
    r = localhttp.post(
        server.url + "/generate", json={"input_ids": ids, "routed_dp_rank": 2}, timeout=10
    )
    assert r.status_code == 400 and "routed_dp_rank" in r.text


def test_cache_aware_dp_aware_router_sends_a_follow_up_to_the_group_holding_it(par, reference):  # noqa: F811
    server, router = par["servers"]["Cdp"], par["routers"]["cache dp"]
    rng = random.Random(71)
    for k in range(3):
        turn1 = [rng.randrange(100, 1000) for _ in range(70)]
        out1 = generate(router.url, turn1)["output_ids"]

        def seen() -> bool:
            r = router.http.post("/kv_index/match", json={"input_ids": turn1})
            return r.json()["workers"][server.url] >= 64

        c.wait_for(seen, 10, "router sees the group's blocks")
        # a load poll taken while turn 1 ran counts its tokens against the holding group
        c.wait_for(
            lambda: all(
                w.get("polled_load") in ([0, 0], None)
                for ws in router.http.get("/get_load").json().values()
                for w in ws
            ),
            10,
            "router polls the server idle",
        )
        before = server.http.get("/server_info").json()["internal_states"]
        turn2 = turn1 + out1 + [rng.randrange(100, 1000) for _ in range(20)]
        assert generate(router.url, turn2)["output_ids"] == reference("llama", turn2)["output_ids"]
        after = server.http.get("/server_info").json()["internal_states"]
        [group] = [g for g in (0, 1) if after[g]["prompt_tokens"] > before[g]["prompt_tokens"]]
        assert after[group]["cache_hit_tokens"] - before[group]["cache_hit_tokens"] >= 64, (
            k,
            group,
        )


@pytest.mark.parametrize("pairing", ["pp2->1", "1->dp", "dp->dp", "dp->dp aware"])
def test_pd_matches_one_rank(par, reference, pairing):  # noqa: F811
    router = par["routers"][pairing]
    ps = prompts(10, seed=60 + len(pairing) + ord(pairing[0]))
    with ThreadPoolExecutor(5) as ex:
        outs = list(ex.map(lambda ids: generate(router.url, ids), ps))
    for ids, out in zip(ps, outs):
        assert out["output_ids"] == reference("llama", ids)["output_ids"], (
            f"{pairing}: prompt of {len(ids)} tokens"
        )
    S = par["servers"]
    for name in {
        "pp2->1": ("Ppp", "D1"),
        "1->dp": ("P1", "Ddp"),
        "dp->dp": ("Pdp", "Ddp"),
        "dp->dp aware": ("Pdp", "Ddp"),
    }[pairing]:
        if (
            S[name].http.get("/server_info").json()["tp_size"]
            * S[name].http.get("/server_info").json()["pp_size"]
            > 1
        ):
            all_ranks_idle(S[name])
        else:
            S[name].wait_idle()


def test_pipeline_stages_send_their_own_layers(par):
    """Each prefill stage writes its own half of the layers (the tiny model has 4: 2 per stage),
    so for one request both stages send the same number of KV bytes, together the whole prompt."""
    S = par["servers"]
    ids = prompts(1, seed=70, max_len=200)[0]
    ids = ids + [7] * (64 - len(ids)) if len(ids) < 64 else ids

    def sent() -> list[int]:
        return [
            r["kv_bytes_sent"]
            for r in S["Ppp"].http.get("/debug/integrity").json()["integrity"]["ranks"]
        ]

    before = sent()
    generate(par["routers"]["pp2->1"].url, ids)
    c.wait_for(
        lambda: all(a > b for a, b in zip(sent(), before)), 10, "both stages' transfers to finish"
    )
    delta = [a - b for a, b in zip(sent(), before)]
    info = S["D1"].http.get("/model_info").json()
    assert len(delta) == 2 and delta[0] == delta[1], delta
    cfg = __import__("json").load(
        open(S["D1"].http.get("/server_info").json()["model_path"] + "/config.json")
    )
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    pages = -(-len(ids) // info["page_size"])
    per_layer = (
        2 * pages * info["page_size"] * cfg["num_key_value_heads"] * head_dim * 4
    )  # K and V, float32
    assert delta[0] == per_layer * cfg["num_hidden_layers"] // 2
    # each stage registered its layer range with the bootstrap server
    half = cfg["num_hidden_layers"] // 2
    for stage, layers in ((0, (0, half)), (1, (half, 2 * half))):
        r = fetch_rank_info("127.0.0.1", S["Ppp"].bootstrap_port, 0, 0, stage)
        assert (r["start_layer"], r["end_layer"]) == layers, r
    all_ranks_idle(S["Ppp"])


def test_fault_in_one_prefill_group_leaves_the_other_alone(tmp_path, tp_models):  # noqa: F811
    llama = tp_models["llama"]
    P, _ = c.prefill(
        "Pf",
        llama,
        tmp_path,
        *DP,
        "--disaggregation-fault-prob",
        "1",
        "--disaggregation-fault-ranks",
        "1",
        "--disaggregation-fault-mode",
        "fail_transfer",
        *COMMON,
    )
    D = c.decode("Df", llama, tmp_path, *DP, *COMMON)
    try:
        c.start_all((P, D))

        def run(group: int, hint: bool) -> tuple[int, str, int, str]:
            room = random.randrange(2**63)
            body = {
                "input_ids": list(range(100, 140)),
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": P.bootstrap_port,
                "bootstrap_room": room,
                "sampling_params": {"temperature": 0, "max_new_tokens": 4},
            }
            d_body = {
                **body,
                "routed_dp_rank": 1 - group,
                **({"disagg_prefill_dp_rank": group} if hint else {}),
            }
            with ThreadPoolExecutor(2) as ex:
                fp = ex.submit(
                    localhttp.post,
                    P.url + "/generate",
                    json={**body, "routed_dp_rank": group},
                    timeout=60,
                )
                fd = ex.submit(localhttp.post, D.url + "/generate", json=d_body, timeout=60)
                rp, rd = fp.result(), fd.result()
            return rp.status_code, rp.text, rd.status_code, rd.text

        with ThreadPoolExecutor(4) as ex:
            results = list(
                ex.map(lambda a: run(*a), [(0, True), (1, True), (0, False), (1, False)])
            )
        for (group, _), (p_code, p_text, d_code, d_text) in zip(
            [(0, 1), (1, 1), (0, 0), (1, 0)], results
        ):
            if group == 0:  # the healthy group serves, whichever decode group takes the room
                assert p_code == 200 and d_code == 200, (p_text, d_text)
            else:
                assert p_code >= 500 and d_code >= 500 and "injected fault" in d_text, (
                    p_text,
                    d_text,
                )
        for s in (P, D):
            all_ranks_idle(s)
            assert s.http.get("/health").status_code == 200
    finally:
        c.stop_all((P, D))
