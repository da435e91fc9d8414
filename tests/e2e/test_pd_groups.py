"""PD on models with two cache groups (Gemma 2: S,F,S,F; Gemma 3: S,S,F,S,S,F; window 16): the
full-attention group's pages go with every chunk, the sliding-window group's only after the last
chunk and only those its window covers at the end of the prompt; decode preallocates just those.
Tokens equal a colocated server's, across TP sizes (P tp1 -> D tp2, P tp2 -> D tp1) and over the
local and Mooncake backends; the bytes a request moves are what the layout predicts; every pool
of every group is free afterwards; a decode whose window differs is refused, naming both.
"""

from __future__ import annotations

import random

import httpx
import pytest

from pdserve.disagg.transfer import get_backend
from tests.e2e.test_tp import all_ranks_idle
from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.checkpoints import build_tiny_checkpoint

PAGE = 4
WINDOW = 16
NEW_TOKENS = 12  # decode runs past the window's pages
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
LENS = (1, 7, 15, 16, 17, 40, 90)


def mooncake_available() -> bool:
    try:
        get_backend("mooncake")
    except ValueError:
        return False
    return True


@pytest.fixture(scope="module")
def groups_pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-groups")
    g2, g3 = build_tiny_checkpoint("gemma2"), build_tiny_checkpoint("gemma3")
    g3w8 = build_tiny_checkpoint("gemma3", sliding_window=8)
    tp2 = ["--tp-size", "2"]
    s = {
        "S2": c.server("S2", g2, logs, *COMMON),
        "S3": c.server("S3", g3, logs, *COMMON),
        "P2": c.prefill("P2", g2, logs, *COMMON)[0],
        "D2": c.decode("D2", g2, logs, *COMMON),
        "P3": c.prefill("P3", g3, logs, *COMMON)[0],
        "D3": c.decode("D3", g3, logs, *COMMON),
        "P3tp2": c.prefill("P3tp2", g3, logs, *COMMON, *tp2)[0],
        "D3tp2": c.decode("D3tp2", g3, logs, *COMMON, *tp2),
        "D3w8": c.decode("D3w8", g3w8, logs, *COMMON),
    }
    if mooncake_available():
        mc = ["--disaggregation-transfer-backend", "mooncake"]
        s["P3mc"] = c.prefill("P3mc", g3, logs, *COMMON, *mc)[0]
        s["D3mc"] = c.decode("D3mc", g3, logs, *COMMON, *mc)
    try:
        c.start_all(list(s.values()))
        yield s
    finally:
        c.stop_all(s.values())


def body(ids: list[int], prefill: c.Proc | None = None, room: int = 0) -> dict:
    return c.greedy_body(ids, NEW_TOKENS, prefill, room)


def pd(prefill: c.Proc, decode: c.Proc, ids: list[int]) -> tuple[httpx.Response, httpx.Response]:
    return c.post_pd(prefill, decode, body(ids, prefill, random.randrange(2**63)))


def predicted(info: dict, n: int) -> tuple[list[int], int]:
    """(pages per group, bytes) a prompt of ``n`` tokens moves from a one-rank prefill."""
    total = -(-n // PAGE)
    pages, nbytes = [], 0
    for g in info["cache_groups"]:
        first = max(0, n - g["window"] + 1) // PAGE if g["kind"] == "sliding_window" else 0
        pages.append(total - first)
        nbytes += (
            pages[-1] * len(g["layers"]) * 2 * g["num_kv_heads"] * PAGE * g["head_dim"] * 4
        )  # float32
    return pages, nbytes


def idle(*procs: c.Proc) -> None:
    for p in procs:
        if p.http.get("/server_info").json()["tp_size"] > 1:
            all_ranks_idle(p)
        else:
            p.wait_idle()


PAIRS = [
    ("gemma2", "P2", "D2", "S2"),
    ("gemma3", "P3", "D3", "S3"),
    ("gemma3 tp1->tp2", "P3", "D3tp2", "S3"),
    ("gemma3 tp2->tp1", "P3tp2", "D3", "S3"),
    ("gemma3 mooncake", "P3mc", "D3mc", "S3"),
]


@pytest.mark.parametrize("name, p, d, ref", PAIRS, ids=[x[0] for x in PAIRS])
def test_pd_matches_colocated_and_moves_the_predicted_pages(groups_pd, name, p, d, ref):
    if p not in groups_pd:
        pytest.skip("the mooncake transfer engine is not installed")
    P, D, S = groups_pd[p], groups_pd[d], groups_pd[ref]
    info = P.http.get("/server_info").json()["scheduler_info"]
    assert [g["kind"] for g in info["cache_groups"]] == ["sliding_window", "full_attention"]
    rng = random.Random(hash(name) % 1000)
    for n in LENS:
        ids = [rng.randrange(100, 40000) for _ in range(n)]
        rp, rd = pd(P, D, ids)
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        want = localhttp.post(S.url + "/generate", json=body(ids), timeout=120).json()["output_ids"]
        assert rd.json()["output_ids"] == want, f"{name}: prompt of {n} tokens"
        if "tp2" not in p:  # a one-rank prefill's record covers the whole request
            last = P.http.get("/server_info").json()["internal_states"][0]["recent_transfers"][-1]
            pages, nbytes = predicted(info, n)
            assert last["pages_per_group"] == pages and last["kv_bytes"] == nbytes, (
                n,
                last,
                pages,
                nbytes,
            )
    idle(P, D, S)


def test_decode_with_another_window_is_refused_naming_both(groups_pd):
    P, D = groups_pd["P3"], groups_pd["D3w8"]
    rp, rd = pd(P, D, [5, 6, 7, 8])
    assert rd.status_code >= 400, rd.text
    msg = rd.json()["error"]["message"]
    assert "window 16" in msg and "window 8" in msg and "prefill" in msg and "decode" in msg, msg
    assert rp.status_code >= 400  # prefill gives up on the room instead of hanging
    idle(P, D)
