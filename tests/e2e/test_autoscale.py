"""``pdserve router --autoscale`` end to end: three real servers (one prefill, two decodes) behind
an autoscaling router. Long prompts with short answers make a lasting prefill queue: the router
moves a decode server to prefill (drained, ``POST /switch_role``, taken back as a prefill). Then
short prompts with long answers make a lasting decode queue: a prefill goes back to decode.

Every request of both loads completes (none lost to a switch) with the offline engine's tokens;
the switched servers keep their weights; every page is free or cached once idle.
"""

from __future__ import annotations

import random
import threading

import pytest

from tests.helpers import cluster as c
from tests.helpers import localhttp

# small prefill chunks and batches, so that a queue builds on a tiny model; generous PD timeouts,
# since requests wait in queues on purpose
COMMON = [
    "--max-total-tokens",
    "65536",
    "--page-size",
    "16",
    "--chunked-prefill-size",
    "16",
    "--max-running-requests",
    "2",
    "--disaggregation-bootstrap-timeout",
    "60",
    "--disaggregation-waiting-timeout",
    "60",
    "--disaggregation-prealloc-timeout",
    "60",
]
AUTOSCALE = [
    "--autoscale",
    "--autoscale-interval",
    "0.5",
    "--autoscale-window",
    "3",
    "--autoscale-cooldown",
    "2",
    "--autoscale-queue",
    "1.5",
    "--drain-timeout",
    "60",
    "--health-check-interval",
    "1",
]


class Load:
    """Threads sending /generate through the router until ``stop``, each prompt new (a prompt sent
    before would be in the prefix cache and cost prefill nothing)."""

    def __init__(
        self, url: str, lengths: tuple[int, int], new_tokens: int, seed: int, threads: int = 8
    ):
        self.url, self.lengths, self.new_tokens = url, lengths, new_tokens
        self.stop = threading.Event()
        self.outcomes: list[tuple[list[int], int, dict]] = []
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._run, args=(random.Random(seed * 100 + i),), daemon=True)
            for i in range(threads)
        ]
        for t in self.threads:
            t.start()

    def _run(self, rng: random.Random) -> None:
        with localhttp.Client(timeout=120) as h:
            while not self.stop.is_set():
                ids = [rng.randrange(100, 40000) for _ in range(rng.randint(*self.lengths))]
                r = h.post(
                    self.url + "/generate",
                    json={
                        "input_ids": ids,
                        "sampling_params": {
                            "temperature": 0,
                            "max_new_tokens": self.new_tokens,
                            "ignore_eos": True,
                        },
                    },
                )
                with self.lock:
                    self.outcomes.append((ids, r.status_code, r.json()))

    def join(self) -> list:
        self.stop.set()
        for t in self.threads:
            t.join(120)
        return self.outcomes


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_path):
    logs = tmp_path_factory.mktemp("autoscale")
    P1, _ = c.prefill("P1", tiny_llama_path, logs, *COMMON)
    # each decode's --disaggregation-bootstrap-port is the one it serves as a prefill
    D1 = c.decode(
        "D1", tiny_llama_path, logs, *COMMON, "--disaggregation-bootstrap-port", str(c.free_port())
    )
    D2 = c.decode(
        "D2", tiny_llama_path, logs, *COMMON, "--disaggregation-bootstrap-port", str(c.free_port())
    )
    procs = [P1, D1, D2]
    try:
        c.start_all(procs)
        R = c.router("R", [P1], [D1, D2], logs, *AUTOSCALE)
        procs.append(R)
        R.start()
        yield {"P1": P1, "D1": D1, "D2": D2, "R": R}
    finally:
        c.stop_all(reversed(procs))


def roles(router: c.Proc) -> dict[str, str]:
    return {
        w["url"]: w["worker_type"]
        for w in router.http.get("/workers").json()["workers"]
        if not w["draining"]
    }


def switches(router: c.Proc) -> list[dict]:
    return router.http.get("/autoscale").json()["switches"]


def weights(proc: c.Proc) -> dict:
    return proc.http.get("/server_info").json()["scheduler_info"]["weights"]


def check(outcomes: list, offline_engine, new_tokens: int, cache: dict) -> None:
    assert outcomes
    for ids, status, out in outcomes:
        assert status == 200, out  # none lost: the router drains a server before it switches
        key = (tuple(ids), new_tokens)
        if key not in cache:
            cache[key] = offline_engine.generate(
                input_ids=ids,
                sampling_params={
                    "temperature": 0,
                    "max_new_tokens": new_tokens,
                    "ignore_eos": True,
                },
            )["output_ids"]
        assert out["output_ids"] == cache[key]


def test_autoscale_follows_the_queues(cluster, offline_engine):
    P1, D1, D2, R = cluster["P1"], cluster["D1"], cluster["D2"], cluster["R"]
    servers = (P1, D1, D2)
    started = {p.url: weights(p) for p in servers}
    state = R.http.get("/autoscale").json()
    assert (
        state["enabled"]
        and state["servers"] == {"prefill": 1, "decode": 2}
        and state["switches"] == []
    )
    cache: dict = {}

    # 1. long prompts, short answers: prefill falls behind, a decode becomes a prefill
    load = Load(R.url, (2000, 3000), new_tokens=4, seed=1)
    c.wait_for(lambda: switches(R), 120, "the autoscaler to switch a server", interval=0.5)
    c.wait_for(
        lambda: sorted(roles(R).values()) == ["decode", "prefill", "prefill"],
        60,
        "the router to take the switched server as a prefill",
        interval=0.5,
    )
    moved = switches(R)[0]
    assert (moved["from"], moved["to"], moved["outcome"]) == ("decode", "prefill", "switched"), (
        moved
    )
    assert moved["url"] in (D1.url, D2.url) and "prefill falls behind" in moved["reason"]
    n = len(load.outcomes)
    c.wait_for(lambda: len(load.outcomes) >= n + 8, 60, "requests through the new split")
    check(load.join(), offline_engine, 4, cache)
    assert len(switches(R)) == 1  # the last decode stays (--autoscale-min-decode 1)

    # 2. short prompts, long answers: one decode with 2 batch slots falls behind, a prefill goes to
    # decode
    load = Load(R.url, (4, 24), new_tokens=48, seed=2)
    c.wait_for(
        lambda: len(switches(R)) == 2, 120, "the autoscaler to switch a server back", interval=0.5
    )
    c.wait_for(
        lambda: sorted(roles(R).values()) == ["decode", "decode", "prefill"],
        60,
        "the router to take the switched server as a decode",
        interval=0.5,
    )
    back = switches(R)[1]
    assert (back["from"], back["to"], back["outcome"]) == ("prefill", "decode", "switched"), back
    assert "decode falls behind" in back["reason"]
    n = len(load.outcomes)
    c.wait_for(lambda: len(load.outcomes) >= n + 8, 60, "requests through the new split")
    check(load.join(), offline_engine, 48, cache)

    for p in servers:
        assert weights(p) == started[p.url]  # no weight loaded again
        p.wait_idle()  # every page free or cached
    epochs = {p.url: p.http.get("/server_info").json()["role_epoch"] for p in servers}
    assert epochs[moved["url"]] >= 1 and epochs[back["url"]] >= 1
