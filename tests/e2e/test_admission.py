"""Admission (``engine/admission.py``): a server with ``--max-queued-requests 2``, priority
scheduling and one running request at a time, directly and behind pdserve's router.

With one long request running and two waiting, a third of the same priority is refused at once
with 429, ``Retry-After`` and OpenAI's error shape (the official client raises its
``RateLimitError``); one of higher priority is admitted and the latest queued request of lower
priority is shed with 429; once the running one ends, the waiting queue runs by priority, not by
arrival. The router retries a shed request on the same worker after its backoff, then answers the
worker's 429 with its ``Retry-After``. A streamed request refused the same way gets the 429 as
its stream's error event. A request of priority 10 (the preemption threshold) above the running
one's takes its place, and the preempted one runs again after it to its last token; 9 above
waits its turn. Every pool is free afterwards.
"""

from __future__ import annotations

import sys
import threading
import time

import openai
import pytest

from tests.helpers import cluster as c
from tests.helpers import localhttp

# runs until the test aborts it (POST /abort_request), however fast the host decodes
LONG = {"temperature": 0, "max_new_tokens": 3000, "ignore_eos": True}
SHORT = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
SERVE = [
    "--max-queued-requests",
    "2",
    "--enable-priority-scheduling",
    "--max-running-requests",
    "1",
    "--max-total-tokens",
    "8192",
]


