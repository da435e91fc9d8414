"""The router's worker API against fake workers: sglang-router's wire shape, checks before a
worker takes traffic, drains (and their timeout), bad input, the API key, an empty PD router."""

from __future__ import annotations

import threading

import pytest

from pdserve.router.workers import worker_id
from tests.helpers import localhttp
from tests.helpers.fake_workers import free_port, wait_until
from tests.unit.test_router import GEN, sse_events

WORKER_KEYS = {
    "id",
    "url",
    "model_id",
    "priority",
    "cost",
    "worker_type",
    "is_healthy",
    "load",
    "connection_mode",
    "metadata",
    "disable_health_check",
}  # what sglang-router 0.3.2 lists for each worker


# the fake workers of this module (tests/unit/conftest.py: ``workers``, ``pd``)
WORKER_ROLES = ("prefill", "prefill", "decode", "decode", "regular")


def served_by(r, n: int = 4) -> list[str]:
    return [r.client.post("/generate", json=GEN).json()["meta_info"]["served_by"] for _ in range(n)]


def test_list_has_sglang_router_shape_and_pdserve_fields(pd, make_router):
    p0, _, d0, _, _ = pd
    r = make_router([p0], [d0])
    body = r.client.get("/workers").json()
    assert body["total"] == 2 and body["stats"] == {
        "prefill_count": 1,
        "decode_count": 1,
        "regular_count": 0,
    }
    prefill, decode = body["workers"]
    assert WORKER_KEYS <= set(prefill) and WORKER_KEYS <= set(decode)
    assert prefill["worker_type"] == "prefill" and prefill["bootstrap_port"] == p0.bootstrap_port
    assert decode["worker_type"] == "decode" and decode["is_healthy"] is True
    assert prefill["id"] == worker_id(p0.url) and prefill["model_id"] == "fake-model"
    assert (
        prefill["metadata"]["dp_size"] == "1"
        and prefill["metadata"]["disaggregation_mode"] == "prefill"
    )
    extra = (decode["draining"], decode["in_flight"], decode["dp_size"], decode["source"])
    assert extra == (False, 0, 1, "command line")
    one = r.client.get(f"/workers/{decode['id']}")
    assert one.status_code == 200 and one.json()["url"] == d0.url
    spec = r.client.get("/openapi.json").json()
    assert {"WorkerConfigRequest", "WorkerInfo", "WorkerListResponse"} <= set(
        spec["components"]["schemas"]
    )
    assert {"get", "post"} <= set(spec["paths"]["/workers"])


def test_added_decode_takes_requests_and_removed_one_drains(pd, make_router):
    p0, _, d0, d1, _ = pd
    r = make_router([p0], [d0], policy="round_robin")
    resp = r.client.post("/workers", json={"url": d1.url, "worker_type": "decode", "priority": 10})
    assert resp.status_code == 202, resp.text
    body = resp.json()
    assert body["status"] == "accepted" and body["worker_id"] == worker_id(d1.url)
    assert body["location"] == f"/workers/{body['worker_id']}" and body["ignored_fields"] == [
        "priority"
    ]
    assert sorted(served_by(r)) == ["decode0", "decode0", "decode1", "decode1"]
    # a stream held open on one decode, then that decode removed: it takes nothing new, the stream
    # finishes
    d0.stream_gate.close()
    d1.stream_gate.close()
    out: dict = {}
    threading.Thread(
        target=lambda: out.update(r=r.client.post("/generate", json={**GEN, "stream": True}))
    ).start()
    wait_until(
        lambda: r.worker(d0.url).in_flight + r.worker(d1.url).in_flight == 1, what="a stream"
    )
    held, free = (d0, d1) if r.worker(d0.url).in_flight else (d1, d0)
    free.stream_gate.open()
    gone = r.client.delete(f"/workers/{worker_id(held.url)}")
    assert gone.status_code == 202 and gone.json()["worker_id"] == worker_id(held.url)
    state = r.client.get(f"/workers/{worker_id(held.url)}").json()
    assert state["draining"] is True and state["in_flight"] == 1
    assert served_by(r, 3) == [free.name] * 3
    held.stream_gate.open()
    wait_until(lambda: "r" in out, timeout=10, what="the held stream")
    events = sse_events(out["r"].content)
    assert events[-1] == "[DONE]" and not any(
        "error" in e for e in events[:-1] if isinstance(e, dict)
    )
    wait_until(
        lambda: r.client.get(f"/workers/{worker_id(held.url)}").status_code == 404,
        what="the removal",
    )
    assert r.client.get("/workers").json()["total"] == 2


