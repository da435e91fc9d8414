"""Expert parallelism end to end on the tiny Qwen3-MoE (8 experts, top 2; layers 0 and 2 sparse,
layer 1 dense): every layout serves the offline one-rank engine's tokens (float32; the only
difference is the order of partial sums over the ranks), colocated and through PD, behind
pdserve's router and the real sglang-router, with every rank's pools free afterwards.

Colocated: ``--ep-size 2`` (all-to-all dispatch), DP attention + EP under both
``--moe-a2a-backend`` values (one with ``--moe-dense-tp-size 1``), and TP inside the expert
groups (``--tp-size 4 --ep-size 2``). PD: prefill tp2 -> decode tp2 dp2 (DP attention) ep2, and
prefill tp1 -> decode tp2 ep2.

The other MoE families on the layouts of a PD pair, against HF's float32 tokens: a two-rank
prefill with EP (heads, experts and any recurrent state split over the ranks) to a decode of two
DP-attention ranks with EP (a whole attention and state per rank, half the experts each, tokens
exchanged over the all-to-all): Kimi-Linear and Jamba (hybrids with a state per request),
Granite MoE, ERNIE 4.5 MoE, Hunyuan MoE and PhiMoE.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.test_tp import COMMON, NEW_TOKENS, generate, idle, prompts
from tests.helpers import cluster as c
from tests.helpers.checkpoints import build_tiny_checkpoint
from tests.helpers.sglang_router import sglang_router_available, start_sglang_router

DP_EP = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2"]
COLOCATED = {
    "ep2 torch": ["--tp-size", "2", "--ep-size", "2", "--moe-a2a-backend", "torch"],
    "dp2 ep2 none dense-tp1": [*DP_EP, "--moe-dense-tp-size", "1"],
    "dp2 ep2 torch": [*DP_EP, "--moe-a2a-backend", "torch"],
    "tp4 ep2": ["--tp-size", "4", "--ep-size", "2"],
}


@pytest.fixture(scope="module")
def moe_model():
    return build_tiny_checkpoint("qwen3_moe")


def one_rank_reference(model_path: str, **engine_kw):
    """A fixture body: ``get(ids)`` is the offline one-rank engine's greedy answer (with
    logprobs)."""
    import torch

    import pdserve

    torch.set_num_threads(1)
    eng = pdserve.Engine(
        model_path=model_path,
        torch_num_threads=1,
        max_total_tokens=16384,
        page_size=16,
        **engine_kw,
    )
    cache: dict = {}

    def get(ids: list[int]) -> dict:
        if tuple(ids) not in cache:
            cache[tuple(ids)] = eng.generate(
                input_ids=ids,
                sampling_params={
                    "temperature": 0,
                    "max_new_tokens": NEW_TOKENS,
                    "ignore_eos": True,
                },
                return_logprob=True,
                logprob_start_len=0,
            )
        return cache[tuple(ids)]

    yield get
    eng.shutdown()


@pytest.fixture(scope="module")
def reference(moe_model):
    yield from one_rank_reference(moe_model)


@pytest.fixture(scope="module")
def moe(tmp_path_factory, moe_model):
    logs = tmp_path_factory.mktemp("moe")
    small = [*COMMON, "--max-total-tokens", "4096"]
    S = {
        name: c.server(f"C {name}".replace(" ", "_"), moe_model, logs, *args, *small)
        for name, args in COLOCATED.items()
    }
    S["P2"] = c.prefill("P2", moe_model, logs, "--tp-size", "2", *small)[0]
    S["Ddp"] = c.decode("Ddp", moe_model, logs, *DP_EP, "--moe-a2a-backend", "torch", *small)
    S["P1"] = c.prefill("P1", moe_model, logs, *small)[0]
    S["Dep"] = c.decode("Dep", moe_model, logs, "--tp-size", "2", "--ep-size", "2", *small)
    try:
        c.start_all(S.values())
        routers = {
            "tp2 -> dp2 ep2": c.router("R_dp", [S["P2"]], [S["Ddp"]], logs),
            "tp1 -> tp2 ep2": c.router("R_ep", [S["P1"]], [S["Dep"]], logs),
        }
        for r in routers.values():
            r.start()
        yield {"servers": S, "routers": routers}
    finally:
        c.stop_all(list(locals().get("routers", {}).values()) + list(S.values()))


def check_outputs(
    url: str, reference, ps: list[list[int]], what: str, logprobs: bool = False
) -> None:
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda ids: generate(url, ids, logprobs=logprobs), ps))
    for ids, out in zip(ps, outs):
        ref = reference(ids)
        assert out["output_ids"] == ref["output_ids"], f"{what}: prompt of {len(ids)} tokens"
        if logprobs:
            for a, b in zip(
                out["meta_info"]["output_token_logprobs"], ref["meta_info"]["output_token_logprobs"]
            ):
                assert abs(a[0] - b[0]) < 1e-4, what


@pytest.mark.parametrize("layout", sorted(COLOCATED))
def test_colocated_expert_parallel_matches_one_rank(moe, reference, layout):
    server = moe["servers"][layout]
    check_outputs(
        server.url,
        reference,
        prompts(8, seed=sorted(COLOCATED).index(layout), max_len=200),
        layout,
        logprobs=True,
    )
    idle(server)


PAIRS = {"tp2 -> dp2 ep2": ("P2", "Ddp"), "tp1 -> tp2 ep2": ("P1", "Dep")}


@pytest.mark.parametrize("pairing", sorted(PAIRS))
def test_pd_expert_parallel_matches_one_rank(moe, reference, pairing):
    check_outputs(
        moe["routers"][pairing].url,
        reference,
        prompts(8, seed=20 + sorted(PAIRS).index(pairing)),
        pairing,
    )
    for name in PAIRS[pairing]:
        idle(moe["servers"][name])


@pytest.mark.skipif(not sglang_router_available(), reason="sglang-router is not installed")
def test_pd_expert_parallel_behind_the_real_sglang_router(moe, reference, tmp_path):
    check_behind_sglang_router(
        moe["servers"], ("P2", "P1"), ("Ddp", "Dep"), reference, prompts(8, seed=40), tmp_path
    )


def check_behind_sglang_router(
    S: dict, prefill: tuple, decode: tuple, reference, ps: list[list[int]], tmp_path
) -> None:
    """The real sglang-router in front of servers ``S[prefill]`` / ``S[decode]`` serves the
    reference's tokens; every server idle afterwards."""
    port = c.free_port()
    proc = start_sglang_router(
        [(S[p].url, S[p].bootstrap_port) for p in prefill],
        [S[d].url for d in decode],
        port,
        log_path=str(tmp_path / "sglang-router.log"),
    )
    try:
        check_outputs(f"http://127.0.0.1:{port}", reference, ps, "sglang-router")
    finally:
        proc.terminate()
        proc.wait()
    for name in (*prefill, *decode):
        idle(S[name])


