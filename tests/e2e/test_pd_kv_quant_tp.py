"""PD with an int8 KV cache between different TP sizes: each prefill rank sends its KV heads'
int8 rows with their float32 scales (a scale region per K/V, split by heads like the rows), and
a decode of another TP size continues from them with the tokens of a colocated server with the
same ``--kv-cache-dtype`` (P tp1 -> D tp2, P tp2 -> D tp1); the bytes moved are the int8 pages and
their scales once, whatever the ranks."""

from __future__ import annotations

import random

import pytest

from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.checkpoints import build_tiny_checkpoint

PAGE = 4
NEW_TOKENS = 8
COMMON = [
    "--kv-cache-dtype",
    "int8",
    "--page-size",
    str(PAGE),
    "--max-total-tokens",
    "4096",
    "--chunked-prefill-size",
    "24",
    *c.PD_TIMEOUTS,
]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-int8-tp")
    path = build_tiny_checkpoint("llama")  # 2 KV heads: one per rank at tp 2
    S = c.server("S", path, logs, *COMMON)
    S.start()
    try:
        for pairs in c.tp_pairs(path, logs, *COMMON):
            yield {**pairs, "S": S}
    finally:
        S.stop()


@pytest.mark.parametrize("p, d", [("P1", "D2"), ("P2", "D1")])
def test_int8_pages_and_scales_move_between_tp_sizes(servers, p, d):
    from tests.e2e.test_tp import all_ranks_idle

    P, D, S = servers[p], servers[d], servers["S"]
    info = S.http.get("/server_info").json()["scheduler_info"]
    per_token = info["kv_bytes_per_token"]  # int8 rows and their scales, every layer
    rng = random.Random(hash(p) % 100)
    for n in (3, 25, 61):
        ids = [rng.randrange(100, 40000) for _ in range(n)]
        body = c.greedy_body(ids, NEW_TOKENS, P, rng.randrange(2**63))
        before = sum(c.kv_bytes_sent(P))
        rp, rd = c.post_pd(P, D, body)
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        want = localhttp.post(S.url + "/generate", json=c.greedy_body(ids, NEW_TOKENS), timeout=60)
        assert rd.json()["output_ids"] == want.json()["output_ids"], f"{p}->{d}: {n} tokens"
        assert sum(c.kv_bytes_sent(P)) - before == per_token * -(-n // PAGE) * PAGE, n
    for proc in (P, D):
        all_ranks_idle(proc) if proc in (servers["P2"], servers["D2"]) else proc.wait_idle()
