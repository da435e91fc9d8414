"""Decode prefix cache (``--disaggregation-decode-enable-radix-cache``): a decode server keeps
finished requests' KV; the next turn of a conversation matches its prefix there, decode asks
prefill only for the pages it lacks, and the output is still the reference's token for token."""

from __future__ import annotations

import random

import pytest

from tests.e2e.conftest import PD_NEW_TOKENS
from tests.helpers import cluster as c
from tests.helpers import localhttp

COMMON = c.PAGED_PD_ARGS


@pytest.fixture(scope="module")
def pd_cached(tmp_path_factory, tiny_llama_path):
    logs = tmp_path_factory.mktemp("decode_prefix")
    P, _ = c.prefill("Pdc", tiny_llama_path, logs, *COMMON)
    D = c.decode(
        "Ddc", tiny_llama_path, logs, "--disaggregation-decode-enable-radix-cache", *COMMON
    )
    R = None
    try:
        c.start_all((P, D))
        R = c.router("Rdc", [P], [D], logs).start()
        yield P, D, R
    finally:
        c.stop_all([x for x in (R, D, P) if x is not None])


def generate(url: str, ids: list[int]) -> list[int]:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": PD_NEW_TOKENS, "ignore_eos": True},
    }
    r = localhttp.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def stats(server: c.Proc) -> dict:
    return server.http.get("/server_info").json()["internal_states"][0]


def test_next_turn_sends_only_the_missing_pages(pd_cached, reference):
    P, D, R = pd_cached
    rng = random.Random(5)
    turn1 = [rng.randrange(100, 40000) for _ in range(60)]
    out1 = generate(R.url, turn1)
    assert out1 == reference(turn1)["output_ids"]
    D.wait_idle()
    hits = stats(D)["cache_hit_tokens"]
    turn2 = turn1 + out1 + [rng.randrange(100, 40000) for _ in range(30)]
    out2 = generate(R.url, turn2)
    assert out2 == reference(turn2)["output_ids"]
    # decode held turn 1's KV: 60 + 8 - 1 = 67 tokens -> 4 full pages of 16
    assert stats(D)["cache_hit_tokens"] - hits == 4 * 16
    last = stats(P)["recent_transfers"][-1]
    total = -(-len(turn2) // 16)
    assert last["decode_prefix_pages"] == 4 and last["pages"] == total - 4, last
    for s in (P, D):
        s.wait_idle()


def test_a_failed_room_keeps_the_decode_cache_consistent(pd_cached, reference):
    """A request whose prefill never comes (wrong bootstrap port) fails on decode: its cached
    prefix goes back to the tree unlocked, its own pages to the pool."""
    P, D, R = pd_cached
    rng = random.Random(6)
    turn1 = [rng.randrange(100, 40000) for _ in range(40)]
    out1 = generate(R.url, turn1)
    D.wait_idle()
    body = {
        "input_ids": turn1 + out1 + [5, 6, 7],
        "sampling_params": {"max_new_tokens": 2},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": P.bootstrap_port,
        "bootstrap_room": 12345,
    }
    # only the decode leg: prefill never hears of the room and decode gives up after its waiting
    # timeout
    r = localhttp.post(D.url + "/generate", json=body, timeout=60)
    assert r.status_code >= 500
    D.wait_idle()  # integrity: free + cached + in use == capacity, no lock left
    assert generate(R.url, turn1 + out1 + [8, 9]) == reference(turn1 + out1 + [8, 9])["output_ids"]


def test_constrained_turns_through_the_decode_cache(pd_cached, offline_engine):
    """A grammar request whose prefix decode holds: only the missing pages move, and its tokens
    are the offline engine's under the same grammar."""
    P, D, R = pd_cached
    rng = random.Random(13)
    sp = {"temperature": 0, "max_new_tokens": 40, "regex": r"(yes|no), [0-9]{1,3} (apples|pears)"}

    def run(ids: list[int]) -> dict:
        r = localhttp.post(
            R.url + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=60
        )
        assert r.status_code == 200, r.text
        out = r.json()
        assert (
            out["output_ids"]
            == offline_engine.generate(input_ids=ids, sampling_params=sp)["output_ids"]
        )
        return out

    turn1 = [rng.randrange(100, 40000) for _ in range(70)]
    out1 = run(turn1)
    D.wait_idle()
    hits = stats(D)["cache_hit_tokens"]
    run(turn1 + out1["output_ids"] + [rng.randrange(100, 40000) for _ in range(20)])
    assert stats(D)["cache_hit_tokens"] - hits >= 4 * 16
    for s in (P, D):
        s.wait_idle()
