"""Workers joining and leaving a running router, for real (tests/helpers/elastic.py: two prefills,
two decodes on their own loopback addresses): ``GET /workers`` lists what the servers report;
bad input and unauthenticated calls are refused; a decode added under load takes new requests
and the decode removed then drains without failing a stream; a prefill removed under load
finishes its rooms, no stream fails, and it is left with nothing in use. Then the same worker
API of the real sglang-router in front of pdserve servers."""

from __future__ import annotations

import time

import pytest

from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.elastic import StreamLoad, worker_state
from tests.helpers.sglang_router import sglang_router_available, start_sglang_router

KEY = "membership-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def router(elastic_servers):
    s = elastic_servers
    r = s.router(
        "MR",
        s.prefills[:1],
        s.decodes[:1],
        "--api-key",
        KEY,
        "--add-worker-timeout",
        "2",
        "--policy",
        "round_robin",
        "--health-check-interval",
        "1",
    )
    r.http.headers.update(AUTH)
    r.start()
    yield r
    r.stop()


def served(proc: c.Proc) -> float:
    """Requests the server finished, from its own /metrics."""
    for line in localhttp.get(proc.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pdserve:e2e_request_latency_seconds_count"):
            return float(line.split()[-1])
    return 0.0


def test_get_workers_lists_what_the_servers_report(router, elastic_servers):
    s = elastic_servers
    body = router.http.get("/workers").json()
    assert body["total"] == 2 and body["stats"] == {
        "prefill_count": 1,
        "decode_count": 1,
        "regular_count": 0,
    }
    p, d = worker_state(router, s.prefills[0].url), worker_state(router, s.decodes[0].url)
    assert (p["worker_type"], p["bootstrap_port"], p["is_healthy"]) == (
        "prefill",
        s.bootstrap_port,
        True,
    )
    assert (d["worker_type"], d["model_id"], d["dp_size"]) == ("decode", "tiny-llama", 1)
    assert d["transfer_backend"] == "local" and d["requests"] == 0
    assert p["metadata"]["disaggregation_mode"] == "prefill" and d["connection_mode"] == "HTTP"


def test_bad_input_and_unauthenticated_calls_are_refused(router, elastic_servers):
    s = elastic_servers
    p1, d0 = s.prefills[1], s.decodes[0]
    assert router.http.get("/workers", headers={"Authorization": ""}).status_code == 401
    assert localhttp.post(router.url + "/workers", json={"url": p1.url}).status_code == 401
    assert (
        localhttp.delete(f"{router.url}/workers/{worker_state(router, d0.url)['id']}").status_code
        == 401
    )

    def refused(body: dict, status: int = 400) -> str:
        resp = router.http.post("/workers", json=body)
        assert resp.status_code == status, resp.text
        return resp.json()["error"]

    assert "runs with disaggregation_mode prefill" in refused(
        {"url": p1.url, "worker_type": "decode"}
    )
    assert f"reports bootstrap port {s.bootstrap_port}" in refused(
        {"url": p1.url, "worker_type": "prefill", "bootstrap_port": s.bootstrap_port + 1}
    )
    assert "worker_type" in refused({"url": p1.url, "worker_type": "primary"})
    assert "invalid worker URL" in refused(
        {"url": "http://127.0.0.2:port", "worker_type": "prefill"}
    )
    assert "already a worker" in refused({"url": d0.url, "worker_type": "decode"}, 409)
    t0 = time.monotonic()
    assert "not healthy after 2 s" in refused(
        {"url": f"http://127.0.0.9:{c.free_port()}", "worker_type": "decode"}
    )
    assert time.monotonic() - t0 < 6
    assert router.http.delete("/workers/http%3A%2F%2F127.0.0.9%3A1").status_code == 404
    assert router.http.get("/workers").json()["total"] == 2


def test_decode_added_under_load_takes_requests_then_the_removed_decode_drains(
    router, elastic_servers
):
    s = elastic_servers
    d0, d1 = s.decodes
    load = StreamLoad(router.url, headers=AUTH)
    try:
        c.wait_for(lambda: len(load.results) >= 3, 60, "streams before the add")
        before = served(d1)
        resp = router.http.post("/workers", json={"url": d1.url, "worker_type": "decode"})
        assert resp.status_code == 202, resp.text
        added = time.monotonic()
        c.wait_for(lambda: served(d1) >= before + 3, 60, "the added decode to serve streams")
        assert worker_state(router, d1.url)["requests"] >= 3
        # now remove decode 0 while it runs a stream
        c.wait_for(
            lambda: worker_state(router, d0.url)["in_flight"] > 0, 30, "a stream on decode 0"
        )
        gone = router.http.delete(f"/workers/{worker_state(router, d0.url)['id']}")
        assert gone.status_code == 202, gone.text
        removed = time.monotonic()
        c.wait_for(lambda: worker_state(router, d0.url) is None, 60, "decode 0 to drain")
        n = len(load.done_after(removed))
        c.wait_for(lambda: len(load.done_after(removed)) >= n + 3, 60, "streams after the removal")
    finally:
        results = load.close()
    assert not load.failures(), load.failures()[:3]
    assert (
        len({text for _, _, text, _ in results}) == 1
    )  # the same greedy output from either decode
    assert any(t >= added for t, *_ in results)
    d0.wait_idle()


def test_prefill_removed_under_load_finishes_its_rooms(router, elastic_servers):
    s = elastic_servers
    p0, p1 = s.prefills
    # no bootstrap_port: the one p1 reports in /server_info
    resp = router.http.post("/workers", json={"url": p1.url, "worker_type": "prefill"})
    assert (
        resp.status_code == 202 and resp.json()["worker"]["bootstrap_port"] == s.bootstrap_port
    ), resp.text
    load = StreamLoad(router.url, headers=AUTH)
    try:
        c.wait_for(lambda: worker_state(router, p0.url)["in_flight"] > 0, 60, "a room on prefill 0")
        gone = router.http.delete(f"/workers/{worker_state(router, p0.url)['id']}")
        assert gone.status_code == 202
        assert worker_state(router, p0.url)["draining"] in (True, None)  # None: it already drained
        removed = time.monotonic()
        c.wait_for(lambda: worker_state(router, p0.url) is None, 60, "prefill 0 to drain")
        p1_before = worker_state(router, p1.url)["requests"]
        c.wait_for(lambda: len(load.done_after(removed)) >= 4, 60, "streams after the removal")
    finally:
        results = load.close()
    assert not load.failures(), load.failures()[:3]
    assert len({text for _, _, text, _ in results}) == 1
    assert worker_state(router, p1.url)["requests"] > p1_before
    p0.wait_idle()
    for proc in (p1, *s.decodes):
        proc.wait_idle()


@pytest.mark.skipif(
    not sglang_router_available(),
    reason="sglang-router is not installed (scripts/install.sh --test)",
)
def test_sglang_router_worker_api_in_front_of_pdserve(elastic_servers, tmp_path):
    """sglang-router 0.3.2 takes a pdserve decode at run time through POST /workers, serves
    through it, and lets it go with DELETE /workers/{id}."""
    s = elastic_servers
    p0, (d0, d1) = s.prefills[0], s.decodes
    port = c.free_port()
    proc = start_sglang_router(
        [(p0.url, s.bootstrap_port)],
        [d0.url],
        port,
        policy="round_robin",
        log_path=str(tmp_path / "sglang-router.log"),
    )
    base = f"http://127.0.0.1:{port}"
    try:
        resp = localhttp.post(
            base + "/workers", json={"url": d1.url, "worker_type": "decode"}, timeout=30
        )
        assert resp.status_code == 202 and resp.json()["status"] == "accepted", resp.text
        wid = resp.json()["worker_id"]

        def listed():
            return [
                w
                for w in localhttp.get(base + "/workers", timeout=10).json()["workers"]
                if w["url"] == d1.url
            ]

        c.wait_for(
            lambda: listed() and listed()[0]["is_healthy"], 60, "sglang-router to take decode 1"
        )
        assert listed()[0]["worker_type"] == "decode" and listed()[0]["id"] == wid
        before = served(d1)
        body = {
            "input_ids": [1, 5, 9, 14],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        }
        texts = set()
        for _ in range(6):
            r = localhttp.post(base + "/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            texts.add(r.json()["text"])
        assert len(texts) == 1 and served(d1) >= before + 2  # round robin: about half on decode 1
        assert localhttp.delete(f"{base}/workers/{wid}", timeout=10).status_code == 202
        c.wait_for(lambda: not listed(), 30, "sglang-router to drop decode 1")
        assert localhttp.post(base + "/generate", json=body, timeout=120).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for proc_ in (p0, d0, d1):
        proc_.wait_idle()
