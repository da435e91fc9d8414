"""KV-aware routing and conditional disaggregation against real servers: the router follows the
workers' KV events, sends a follow-up to the worker holding its prefix (and away from it when
that worker is overloaded), rebuilds a restarted worker's index, and with ``--pd-policy
conditional`` lets decode prefill short prompts itself; outputs stay the reference's."""

from __future__ import annotations

import contextlib
import random
import re
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import PD_NEW_TOKENS
from tests.helpers import cluster as c
from tests.helpers import localhttp

COMMON = c.PAGED_PD_ARGS
# fixed prefill costs for the conditional router, so its choices do not depend on how fast the
# servers happened to be at start-up (the calibration itself is tested in test_calibration)
FIT = ["--pd-prefill-fixed-s", "0.005", "--pd-prefill-s-per-token", "0.00001"]


def events() -> list[str]:
    return [
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{c.free_port()}",
        "--kv-events-replay-endpoint",
        f"tcp://127.0.0.1:{c.free_port()}",
    ]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_path):
    logs = tmp_path_factory.mktemp("kv_routing")
    Pa, _ = c.prefill("Pka", tiny_llama_path, logs, *COMMON, *events())
    Pb, _ = c.prefill("Pkb", tiny_llama_path, logs, *COMMON, *events())
    D = c.decode(
        "Dk",
        tiny_llama_path,
        logs,
        "--disaggregation-decode-enable-radix-cache",
        *COMMON,
        *events(),
    )
    Wa = c.server("Wka", tiny_llama_path, logs, *COMMON, *events())
    Wb = c.server("Wkb", tiny_llama_path, logs, *COMMON, *events())
    procs = [Pa, Pb, D, Wa, Wb]
    try:
        c.start_all(procs)
        fast = ["--load-poll-interval", "0.05", "--health-check-interval", "0.5"]
        routers = {
            "pd_cache": c.router(
                "Rk1", [Pa, Pb], [D], logs, "--prefill-policy", "cache_aware", *fast
            ),
            "pd_cond": c.router(
                "Rk2",
                [Pa, Pb],
                [D],
                logs,
                "--prefill-policy",
                "cache_aware",
                "--pd-policy",
                "conditional",
                "--pd-local-max-tokens",
                "100",
                *FIT,
                *fast,
            ),
        }
        workers = [arg for w in (Wa, Wb) for arg in ("--worker", w.url)]
        routers["colocated"] = c.router(
            "Rk3", [], [], logs, "--policy", "cache_aware", *fast, *workers
        )
        for r in routers.values():
            procs.append(r)
            r.start()
        yield {"P": (Pa, Pb), "D": D, "W": (Wa, Wb), **routers}
    finally:
        c.stop_all(reversed(procs))


@contextlib.contextmanager
def streams_on(server: c.Proc, count: int, prompt_len: int, new_tokens: int, rng: random.Random):
    """``count`` long greedy streams running on ``server`` (sent to it directly, so a router sees
    only their load) until the block ends."""
    stop = threading.Event()

    def stream(ids: list[int]) -> None:
        body = {
            "input_ids": ids,
            "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
        }
        with localhttp.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
            for _ in r.iter_bytes():
                if stop.is_set():
                    return

    prompts = [[rng.randrange(100, 40000) for _ in range(prompt_len)] for _ in range(count)]
    threads = [threading.Thread(target=stream, args=(ids,), daemon=True) for ids in prompts]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        server.wait_idle()


def gen(url: str, ids: list[int], n: int = PD_NEW_TOKENS, **extra) -> httpx.Response:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
        **extra,
    }
    r = localhttp.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def index_blocks(router: c.Proc) -> dict[str, int]:
    workers = router.http.get("/kv_index").json()["workers"]
    return {url: sum(g["blocks"] for g in groups) for url, groups in workers.items()}