def test_drain_timeout_ends_a_stream_with_the_reason_and_retries_what_has_no_output(
    pd, make_router
):
    p0, _, d0, d1, _ = pd
    r = make_router([p0], [d0], drain_timeout=0.5)
    d0.stream_gate.close()
    out: dict = {}
    threading.Thread(
        target=lambda: out.update(s=r.client.post("/generate", json={**GEN, "stream": True}))
    ).start()
    wait_until(lambda: r.worker(d0.url).in_flight == 1, what="the stream on decode0")
    assert (
        r.client.post("/workers", json={"url": d1.url}).status_code == 202
    )  # role from its /server_info
    assert r.client.delete(f"/workers/{worker_id(d0.url)}").status_code == 202
    wait_until(lambda: "s" in out, timeout=10, what="the stream to end")
    events = sse_events(out["s"].content)
    assert events[-1] == "[DONE]" and events[0]["meta_info"]["served_by"] == "decode0"
    assert "drain timeout of 0.5 s" in events[-2]["error"]["message"], events
    assert d0.url in events[-2]["error"]["message"]
    wait_until(
        lambda: r.client.get(f"/workers/{worker_id(d0.url)}").status_code == 404, what="the removal"
    )


@pytest.mark.parametrize(
    "body, status, names",
    [
        ({"url": "http://127.0.0.1:1x", "worker_type": "decode"}, 400, "url: invalid worker URL"),
        ({"worker_type": "decode"}, 400, "url: Field required"),
        ({"url": "http://127.0.0.1:9", "worker_type": "sideways"}, 400, "worker_type"),
        ({"url": "http://127.0.0.1:9", "worker_type": "regular"}, 400, "takes no regular worker"),
        (
            {"url": "http://127.0.0.1:9", "worker_type": "prefill", "bootstrap_port": 70000},
            400,
            "bootstrap_port",
        ),
        (
            {"url": "http://127.0.0.1:9", "worker_type": "decode", "api_key": "other"},
            400,
            "api_key",
        ),
    ],
)
def test_bad_input_is_refused_naming_the_problem(pd, make_router, body, status, names):
    p0, _, d0, _, _ = pd
    r = make_router([p0], [d0])
    resp = r.client.post("/workers", json=body)
    assert resp.status_code == status and names in resp.json()["error"], resp.text
    assert r.client.get("/workers").json()["total"] == 2


def test_workers_that_cannot_serve_are_refused(pd, make_router):
    p0, p1, d0, d1, _ = pd
    r = make_router([p0], [d0], add_worker_timeout=1.0)
    post = lambda **b: r.client.post("/workers", json=b)  # noqa: E731
    resp = post(url=d0.url, worker_type="decode")
    assert resp.status_code == 409 and "already a worker" in resp.json()["error"]
    d1.health_status = 503
    resp = post(url=d1.url, worker_type="decode")
    assert (
        resp.status_code == 400
        and "not healthy after 1 s (--add-worker-timeout)" in resp.json()["error"]
    )
    assert "answered 503" in resp.json()["error"]
    d1.health_status = 200
    resp = post(url=d1.url, worker_type="prefill", bootstrap_port=p1.bootstrap_port)
    assert (
        resp.status_code == 400 and "runs with disaggregation_mode decode" in resp.json()["error"]
    )
    resp = post(
        url=p1.url, worker_type="prefill", bootstrap_port=free_port()
    )  # nothing listens there
    assert resp.status_code == 400 and "does not accept connections" in resp.json()["error"]
    d1.info_extra = {"disaggregation_transfer_backend": "nixl"}
    d0.info_extra = {"disaggregation_transfer_backend": "mooncake"}
    p0.info_extra = {"disaggregation_transfer_backend": "mooncake"}
    r2 = make_router([p0], [d0])
    resp = r2.client.post("/workers", json={"url": d1.url, "worker_type": "decode"})
    assert resp.status_code == 400 and "cannot be paired" in resp.json()["error"], resp.text
    assert "--disaggregation-transfer-backend" in resp.json()["error"]
    resp = r.client.delete(f"/workers/{worker_id('http://127.0.0.1:9')}")
    assert resp.status_code == 404 and resp.json()["code"] == "WORKER_NOT_FOUND"
    assert r.client.delete("/workers/not-a-worker").status_code == 404


