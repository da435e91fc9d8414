"""The cluster-wide prefix store (``--hicache-storage-backend mooncake``) with a real
``mooncake_master`` on TCP: two prefill servers and a decode server (local transfer backend). A
prompt prefilled on prefill A is served from the store on prefill B, with the greedy tokens of a
cold colocated run; killing the master while requests flow fails none of them, and later prompts
are computed locally."""

from __future__ import annotations

import json
import random
import threading

import pytest

from tests.helpers import cluster as c
from tests.helpers.store_master import running_master

PAGE = 16
COMMON = [
    "--page-size",
    str(PAGE),
    "--max-total-tokens",
    "8192",
    "--disaggregation-bootstrap-timeout",
    "20",
    "--disaggregation-waiting-timeout",
    "20",
]


@pytest.fixture(scope="module")
def store_pd(tmp_path_factory, tiny_llama_path):
    logs = tmp_path_factory.mktemp("kv_store")
    with running_master(str(logs)) as master:
        store = [
            "--enable-hierarchical-cache",
            "--hicache-storage-backend",
            "mooncake",
            "--hicache-storage-backend-extra-config",
            json.dumps(
                master.client_config(
                    global_segment_size="64MB",
                    local_buffer_size="16MB",
                    timeout_s=1.0,
                    breaker_cooldown_s=0.5,
                )
            ),
        ]
        A, _ = c.prefill("Pa", tiny_llama_path, logs, *COMMON, *store)
        B, _ = c.prefill("Pb", tiny_llama_path, logs, *COMMON, *store)
        D = c.decode("D", tiny_llama_path, logs, *COMMON)
        try:
            c.start_all((A, B, D))
            yield master, A, B, D
        finally:
            for s in (D, B, A):
                s.stop()


def stats(server: c.Proc) -> dict:
    return server.http.get("/server_info").json()["internal_states"][0]


def computed(server: c.Proc) -> int:
    """Prompt tokens the server computed (not found in its pool or tiers)."""
    s = stats(server)
    return s["prompt_tokens"] - s["cache_hit_tokens"]


def run_pd(prefill: c.Proc, decode: c.Proc, ids: list[int], room: int) -> list[int]:
    rp, rd = c.post_pd(prefill, decode, c.greedy_body(ids, 8, prefill, room))
    assert rp.status_code == 200, rp.text
    assert rd.status_code == 200, rd.text
    return rd.json()["output_ids"]


def test_a_prefix_prefilled_on_one_server_is_a_store_hit_on_another(store_pd, reference):
    master, A, B, D = store_pd
    rng = random.Random(11)
    prompt = [rng.randrange(100, 30000) for _ in range(7 * PAGE + 5)]
    assert run_pd(A, D, prompt, room=1) == reference(prompt)["output_ids"]
    full_pages = (len(prompt) - 1) // PAGE  # the last token is always computed
    # write-through: A's pages reach the store off its request's path
    c.wait_for(
        lambda: stats(A).get("hicache_writes_storage", 0) >= full_pages,
        30,
        "A's pages written to the store",
    )
    before, hits_before = computed(B), stats(B).get("hicache_hit_tokens_storage", 0)
    # the same prompt and one that extends it, on B: both find A's pages in the store
    assert run_pd(B, D, prompt, room=2) == reference(prompt)["output_ids"]
    hit = stats(B)["hicache_hit_tokens_storage"] - hits_before
    assert hit == full_pages * PAGE
    assert computed(B) - before == len(prompt) - hit
    longer = prompt + [rng.randrange(100, 30000) for _ in range(20)]
    assert run_pd(B, D, longer, room=3) == reference(longer)["output_ids"]
    for s in (A, B, D):
        s.wait_idle()


def test_killing_the_master_mid_run_fails_no_request(store_pd, reference):
    master, A, B, D = store_pd
    rng = random.Random(12)
    shared = [rng.randrange(100, 30000) for _ in range(4 * PAGE)]
    prompts = [shared + [rng.randrange(100, 30000) for _ in range(9)] for _ in range(8)]
    failures: list = []
    outputs: dict[int, list[int]] = {}
    half = threading.Event()

    def flow() -> None:
        for i, ids in enumerate(prompts):
            if i == len(prompts) // 2:
                half.set()
            try:
                outputs[i] = run_pd((A, B)[i % 2], D, ids, room=100 + i)
            except AssertionError as e:
                failures.append((i, str(e)))
        half.set()

    t = threading.Thread(target=flow)
    t.start()
    half.wait(120)
    master.kill()  # SIGKILL while requests are in flight
    t.join(300)
    assert not t.is_alive() and not failures, failures
    for i, ids in enumerate(prompts):
        assert outputs[i] == reference(ids)["output_ids"], i
    # with the store gone, a prompt prefilled on A is computed again on B, correctly
    hits = stats(B).get("hicache_hit_tokens_storage", 0)
    fresh = [rng.randrange(100, 30000) for _ in range(5 * PAGE + 3)]
    assert run_pd(A, D, fresh, room=200) == reference(fresh)["output_ids"]
    before = computed(B)
    assert run_pd(B, D, fresh, room=201) == reference(fresh)["output_ids"]
    assert stats(B)["hicache_hit_tokens_storage"] == hits
    assert computed(B) - before == len(fresh)
    assert stats(A).get("hicache_write_failures_storage", 0) > 0  # writes after the kill failed
    for s in (A, B, D):
        s.wait_idle()
