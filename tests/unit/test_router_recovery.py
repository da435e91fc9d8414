"""Router recovery against fake workers: a connection closed mid-request takes the worker out,
a worker back from being out gets its trial at once, the only worker of a role is never turned
away by its breaker; and the router's API key (its own, and the one it presents to workers)."""

from __future__ import annotations

import pytest

from pdserve.router.args import RouterArgs, parse_args
from pdserve.router.workers import CircuitBreaker
from tests.helpers.fake_workers import wait_until
from tests.unit.test_router import GEN

# the fake workers of this module (tests/unit/conftest.py: ``workers``, ``pd``)
WORKER_ROLES = ("prefill", "decode", "decode")


def test_connection_closed_mid_request_takes_the_worker_out(pd, make_router):
    p0, d0, _ = pd
    d0.die_mid_stream = True
    # health checks far apart: only the broken request can have taken decode0 out
    r = make_router([p0], [d0], health_check_interval=30, cb_failure_threshold=0)
    d0.health_status = (
        503  # as a restarting server would answer; the health loop is asleep for 30 s
    )
    resp = r.client.post("/generate", json={**GEN, "stream": True})
    assert resp.status_code == 200 and b"decode stream broke" in resp.content
    assert not r.worker(d0.url).healthy
    assert r.client.get("/health").status_code == 503
    # taken out by a request, it is checked again within about a second, not after 30 s
    d0.die_mid_stream, d0.health_status = False, 200
    wait_until(lambda: r.worker(d0.url).healthy, timeout=5, what="decode0 back")
    assert r.client.post("/generate", json=GEN).status_code == 200


def test_the_only_worker_of_a_role_is_not_turned_away_by_its_breaker(pd, make_router):
    p0, d0, _ = pd
    r = make_router([p0], [d0], cb_failure_threshold=1, cb_cooldown=600)
    d0.fail_status = 503
    assert r.client.post("/generate", json=GEN).status_code == 503
    assert r.worker(d0.url).breaker.state == "open" and r.worker(d0.url).healthy
    d0.fail_status = None  # recovered; its health checks passed all along
    resp = r.client.post("/generate", json=GEN)
    assert resp.status_code == 200, resp.text
    assert r.worker(d0.url).breaker.state == "closed"


def test_a_breaker_with_another_worker_to_use_still_waits_out_its_cooldown(pd, make_router):
    p0, d0, d1 = pd
    r = make_router([p0], [d0, d1], cb_failure_threshold=1, cb_cooldown=600, policy="round_robin")
    d0.fail_status = 503
    for _ in range(2):
        r.client.post("/generate", json=GEN)
    assert r.worker(d0.url).breaker.state == "open"
    d0.fail_status = None
    before = len(d0.generation_requests())
    for _ in range(3):
        assert r.client.post("/generate", json=GEN).json()["meta_info"]["served_by"] == "decode1"
    assert len(d0.generation_requests()) == before


def test_health_passing_after_being_out_makes_the_breaker_half_open():
    now = [0.0]
    b = CircuitBreaker(threshold=1, cooldown=30.0, clock=lambda: now[0])
    b.record(False)
    assert b.state == "open" and not b.allows()
    now[0] = 1.0
    b.half_open_now()
    assert b.state == "half_open" and b.allows()
    b.on_dispatch()
    assert not b.allows()  # one trial at a time
    b.record(False)
    assert b.state == "open"  # a failed trial opens it again, for a whole cooldown
    b.half_open_now()
    b.on_dispatch()
    b.record(True)
    assert b.state == "closed"


# ---------------------------------------------------------------------------- API keys
def test_router_api_key_and_the_key_it_gives_workers(pd, make_router):
    p0, d0, _ = pd
    r = make_router([p0], [d0], api_key="router-key", worker_api_key="worker-key")
    resp = r.client.post("/generate", json=GEN)
    assert resp.status_code == 401
    assert resp.json() == {
        "error": {
            "message": "missing API key: send it as 'Authorization: Bearer <key>'",
            "type": "invalid_request_error",
            "code": 401,
        }
    }
    resp = r.client.post("/generate", json=GEN, headers={"Authorization": "Bearer worker-key"})
    assert (
        resp.status_code == 401 and resp.json()["error"]["message"] == "incorrect API key provided"
    )
    assert not p0.generation_requests() and not d0.generation_requests()
    assert r.client.get("/health").status_code == 200
    assert r.client.get("/metrics").status_code == 200
    ok = {"Authorization": "Bearer router-key"}
    assert r.client.post("/generate", json=GEN, headers=ok).status_code == 200
    assert r.client.post("/flush_cache", headers=ok).status_code == 200
    # Anthropic's clients send the key as x-api-key; the workers get the router's key only
    anthropic_style = {"x-api-key": "router-key"}
    assert r.client.post("/generate", json=GEN, headers=anthropic_style).status_code == 200
    wrong = r.client.post("/generate", json=GEN, headers={"x-api-key": "worker-key"})
    assert wrong.status_code == 401
    legs = p0.requests + d0.requests  # both generation legs and the fan-out
    assert {rec.path for rec in legs} == {"/generate", "/flush_cache"}
    assert all(rec.headers.get("authorization") == "Bearer worker-key" for rec in legs)
    assert not any("x-api-key" in rec.headers for rec in legs)
    info = r.client.get("/server_info", headers=ok).json()["router"]
    assert info["api_key"] == info["worker_api_key"] == "***"


def test_router_key_flags(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    base = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    assert (
        parse_args([*base, "--api-key", "k"]).worker_api_key == "k"
    )  # workers share the router's key
    assert parse_args([*base, "--api-key", "k", "--worker-api-key", "w"]).worker_api_key == "w"
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    assert parse_args(base).api_key == "from-env"
    with pytest.raises(ValueError, match="api_key"):
        RouterArgs(
            prefill=[("http://127.0.0.1:1", None)], decode=["http://127.0.0.1:2"], api_key=""
        )