@pytest.fixture(scope="module")
def servers(tiny_llama_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("admission")
    S = c.server("S", tiny_llama_path, logs, *SERVE, "--served-model-name", "tiny")
    c.start_all([S])
    R = c.Proc(
        "R",
        [sys.executable, "-m", "pdserve.cli", "router", "--port", str(port := c.free_port())]
        + ["--worker", S.url, "--max-retries", "1", "--retry-initial-backoff-ms", "200"],
        port,
        logs,
    )
    try:
        c.start_all([R])
        yield {"S": S, "R": R}
    finally:
        R.stop()
        S.stop()


class Call(threading.Thread):
    """One /generate in the background: its status, body and headers."""

    def __init__(self, url: str, ids: list[int], sampling: dict, priority=None, rid=None):
        super().__init__(daemon=True)
        body = {"input_ids": ids, "sampling_params": sampling, "rid": rid}
        if priority is not None:
            body["priority"] = priority
        self.url, self.body = url, body
        self.status, self.json, self.headers = None, None, None
        self.start()

    def run(self) -> None:
        r = localhttp.post(
            self.url + "/generate",
            json=self.body,
            headers={"X-PDServe-Timeline": "1"},  # meta_info.timeline: when the scheduler ran it
            timeout=300,
        )
        self.status, self.json, self.headers = r.status_code, r.json(), r.headers


def queue_of(S: c.Proc) -> tuple[int, int]:
    pools = S.integrity()
    return pools["running"], pools["waiting"]


def fill(S: c.Proc) -> tuple[Call, Call, Call]:
    """A long request running and two short ones (priority 0) waiting behind it."""
    a = Call(S.url, list(range(100, 110)), LONG, rid=f"long-{time.monotonic_ns()}")
    c.wait_for(lambda: queue_of(S) == (1, 0), 60, "the long request to run", interval=0.02)
    b = Call(S.url, list(range(200, 210)), SHORT, priority=0)
    c.wait_for(lambda: queue_of(S) == (1, 1), 30, "the first to wait", interval=0.02)
    q = Call(S.url, list(range(300, 310)), SHORT)  # no priority: 0
    c.wait_for(lambda: queue_of(S) == (1, 2), 30, "the second to wait", interval=0.02)
    return a, b, q


def end(S: c.Proc, a: Call) -> None:
    """Abort the long request: the queue behind it runs."""
    r = S.http.post("/abort_request", json={"rid": a.body["rid"]})
    assert r.status_code == 200 and r.json()["aborted"], r.text
    a.join(60)
    assert a.status is not None and a.status != 200, a.json


def shed_count(S: c.Proc) -> float:
    for line in S.http.get("/metrics").text.splitlines():
        if line.startswith("pdserve:requests_total{") and 'finish_reason="shed"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_full_queue_refuses_with_429_and_sheds_lower_priority(servers):
    S = servers["S"]
    before = shed_count(S)
    refused_before = S.http.get("/get_load").json()[0]["num_shed_reqs"]
    a, b, q = fill(S)
    # the same priority as the queued ones: refused at once, nothing queued changes
    t0 = time.monotonic()
    r = localhttp.post(
        S.url + "/generate",
        json={"input_ids": [5, 6, 7], "sampling_params": SHORT, "priority": 0},
        timeout=30,
    )
    assert r.status_code == 429, r.text
    assert time.monotonic() - t0 < 5  # answered while the long request still runs
    assert r.headers["Retry-After"] == "1"
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == 429
    assert "--max-queued-requests 2" in err["message"]
    assert queue_of(S) == (1, 2)
    # the official client: a RateLimitError (no retries asked for)
    client = openai.OpenAI(base_url=S.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2)
    # higher priority: admitted; the latest queued one of lower priority gives way
    hi = Call(S.url, list(range(400, 410)), SHORT, priority=5)
    q.join(30)
    assert q.status == 429, q.json
    assert "higher priority" in q.json["error"]["message"]
    assert q.headers["Retry-After"] == "1"
    end(S, a)
    for call in (b, hi):
        call.join(300)
        assert call.status == 200, call.json
    # the waiting queue ran by priority: the later, higher one before the earlier one
    started = {
        k: x.json["meta_info"]["timeline"]["server_forward_start"]
        for k, x in (("hi", hi), ("b", b))
    }
    assert started["hi"] < started["b"], started
    assert shed_count(S) - before == 3
    # what the autoscaler reads as demand: two refused at the door, one shed from the queue
    assert S.http.get("/get_load").json()[0]["num_shed_reqs"] - refused_before == 3
    S.wait_idle()


def test_a_streamed_request_refused_gets_the_429_as_its_error_event(servers):
    S = servers["S"]
    a, b, q = fill(S)
    with localhttp.stream(
        "POST",
        S.url + "/generate",
        json={"input_ids": [5, 6, 7], "sampling_params": SHORT, "stream": True},
        timeout=30,
    ) as r:
        events = [ln for ln in r.iter_lines() if ln.startswith("data:")]
    assert '"code":429' in events[0] and events[-1] == "data: [DONE]", events
    end(S, a)
    for call in (b, q):
        call.join(300)
        assert call.status == 200, call.json
    S.wait_idle()


def test_the_router_retries_a_shed_request_then_answers_its_429(servers):
    S, R = servers["S"], servers["R"]
    a, b, q = fill(S)
    t0 = time.monotonic()
    r = localhttp.post(
        R.url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": SHORT}, timeout=60
    )
    assert r.status_code == 429, r.text
    assert time.monotonic() - t0 >= 0.2 * 0.8  # one retry, after its backoff (jitter 0.2)
    assert r.headers["Retry-After"] == "1"
    assert r.json()["error"]["code"] == 429
    retries = [
        ln
        for ln in R.http.get("/metrics").text.splitlines()
        if ln.startswith("pdserve_router_retries_total") and "/generate" in ln
    ]
    assert retries and float(retries[0].rsplit(" ", 1)[1]) >= 1, retries
    end(S, a)
    for call in (b, q):
        call.join(300)
        assert call.status == 200, call.json
    S.wait_idle()


def preemptions(S: c.Proc) -> int:
    return S.http.get("/server_info").json()["internal_states"][0]["preemptions"]


@pytest.mark.parametrize("priority, preempts", [(10, True), (9, False)], ids=["at", "below"])
def test_a_far_higher_priority_preempts_the_running_request(servers, priority, preempts):
    """With the one running place taken, a request whose priority is the threshold (10) above
    the running one's takes its place; the preempted one runs again after it and ends whole. Just
    below the threshold it waits its turn."""
    S = servers["S"]
    before = preemptions(S)
    n = 1500
    a = Call(S.url, list(range(100, 110)), {**LONG, "max_new_tokens": n}, priority=0)
    c.wait_for(lambda: queue_of(S) == (1, 0), 60, "the long request to run", interval=0.02)
    hi = Call(S.url, list(range(400, 410)), SHORT, priority=priority)
    for call in (hi, a):
        call.join(300)
        assert call.status == 200, call.json
    assert a.json["meta_info"]["completion_tokens"] == n
    events = {k: x.json["meta_info"]["timeline"] for k, x in (("a", a), ("hi", hi))}
    first, last = ("hi", "a") if preempts else ("a", "hi")
    assert events[first]["server_finished"] < events[last]["server_finished"], events
    assert preemptions(S) - before == int(preempts)
    S.wait_idle()


@pytest.fixture(scope="module")
def pd_servers(tiny_llama_path, tmp_path_factory):
    """P -> D behind a router; D runs one request at a time and lets one more wait."""
    logs = tmp_path_factory.mktemp("admission-pd")
    P, _ = c.prefill("P", tiny_llama_path, logs, *c.PAGED_PD_ARGS)
    D = c.decode(
        "D",
        tiny_llama_path,
        logs,
        *c.PAGED_PD_ARGS,
        "--max-running-requests",
        "1",
        "--max-queued-requests",
        "1",
    )
    procs = [P, D]
    try:
        c.start_all(procs)
        R = c.router("R", [P], [D], logs, "--retry-initial-backoff-ms", "100")
        procs.append(R)
        c.start_all([R])
        yield {"P": P, "D": D, "R": R}
    finally:
        c.stop_all(reversed(procs))


def test_through_pd_a_full_decode_queue_answers_429_and_ends_the_room(pd_servers):
    """Decode full (one running, one waiting): a third request is refused by decode with 429,
    retried once by the router, answered 429 with Retry-After; prefill's room for it ends (no
    room, page or slot held on either side); the waiting one runs once the running one ends."""
    P, D, R = pd_servers["P"], pd_servers["D"], pd_servers["R"]
    rid = f"long-{time.monotonic_ns()}"
    a = Call(R.url, list(range(100, 110)), LONG, rid=rid)
    c.wait_for(lambda: D.integrity()["running"] == 1, 60, "the long request on decode")
    b = Call(R.url, list(range(200, 210)), SHORT)

    def waiting_on_decode() -> bool:
        pools = D.integrity()
        return pools["prealloc_queue"] + pools["transfer_queue"] == 1

    c.wait_for(waiting_on_decode, 30, "the second waiting on decode", interval=0.02)
    r = localhttp.post(
        R.url + "/generate",
        json={"input_ids": [5, 6, 7], "sampling_params": SHORT},
        timeout=60,
    )
    assert r.status_code == 429, r.text
    assert r.headers["Retry-After"] == "1"
    assert "--max-queued-requests 1" in r.json()["error"]["message"]
    # the long one ends (aborted on decode, which prefill's side had finished long ago)
    assert D.http.post("/abort_request", json={"rid": rid}).json()["aborted"]
    a.join(60)
    b.join(120)
    assert b.status == 200, b.json
    assert b.json["meta_info"]["completion_tokens"] == SHORT["max_new_tokens"]
    for proc in (P, D):  # well before the 20 s a room waits for its peer
        pools = proc.wait_idle(timeout=5)
        assert pools.get("kv_rooms", 0) == 0, pools
