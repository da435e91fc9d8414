"""The PD router against fake prefill/decode workers (real HTTP servers on loopback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.router.app import create_app
from pdserve.router.args import RouterArgs
from pdserve.router.dispatch import retry_backoff_s
from tests.helpers import localhttp
from tests.helpers.fake_workers import AppServer, FakeCluster, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
GEN = {"text": "one two three", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}


@pytest.fixture(scope="module")
def cluster():
    c = FakeCluster()
    for _ in range(2):
        c.add("prefill")
    for _ in range(2):
        c.add("decode")
    yield c
    c.close()


@pytest.fixture
def pd(cluster):
    for w in cluster.workers:
        w.reset()
    p0, p1, d0, d1 = cluster.workers
    return p0, p1, d0, d1


class RunningRouter:
    def __init__(self, args: RouterArgs):
        self.app = create_app(args)
        self.router = self.app.state.router
        self.server = AppServer(self.app, lifespan="on")
        self.url = self.server.url
        self.client = localhttp.Client(base_url=self.url, timeout=20)

    def worker(self, url: str):
        return next(w for w in self.router.pool.workers if w.url == url)

    def wait_ready(self):
        wait_until(lambda: self.client.get("/health").status_code == 200, what="router /health 200")

    def stop(self):
        self.client.close()
        self.server.stop()


def gen_requests(*workers):
    return [r for w in workers for r in w.generation_requests()]


def sse_events(raw: bytes) -> list:
    out = []
    for event in raw.decode().split("\n\n"):
        for line in event.splitlines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---------------------------------------------------------------------------- dual dispatch
def test_both_legs_get_identical_body_with_bootstrap_fields(pd, make_router):
    p0, p1, d0, d1 = pd
    r = make_router([p0, p1], [d0, d1])
    resp = r.client.post(
        "/generate", json=GEN, headers={"Authorization": "Bearer tok", "X-Request-ID": "abc"}
    )
    assert resp.status_code == 200
    [pre] = gen_requests(p0, p1)
    [dec] = gen_requests(d0, d1)
    assert pre.body == dec.body
    body = pre.json
    prefill = p0 if pre in p0.requests else p1
    assert body["bootstrap_host"] == "127.0.0.1"
    assert body["bootstrap_port"] == prefill.bootstrap_port
    assert isinstance(body["bootstrap_room"], int) and 0 <= body["bootstrap_room"] < 2**63
    assert {k: v for k, v in body.items() if not k.startswith("bootstrap_")} == GEN
    assert pre.headers["authorization"] == dec.headers["authorization"] == "Bearer tok"
    assert dec.headers["x-request-id"] == "abc"
    assert resp.content == bytes(dec.sent)  # decode's answer, untouched


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"model": "m", "prompt": "Once upon a time", "max_tokens": 3}),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        ),
    ],
)
def test_openai_endpoints_dispatch_to_both(pd, make_router, path, body):
    p0, p1, d0, d1 = pd
    r = make_router([p0, p1], [d0, d1])
    resp = r.client.post(path, json=body)
    assert resp.status_code == 200
    [pre], [dec] = gen_requests(p0, p1), gen_requests(d0, d1)
    assert pre.path == dec.path == path and pre.body == dec.body
    assert isinstance(pre.json["bootstrap_room"], int)
    assert resp.content == bytes(dec.sent)


@pytest.mark.parametrize(
    "path,body,count",
    [
        ("/generate", {"text": ["a", "b c", "d e f"]}, 3),
        ("/generate", {"input_ids": [[1, 2, 3], [4, 5]]}, 2),
        ("/generate", {"input_ids": [1, 2, 3]}, None),
        (
            "/generate",
            {"text": "a b", "sampling_params": {"n": 2}},
            None,
        ),  # the server expands rooms x n
        ("/v1/completions", {"model": "m", "prompt": ["a", "b"], "n": 2}, 2),
        ("/v1/completions", {"model": "m", "prompt": [1, 2, 3]}, None),
        ("/v1/completions", {"model": "m", "prompt": "a", "n": 3}, None),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2},
            2,
        ),
    ],
)
def test_batched_requests_get_one_room_per_item(pd, make_router, path, body, count):
    p0, p1, d0, d1 = pd
    r = make_router([p0, p1], [d0, d1])
    assert r.client.post(path, json=body).status_code == 200
    [pre], [dec] = gen_requests(p0, p1), gen_requests(d0, d1)
    sent = pre.json
    assert pre.body == dec.body
    prefill = p0 if pre in p0.requests else p1
    if count is None:
        assert (
            isinstance(sent["bootstrap_room"], int)
            and sent["bootstrap_port"] == prefill.bootstrap_port
        )
    else:
        assert sent["bootstrap_host"] == ["127.0.0.1"] * count
        assert sent["bootstrap_port"] == [prefill.bootstrap_port] * count
        rooms = sent["bootstrap_room"]
        assert len(set(rooms)) == count and all(
            isinstance(x, int) and 0 <= x < 2**63 for x in rooms
        )


# ---------------------------------------------------------------------------- logprobs
def test_input_logprobs_merged_non_stream(pd, make_router):
    p0, p1, d0, d1 = pd
    r = make_router([p0, p1], [d0, d1])
    single = r.client.post("/generate", json={**GEN, "return_logprob": True}).json()
    assert single["meta_info"]["input_token_logprobs"] == [
        [-1.0, 100, None],
        [-1.01, 101, None],
        [-1.02, 102, None],
    ]
    assert len(single["meta_info"]["output_token_logprobs"]) == 3
    batch = r.client.post(
        "/generate", json={"text": ["a b", "c d e f"], "return_logprob": True}
    ).json()
    assert [len(item["meta_info"]["input_token_logprobs"]) for item in batch] == [2, 4]


@pytest.mark.parametrize("sse_prefill", [False, True])
def test_input_logprobs_merged_into_every_stream_event(pd, make_router, sse_prefill):
    p0, p1, d0, d1 = pd
    for p in (p0, p1):
        p.sse_prefill = sse_prefill
    r = make_router([p0, p1], [d0, d1])
    resp = r.client.post("/generate", json={**GEN, "stream": True, "return_logprob": True})
    assert resp.status_code == 200
    events = sse_events(resp.content)
    assert events[-1] == "[DONE]" and len(events) == 4
    expected = [[-1.0, 100, None], [-1.01, 101, None], [-1.02, 102, None]]
    for k, ev in enumerate(events[:-1], start=1):
        assert ev["meta_info"]["input_token_logprobs"] == expected
        assert len(ev["meta_info"]["output_token_logprobs"]) == k


# ---------------------------------------------------------------------------- streaming
@pytest.mark.parametrize(
    "path,body",
    [
        ("/generate", {**GEN, "stream": True}),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True},
        ),
    ],
)
def test_stream_passthrough_is_byte_exact(pd, make_router, path, body):
    p0, p1, d0, d1 = pd
    r = make_router([p0, p1], [d0, d1])
    resp = r.client.post(path, json=body)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    [dec] = gen_requests(d0, d1)
    assert dec.done and resp.content == bytes(dec.sent)


def test_stream_is_not_held_back_by_prefill(pd, make_router):
    p0, p1, d0, d1 = pd
    for p in (p0, p1):
        p.respond_gate.close()  # KV "sent", but prefill's HTTP answer is held
    r = make_router([p0, p1], [d0, d1])
    resp = r.client.post("/generate", json={**GEN, "stream": True})
    assert sse_events(resp.content)[-1] == "[DONE]"
    [pre] = gen_requests(p0, p1)
    assert not pre.done
    for p in (p0, p1):
        p.respond_gate.open()
    wait_until(lambda: pre.done, what="prefill leg to finish in the background")
    assert not pre.disconnected
    wait_until(lambda: all(w.in_flight == 0 for w in r.router.pool.workers), what="legs released")


def test_mid_stream_failure_ends_with_sse_error_and_done(pd, make_router):
    p0, p1, d0, d1 = pd
    for d in (d0, d1):
        d.die_mid_stream = True
    r = make_router([p0, p1], [d0, d1])
    resp = r.client.post("/generate", json={**GEN, "stream": True})
    assert resp.status_code == 200
    assert b"partial" not in resp.content  # the half-written event is not forwarded
    events = sse_events(resp.content)
    assert events[0]["output_ids"] == [2000]
    assert events[1]["error"]["code"] == 502 and events[1]["error"]["message"]
    assert events[2] == "[DONE]" and len(events) == 3


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_both_legs(pd, make_router, stream):
    p0, p1, d0, d1 = pd
    for w in (p0, p1):
        w.respond_gate.close()
    for w in (d0, d1):
        w.stream_gate.close()
    r = make_router([p0, p1], [d0, d1])
    if stream:
        with r.client.stream("POST", "/generate", json={**GEN, "stream": True}) as s:
            first = next(s.iter_raw())
            assert first.startswith(b"data: ")
    else:
        with pytest.raises(httpx.ReadTimeout):
            r.client.post("/generate", json=GEN, timeout=httpx.Timeout(20, read=0.5))
    [pre], [dec] = gen_requests(p0, p1), gen_requests(d0, d1)
    wait_until(lambda: pre.disconnected and dec.disconnected, what="both legs cancelled")
    wait_until(lambda: all(w.in_flight == 0 for w in r.router.pool.workers), what="legs released")


# ---------------------------------------------------------------------------- policies and health
def test_round_robin_alternates(pd, make_router):
    p0, p1, d0, d1 = pd
    r = make_router([p0, p1], [d0, d1], policy="round_robin")
    served = [
        r.client.post("/generate", json=GEN).json()["meta_info"]["served_by"] for _ in range(4)
    ]
    assert served == ["decode0", "decode1", "decode0", "decode1"]
    prefills = [rec.worker for rec in sorted(gen_requests(p0, p1), key=lambda rec: rec.seq)]
    assert prefills == ["prefill0", "prefill1", "prefill0", "prefill1"]


def test_least_load_picks_the_idle_worker(pd, make_router):
    p0, p1, d0, d1 = pd
    p1.load = {"num_reqs": 0, "num_waiting_reqs": 3, "num_tokens": 0}
    d0.load = {"num_reqs": 8, "num_waiting_reqs": 0, "num_tokens": 900}
    r = make_router([p0, p1], [d0, d1], policy="least_load")
    wait_until(
        lambda: r.worker(d0.url).polled_load == (8, 900) and r.worker(p1.url).polled_load == (3, 0),
        what="loads polled",
    )
    for _ in range(4):
        assert r.client.post("/generate", json=GEN).json()["meta_info"]["served_by"] == "decode1"
    assert len(p0.generation_requests()) == 4 and not p1.generation_requests()
    d0.load, d1.load = {"num_reqs": 0}, {"num_reqs": 5}
    wait_until(
        lambda: r.worker(d1.url).polled_load == (5, 0) and r.worker(d0.url).polled_load == (0, 0),
        what="new loads polled",
    )
    assert r.client.post("/generate", json=GEN).json()["meta_info"]["served_by"] == "decode0"


def test_worker_failing_health_check_is_avoided(pd, make_router):
    p0, p1, d0, d1 = pd
    r = make_router([p0, p1], [d0, d1])
    d1.health_status = 503
    wait_until(lambda: not r.worker(d1.url).healthy, what="decode1 marked unhealthy")
    assert not any(
        e["healthy"] for e in r.client.get("/get_load").json()["decode"] if e["url"] == d1.url
    )
    for _ in range(4):
        assert r.client.post("/generate", json=GEN).status_code == 200
    assert len(d0.generation_requests()) == 4 and not d1.generation_requests()
    d1.health_status = 200
    wait_until(lambda: r.worker(d1.url).healthy, what="decode1 back")
    served = {
        r.client.post("/generate", json=GEN).json()["meta_info"]["served_by"] for _ in range(2)
    }
    assert served == {"decode0", "decode1"}


def test_stopped_worker_is_avoided():
    c = FakeCluster()
    try:
        p0, p1, d0 = c.add("prefill"), c.add("prefill"), c.add("decode")
        args = RouterArgs(
            prefill=[(p.url, p.bootstrap_port) for p in (p0, p1)],
            decode=[d0.url],
            health_check_interval=0.2,
            health_failure_threshold=1,
        )
        r = RunningRouter(args)
        try:
            r.wait_ready()
            p1.stop()
            wait_until(
                lambda: not r.worker(p1.url).healthy, what="stopped prefill marked unhealthy"
            )
            for _ in range(3):
                assert r.client.post("/generate", json=GEN).status_code == 200
            assert len(p0.generation_requests()) == 3
        finally:
            r.stop()
    finally:
        c.close()


# ---------------------------------------------------------------------------- failures
@pytest.mark.parametrize("stream", [False, True])
def test_prefill_500_is_retried_on_a_new_pair_with_a_new_room(pd, make_router, stream):
    p0, p1, d0, d1 = pd
    p0.fail_status = 500
    r = make_router([p0, p1], [d0, d1], policy="round_robin", cb_failure_threshold=0)
    resp = r.client.post("/generate", json={**GEN, "stream": stream})
    assert resp.status_code == 200
    [bad], [good] = p0.generation_requests(), p1.generation_requests()
    assert bad.json["bootstrap_room"] != good.json["bootstrap_room"]
    assert good.json["bootstrap_port"] == p1.bootstrap_port
    served = [
        rec
        for rec in gen_requests(d0, d1)
        if rec.json["bootstrap_room"] == good.json["bootstrap_room"]
    ]
    assert len(served) == 1 and served[0].body == good.body
    if stream:
        assert sse_events(resp.content)[-1] == "[DONE]"
    assert 'pdserve_router_retries_total{endpoint="/generate"} 1.0' in r.client.get("/metrics").text


@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_pair_is_retried_after_its_backoff(pd, make_router, stream):
    p0, _, d0, _ = pd
    p0.fail_status, p0.fail_count = 502, 1  # e.g. a transfer that failed after a network blip
    r = make_router([p0], [d0], cb_failure_threshold=0, retry_initial_backoff_ms=300)
    t0 = time.monotonic()
    resp = r.client.post("/generate", json={**GEN, "stream": stream})
    assert resp.status_code == 200 and time.monotonic() - t0 >= 0.3 * 0.8
    bad, good = p0.generation_requests()
    assert bad.json["bootstrap_room"] != good.json["bootstrap_room"]
    assert [rec.json["bootstrap_room"] for rec in d0.generation_requests()][-1] == (
        good.json["bootstrap_room"]
    )
    assert 'pdserve_router_retries_total{endpoint="/generate"} 1.0' in r.client.get("/metrics").text
    # --disable-retries: the first failure is the answer
    p0.fail_status, p0.fail_count = 502, 1
    r = make_router([p0], [d0], cb_failure_threshold=0, max_retries=0)
    assert r.client.post("/generate", json={**GEN, "stream": stream}).status_code >= 500


def test_retry_backoff_grows_to_its_cap_with_jitter():
    args = RouterArgs(
        worker=["http://w"],
        retry_initial_backoff_ms=100,
        retry_backoff_multiplier=2,
        retry_max_backoff_ms=500,
        retry_jitter_factor=0.2,
    )
    for attempt, ms in [(1, 100), (2, 200), (3, 400), (4, 500), (9, 500)]:
        waits = [retry_backoff_s(args, attempt) for _ in range(200)]
        assert all(0.8 * ms / 1000 <= w <= 1.2 * ms / 1000 for w in waits), (attempt, waits[:3])
        assert max(waits) - min(waits) > 0.1 * ms / 1000  # jittered
    for bad in (dict(retry_jitter_factor=1.5), dict(retry_backoff_multiplier=0.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RouterArgs(worker=["http://w"], **bad)


def test_prefill_error_is_returned_when_retry_fails_too(pd, make_router):
    p0, p1, d0, d1 = pd
    p0.fail_status = p1.fail_status = 500
    r = make_router([p0, p1], [d0, d1], cb_failure_threshold=0)
    resp = r.client.post("/generate", json=GEN)
    assert resp.status_code == 500 and "error" in resp.json()
    assert len(p0.generation_requests()) == len(p1.generation_requests()) == 1  # one retry, no more


def test_decode_client_error_is_passed_through_without_retry(pd, make_router):
    p0, p1, d0, d1 = pd
    d0.fail_status = d1.fail_status = 400
    r = make_router([p0, p1], [d0, d1])
    resp = r.client.post("/generate", json=GEN)
    assert resp.status_code == 400 and resp.json()["error"]["message"].endswith("injected failure")
    assert len(gen_requests(p0, p1)) == 1


def test_circuit_breaker_takes_a_failing_worker_out_then_tries_it_again(pd, make_router):
    p0, p1, d0, d1 = pd
    d0.fail_status = 503
    r = make_router(
        [p0, p1], [d0, d1], policy="round_robin", cb_failure_threshold=1, cb_cooldown=0.3
    )
    assert (
        r.client.post("/generate", json=GEN).json()["meta_info"]["served_by"] == "decode1"
    )  # after a retry
    assert r.worker(d0.url).breaker.state == "open"
    assert (
        f'pdserve_router_worker_circuit_open{{role="decode",worker="{d0.url}"}} 1.0'
        in r.client.get("/metrics").text
    )
    before = len(d0.generation_requests())
    for _ in range(3):
        assert r.client.post("/generate", json=GEN).json()["meta_info"]["served_by"] == "decode1"
    assert len(d0.generation_requests()) == before  # not even tried while open
    d0.fail_status = None
    wait_until(lambda: r.worker(d0.url).breaker.state == "half_open", what="cool-down over")
    served = {
        r.client.post("/generate", json=GEN).json()["meta_info"]["served_by"] for _ in range(2)
    }
    assert served == {"decode0", "decode1"} and r.worker(d0.url).breaker.state == "closed"


def test_503_when_all_decodes_are_down(pd, make_router):
    p0, p1, d0, d1 = pd
    r = make_router([p0, p1], [d0, d1])
    d0.health_status = d1.health_status = 503
    wait_until(lambda: r.client.get("/health").status_code == 503, what="router /health 503")
    resp = r.client.post("/generate", json=GEN)
    assert resp.status_code == 503
    err = resp.json()["error"]
    assert err["code"] == 503 and "decode" in err["message"] and err["type"]
    assert not gen_requests(p0, p1, d0, d1)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'"text"', b'{"text": NaN}', b"\xff\xfe"])
def test_bad_body_is_400_and_reaches_no_worker(pd, make_router, raw):
    p0, p1, d0, d1 = pd
    r = make_router([p0, p1], [d0, d1])
    resp = r.client.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error" and err["message"]
    assert not gen_requests(p0, p1, d0, d1)


def test_oversized_body_is_413(pd, make_router):
    p0, p1, d0, d1 = pd
    r = make_router([p0, p1], [d0, d1], max_body_bytes=1024)
    resp = r.client.post("/generate", json={"text": "x" * 5000})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == 413
    assert r.client.post("/generate", json={"text": "x" * 100}).status_code == 200
    assert len(gen_requests(d0, d1)) == 1


# ---------------------------------------------------------------------------- other endpoints
def test_info_endpoints(pd, make_router):
    p0, p1, d0, d1 = pd
    r = make_router([p0, p1], [d0, d1])
    assert r.client.get("/health_generate").status_code == 200
    assert r.client.get("/v1/models").json()["data"][0]["owned_by"] in ("decode0", "decode1")
    for path in ("/get_model_info", "/model_info"):
        assert r.client.get(path).json()["model_path"] == "fake-model"
    for path in ("/get_server_info", "/server_info"):
        info = r.client.get(path).json()
        assert info["model_path"] == "fake-model" and info["router"]["policy"] == "round_robin"
        assert [e["server_info"]["name"] for e in info["prefill"]] == ["prefill0", "prefill1"]
        assert [e["bootstrap_port"] for e in info["prefill"]] == [
            p0.bootstrap_port,
            p1.bootstrap_port,
        ]
        assert [e["server_info"]["disaggregation_mode"] for e in info["decode"]] == [
            "decode",
            "decode",
        ]
    load = r.client.get("/get_load").json()
    assert [e["load"][0]["num_reqs"] for e in load["prefill"] + load["decode"]] == [0, 0, 0, 0]
    flushed = r.client.post("/flush_cache")
    assert flushed.status_code == 200 and len(flushed.json()["flushed"]) == 4
    assert all(any(x.path == "/flush_cache" for x in w.requests) for w in (p0, p1, d0, d1))
    r.client.post("/generate", json=GEN)
    metrics = r.client.get("/metrics").text
    for needle in (
        'pdserve_router_requests_total{endpoint="/generate",status="200"} 1.0',
        f'pdserve_router_worker_in_flight{{role="decode",worker="{d0.url}"}} 0.0',
        'pdserve_router_upstream_latency_seconds_count{role="prefill"} 1.0',
        "pdserve_router_retries_total",
    ):
        assert needle in metrics


def test_colocated_workers_round_robin_without_bootstrap_fields(make_router):
    c = FakeCluster()
    r = None
    try:
        w0, w1 = c.add("regular"), c.add("regular")
        r = make_router(worker=[w0, w1])
        raw = b'{"text": "a b",   "sampling_params": {"max_new_tokens": 2}}'
        for _ in range(2):
            assert r.client.post("/generate", content=raw).status_code == 200
        recs = gen_requests(w0, w1)
        assert len(w0.generation_requests()) == len(w1.generation_requests()) == 1
        assert all(rec.body == raw for rec in recs)  # passed on unchanged
        resp = r.client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        last = max(gen_requests(w0, w1), key=lambda rec: rec.seq)
        assert resp.content == bytes(last.sent) and last.done
    finally:
        if r is not None:
            r.stop()
        c.close()


def test_cli_entry_point(pd):
    p0, _, d0, _ = pd
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "router",
        "--prefill",
        p0.url,
        str(p0.bootstrap_port),
        "--decode",
        d0.url,
        "--port",
        str(port),
        "--health-check-interval",
        "0.2",
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        base = f"http://127.0.0.1:{port}"

        def ready():
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                return localhttp.get(base + "/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, timeout=30, interval=0.05, what="CLI router ready")
        assert localhttp.post(base + "/generate", json=GEN).status_code == 200
        [dec] = d0.generation_requests()
        assert dec.json["bootstrap_port"] == p0.bootstrap_port
    finally:
        proc.terminate()
        proc.wait(timeout=15)
