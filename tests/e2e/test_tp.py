"""Tensor parallelism end to end: ``pdserve serve --tp-size 2`` against one rank, and PD between
servers of equal and different TP sizes (P tp1 -> D tp2, P tp2 -> D tp1, P tp2 -> D tp2), through
pdserve's router and the real sglang-router, with every rank's pools and metadata slots free
afterwards; a fault on one prefill rank fails the room everywhere; a killed decode rank takes its
server down.

Reference outputs come from the offline engine (one rank, float32), itself checked against HF.
"""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers import cluster as c
from tests.helpers.checkpoints import LLAMA_MQA_TIED, build_tiny_checkpoint
from tests.helpers.sglang_router import sglang_router_available, start_sglang_router

NEW_TOKENS = 8
COMMON = ["--max-total-tokens", "16384", "--page-size", "16", "--chunked-prefill-size", "128",
          "--disaggregation-bootstrap-timeout", "20", "--disaggregation-waiting-timeout", "20"]


def prompts(n: int, seed: int, max_len: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def generate(url: str, ids: list[int], logprobs: bool = False) -> dict:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
    if logprobs:
        body.update(return_logprob=True, logprob_start_len=0)
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def all_ranks_idle(proc: c.Proc) -> None:
    """Every rank's pool and metadata slots back to free/cached."""
    proc.wait_idle()
    ranks = proc.http.get("/debug/integrity").json()["integrity"].get("ranks")
    assert ranks is not None and len(ranks) >= 2, "expected per-rank accounting from a TP server"
    for i, r in enumerate(ranks):
        assert r["in_use_pages"] == 0 and r["running"] == 0, (i, r)
        assert r["free_pages"] + r["cached_pages"] == r["total_pages"], (i, r)
        assert r.get("metadata_slots_free", 0) == r.get("metadata_slots_total", 0), (i, r)


@pytest.fixture(scope="session")
def tp_models():
    return {"llama": build_tiny_checkpoint("llama"),  # 4 heads, 2 KV heads: one KV head per rank at tp 2
            "mqa": build_tiny_checkpoint("llama", **LLAMA_MQA_TIED)}  # 1 KV head (replicated), tied head


@pytest.fixture(scope="session")
def reference(tp_models):
    import torch

    import pdserve

    torch.set_num_threads(1)
    engines = {name: pdserve.Engine(model_path=path, torch_num_threads=1, max_total_tokens=16384, page_size=16)
               for name, path in tp_models.items()}
    cache: dict = {}

    def get(model: str, ids: list[int]) -> dict:
        key = (model, tuple(ids))
        if key not in cache:
            cache[key] = engines[model].generate(
                input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
                return_logprob=True, logprob_start_len=0)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def tp(tmp_path_factory, tp_models):
    """Servers: colocated tp2 (llama, mqa); prefill P1 (tp1) / P2 (tp2); decode D1 (tp1) / D2 (tp2);
    routers for the three PD pairings."""
    logs = tmp_path_factory.mktemp("tp")
    llama = tp_models["llama"]
    S = {
        "C2": c.server("C2", llama, logs, "--tp-size", "2", *COMMON),
        "C2mqa": c.server("C2mqa", tp_models["mqa"], logs, "--tp-size", "2", *COMMON),
        "P1": c.prefill("P1", llama, logs, *COMMON)[0],
        "P2": c.prefill("P2", llama, logs, "--tp-size", "2", *COMMON)[0],
        "D1": c.decode("D1", llama, logs, *COMMON),
        "D2": c.decode("D2", llama, logs, "--tp-size", "2", *COMMON),
    }
    try:
        c.start_all(S.values())
        routers = {"1->2": c.router("R12", [S["P1"]], [S["D2"]], logs),
                   "2->1": c.router("R21", [S["P2"]], [S["D1"]], logs),
                   "2->2": c.router("R22", [S["P2"]], [S["D2"]], logs)}
        for r in routers.values():
            r.start()
        yield {"servers": S, "routers": routers, "logs": logs}
    finally:
        for p in list(locals().get("routers", {}).values()) + list(S.values()):
            p.stop()


@pytest.mark.parametrize("model", ["llama", "mqa"])
def test_colocated_tp2_matches_one_rank(tp, reference, model):
    server = tp["servers"]["C2" if model == "llama" else "C2mqa"]
    info = server.http.get("/server_info").json()
    assert info["tp_size"] == 2
    ps = prompts(12, seed=1 if model == "llama" else 2)
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda ids: generate(server.url, ids, logprobs=True), ps))
    for ids, out in zip(ps, outs):
        ref = reference(model, ids)
        # float32 on both: the only difference is the order of the partial sums over the ranks
        assert out["output_ids"] == ref["output_ids"], f"prompt of {len(ids)} tokens"
        for a, b in zip(out["meta_info"]["output_token_logprobs"], ref["meta_info"]["output_token_logprobs"]):
            assert abs(a[0] - b[0]) < 1e-4
    all_ranks_idle(server)


