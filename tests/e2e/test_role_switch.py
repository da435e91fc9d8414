"""``POST /switch_role`` end to end: two servers behind pdserve's router swap prefill and decode
under load, one becomes colocated and goes back, all without loading their weights again; the
router notices a switch by itself (the server's ``/server_info`` role and ``role_epoch``, read at
each health check), lets the server go from its old role and takes it in its new one; a server
can also be taken out and put back through the router's worker API.

Every request either completes with the offline engine's tokens or, having arrived during the
drain (or still running at its timeout), ends with a 503 naming the switch; the switched servers
serve their new roles token for token like the fresh servers did; every page is free or cached
once idle; the weights' digest (model object, data pointers of every weight and packed weight)
is the one the server started with.
"""

from __future__ import annotations

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import httpx
import pytest

from tests.e2e.conftest import PD_NEW_TOKENS as NEW_TOKENS
from tests.helpers import cluster as c
from tests.helpers import localhttp

KEY = "role-switch-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMMON = [
    "--max-total-tokens",
    "65536",
    "--page-size",
    "16",
    "--api-key",
    KEY,
    "--disaggregation-bootstrap-timeout",
    "10",
    "--disaggregation-waiting-timeout",
    "10",
]
SWITCHING = "switching its role"


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(1, 300))] for _ in range(n)]


def body(ids: list[int], stream: bool = False, new_tokens: int = NEW_TOKENS) -> dict:
    return {
        "input_ids": ids,
        "stream": stream,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
    }


def generate(url: str, ids: list[int], stream: bool = False) -> tuple[int, dict]:
    """(status, final output or error body) of one /generate."""
    with localhttp.Client(timeout=60, headers=AUTH) as h:
        if not stream:
            r = h.post(url + "/generate", json=body(ids))
            return r.status_code, r.json()
        with h.stream("POST", url + "/generate", json=body(ids, stream=True)) as r:
            if r.status_code != 200:
                return r.status_code, json.loads(r.read())
            events = [
                json.loads(line[6:])
                for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
        last = events[-1]
        return (last["error"]["code"], last) if "error" in last else (200, last)


def info(proc: c.Proc) -> dict:
    r = proc.http.get("/server_info")
    assert r.status_code == 200, r.text
    return r.json()


def switch(proc: c.Proc, **fields) -> httpx.Response:
    return proc.http.post("/switch_role", json=fields, timeout=120)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_llama_path):
    """A (prefill) and B (decode) with the API key, and router R1 over them."""
    logs = tmp_path_factory.mktemp("role_switch")
    A, _ = c.prefill("A", tiny_llama_path, logs, *COMMON)
    B = c.decode("B", tiny_llama_path, logs, *COMMON)
    B.bootstrap_port = c.free_port()  # the one B takes as a prefill
    routers = []
    try:
        c.start_all([A, B])
        for p in (A, B):
            p.http.headers.update(AUTH)
        R1 = c.router("R1", [A], [B], logs, "--api-key", KEY)
        R1.http.headers.update(AUTH)
        R1.start()
        routers.append(R1)
        yield {"A": A, "B": B, "R1": R1}
    finally:
        c.stop_all([*routers, A, B])


class Load:
    """Threads sending /generate through a router until ``stop``; every outcome is kept."""

    def __init__(self, url: str, ids: list[list[int]], threads: int = 6):
        self.url, self.ids = url, ids
        self.stop = threading.Event()
        self.outcomes: list[tuple[list[int], int, dict]] = []
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)
        ]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        k = i
        while not self.stop.is_set():
            ids = self.ids[k % len(self.ids)]
            status, out = generate(self.url, ids, stream=k % 2 == 1)
            with self.lock:
                self.outcomes.append((ids, status, out))
            k += len(self.threads)

    def done(self) -> int:
        with self.lock:
            return len(self.outcomes)

    def join(self) -> list:
        self.stop.set()
        for t in self.threads:
            t.join(60)
        return self.outcomes


