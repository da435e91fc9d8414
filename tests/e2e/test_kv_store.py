"""The cluster-wide prefix store (``--hicache-storage-backend mooncake``) with a real
``mooncake_master`` on TCP: two prefill servers and a decode server (local transfer backend). A
prompt prefilled on prefill A is served from the store on prefill B, with the greedy tokens of a
cold colocated run; killing the master while requests flow fails none of them, later prompts
are computed locally, and once a master is back at the same address sharing resumes."""

from __future__ import annotations

import json
import random
import threading

import pytest

from pdserve.server.store_master import StoreMaster
from tests.helpers import cluster as c
from tests.helpers import localhttp
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
                    breaker_max_cooldown_s=2.0,
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
            c.stop_all((D, B, A))
    # the master is gone by now: leaving the store must not hold up a server's exit
    for s in (A, B):
        assert "did not exit after SIGTERM" not in s.log_path.read_text(errors="replace"), s.name


def master_log(server: c.Proc):
    return server.log_path.parent / "mooncake_master_restarted.log"


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


def test_killing_the_master_mid_run_fails_no_request_and_a_new_one_is_used(store_pd, reference):
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
    # A's writes after the kill fail (off the requests' path, counted when the writer gets to them)
    c.wait_for(
        lambda: stats(A)["hicache_write_failures_storage"] > 0, 30, "A's failed store writes"
    )
    # the master comes back at the same address: the servers' next probes find it, their
    # clients mount their segments again, and prompts are shared once more
    back = StoreMaster(rpc_port=master.rpc_port, log_path=str(master_log(A))).wait_ready()
    try:
        room = [300]

        def shared_again():
            ids = [rng.randrange(100, 30000) for _ in range(3 * PAGE + 1)]
            written = stats(A)["hicache_writes_storage"]
            room[0] += 2
            assert run_pd(A, D, ids, room=room[0]) == reference(ids)["output_ids"]
            try:
                c.wait_for(lambda: stats(A)["hicache_writes_storage"] >= written + 3, 3)
            except TimeoutError:
                return None  # written while A's breaker was still open
            # B finds them once its own probe has found the master again (each server probes on
            # its own schedule): until then it computes them, correctly
            hits = stats(B)["hicache_hit_tokens_storage"]
            assert run_pd(B, D, ids, room=room[0] + 1) == reference(ids)["output_ids"]
            return stats(B)["hicache_hit_tokens_storage"] - hits == 3 * PAGE or None

        c.wait_for(shared_again, 90, "A's writes reaching the restarted master and B reading them")
    finally:
        back.stop()
    for s in (A, B, D):
        s.wait_idle()


def test_launch_kv_store_starts_the_master_and_its_servers_use_it(tiny_llama_path, tmp_path):
    """``pdserve launch --kv-store mooncake`` with two prefills: a prompt that prefill 0 computed
    is a store hit on prefill 1 (the router alternates them), with the same tokens; Ctrl-C stops
    the master with the rest."""
    import os
    import signal
    import subprocess
    import sys

    port = c.free_port()
    log_path = tmp_path / "launch.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "launch",
            "--model-path",
            tiny_llama_path,
            "--port",
            str(port),
            "--num-prefill",
            "2",
            "--torch-num-threads",
            "1",
            "--max-total-tokens",
            "8192",
            "--kv-store",
            "mooncake",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    master_pids: list[int] = []
    try:

        def ready():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            return b"pdserve cluster ready" in log_path.read_bytes()

        c.wait_for(ready, 300, "the cluster to be ready", interval=0.5)
        master_pids = [
            p
            for p in c.children(proc.pid)
            if open(f"/proc/{p}/comm").read().strip() == "mooncake_master"
        ]
        assert len(master_pids) == 1

        def prefills() -> list[dict]:
            info = localhttp.get(url + "/server_info", timeout=30).json()["prefill"]
            return [p["server_info"]["internal_states"][0] for p in info]

        # the servers run the store tier (their warm-up already wrote to it)
        before = prefills()
        assert all("hicache_hit_tokens_storage" in p for p in before), before
        rng = random.Random(21)
        ids = [rng.randrange(100, 30000) for _ in range(6 * PAGE + 2)]
        body = {
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
        }
        outs = []
        for turn in range(2):
            r = localhttp.post(url + "/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            outs.append(r.json()["output_ids"])
            if turn == 0:
                c.wait_for(
                    lambda: (
                        sum(p["hicache_writes_storage"] for p in prefills())
                        >= sum(p["hicache_writes_storage"] for p in before) + 6
                    ),
                    30,
                    "the first prefill's pages in the store",
                )
        assert outs[0] == outs[1]
        hits = [
            p["hicache_hit_tokens_storage"] - b["hicache_hit_tokens_storage"]
            for p, b in zip(prefills(), before)
        ]
        assert sorted(hits) == [0, 6 * PAGE], hits  # the other prefill read them from the store
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=90)
        log.close()
    assert code == 0, log_path.read_text()[-3000:]
    c.wait_for(lambda: not any(c.is_alive(p) for p in master_pids), 15, "the master to stop")
