"""PD on a linear-attention hybrid (Bamba: Mamba2 layers around one attention layer): the attention
layer's pages go with every chunk, each Mamba2 layer's state slot (its convolution window and SSM
state) once, after the last chunk; decode preallocates the pages and one slot, then continues from
the state. Tokens equal a colocated server's for prompts shorter than a page and longer than several
chunks, across TP sizes (P tp1 -> D tp2, P tp2 -> D tp1: each state tensor sliced along its own
axis, the convolution's x | B | C per segment); the bytes a request moves are the pages' plus the
fixed-size state; pools and state slots are free afterwards, also after a request whose decode side
was aborted; a decode whose state shapes differ is refused, naming both; pdserve's router and the
real sglang-router serve the same tokens. Qwen3-Next (Gated DeltaNet: a convolution state of q | k |
v segments and a recurrent state per value head; one KV head, replicated on two ranks), Qwen3.5
and the other hybrids go from one rank to two and from two to one with HF's tokens. A next turn
hits prefill's prefix cache (the state restored from a snapshot) and, when decode keeps one,
decode's."""

from __future__ import annotations

import random

import httpx
import pytest

from tests.e2e.test_tp import all_ranks_idle
from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.checkpoints import build_tiny_checkpoint
from tests.helpers.sglang_router import sglang_router_available, start_sglang_router

PAGE = 4
NEW_TOKENS = 10
COMMON = [
    "--dtype",
    "float32",
    "--max-total-tokens",
    "4096",
    "--max-running-requests",
    "8",
    "--page-size",
    str(PAGE),
    "--chunked-prefill-size",
    "24",
    "--disaggregation-bootstrap-timeout",
    "20",
    "--disaggregation-waiting-timeout",
    "20",
]
LENS = (1, 3, 9, 24, 25, 70)


@pytest.fixture(scope="module")
def hybrid_pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-hybrid")
    path = build_tiny_checkpoint("bamba")
    yield from c.running(
        {
            "S": c.server("S", path, logs, *COMMON),
            "P": c.prefill("P", path, logs, *COMMON)[0],
            # a room without a prefill is given up on soon
            "D": c.decode(
                "D",
                path,
                logs,
                *COMMON,
                "--disaggregation-bootstrap-timeout",
                "6",
                "--disaggregation-waiting-timeout",
                "6",
            ),
            # the Mamba2 heads and groups, and the attention's KV heads, split over two ranks
            "Ptp2": c.prefill("Ptp2", path, logs, *COMMON, "--tp-size", "2")[0],
            "Dtp2": c.decode("Dtp2", path, logs, *COMMON, "--tp-size", "2"),
            # a decode with its prefix cache (a snapshot slot beside each request's state slot)
            "Dpc": c.decode(
                "Dpc", path, logs, *COMMON, "--disaggregation-decode-enable-radix-cache"
            ),
            # a decode whose Mamba2 layers keep another state size
            "Dn8": c.decode("Dn8", build_tiny_checkpoint("bamba", mamba_d_state=8), logs, *COMMON),
        }
    )


def body(ids: list[int], prefill: c.Proc | None = None, room: int = 0) -> dict:
    return c.greedy_body(ids, NEW_TOKENS, prefill, room)


def pd(prefill: c.Proc, decode: c.Proc, ids: list[int]) -> tuple[httpx.Response, httpx.Response]:
    return c.post_pd(prefill, decode, body(ids, prefill, random.randrange(2**63)))


def state_bytes(group: dict) -> int:
    """One request's state of every layer of a recurrent-state group."""
    per_layer = 0
    for shape, dtype in zip(group["shapes"], group["dtypes"]):
        n = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
        for s in shape:
            n *= s
        per_layer += n
    return per_layer * len(group["layers"])


PAIRS = [("tp1", "P", "D"), ("tp1->tp2", "P", "Dtp2"), ("tp2->tp1", "Ptp2", "D")]