def test_the_api_key_guards_the_worker_api(pd, make_router):
    p0, _, d0, d1, _ = pd
    r = make_router([p0], [d0], api_key="sekrit", worker_api_key="sekrit")
    for method, path, kw in [
        ("GET", "/workers", {}),
        ("POST", "/workers", {"json": {"url": d1.url}}),
        ("GET", f"/workers/{worker_id(d0.url)}", {}),
        ("DELETE", f"/workers/{worker_id(d0.url)}", {}),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            assert r.client.request(method, path, headers=headers, **kw).status_code == 401, (
                method,
                path,
            )
    assert len(r.router.pool.workers) == 2 and r.worker(d0.url).draining is None
    ok = {"Authorization": "Bearer sekrit"}
    assert r.client.get("/workers", headers=ok).json()["total"] == 2


def test_an_empty_pd_router_serves_once_workers_join(pd, make_router):
    p0, _, d0, _, w = pd
    r = make_router(pd_disaggregation=True, wait=False)
    wait_until(lambda: r.client.get("/health").status_code == 503, what="the router up")
    assert "no healthy prefill or decode" in r.client.get("/health").text
    assert r.client.post("/generate", json=GEN).status_code == 503
    assert (
        r.client.post(
            "/workers", json={"url": p0.url, "bootstrap_port": p0.bootstrap_port}
        ).status_code
        == 202
    )
    assert r.client.post("/workers", json={"url": w.url}).status_code == 400  # a colocated server
    assert (
        r.client.post("/workers", json={"url": d0.url, "worker_type": "decode"}).status_code == 202
    )
    assert r.client.get("/health").status_code == 200
    resp = r.client.post("/generate", json=GEN)
    assert resp.status_code == 200 and resp.json()["meta_info"]["served_by"] == "decode0"
    [pre] = p0.generation_requests()
    assert pre.json["bootstrap_port"] == p0.bootstrap_port
    assert localhttp.get(r.url + "/workers").json()["stats"]["prefill_count"] == 1


def test_dns_flags_parse_and_name_their_problem():
    from pdserve.router.args import dns_server_address, parse_args
    from pdserve.router.discovery import Target, targets

    args = parse_args(
        [
            "--prefill-dns",
            "p.svc:30000:8998",
            "--prefill-dns",
            "q.svc:30000",
            "--decode-dns",
            "d.svc:30001",
            "--dns-server",
            "[::1]:5353",
        ]
    )
    assert args.pd_mode and args.prefill_dns == [("p.svc", 30000, 8998), ("q.svc", 30000, None)]
    assert [t.source for t in targets(args)] == ["dns p.svc", "dns q.svc", "dns d.svc"]
    assert Target("decode", "d.svc", 30001).url("fd00::7") == "http://[fd00::7]:30001"
    assert dns_server_address("10.0.0.2") == ("10.0.0.2", 53)
    for argv, names in [
        (["--decode-dns", "d.svc"], "decode_dns: expected NAME:PORT"),
        (["--prefill-dns", "p.svc:http"], "prefill_dns: ports must be integers"),
        (["--decode-dns", "d.svc:0"], "port in 1-65535"),
        (["--decode-dns", "d.svc:1", "--dns-server", "a:b"], "dns_server"),
        (["--decode-dns", "d.svc:1", "--drain-timeout", "0"], "drain_timeout"),
    ]:
        with pytest.raises(ValueError, match=names):
            parse_args(argv)


def test_a_drained_decode_moves_requests_only_to_its_migration_peers():
    """The router offers a draining decode (``--drain-migrate``, the autoscaler's ``migrate_to``)
    only the decodes its /server_info's ``migration_peers`` allows, and all of them to a server
    that reports no such field (it decides alone)."""
    from pdserve.router.drain_migrate import peer_targets
    from pdserve.router.workers import DECODE, Worker

    others = ["http://127.0.0.1:30002", "http://10.0.0.7:30002", "http://decode-2:30002"]
    w = Worker("http://127.0.0.1:30001", DECODE)
    assert peer_targets(w, others) == others  # info not read yet
    w.info = {"disaggregation_mode": "decode"}  # an older server: no such field
    assert peer_targets(w, others) == others
    w.info = {"migration_peers": None}
    assert peer_targets(w, others) == []  # none listed: it would answer 403
    w.info = {"migration_peers": "127.0.0.1,10.0.0.0/8"}
    assert peer_targets(w, others) == others[:2]
    w.info = {"migration_peers": "decode-2:30002"}
    assert peer_targets(w, others) == others[2:]