def matched(router: c.Proc, body: dict, path: str = "/generate") -> dict[str, int]:
    """Tokens of ``body``'s prompt each worker holds, as the router sees it."""
    r = router.http.post("/kv_index/match", params={"path": path}, json=body)
    assert r.status_code == 200, r.text
    return r.json()["workers"]


def wait_polled_idle(router: c.Proc) -> None:
    """Until the router's last load poll of every worker found it idle."""
    c.wait_for(
        lambda: all(
            w.get("polled_load") in ([0, 0], None)
            for ws in router.http.get("/get_load").json().values()
            for w in ws
        ),
        10,
        "router polls the workers idle",
    )


def wait_held(router: c.Proc, body: dict, tokens: int, path: str = "/generate") -> str:
    """The worker the router sees holding ``tokens`` of ``body``'s prompt (waits for the events,
    and for a load poll of every worker after the request that stored them: a poll taken while it
    ran would still count its tokens against the holder)."""
    c.wait_for(
        lambda: max(matched(router, body, path).values()) >= tokens,
        10,
        "router sees the prompt's blocks",
    )
    wait_polled_idle(router)
    return max(matched(router, body, path).items(), key=lambda kv: kv[1])[0]


def prefill_hits(p: c.Proc) -> int:
    return p.http.get("/server_info").json()["internal_states"][0]["cache_hit_tokens"]


def prefill_transfers(p: c.Proc) -> int:
    return len(p.http.get("/server_info").json()["internal_states"][0]["recent_transfers"])


def test_colocated_follow_up_goes_to_the_worker_holding_its_prefix(cluster, reference):
    R = cluster["colocated"]
    rng = random.Random(11)
    for k in range(4):
        turn1 = [rng.randrange(100, 40000) for _ in range(70)]
        out1 = gen(R.url, turn1).json()
        assert out1["output_ids"] == reference(turn1)["output_ids"]
        wait_held(R, {"input_ids": turn1}, 64)
        turn2 = turn1 + out1["output_ids"] + [rng.randrange(100, 40000) for _ in range(20)]
        out2 = gen(R.url, turn2).json()
        assert out2["output_ids"] == reference(turn2)["output_ids"]
        # only the worker that served turn 1 holds its pages (both start empty for this prompt)
        assert out2["meta_info"]["cached_tokens"] >= 64, (k, out2["meta_info"])
    # text prompts are tokenized by the router as the server does: chat turns share the prefix
    messages = [
        {"role": "user", "content": "Tell me about the sea and the ships that sail on it, " * 4}
    ]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0}
    first = localhttp.post(R.url + "/v1/chat/completions", json=body, timeout=60).json()
    wait_held(R, body, 32, "/v1/chat/completions")
    messages += [first["choices"][0]["message"], {"role": "user", "content": "And the wind?"}]
    second = localhttp.post(
        R.url + "/v1/chat/completions", json={**body, "messages": messages}, timeout=60
    ).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32, second["usage"]


def test_colocated_overloaded_worker_is_passed_over(cluster, reference):
    R, (Wa, Wb) = cluster["colocated"], cluster["W"]
    rng = random.Random(12)
    turn1 = [rng.randrange(100, 40000) for _ in range(70)]
    out1 = gen(R.url, turn1).json()["output_ids"]
    holder = Wa if wait_held(R, {"input_ids": turn1}, 64) == Wa.url else Wb
    with streams_on(holder, 4, 100, 2000, rng):
        c.wait_for(
            lambda: holder.http.get("/get_load").json()[0]["num_tokens"] > 400, 20, "holder loaded"
        )
        time.sleep(0.3)  # a few load polls
        turn2 = turn1 + out1 + [rng.randrange(100, 40000) for _ in range(20)]
        out2 = gen(R.url, turn2).json()
        assert out2["output_ids"] == reference(turn2)["output_ids"]
        assert out2["meta_info"]["cached_tokens"] == 0, (
            "went to the overloaded worker that holds the prefix"
        )


