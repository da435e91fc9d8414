"""Tensor parallelism end to end: ``pdserve serve --tp-size 2`` against one rank, and PD between
servers of equal and different TP sizes (P tp1 -> D tp2, P tp2 -> D tp1, P tp2 -> D tp2), through
pdserve's router and the real sglang-router, with every rank's pools and metadata slots free
afterwards; pairings where some prefill ranks hold no KV head decode reads from them (MQA tp2 ->
tp1, tp4 -> tp2 and tp1; GQA with 2 KV heads tp4 -> tp2 and tp1), a room failed there ending on
every rank; a fault on one prefill rank fails the room everywhere; a killed decode rank takes its
server down.

Reference outputs come from the offline engine (one rank, float32), itself checked against HF.
"""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.checkpoints import LLAMA_MQA_TIED, build_tiny_checkpoint
from tests.helpers.sglang_router import sglang_router_available, start_sglang_router

NEW_TOKENS = 8
COMMON = [
    "--max-total-tokens",
    "16384",
    "--page-size",
    "16",
    "--chunked-prefill-size",
    "128",
    "--disaggregation-bootstrap-timeout",
    "20",
    "--disaggregation-waiting-timeout",
    "20",
]


def prompts(n: int, seed: int, max_len: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def generate(url: str, ids: list[int], logprobs: bool = False) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
    }
    if logprobs:
        body.update(return_logprob=True, logprob_start_len=0)
    r = localhttp.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def generate_pd(
    prefill: c.Proc, decode: c.Proc, ids: list[int], decode_ids: list[int] | None = None
):
    """One request sent to prefill and decode as a router sends it (``decode_ids``: decode gets
    another prompt); returns both responses."""
    room = random.randrange(2**63)

    def body(x: list[int]) -> dict:
        return {
            "input_ids": x,
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": room,
        }

    with ThreadPoolExecutor(2) as ex:
        fp = ex.submit(localhttp.post, prefill.url + "/generate", json=body(ids), timeout=120)
        fd = ex.submit(
            localhttp.post, decode.url + "/generate", json=body(decode_ids or ids), timeout=120
        )
        return fp.result(), fd.result()


def idle(proc: c.Proc) -> None:
    if proc.http.get("/server_info").json()["tp_size"] > 1:
        all_ranks_idle(proc)
    else:
        proc.wait_idle()


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
    return {
        "llama": build_tiny_checkpoint(
            "llama"
        ),  # 4 heads, 2 KV heads: one KV head per rank at tp 2
        "mqa": build_tiny_checkpoint("llama", **LLAMA_MQA_TIED),
    }  # 1 KV head (replicated), tied head


@pytest.fixture(scope="session")
def reference(tp_models):
    import torch

    import pdserve

    torch.set_num_threads(1)
    engines = {
        name: pdserve.Engine(
            model_path=path, torch_num_threads=1, max_total_tokens=16384, page_size=16
        )
        for name, path in tp_models.items()
    }
    cache: dict = {}

    def get(model: str, ids: list[int]) -> dict:
        key = (model, tuple(ids))
        if key not in cache:
            cache[key] = engines[model].generate(
                input_ids=ids,
                sampling_params={
                    "temperature": 0,
                    "max_new_tokens": NEW_TOKENS,
                    "ignore_eos": True,
                },
                return_logprob=True,
                logprob_start_len=0,
            )
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
    # the other way to start ranks: spawned, each a fresh interpreter (C2's are forked)
    S["C2mqa"].env["PDSERVE_RANK_START_METHOD"] = "spawn"
    try:
        c.start_all(S.values())
        routers = {
            "1->2": c.router("R12", [S["P1"]], [S["D2"]], logs),
            "2->1": c.router("R21", [S["P2"]], [S["D1"]], logs),
            "2->2": c.router("R22", [S["P2"]], [S["D2"]], logs),
        }
        for r in routers.values():
            r.start()
        yield {"servers": S, "routers": routers, "logs": logs}
    finally:
        c.stop_all(list(locals().get("routers", {}).values()) + list(S.values()))


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
        for a, b in zip(
            out["meta_info"]["output_token_logprobs"], ref["meta_info"]["output_token_logprobs"]
        ):
            assert abs(a[0] - b[0]) < 1e-4
    all_ranks_idle(server)


