"""LFM2 and LFM3 against HF transformers and through PD.

The tiny checkpoints (``tests/helpers/checkpoints.py``): LFM2's layers C, C, A, C, A, C: gated
short convolutions of 3 taps with biases (a state of the last 2 inputs per request) and attention
with per-head q/k norms, the MLP at HF's adjusted width; LFM3's C, C, F, C, S, C: a window of 16 on
S, RoPE per attention kind (proportional on F), a sigmoid gate per query head on the attention's
output, sandwich norms (three cache groups: full pages, window pages, the state). For each,
float32 greedy tokens equal HF's with logprobs within 1e-4 for prompts of 1 to 160 tokens
prefilled in chunks of 64, 5 and 1 at page sizes 16 and 1, a long decode; a second turn restores
the convolution state from the snapshot at its last page boundary; bf16 by the tie rule. Through
PD (P tp1 -> D tp2 and P tp2 -> D tp1) the tokens of a colocated server and HF's, and the bytes a
request moves: its pages (LFM3's window layer: the window's last pages only) and one state of
each convolution layer, each rank's channels to the rank that holds them.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.e2e.test_engine import make_engine, prompts_for
from tests.e2e.test_engine_hybrid import assert_matches, reference
from tests.e2e.test_pd_groups import idle
from tests.e2e.test_pd_hybrid import state_bytes
from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.checkpoints import build_tiny_checkpoint

torch.set_num_threads(1)

NEW_TOKENS = 8
GROUPS = {
    "lfm2": [("full_attention", (2, 4)), ("recurrent_state", (0, 1, 3, 5))],
    "lfm3": [
        ("full_attention", (2,)),
        ("sliding_window", (4,)),
        ("recurrent_state", (0, 1, 3, 5)),
    ],
}
FAMILIES = sorted(GROUPS)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk, page_size", [(64, 16), (5, 1), (1, 1)])
def test_matches_hf_float32(family, chunk, page_size):
    path = build_tiny_checkpoint(family)
    eng = make_engine(
        path,
        page_size=page_size,
        chunked_prefill_size=chunk,
        dtype="float32",
        max_running_requests=3,
    )
    try:
        runner = eng.scheduler.runner
        assert [(g.kind, g.layers) for g in runner.cache_groups] == GROUPS[family]
        state = runner.pools[-1]
        assert state.spec.parts == ("conv",) and tuple(state.state("conv", 0).shape[1:]) == (64, 2)
        prompts = prompts_for(6)[:6]  # 1 to 160 tokens
        sp = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        outs = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
        assert_matches(path, prompts, outs, NEW_TOKENS, f"chunk {chunk}, page {page_size}")
        if chunk == 64:  # a long decode carries the state over many steps
            long = {**sp, "max_new_tokens": 48}
            out = eng.generate(input_ids=prompts[3], sampling_params=long, return_logprob=True)
            assert_matches(path, [prompts[3]], [out], 48, "long decode")
        info = eng.check_integrity()
        assert info["in_use_pages"] == 0 and info["running"] == 0
    finally:
        eng.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_second_turn_continues_from_the_state_snapshot(family):
    path = build_tiny_checkpoint(family)
    eng = make_engine(path, page_size=4, chunked_prefill_size=16, dtype="float32")
    try:
        kv = eng.scheduler.kv
        sp = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        turn1 = prompts_for(6)[3]  # 40 tokens
        out1 = eng.generate(input_ids=turn1, sampling_params=sp)
        turn2 = turn1 + out1["output_ids"] + [101, 202, 303, 404, 505]
        outs = eng.generate(input_ids=[turn2], sampling_params=sp, return_logprob=True)
        # the snapshot at the last page boundary turn 1 crossed: (40 + 7) // 4 * 4 = 44
        assert kv.restored == 1 and outs[0]["meta_info"]["cached_tokens"] == 44
        assert_matches(path, [turn2], outs, NEW_TOKENS, "second turn")
        assert eng.check_integrity()["in_use_pages"] == 0
    finally:
        eng.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_matches_hf_bf16_up_to_ties(family):
    from tests.e2e.test_engine_bf16 import NEW_TOKENS as N
    from tests.e2e.test_engine_bf16 import compare, hf_bf16
    from tests.e2e.test_engine_bf16 import make_engine as bf16_engine

    path = build_tiny_checkpoint(family)
    eng = bf16_engine(path, page_size=16, chunked_prefill_size=64)
    try:
        assert eng.scheduler.runner.pools[-1].state("conv", 0).dtype == torch.bfloat16
        prompts = prompts_for(4)
        sp = {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}
        outs = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
        compared = sum(compare(out, *hf_bf16(path, ids, N)) for ids, out in zip(prompts, outs))
        assert compared >= N * len(prompts) // 2, f"only {compared} positions compared"
    finally:
        eng.shutdown()


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
    "32",
    "--disaggregation-bootstrap-timeout",
    "20",
    "--disaggregation-waiting-timeout",
    "20",
]


@pytest.fixture(scope="module", params=FAMILIES)
def lfm_pd(request, tmp_path_factory):
    logs = tmp_path_factory.mktemp(f"pd-{request.param}")
    path = build_tiny_checkpoint(request.param)
    tp2 = ["--tp-size", "2"]
    procs = {
        "S": c.server("S", path, logs, *COMMON),
        "P": c.prefill("P", path, logs, *COMMON)[0],
        "D": c.decode("D", path, logs, *COMMON),
        "Ptp2": c.prefill("Ptp2", path, logs, *COMMON, *tp2)[0],
        "Dtp2": c.decode("Dtp2", path, logs, *COMMON, *tp2),
    }
    for running in c.running(procs):
        yield {**running, "family": request.param}


PAIRS = [("tp1->tp2", "P", "Dtp2"), ("tp2->tp1", "Ptp2", "D")]


def page_bytes(groups: list[dict], n: int) -> int:
    """The pages a prompt of ``n`` tokens moves (float32): every page of a full-attention group, a
    window's from the one holding the first key the next query sees."""
    total, out = -(-n // PAGE), 0
    for g in groups:
        if g["kind"] == "recurrent_state":
            continue
        first = max(0, n - g["window"] + 1) // PAGE if g["kind"] == "sliding_window" else 0
        out += (total - first) * len(g["layers"]) * 2 * g["num_kv_heads"] * PAGE * g["head_dim"] * 4
    return out


@pytest.mark.parametrize("name, p, d", PAIRS, ids=[x[0] for x in PAIRS])
def test_pd_across_tp_sizes_matches_hf_and_moves_pages_and_one_state(lfm_pd, name, p, d):
    P, D, S = lfm_pd[p], lfm_pd[d], lfm_pd["S"]
    path = build_tiny_checkpoint(lfm_pd["family"])
    info = P.http.get("/server_info").json()["scheduler_info"]
    groups = info["cache_groups"]
    state = groups[-1]
    assert [(g["kind"], tuple(g["layers"])) for g in groups] == GROUPS[lfm_pd["family"]]
    assert state["shapes"] == [[64, 2]]  # the whole layer's channels, whatever the TP size
    rng = random.Random(len(name))
    for n in (3, 25, 70):
        ids = [rng.randrange(100, 40000) for _ in range(n)]
        rp, rd = c.post_pd(P, D, c.greedy_body(ids, NEW_TOKENS, P, rng.randrange(2**63)))
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        want = localhttp.post(S.url + "/generate", json=c.greedy_body(ids, NEW_TOKENS), timeout=120)
        assert rd.json()["output_ids"] == want.json()["output_ids"], f"{name}: prompt of {n}"
        assert rd.json()["output_ids"] == reference(path, tuple(ids), NEW_TOKENS)[0]
        if p == "P":  # a one-rank prefill's record covers the whole request
            last = P.http.get("/server_info").json()["internal_states"][0]["recent_transfers"][-1]
            assert last["kv_bytes"] == page_bytes(groups, n) + state_bytes(state), (n, last)
    idle(P, D, S)