@pytest.mark.parametrize("name, p, d", PAIRS, ids=[x[0] for x in PAIRS])
def test_pd_matches_colocated_and_moves_pages_and_one_state(hybrid_pd, name, p, d):
    P, D, S = hybrid_pd[p], hybrid_pd[d], hybrid_pd["S"]
    info = S.http.get("/server_info").json()["scheduler_info"]
    attn, state = info["cache_groups"]
    assert attn["kind"] == "full_attention" and state["kind"] == "recurrent_state"
    # the cost models' figures: the attention layer per token, the state per request
    per_token = len(attn["layers"]) * 2 * attn["num_kv_heads"] * attn["head_dim"] * 4
    assert info["kv_bytes_per_token"] == per_token
    assert info["kv_bytes_per_request"] == state_bytes(state)
    rng = random.Random(31)
    for n in LENS:
        ids = [rng.randrange(100, 40000) for _ in range(n)]
        rp, rd = pd(P, D, ids)
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        want = localhttp.post(S.url + "/generate", json=body(ids), timeout=120).json()["output_ids"]
        assert rd.json()["output_ids"] == want, f"{name}: prompt of {n} tokens"
        if p != "P":  # a one-rank prefill's record covers the whole request
            continue
        last = P.http.get("/server_info").json()["internal_states"][0]["recent_transfers"][-1]
        pages = -(-n // PAGE)
        page_bytes = len(attn["layers"]) * 2 * attn["num_kv_heads"] * PAGE * attn["head_dim"] * 4
        assert last["pages_per_group"] == [pages, 1], (n, last)
        assert last["kv_bytes"] == pages * page_bytes + state_bytes(state), (n, last)
    for proc in (P, D, S):
        if proc.http.get("/server_info").json()["tp_size"] > 1:
            all_ranks_idle(proc)
        else:
            proc.wait_idle()


def test_an_aborted_decode_frees_its_state_slot(hybrid_pd):
    """A decode whose room never gets a prefill gives its pages and slot back at the timeout."""
    P, D = hybrid_pd["P"], hybrid_pd["D"]
    b = body(list(range(100, 130)), P, random.randrange(2**63))
    b["bootstrap_port"] = c.free_port()  # no prefill there: the decode gives up on the room
    r = localhttp.post(D.url + "/generate", json=b, timeout=120)
    assert r.status_code >= 400, r.text
    D.wait_idle()
    P.wait_idle()


def test_a_decode_with_other_state_shapes_is_refused_naming_both(hybrid_pd):
    P, D = hybrid_pd["P"], hybrid_pd["Dn8"]
    rp, rd = pd(P, D, [5, 6, 7, 8])
    assert rd.status_code >= 400, rd.text
    msg = rd.json()["error"]["message"]
    # the SSM state of 8 heads of 16: a state size of 16 on prefill, 8 on decode
    assert "[8, 16, 16]" in msg and "[8, 16, 8]" in msg and "prefill" in msg, msg
    assert rp.status_code >= 400  # prefill gives up on the room instead of hanging
    P.wait_idle()
    D.wait_idle()


def stats(proc: c.Proc) -> dict:
    return proc.http.get("/server_info").json()["internal_states"][0]


@pytest.mark.parametrize("decode", ["Dpc", "D"])
def test_a_next_turn_hits_the_prefill_and_decode_prefix_caches(hybrid_pd, decode):
    """Turn 2 extends turn 1 and its answer. Prefill's tree holds turn 1's prompt with the state
    at its last page boundary, so prefill restores it and computes the rest; decode's tree (when
    on) holds turn 1's prompt and answer with the state snapshot decode took at its last page
    boundary, so those pages are not sent again; the state always is. The colocated tokens."""
    P, D, S = hybrid_pd["P"], hybrid_pd[decode], hybrid_pd["S"]
    rng = random.Random(41 if decode == "Dpc" else 43)
    turn1 = [rng.randrange(100, 40000) for _ in range(30)]
    rp, rd = pd(P, D, turn1)
    assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
    out1 = rd.json()["output_ids"]
    D.wait_idle()
    P.wait_idle()
    p_hits, d_hits = stats(P)["cache_hit_tokens"], stats(D)["cache_hit_tokens"]
    turn2 = turn1 + out1 + [rng.randrange(100, 40000) for _ in range(9)]
    rp, rd = pd(P, D, turn2)
    assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
    want = localhttp.post(S.url + "/generate", json=body(turn2), timeout=120).json()["output_ids"]
    assert rd.json()["output_ids"] == want
    # prefill: turn 1's 30 tokens went in chunks of 24, the second crossing token 28
    assert stats(P)["cache_hit_tokens"] - p_hits == 28
    # decode: turn 1's 30 + 10 - 1 tokens computed, its last snapshot at token 36
    hit = 36 if decode == "Dpc" else 0
    assert stats(D)["cache_hit_tokens"] - d_hits == hit
    last = stats(P)["recent_transfers"][-1]
    assert last["decode_prefix_pages"] == hit // PAGE, last
    assert last["pages_per_group"] == [-(-len(turn2) // PAGE) - hit // PAGE, 1], last
    D.wait_idle()
    P.wait_idle()


@pytest.mark.parametrize("router", ["pdserve", "sglang-router"])
def test_hybrid_pd_behind_a_router(hybrid_pd, router, tmp_path):
    """Through pdserve's router and the real sglang-router (prefill tp1, decode tp2): the
    colocated server's tokens, every server idle afterwards."""
    P, D, S = hybrid_pd["P"], hybrid_pd["Dtp2"], hybrid_pd["S"]
    if router == "sglang-router":
        if not sglang_router_available():
            pytest.skip("sglang-router is not installed")
        port = c.free_port()
        proc = start_sglang_router(
            [(P.url, P.bootstrap_port)], [D.url], port, log_path=str(tmp_path / "router.log")
        )
        url, stop = f"http://127.0.0.1:{port}", lambda: (proc.terminate(), proc.wait())
    else:
        R = c.router("R", [P], [D], tmp_path).start()
        url, stop = R.url, R.stop
    try:
        rng = random.Random(7)
        for n in (5, 40):
            ids = [rng.randrange(100, 40000) for _ in range(n)]
            got = localhttp.post(url + "/generate", json=body(ids), timeout=120)
            assert got.status_code == 200, got.text
            want = localhttp.post(S.url + "/generate", json=body(ids), timeout=120).json()
            assert got.json()["output_ids"] == want["output_ids"], (router, n)
    finally:
        stop()
    P.wait_idle()
    all_ranks_idle(D)


# Bamba with one Mamba2 group (as Bamba-9B and Granite 4.0-H have): two ranks split its heads
# and each holds the group whole, the gated norm summing over both
ONE_GROUP = dict(mamba_n_groups=1)


@pytest.fixture(
    scope="module",
    params=[
        "qwen3_next",
        "qwen3_5",
        "bamba",
        "olmo_hybrid",
        "jamba",
        "falcon_h1",
        "mamba2",
        "kimi_linear",
    ],
)
def qwen3_next_pd(request, tmp_path_factory):
    """Qwen3-Next (Gated DeltaNet with a q | k | v convolution state, gated attention, MoE),
    Qwen3.5 (its input projections apart, each sliced per rank; a dense MLP), Bamba with one
    Mamba2 group, OLMo-Hybrid (six input projections and a convolution stored in three parts;
    post-norm attention with q/k norms over the projections), Jamba (Mamba version 1: each rank
    its channels of x, z, the convolution, the time step and the state, x_proj's outputs summed
    before the norms; MoE), Falcon-H1 (every layer both a Mamba2 mixer and attention: in both
    cache groups), a pure Mamba2 model (pages without bytes: only the states move) and
    Kimi-Linear (Kimi Delta Attention: per-channel decays and their projections sliced per rank;
    latent attention, one latent per token for every rank; MoE) on one and two ranks each side,
    the attention with one KV head: two ranks replicate it."""
    logs = tmp_path_factory.mktemp(f"pd-{request.param}")
    extra = ONE_GROUP if request.param == "bamba" else {}
    if request.param != "kimi_linear":  # latent attention has no KV heads to set
        extra["num_key_value_heads"] = 1
    path = build_tiny_checkpoint(request.param, **extra)
    s = {
        "family": request.param,
        "path": path,
        "P": c.prefill("P", path, logs, *COMMON)[0],
        "D": c.decode("D", path, logs, *COMMON),
        "Ptp2": c.prefill("Ptp2", path, logs, *COMMON, "--tp-size", "2")[0],
        "Dtp2": c.decode("Dtp2", path, logs, *COMMON, "--tp-size", "2"),
    }
    procs = [p for p in s.values() if isinstance(p, c.Proc)]
    try:
        c.start_all(procs)
        yield s
    finally:
        c.stop_all(procs)


QWEN3_NEXT_PAIRS = [("tp1->tp2", "P", "Dtp2"), ("tp2->tp1", "Ptp2", "D")]
STATE_LAYERS = {"bamba": [0, 2, 3], "olmo_hybrid": [0, 1, 2], "jamba": [0, 2, 3]}
STATE_LAYERS["falcon_h1"] = [0, 1]
STATE_LAYERS["mamba2"] = [0, 1, 2]
STATE_LAYERS["kimi_linear"] = [0, 1, 2]


@pytest.mark.parametrize("name, p, d", QWEN3_NEXT_PAIRS, ids=[x[0] for x in QWEN3_NEXT_PAIRS])
def test_qwen3_next_pd_across_tp_sizes_gives_hf_tokens(qwen3_next_pd, name, p, d):
    """Each rank's key heads' q, k and v channels of the convolution state and its value heads'
    recurrent state reach the decode ranks that hold them, and the one KV head reaches both
    ranks of a two-rank decode (more ranks than KV heads): HF's greedy tokens (float32). Bamba's
    one group of B and C channels reaches both ranks of a two-rank decode whole, from one rank of
    a two-rank prefill."""
    from tests.e2e.test_engine_moe import hf_reference

    P, D = qwen3_next_pd[p], qwen3_next_pd[d]
    info = P.http.get("/server_info").json()["scheduler_info"]
    state = info["cache_groups"][1]
    bamba = qwen3_next_pd["family"] == "bamba"
    assert state["kind"] == "recurrent_state"
    assert state["layers"] == STATE_LAYERS.get(qwen3_next_pd["family"], [0, 1, 3])
    # what a one-rank prefill sends a two-rank decode twice: the one group's B and C channels
    shared = 0
    if bamba:
        x, b, c = state["segments"][0]
        shared = len(state["layers"]) * (b + c) * state["shapes"][0][1] * 4
    rng = random.Random(37)
    for n in (3, 25, 70):
        ids = [rng.randrange(100, 40000) for _ in range(n)]
        rp, rd = pd(P, D, ids)
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        want, _ = hf_reference(qwen3_next_pd["path"], ids, NEW_TOKENS)
        assert rd.json()["output_ids"] == want, f"{name}: prompt of {n} tokens"
        if p == "P":  # the whole request's bytes: its pages, to each of decode's two ranks (the
            # one KV head replicated there), and one state of each GDN layer, sliced between them
            last = P.http.get("/server_info").json()["internal_states"][0]["recent_transfers"][-1]
            pages = info["kv_bytes_per_token"] * -(-n // PAGE) * PAGE
            assert last["kv_bytes"] == 2 * pages + state_bytes(state) + shared, (n, last)
    for proc in (P, D):
        if proc.http.get("/server_info").json()["tp_size"] > 1:
            all_ranks_idle(proc)
        else:
            proc.wait_idle()
