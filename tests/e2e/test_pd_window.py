"""PD on a sliding-window model (Mistral: a window on every layer, one cache group): decode
preallocates and prefill sends only the pages the window covers at the end of the prompt, the
tokens equal a colocated server's, the bytes moved equal what the layout predicts, and every
pool is free afterwards."""

from __future__ import annotations

import random

import pytest

from tests.e2e.conftest import PD_NEW_TOKENS
from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.checkpoints import build_tiny_checkpoint

PAGE = 4
WINDOW = 32  # the tiny mistral's
COMMON = [
    "--max-total-tokens",
    "8192",
    "--page-size",
    str(PAGE),
    "--chunked-prefill-size",
    "48",
    "--disaggregation-bootstrap-timeout",
    "10",
    "--disaggregation-waiting-timeout",
    "10",
]


@pytest.fixture(scope="module")
def window_pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-window")
    model = build_tiny_checkpoint("mistral")
    P, _ = c.prefill("Pw", model, logs, *COMMON)
    D = c.decode("Dw", model, logs, *COMMON)
    S = c.server("Sw", model, logs, *COMMON)
    servers = [P, D, S]
    R = None
    try:
        c.start_all(servers)
        R = c.router("Rw", [P], [D], logs).start()
        yield P, D, S, R
    finally:
        c.stop_all([x for x in (R, *servers) if x is not None])


def generate(url: str, ids: list[int]) -> list[int]:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": PD_NEW_TOKENS, "ignore_eos": True},
    }
    r = localhttp.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def window_pages(prompt_len: int) -> int:
    """Pages decode needs for its first query (position prompt_len sees keys from
    prompt_len - 31)."""
    return -(-prompt_len // PAGE) - max(0, prompt_len - WINDOW + 1) // PAGE


def test_pd_sends_only_the_window_and_matches_colocated(window_pd):
    P, D, S, R = window_pd
    # K and V of every layer for one token, as the server reports it
    per_token = P.http.get("/server_info").json()["scheduler_info"]["kv_bytes_per_token"]
    rng = random.Random(11)
    for n in (5, 31, 32, 33, 150, 301):  # shorter than, at and far past the window
        ids = [rng.randrange(100, 40000) for _ in range(n)]
        assert generate(R.url, ids) == generate(S.url, ids), f"prompt of {n} tokens"
        last = P.http.get("/server_info").json()["internal_states"][0]["recent_transfers"][-1]
        assert last["pages"] == window_pages(n), (n, last)
        assert last["kv_bytes"] == window_pages(n) * PAGE * per_token, (n, last)
    for s in (P, D, S):
        s.wait_idle()
        pools = s.integrity()
        assert (
            pools["in_use_pages"] == 0
            and pools["free_pages"] + pools["cached_pages"] == pools["total_pages"]
        )