def long_stream(url: str, ids: list[int], first: threading.Event, result: list) -> None:
    """A stream that runs past any drain timeout here; its last event is kept."""
    with localhttp.Client(timeout=120, headers=AUTH) as h:
        with h.stream("POST", url + "/generate", json=body(ids, stream=True, new_tokens=4000)) as r:
            last = None
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = json.loads(line[6:])
                    first.set()
            result.append((r.status_code, last))


def test_swap_roles_under_load(pair, reference):
    A, B, R1 = pair["A"], pair["B"], pair["R1"]
    started = {p.name: info(p)["scheduler_info"] for p in (A, B)}
    sample = prompts(12, seed=7)
    fresh = [generate(R1.url, ids) for ids in sample]  # the fresh servers, in their start-up roles
    for ids, (status, out) in zip(sample, fresh):
        assert status == 200 and out["output_ids"] == reference(ids)["output_ids"]

    # B: decode -> prefill while requests run through R1
    load = Load(R1.url, prompts(30, seed=8))
    first, long_result = threading.Event(), []
    long_req = threading.Thread(
        target=long_stream, args=(R1.url, prompts(1, seed=9)[0], first, long_result)
    )
    long_req.start()
    c.wait_for(lambda: load.done() >= 12 and first.is_set(), 60, "load through R1")
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(switch, B, role="prefill", bootstrap_port=B.bootstrap_port, drain_timeout=3)
        c.wait_for(lambda: B.http.get("/health").status_code == 503, 10, "B to refuse new work")
        load.stop.set()  # requests already sent finish; new ones now get 503
        during = [
            generate(R1.url, sample[0]),
            generate(B.url, sample[0]),
            generate(B.url, sample[1], stream=True),
        ]
        health = B.http.get("/health")
        state = info(B)
        again = switch(B, role="colocated")
        resp = fut.result()
    outcomes = load.join()
    long_req.join(60)

    assert resp.status_code == 200, resp.text
    done = resp.json()
    assert (done["role"], done["previous_role"], done["role_epoch"]) == ("prefill", "decode", 1)
    assert done["aborted_requests"] >= 1  # the long stream, past the 3 s drain timeout
    assert done["weights"] == started["B"]["weights"]  # same model object, same data pointers
    for status, out in during:
        assert status == 503 and SWITCHING in out["error"]["message"], out
    assert health.status_code == 503 and SWITCHING in health.json()["error"]["message"]
    assert state["status"] == "switching" and state["role_switch"]["to"] == "prefill", state[
        "role_switch"
    ]
    assert again.status_code == 409 and "in progress" in again.json()["error"]["message"]
    # no request lost: each finished with the offline engine's tokens, or got the 503 naming the
    # switch
    assert len(outcomes) >= 12
    for ids, status, out in outcomes:
        if status == 200:
            assert out["output_ids"] == reference(ids)["output_ids"]
        else:
            assert status == 503 and SWITCHING in out["error"]["message"], (status, out)
    assert sum(status == 200 for _, status, _ in outcomes) >= 12
    ((status, last),) = long_result
    assert status == 200 and last["error"]["code"] == 503, last  # ended in its stream, naming why
    assert SWITCHING in last["error"]["message"] and "drain timeout" in last["error"]["message"]

    # A: prefill -> decode, still among R1's workers: R1 reads both servers' new roles from their
    # /server_info at its health checks, lets each go from its old role and takes it in its new one
    resp = switch(A, role="decode")
    assert resp.status_code == 200, resp.text
    assert resp.json()["weights"] == started["A"]["weights"]
    want = {B.url: ("prefill", B.bootstrap_port), A.url: ("decode", None)}
    c.wait_for(lambda: worker_roles(R1) == want, 30, "R1 to take A and B in their new roles")
    with ThreadPoolExecutor(6) as ex:
        swapped = list(
            ex.map(
                lambda j: generate(R1.url, *j), [(ids, i % 2 == 1) for i, ids in enumerate(sample)]
            )
        )
    assert [out["output_ids"] for _, out in swapped] == [out["output_ids"] for _, out in fresh]
    for p, mode in ((A, "decode"), (B, "prefill")):
        now = info(p)
        assert (now["disaggregation_mode"], now["role_epoch"], now["status"]) == (mode, 1, "ready")
        assert now["scheduler_info"]["weights"] == started[p.name]["weights"]
        pools = p.wait_idle()
        assert pools["total_pages"] == started[p.name]["num_pages"] - 1
    pair["swapped"] = True