def test_expert_layout_the_model_cannot_take_is_a_start_up_error(moe_model, tmp_path):
    """8 experts + 1 redundant slot over 2 expert-parallel ranks: the server exits at start-up
    naming the flag and the numbers."""
    bad = c.server(
        "bad_ep",
        moe_model,
        tmp_path,
        "--tp-size",
        "2",
        "--ep-size",
        "2",
        "--ep-num-redundant-experts",
        "1",
        *COMMON,
    )
    try:
        with pytest.raises(
            RuntimeError, match=r"ep_size: 2 does not divide the model's 8 experts plus 1 redundant"
        ):
            bad.start()
    finally:
        bad.stop()


# MoE families through PD from an expert-parallel prefill to a DP-attention decode
EP_FAMILIES = ["kimi_linear", "jamba", "granite_moe", "ernie4_5_moe", "hunyuan_moe", "phimoe"]
FLOAT32_PD = [
    "--dtype", "float32", "--page-size", "16", "--max-total-tokens", "4096",
    "--chunked-prefill-size", "24", *c.PD_TIMEOUTS,
]  # fmt: skip


@pytest.fixture(scope="module", params=EP_FAMILIES)
def family_ep(request, tmp_path_factory):
    logs = tmp_path_factory.mktemp(f"pd-ep-{request.param}")
    path = build_tiny_checkpoint(request.param)
    ep = ["--tp-size", "2", "--ep-size", "2"]
    servers = {
        "P": c.prefill("P", path, logs, *FLOAT32_PD, *ep)[0],
        "D": c.decode("D", path, logs, *FLOAT32_PD, *DP_EP, "--moe-a2a-backend", "torch"),
    }
    for procs in c.running(servers):
        yield request.param, procs


def test_families_from_expert_parallel_prefill_to_dp_attention_decode(family_ep):
    import random

    from tests.e2e.test_engine_moe import hf_reference

    family, servers = family_ep
    P, D = servers["P"], servers["D"]
    rng = random.Random(41)
    for n in (3, 25, 70):
        ids = [rng.randrange(100, 40000) for _ in range(n)]
        body = c.greedy_body(ids, NEW_TOKENS, P, rng.randrange(2**63))
        rp, rd = c.post_pd(P, D, body)
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        want, _ = hf_reference(build_tiny_checkpoint(family), ids, NEW_TOKENS)
        assert rd.json()["output_ids"] == want, f"{family}: prompt of {n} tokens"
    for proc in (P, D):
        idle(proc)