def test_ranks_are_forked_or_spawned_as_configured(tp, tmp_path, tp_models):
    """C2's two ranks are forked from its front end (a forked rank keeps its parent's command
    line), C2mqa's spawned (PDSERVE_RANK_START_METHOD=spawn); both name themselves pdserve-tpN
    and both serve the reference's tokens (test_colocated_tp2_matches_one_rank). A value that is
    neither stops the server with a message naming the variable."""

    def ranks(name: str) -> list[tuple[str, bytes]]:
        front = tp["servers"][name].proc.pid
        return [
            (open(f"/proc/{pid}/comm").read().strip(), open(f"/proc/{pid}/cmdline", "rb").read())
            for pid in c.scheduler_pids(front)
        ]

    forked = ranks("C2")
    front_cmdline = open(f"/proc/{tp['servers']['C2'].proc.pid}/cmdline", "rb").read()
    assert sorted(comm for comm, _ in forked) == ["pdserve-tp0", "pdserve-tp1"], forked
    assert all(cmdline == front_cmdline for _, cmdline in forked), forked
    spawned = ranks("C2mqa")
    assert sorted(comm for comm, _ in spawned) == ["pdserve-tp0", "pdserve-tp1"], spawned
    assert all(b"spawn_main" in cmdline for _, cmdline in spawned), spawned

    bad = c.server("Cbad", tp_models["llama"], tmp_path, "--tp-size", "2", *COMMON)
    bad.env["PDSERVE_RANK_START_METHOD"] = "vfork"
    bad.start(wait=False)
    try:
        assert bad.proc.wait(timeout=120) != 0
    finally:
        bad.stop()
    assert "PDSERVE_RANK_START_METHOD='vfork': expected fork or spawn" in bad.log_tail()


@pytest.mark.parametrize("pairing", ["1->2", "2->1", "2->2"])
def test_pd_across_tp_sizes_matches_one_rank(tp, reference, pairing):
    router = tp["routers"][pairing]
    ps = prompts(10, seed=10 + len(pairing) + ord(pairing[0]) + ord(pairing[-1]))
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda ids: generate(router.url, ids), ps))
    for ids, out in zip(ps, outs):
        assert out["output_ids"] == reference("llama", ids)["output_ids"], (
            f"{pairing}: prompt of {len(ids)} tokens"
        )
    S = tp["servers"]
    for name in {"1->2": ("P1", "D2"), "2->1": ("P2", "D1"), "2->2": ("P2", "D2")}[pairing]:
        idle(S[name])


@pytest.fixture(scope="module")
def tp_heads(tp, tmp_path_factory, tp_models):
    """Servers where some prefill ranks hold no KV head any decode rank reads from them: prefill
    tp4 of llama (2 KV heads, each on 2 ranks) next to ``tp``'s D1 and D2; of the MQA model (1 KV
    head on every rank) prefill tp2 and tp4, decode tp1 and tp2. Small pools: few, short
    requests."""
    logs = tmp_path_factory.mktemp("tp_heads")
    small = [*COMMON, "--max-total-tokens", "4096"]
    llama, mqa = tp_models["llama"], tp_models["mqa"]
    S = {
        "P4": c.prefill("P4", llama, logs, "--tp-size", "4", *small)[0],
        "P2mqa": c.prefill("P2mqa", mqa, logs, "--tp-size", "2", *small)[0],
        "P4mqa": c.prefill("P4mqa", mqa, logs, "--tp-size", "4", *small)[0],
        "D1mqa": c.decode("D1mqa", mqa, logs, *small),
        "D2mqa": c.decode("D2mqa", mqa, logs, "--tp-size", "2", *small),
    }
    try:
        c.start_all(S.values())
        yield {**S, "D1": tp["servers"]["D1"], "D2": tp["servers"]["D2"]}
    finally:
        c.stop_all(S.values())


# pairing -> (model, prefill, decode); the prefill ranks that write nothing follow rank_map
HEAD_PAIRINGS = {
    "llama 4->2": ("llama", "P4", "D2"),  # ranks 1, 2 write nothing
    "llama 4->1": ("llama", "P4", "D1"),  # ranks 1, 3
    "mqa 2->1": ("mqa", "P2mqa", "D1mqa"),  # rank 1
    "mqa 4->2": ("mqa", "P4mqa", "D2mqa"),  # ranks 2, 3
    "mqa 4->1": ("mqa", "P4mqa", "D1mqa"),
}  # ranks 1, 2, 3


@pytest.mark.parametrize("pairing", sorted(HEAD_PAIRINGS))
def test_pd_with_prefill_ranks_that_write_nothing(tp_heads, reference, pairing):
    """A prefill rank whose heads decode reads from other replicas concludes every room without
    writing, so no request waits for it (it would fail after the bootstrap timeout otherwise)."""
    model, p, d = HEAD_PAIRINGS[pairing]
    P, D = tp_heads[p], tp_heads[d]
    ps = prompts(6, seed=40 + sorted(HEAD_PAIRINGS).index(pairing))
    with ThreadPoolExecutor(3) as ex:
        outs = list(ex.map(lambda ids: generate_pd(P, D, ids), ps))
    for ids, (rp, rd) in zip(ps, outs):
        assert rp.status_code == 200 and rd.status_code == 200, (pairing, rp.text, rd.text)
        assert rd.json()["output_ids"] == reference(model, ids)["output_ids"], (
            f"{pairing}: prompt of {len(ids)} tokens"
        )
    for s in (P, D):
        idle(s)