def test_restarted_worker_index_is_rebuilt_not_stale(cluster):
    R, (Wa, _) = cluster["colocated"], cluster["W"]
    c.wait_for(lambda: index_blocks(R).get(Wa.url, 0) > 0, 10, "worker a holds blocks")
    Wa.kill9()
    c.wait_for(lambda: index_blocks(R).get(Wa.url, 0) == 0, 10, "index of the dead worker dropped")
    Wa.start()
    c.wait_for(
        lambda: all(g["synced"] for g in R.http.get("/kv_index").json()["workers"][Wa.url]),
        30,
        "index rebuilt after the restart",
    )
    assert index_blocks(R)[Wa.url] == 0  # the new process holds nothing
    metrics = R.http.get("/metrics").text
    assert (
        f'pdserve_router_kv_index_resyncs_total{{reason="reconnected",worker="{Wa.url}"}}'
        in metrics
    )
    rng = random.Random(13)
    ids = [rng.randrange(100, 40000) for _ in range(40)]
    gen(Wa.url, ids)  # the restarted worker's new blocks reach the index again
    c.wait_for(lambda: index_blocks(R)[Wa.url] >= 2, 10, "new blocks of the restarted worker")


def test_pd_prefill_routing_follows_the_prefill_caches(cluster, reference):
    R, (Pa, Pb), D = cluster["pd_cache"], cluster["P"], cluster["D"]
    rng = random.Random(21)
    for k in range(3):
        turn1 = [rng.randrange(100, 40000) for _ in range(70)]
        out1 = gen(R.url, turn1).json()
        assert out1["output_ids"] == reference(turn1)["output_ids"]
        assert (
            "pd_decision" not in out1["meta_info"]
        )  # --pd-policy always: every request through prefill
        c.wait_for(
            lambda: max(matched(R, {"input_ids": turn1})[p.url] for p in (Pa, Pb)) >= 64,
            10,
            "router sees prefill's blocks",
        )
        holder = Pa if matched(R, {"input_ids": turn1})[Pa.url] >= 64 else Pb
        wait_polled_idle(R)  # a poll taken while turn 1 ran counts its tokens against the holder
        hits = prefill_hits(holder)
        turn2 = turn1 + out1["output_ids"] + [rng.randrange(100, 40000) for _ in range(20)]
        assert gen(R.url, turn2).json()["output_ids"] == reference(turn2)["output_ids"]
        assert prefill_hits(holder) - hits >= 64, k
    # --pd-policy always: a short prompt, with decode idle, still goes through a prefill
    D.wait_idle()
    transfers = prefill_transfers(Pa) + prefill_transfers(Pb)
    short = [rng.randrange(100, 40000) for _ in range(20)]
    r = gen(R.url, short)
    assert (
        r.json()["output_ids"] == reference(short)["output_ids"]
        and "x-pdserve-pd-mode" not in r.headers
    )
    c.wait_for(
        lambda: prefill_transfers(Pa) + prefill_transfers(Pb) == transfers + 1, 10, "one transfer"
    )
    D.wait_idle()