def worker_roles(router: c.Proc) -> dict:
    """url -> (role, bootstrap port) of the router's workers that take requests."""
    return {
        w["url"]: (w["worker_type"], w.get("bootstrap_port"))
        for w in router.http.get("/workers").json()["workers"]
        if not w.get("draining")
    }


def leave(router: c.Proc, proc: c.Proc) -> None:
    """Remove ``proc`` from the router's workers and wait until it is forgotten (drained)."""
    assert router.http.delete("/workers/" + quote(proc.url, safe="")).status_code == 202
    c.wait_for(
        lambda: all(w["url"] != proc.url for w in router.http.get("/workers").json()["workers"]),
        30,
        f"the router to let {proc.name} go",
    )


def test_colocated_and_back(pair, reference):
    A, B = pair["A"], pair["B"]
    if not pair.get("swapped"):
        pytest.skip("needs the swapped pair of test_swap_roles_under_load")
    sample = prompts(8, seed=11)
    leave(pair["R1"], A)
    resp = switch(A, role="colocated")
    assert resp.status_code == 200, resp.text
    assert info(A)["disaggregation_mode"] == "null"
    for i, ids in enumerate(sample):  # served by A alone, as a colocated server
        status, out = generate(A.url, ids, stream=i % 2 == 1)
        assert status == 200 and out["output_ids"] == reference(ids)["output_ids"]
    A.wait_idle()
    resp = switch(A, role="decode", drain_timeout=5)
    assert resp.status_code == 200, resp.text
    assert resp.json()["role_epoch"] == 3
    assert A.integrity()["cached_pages"] == 0  # the switch flushed the prefix cache
    assert (
        pair["R1"].http.post("/workers", json={"url": A.url, "worker_type": "decode"}).status_code
        == 202
    )
    for ids in sample:
        status, out = generate(pair["R1"].url, ids)
        assert status == 200 and out["output_ids"] == reference(ids)["output_ids"]
    A.wait_idle()
    B.wait_idle()


def test_bad_input(pair):
    A, B = pair["A"], pair["B"]
    mode = info(A)["disaggregation_mode"]
    current = "colocated" if mode == "null" else mode
    other = "prefill" if current != "prefill" else "decode"
    cases = [
        ({"role": "worker"}, 400, "role: must be one of"),
        ({"role": other, "migrate_to": ["a host"]}, 400, "migrate_to: 'a host' is not a host"),
        ({"role": other, "migrate_to": ["10.0.0.1:1"]}, 403, "--migration-peers"),
        ({"role": other, "drain_timeout": -1}, 400, "drain_timeout"),
        ({"role": other, "drain_timeout": "soon"}, 400, "drain_timeout"),
        ({"role": other, "surprise": 1}, 400, "surprise"),
        ({}, 400, "role"),
        (
            {"role": "colocated" if current != "colocated" else "decode", "bootstrap_port": 9},
            400,
            "only a prefill",
        ),
    ]
    for fields, status, needle in cases:
        r = switch(A, **fields)
        assert r.status_code == status and needle in r.json()["error"]["message"], (fields, r.text)
    r = switch(A, role=current)  # the role it has: nothing to do, and nothing done
    assert r.status_code == 200 and r.json()["changed"] is False, r.text
    assert r.json()["role_epoch"] == info(A)["role_epoch"]
    if (
        info(B)["disaggregation_mode"] == "prefill" and current != "prefill"
    ):  # B holds its bootstrap port
        r = switch(A, role="prefill", bootstrap_port=B.bootstrap_port)
        assert r.status_code == 409 and "not free" in r.json()["error"]["message"], r.text
    r = localhttp.post(A.url + "/switch_role", json={"role": other})  # no key
    assert r.status_code == 401
    assert (
        info(A)["role_epoch"] == info(A)["role_switch"]["epoch"]
    )  # nothing changed by the refusals
    assert info(A)["disaggregation_mode"] == mode
    A.wait_idle()
