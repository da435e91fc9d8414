"""The router pairs only prefill and decode servers that can move KV to each other: the same
transfer backend, and ``local`` (shared memory) only on one host; with no such pair it answers
503 naming the backends to use, at once."""

from __future__ import annotations

from tests.unit.test_router import cluster, gen_requests, pd  # noqa: F401 (fixtures)

GEN = {"text": "one two three", "sampling_params": {"max_new_tokens": 2}}


def on(worker, backend: str, host: str) -> None:
    worker.info_extra = {"disaggregation_transfer_backend": backend, "host_id": host}


def test_local_pairs_stay_on_one_host(pd, make_router):
    p0, p1, d0, d1 = pd
    on(p0, "local", "host-a")
    on(p1, "local", "host-b")
    on(d0, "local", "host-b")
    on(d1, "local", "host-c")  # no prefill on its host
    r = make_router([p0, p1], [d0, d1])
    for _ in range(6):
        assert r.client.post("/generate", json=GEN).status_code == 200
    assert len(gen_requests(p1)) == 6 and len(gen_requests(d0)) == 6
    assert not gen_requests(p0, d1)


def test_no_pair_that_can_work_is_a_503_naming_the_backends(pd, make_router):
    p0, p1, d0, d1 = pd
    on(p0, "local", "host-a")
    on(p1, "local", "host-a")
    on(d0, "local", "host-b")
    on(d1, "local", "host-b")
    r = make_router([p0, p1], [d0, d1])
    resp = r.client.post("/generate", json=GEN)
    assert resp.status_code == 503
    msg = resp.json()["error"]["message"]
    assert "different hosts" in msg and "mooncake" in msg and "nixl" in msg, msg
    assert not gen_requests(p0, p1, d0, d1)


def test_backends_must_match_and_unknown_is_not_held_against_a_pair(pd, make_router):
    p0, p1, d0, d1 = pd
    on(p0, "mooncake", "host-a")
    on(p1, "nixl", "host-b")
    on(d0, "nixl", "host-c")
    d1.info_extra = {}  # reports neither (e.g. another server): any prefill may pair with it
    r = make_router([p0, p1], [d0], decode_policy="round_robin")
    for _ in range(4):
        assert r.client.post("/generate", json=GEN).status_code == 200
    assert len(gen_requests(p1)) == 4 and not gen_requests(p0)
    r2 = make_router([p0], [d0])
    resp = r2.client.post("/generate", json=GEN)
    assert (
        resp.status_code == 503
        and "same --disaggregation-transfer-backend" in resp.json()["error"]["message"]
    )
    r3 = make_router([p0], [d1])
    assert r3.client.post("/generate", json=GEN).status_code == 200
