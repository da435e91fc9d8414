"""Router failure handling against fake workers: streamed errors before any output, which
worker a retry replaces, circuit breakers of a worker that came back."""

from __future__ import annotations

from tests.helpers.fake_workers import wait_until
from tests.unit.test_router import GEN, sse_events

# the fake workers of this module (tests/unit/conftest.py: ``workers``, ``pd``)
WORKER_ROLES = ("prefill", "prefill", "decode", "decode")


def test_stream_whose_first_event_is_an_error_is_retried_on_another_decode(pd, make_router):
    p0, _, d0, d1 = pd
    d0.stream_error_status = 503
    r = make_router([p0], [d0, d1], policy="round_robin", cb_failure_threshold=0)
    for _ in range(2):  # whichever decode round robin picks first, the answer comes from decode1
        resp = r.client.post("/generate", json={**GEN, "stream": True})
        assert resp.status_code == 200
        events = sse_events(resp.content)
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
    assert len(d1.generation_requests()) == 2


def test_stream_error_keeps_its_status_and_reason_when_the_retry_fails_too(pd, make_router):
    p0, _, d0, _ = pd
    d0.stream_error_status = 503
    r = make_router([p0], [d0], cb_failure_threshold=0)
    resp = r.client.post("/generate", json={**GEN, "stream": True})
    assert resp.status_code == 503
    assert resp.json()["error"]["message"] == "decode0 injected stream failure"
    assert len(d0.generation_requests()) == 2  # one decode: the retry goes to it again
    d0.stream_error_status = 400  # a client error is not retried and not a worker failure
    resp = r.client.post("/generate", json={**GEN, "stream": True})
    assert resp.status_code == 400 and len(d0.generation_requests()) == 3


def test_retry_after_a_prefill_failure_keeps_the_decode(pd, make_router):
    p0, p1, d0, d1 = pd
    p0.fail_status = 500
    r = make_router([p0, p1], [d0, d1], policy="round_robin", cb_failure_threshold=0)
    for stream in (False, True):
        before = {d.name: len(d.generation_requests()) for d in (d0, d1)}
        resp = r.client.post("/generate", json={**GEN, "stream": stream})
        assert resp.status_code == 200
        bad = p0.generation_requests()[-1].json["bootstrap_room"]
        first = next(
            d
            for d in (d0, d1)
            if any(rec.json["bootstrap_room"] == bad for rec in d.generation_requests())
        )
        # both attempts went to the same decode: only the prefill leg was at fault
        assert len(first.generation_requests()) == before[first.name] + 2


def test_a_worker_back_from_the_dead_gets_a_fresh_breaker(pd, make_router):
    p0, _, d0, d1 = pd
    r = make_router([p0], [d0, d1], cb_failure_threshold=1, cb_cooldown=60)
    d0.fail_status = 503
    for _ in range(2):
        r.client.post("/generate", json=GEN)
    assert r.worker(d0.url).breaker.state == "open"
    d0.fail_status = None
    d0.health_status = 503
    wait_until(lambda: not r.worker(d0.url).healthy, what="decode0 out")
    d0.health_status = 200  # e.g. restarted: health checks pass again
    wait_until(lambda: r.worker(d0.url).healthy, what="decode0 back")
    assert (
        r.worker(d0.url).breaker.state == "half_open"
    )  # no cooldown to sit out: the next request is its trial
    served = {
        r.client.post("/generate", json=GEN).json()["meta_info"]["served_by"] for _ in range(2)
    }
    assert "decode0" in served and r.worker(d0.url).breaker.state == "closed"


def test_a_502_blames_the_other_leg(pd, make_router):
    p0, p1, d0, d1 = pd
    r = make_router([p0, p1], [d0, d1], policy="round_robin", cb_failure_threshold=0)
    # decode says its KV never came (502): the retry replaces the prefill and keeps the decode
    d0.fail_status = 502
    resp = r.client.post("/generate", json=GEN)
    assert resp.status_code == 502
    assert len(d0.generation_requests()) == 2 and not d1.generation_requests()
    assert len(p0.generation_requests()) == len(p1.generation_requests()) == 1
    # prefill says its decode failed (502): decode's own answer decides, the retry replaces the
    # decode
    d0.reset()
    for w in (p0, p1, d1):
        w.reset()
    p0.fail_status = p1.fail_status = 502
    resp = r.client.post("/generate", json=GEN)
    assert resp.status_code == 500 and "KV transfer failed" in resp.json()["error"]["message"]
    assert len(d0.generation_requests()) == len(d1.generation_requests()) == 1