def test_conditional_short_prompt_on_decode_long_prompt_through_prefill(cluster, reference):
    R, (Pa, Pb), D = cluster["pd_cond"], cluster["P"], cluster["D"]
    for server in (Pa, D):  # each server measured its own prefill at start-up
        cal = server.http.get("/server_info").json()["calibration"]
        assert (
            cal["prefill_fixed_s"] > 0
            and cal["prefill_s_per_token"] >= 0
            and len(cal["measured"]) == 2
        ), cal
    D.wait_idle()
    rng = random.Random(31)
    transfers = prefill_transfers(Pa) + prefill_transfers(Pb)
    short = [rng.randrange(100, 40000) for _ in range(20)]
    r = gen(R.url, short)
    decision = r.json()["meta_info"]["pd_decision"]
    assert decision["mode"] == "local" and r.headers["x-pdserve-pd-mode"] == "local", decision
    assert r.json()["output_ids"] == reference(short)["output_ids"]
    assert prefill_transfers(Pa) + prefill_transfers(Pb) == transfers  # no prefill was involved
    # streamed: the decision comes with the last event
    body = {
        "input_ids": short[:18],
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": PD_NEW_TOKENS, "ignore_eos": True},
    }
    with localhttp.stream("POST", R.url + "/generate", json=body, timeout=60) as s:
        text = s.read().decode()
    assert '"pd_decision": {"mode": "local"' in text and s.headers["x-pdserve-pd-mode"] == "local"

    long = [rng.randrange(100, 40000) for _ in range(200)]
    r = gen(R.url, long)
    decision = r.json()["meta_info"]["pd_decision"]
    assert (decision["mode"], decision["reason"]) == ("pd", "too_long"), decision
    assert r.json()["output_ids"] == reference(long)["output_ids"]
    c.wait_for(
        lambda: prefill_transfers(Pa) + prefill_transfers(Pb) == transfers + 1, 10, "one transfer"
    )
    # the next turn: decode holds the conversation, so only the new tokens are left to prefill there
    c.wait_for(
        lambda: matched(R, {"input_ids": long})[D.url] >= 192, 10, "router sees decode's blocks"
    )
    turn2 = long + r.json()["output_ids"] + [rng.randrange(100, 40000) for _ in range(30)]
    r2 = gen(R.url, turn2)
    decision = r2.json()["meta_info"]["pd_decision"]
    assert decision["mode"] == "local" and decision["decode_cached_tokens"] >= 192, decision
    assert r2.json()["output_ids"] == reference(turn2)["output_ids"]
    metrics = R.http.get("/metrics").text
    assert 'pdserve_router_pd_decisions_total{mode="local",reason="faster_local"}' in metrics
    assert 'pdserve_router_pd_decisions_total{mode="pd",reason="too_long"}' in metrics
    D.wait_idle()
    for p in (Pa, Pb):
        p.wait_idle()


def test_conditional_sends_long_prompts_to_prefill_when_decode_is_busy(cluster):
    """The penalty for decode's running streams turns a short prompt to PD when decode is busy."""
    R, D = cluster["pd_cond"], cluster["D"]
    rng = random.Random(41)
    with streams_on(D, 16, 30, 3000, rng):
        c.wait_for(lambda: D.http.get("/get_load").json()[0]["num_reqs"] >= 16, 20, "decode busy")
        time.sleep(0.3)
        r = gen(R.url, [rng.randrange(100, 40000) for _ in range(90)])
        decision = r.json()["meta_info"]["pd_decision"]
        assert (decision["mode"], decision["reason"]) == ("pd", "faster_pd"), decision
        assert decision["itl_penalty_s"] > 0


REGEX = r"(yes|no), [0-9]{1,3} (apples|pears)"


def test_conditional_pd_keeps_the_grammar(cluster, offline_engine):
    """A constrained request decode runs itself and one through prefill both follow the grammar
    and give the offline engine's tokens (decode continues prefill's first token's grammar)."""
    R, D = cluster["pd_cond"], cluster["D"]
    # the streams of the test before may still be ending on decode: its load would turn the
    # short prompt to PD (the router polls every 0.05 s; a few polls after decode is idle)
    D.wait_idle()
    time.sleep(0.5)
    rng = random.Random(37)
    sp = {"temperature": 0, "max_new_tokens": 40, "regex": REGEX}
    for n, mode in ((20, "local"), (200, "pd")):
        ids = [rng.randrange(100, 40000) for _ in range(n)]
        r = localhttp.post(
            R.url + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=60
        )
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["pd_decision"]["mode"] == mode, out["meta_info"]["pd_decision"]
        assert re.fullmatch(REGEX, out["text"]), out["text"]
        assert (
            out["output_ids"]
            == offline_engine.generate(input_ids=ids, sampling_params=sp)["output_ids"]
        )
    D.wait_idle()