@pytest.mark.parametrize("pairing", ["1->2", "2->1", "2->2"])
def test_pd_across_tp_sizes_matches_one_rank(tp, reference, pairing):
    router = tp["routers"][pairing]
    ps = prompts(10, seed=10 + len(pairing) + ord(pairing[0]) + ord(pairing[-1]))
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda ids: generate(router.url, ids), ps))
    for ids, out in zip(ps, outs):
        assert out["output_ids"] == reference("llama", ids)["output_ids"], f"{pairing}: prompt of {len(ids)} tokens"
    S = tp["servers"]
    for name in {"1->2": ("P1", "D2"), "2->1": ("P2", "D1"), "2->2": ("P2", "D2")}[pairing]:
        if S[name].http.get("/server_info").json()["tp_size"] > 1:
            all_ranks_idle(S[name])
        else:
            S[name].wait_idle()


@pytest.mark.skipif(not sglang_router_available(), reason="sglang-router is not installed")
def test_pd_tp_behind_the_real_sglang_router(tp, reference, tmp_path):
    S = tp["servers"]
    port = c.free_port()
    proc = start_sglang_router([(S["P2"].url, S["P2"].bootstrap_port)], [S["D1"].url], port,
                               log_path=str(tmp_path / "sglang-router.log"))
    try:
        for ids in prompts(4, seed=30):
            assert generate(f"http://127.0.0.1:{port}", ids)["output_ids"] == reference("llama", ids)["output_ids"]
    finally:
        proc.terminate()
        proc.wait()
    all_ranks_idle(S["P2"])
    S["D1"].wait_idle()


def test_fault_on_one_prefill_rank_fails_the_room_everywhere(tmp_path, tp_models):
    """A write that fails on prefill rank 1 only: the request fails once, with the reason, on every
    rank of both servers, and both servers serve the next request."""
    llama = tp_models["llama"]
    P, _ = c.prefill("Pf", llama, tmp_path, "--tp-size", "2", "--disaggregation-fault-prob", "1",
                     "--disaggregation-fault-ranks", "1", "--disaggregation-fault-mode", "fail_transfer", *COMMON)
    D = c.decode("Df", llama, tmp_path, "--tp-size", "2", *COMMON)
    try:
        c.start_all((P, D))
        room = random.randrange(2**63)
        body = {"input_ids": list(range(100, 140)), "sampling_params": {"temperature": 0, "max_new_tokens": 4},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": P.bootstrap_port, "bootstrap_room": room}
        with ThreadPoolExecutor(2) as ex:
            fp = ex.submit(httpx.post, P.url + "/generate", json=body, timeout=60)
            fd = ex.submit(httpx.post, D.url + "/generate", json=body, timeout=60)
            rp, rd = fp.result(), fd.result()
        assert rd.status_code >= 500 and rp.status_code >= 500, (rp.text, rd.text)
        assert "injected fault" in rd.text, rd.text
        for s in (P, D):
            all_ranks_idle(s)
        for s in (P, D):  # the fault was on rank 1 only, and per room: the servers are healthy
            assert s.http.get("/health").status_code == 200
    finally:
        for s in (P, D):
            s.stop()


def test_a_killed_decode_rank_takes_its_server_down(tmp_path, tp_models):
    llama = tp_models["llama"]
    P, _ = c.prefill("Pk", llama, tmp_path, *COMMON)
    D = c.decode("Dk", llama, tmp_path, "--tp-size", "2", *COMMON)
    router = None
    try:
        c.start_all((P, D))
        router = c.router("Rk", [P], [D], tmp_path).start()
        assert generate(router.url, [5, 6, 7])["output_ids"]
        schedulers = [pid for pid in c.children(D.proc.pid)
                      if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read()]
        assert len(schedulers) == 2, schedulers
        os.kill(schedulers[-1], signal.SIGKILL)  # one rank
        # the server goes down cleanly: the front end exits, no process is left behind
        c.wait_for(lambda: D.proc.poll() is not None, 60, "the decode server to exit")
        c.wait_for(lambda: not any(c.is_alive(p) for p in schedulers), 30, "every rank to exit")
        # the router stops sending to it: a request fails fast with a server error, not a hang
        t0 = time.monotonic()
        r = httpx.post(router.url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
            "max_new_tokens": 2}}, timeout=60)
        assert r.status_code >= 500 and time.monotonic() - t0 < 30
    finally:
        if router is not None:
            router.stop()
        for s in (P, D):
            s.stop()