def test_a_room_failed_by_the_writing_ranks_ends_on_the_idle_ones(tp_heads, reference):
    """Decode preallocates for a shorter prompt than prefill's: prefill ranks 0 and 1 (the writing
    ones) fail the room, ranks 2 and 3 (which write nothing and so check no page count) fail it
    through the all-reduce, decode is told, and every rank of both servers frees what it held."""
    P, D = tp_heads["P4mqa"], tp_heads["D2mqa"]
    rp, rd = generate_pd(P, D, list(range(100, 300)), decode_ids=list(range(100, 120)))
    assert rp.status_code >= 400 and rd.status_code >= 400, (rp.text, rd.text)
    assert "preallocated" in rd.text, rd.text
    for s in (P, D):
        all_ranks_idle(s)
    ids = prompts(1, seed=50)[0]  # both servers serve the next request
    rp, rd = generate_pd(P, D, ids)
    assert (
        rd.status_code == 200 and rd.json()["output_ids"] == reference("mqa", ids)["output_ids"]
    ), rd.text


@pytest.mark.skipif(not sglang_router_available(), reason="sglang-router is not installed")
def test_pd_tp_behind_the_real_sglang_router(tp, reference, tmp_path):
    S = tp["servers"]
    port = c.free_port()
    proc = start_sglang_router(
        [(S["P2"].url, S["P2"].bootstrap_port)],
        [S["D1"].url],
        port,
        log_path=str(tmp_path / "sglang-router.log"),
    )
    try:
        for ids in prompts(4, seed=30):
            assert (
                generate(f"http://127.0.0.1:{port}", ids)["output_ids"]
                == reference("llama", ids)["output_ids"]
            )
    finally:
        proc.terminate()
        proc.wait()
    all_ranks_idle(S["P2"])
    S["D1"].wait_idle()


def test_fault_on_one_prefill_rank_fails_the_room_everywhere(tmp_path, tp_models):
    """A write that fails on prefill rank 1 only: the request fails once, with the reason, on every
    rank of both servers, and both servers serve the next request."""
    llama = tp_models["llama"]
    P, _ = c.prefill(
        "Pf",
        llama,
        tmp_path,
        "--tp-size",
        "2",
        "--disaggregation-fault-prob",
        "1",
        "--disaggregation-fault-ranks",
        "1",
        "--disaggregation-fault-mode",
        "fail_transfer",
        *COMMON,
    )
    D = c.decode("Df", llama, tmp_path, "--tp-size", "2", *COMMON)
    try:
        c.start_all((P, D))
        room = random.randrange(2**63)
        body = {
            "input_ids": list(range(100, 140)),
            "sampling_params": {"temperature": 0, "max_new_tokens": 4},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": P.bootstrap_port,
            "bootstrap_room": room,
        }
        with ThreadPoolExecutor(2) as ex:
            fp = ex.submit(localhttp.post, P.url + "/generate", json=body, timeout=60)
            fd = ex.submit(localhttp.post, D.url + "/generate", json=body, timeout=60)
            rp, rd = fp.result(), fd.result()
        assert rd.status_code >= 500 and rp.status_code >= 500, (rp.text, rd.text)
        assert "injected fault" in rd.text, rd.text
        for s in (P, D):
            all_ranks_idle(s)
        for s in (P, D):  # the fault was on rank 1 only, and per room: the servers are healthy
            assert s.http.get("/health").status_code == 200
    finally:
        c.stop_all((P, D))


def test_a_killed_decode_rank_takes_its_server_down(tmp_path, tp_models):
    llama = tp_models["llama"]
    P, _ = c.prefill("Pk", llama, tmp_path, *COMMON)
    D = c.decode("Dk", llama, tmp_path, "--tp-size", "2", *COMMON)
    router = None
    try:
        c.start_all((P, D))
        router = c.router("Rk", [P], [D], tmp_path).start()
        assert generate(router.url, [5, 6, 7])["output_ids"]
        schedulers = c.scheduler_pids(D.proc.pid)
        assert len(schedulers) == 2, schedulers
        os.kill(schedulers[-1], signal.SIGKILL)  # one rank
        # the server goes down cleanly: the front end exits, no process is left behind
        c.wait_for(lambda: D.proc.poll() is not None, 60, "the decode server to exit")
        c.wait_for(lambda: not any(c.is_alive(p) for p in schedulers), 30, "every rank to exit")
        # the router stops sending to it: a request fails fast with a server error, not a hang
        t0 = time.monotonic()
        r = localhttp.post(
            router.url + "/generate",
            json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
            timeout=60,
        )
        assert r.status_code >= 500 and time.monotonic() - t0 < 30
    finally:
        if router is not None:
            router.stop()
        c.stop_all((P, D))
