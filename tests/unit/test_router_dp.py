"""``pdserve router --dp-aware``: learning each worker's dp_size, choosing its DP group, and the
``routed_dp_rank`` / ``disagg_prefill_dp_rank`` fields put on each leg."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI, Request

from pdserve.router import protocol
from pdserve.router.args import RouterArgs, parse_args
from pdserve.router.workers import Worker, parse_group_loads, parse_load
from tests.helpers.fake_workers import AppServer, FakeCluster, wait_until
from tests.unit.test_router import RunningRouter

GEN = {"text": "one two three", "sampling_params": {"max_new_tokens": 2}}


# ---------------------------------------------------------------------------- loads
def test_group_loads_from_each_get_load_shape():
    pdserve_dp = {
        "num_reqs": 5,
        "num_waiting_reqs": 1,
        "num_tokens": 90,
        "dp": [
            {"dp_rank": 1, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 10},
            {"dp_rank": 0, "num_reqs": 4, "num_waiting_reqs": 1, "num_tokens": 80},
        ],
    }
    assert parse_group_loads(pdserve_dp) == [(5, 80), (1, 10)]
    assert parse_load(pdserve_dp) == (6, 90)  # the totals, not totals + groups
    assert parse_group_loads({"num_reqs": 2, "num_tokens": 7}) == [(2, 7)]  # no DP: one group
    sglang = [
        {"dp_rank": 0, "num_reqs": 1, "num_tokens": 3},
        {"dp_rank": 1, "num_reqs": 0, "num_tokens": 0},
    ]
    assert parse_group_loads(sglang) == [(1, 3), (0, 0)]
    for bad in (
        [],
        {"dp": []},
        [{"dp_rank": 0}, {"dp_rank": 2}],
        [{"dp_rank": 0}, {"dp_rank": 0}],
        [{"dp_rank": True}],
        [{"dp_rank": "0"}],
        ["x"],
        "busy",
    ):
        assert parse_group_loads(bad) is None, bad
    with pytest.raises(ValueError):
        parse_group_loads({"dp": [{"dp_rank": 0, "num_reqs": "many"}]})


# ---------------------------------------------------------------------------- choice
def test_unknown_dp_size_is_one_group():
    w = Worker("http://w:1", "decode")
    assert w.dp_size is None and [w.choose_dp_rank() for _ in range(3)] == [0, 0, 0]


def test_groups_take_turns_without_load():
    w = Worker("http://w:1", "decode")
    w.set_dp_size(3)
    assert [w.choose_dp_rank() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_group_counting_what_was_sent_since_the_poll():
    w = Worker("http://w:1", "decode")
    w.set_dp_size(3)
    w.group_loads = [(4, 0), (1, 500), (1, 100)]
    assert w.choose_dp_rank() == 2  # fewest requests, then fewest tokens
    w.group_in_flight = {2: 1}  # one more sent to group 2 since the poll
    assert w.group_load(2) == (2, 100) and w.choose_dp_rank() == 1
    w.group_loads = [(0, 0)] * 3
    w.group_in_flight = {}
    w._next_group = 1  # equal groups: the first one after the last choice
    assert [w.choose_dp_rank() for _ in range(3)] == [1, 2, 0]
    w.group_loads = [(0, 0), (9, 9)]  # another number of groups than dp_size: ignored
    assert [w.choose_dp_rank() for _ in range(3)] == [1, 2, 0]


def test_set_dp_size(caplog):
    w = Worker("http://w:1", "prefill")
    w.set_dp_size(None)  # absent: no DP
    assert w.dp_size == 1
    w.set_dp_size(4)
    w.group_loads = [(0, 0)] * 4
    w.set_dp_size(4)
    assert w.group_loads is not None  # unchanged: the polled loads stay
    w.set_dp_size(2)
    assert w.dp_size == 2 and w.group_loads is None
    with caplog.at_level(logging.WARNING):
        w.set_dp_size("2")
    assert w.dp_size == 1 and "treating it as 1" in caplog.text
    assert w.describe()["dp_size"] == 1


# ---------------------------------------------------------------------------- bodies
def chooser(rank: int):
    calls = []

    def choose() -> int:
        calls.append(rank)
        return rank

    choose.calls = calls
    return choose


def test_pd_legs_get_their_groups_and_decode_the_prefill_group():
    body = {"text": "x", "bootstrap_room": 5}
    p_body, d_body = protocol.with_dp_ranks(body, chooser(1), chooser(3))
    assert p_body == {**body, "routed_dp_rank": 1}
    assert d_body == {**body, "routed_dp_rank": 3, "disagg_prefill_dp_rank": 1}
    assert body == {"text": "x", "bootstrap_room": 5}  # the client's body is not changed
    batch = {"text": ["a", "b"], "bootstrap_room": [1, 2]}  # a batch: one group for all items
    p_body, d_body = protocol.with_dp_ranks(batch, chooser(0), chooser(2))
    assert (
        p_body["routed_dp_rank"],
        d_body["routed_dp_rank"],
        d_body["disagg_prefill_dp_rank"],
    ) == (0, 2, 0)


def test_colocated_gets_routed_dp_rank_only():
    p_body, body = protocol.with_dp_ranks({"prompt": "x"}, None, chooser(2))
    assert p_body is None and body == {"prompt": "x", "routed_dp_rank": 2}


@pytest.mark.parametrize(
    "client, prefill_leg, decode_leg",
    [
        # routed_dp_rank pins both legs (as if the client had sent its body to both servers)
        (
            {"routed_dp_rank": 1},
            {"routed_dp_rank": 1},
            {"routed_dp_rank": 1, "disagg_prefill_dp_rank": 1},
        ),
        (
            {"routed_dp_rank": [0, 1]},
            {"routed_dp_rank": [0, 1]},
            {"routed_dp_rank": [0, 1], "disagg_prefill_dp_rank": [0, 1]},
        ),
        # the deprecated alias counts as routed_dp_rank, and no routed_dp_rank is added next to it
        (
            {"data_parallel_rank": 2},
            {"data_parallel_rank": 2},
            {"data_parallel_rank": 2, "disagg_prefill_dp_rank": 2},
        ),
        # disagg_prefill_dp_rank pins the prefill leg; decode's group is still chosen
        (
            {"disagg_prefill_dp_rank": 1},
            {"disagg_prefill_dp_rank": 1, "routed_dp_rank": 1},
            {"disagg_prefill_dp_rank": 1, "routed_dp_rank": 7},
        ),
        (
            {"routed_dp_rank": 0, "disagg_prefill_dp_rank": 1},
            {"routed_dp_rank": 0, "disagg_prefill_dp_rank": 1},
            {"routed_dp_rank": 0, "disagg_prefill_dp_rank": 1},
        ),
        (
            {"routed_dp_rank": None},
            {"routed_dp_rank": 6},
            {"routed_dp_rank": 7, "disagg_prefill_dp_rank": 6},
        ),
    ],
)
def test_fields_the_client_set_are_kept(client, prefill_leg, decode_leg):
    choose_p, choose_d = chooser(6), chooser(7)
    p_body, d_body = protocol.with_dp_ranks({"text": "x", **client}, choose_p, choose_d)
    assert p_body == {"text": "x", **prefill_leg} and d_body == {"text": "x", **decode_leg}
    assert choose_p.calls == (
        [6] if p_body.get("routed_dp_rank") == 6 else []
    )  # only for groups left open
    assert choose_d.calls == ([7] if d_body.get("routed_dp_rank") == 7 else [])


def test_flag():
    assert not parse_args(["--worker", "http://w:1"]).dp_aware
    args = parse_args(["--prefill", "http://p:1", "--decode", "http://d:1", "--dp-aware"])
    assert args.dp_aware and args.to_dict()["dp_aware"] is True


# ---------------------------------------------------------------------------- against fake workers
@pytest.fixture(scope="module")
def cluster():
    c = FakeCluster()
    c.add("prefill")
    c.add("decode")
    c.add("regular")
    yield c
    c.close()


@pytest.fixture
def workers(cluster):
    for w in cluster.workers:
        w.reset()
    return cluster.workers


@pytest.fixture
def make_router():
    routers = []

    def make(**kw) -> RunningRouter:
        r = RunningRouter(
            RouterArgs(
                health_check_interval=0.2, health_failure_threshold=1, load_poll_interval=0.05, **kw
            )
        )
        routers.append(r)
        r.wait_ready()
        return r

    yield make
    for r in routers:
        r.stop()


def last_body(worker) -> dict:
    return worker.generation_requests()[-1].json


def test_router_learns_dp_sizes_and_routes_each_leg(workers, make_router):
    p, d, _ = workers
    p.dp_size, d.dp_size = 2, 4
    r = make_router(prefill=[(p.url, p.bootstrap_port)], decode=[d.url], dp_aware=True)
    assert (r.worker(p.url).dp_size, r.worker(d.url).dp_size) == (
        2,
        4,
    )  # known before the first request
    seen = []
    for _ in range(3):
        assert r.client.post("/generate", json=GEN).status_code == 200
        pre, dec = last_body(p), last_body(d)
        assert dec["disagg_prefill_dp_rank"] == pre["routed_dp_rank"]
        assert pre["bootstrap_room"] == dec["bootstrap_room"]
        seen.append((pre["routed_dp_rank"], dec["routed_dp_rank"]))
    assert seen == [(0, 0), (1, 1), (0, 2)]  # no load reported: in turn, per worker
    # with per-group loads, the least loaded group
    d.group_loads = [{"num_reqs": 3, "num_waiting_reqs": 0, "num_tokens": 0}] * 3 + [
        {"num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    ]
    wait_until(
        lambda: r.worker(d.url).group_loads == [(3, 0)] * 3 + [(0, 0)],
        what="decode group loads polled",
    )
    r.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "routed_dp_rank": None})
    assert last_body(d)["routed_dp_rank"] == 3
    # a client's choice stands
    r.client.post("/generate", json={**GEN, "routed_dp_rank": 1})
    assert last_body(p)["routed_dp_rank"] == last_body(d)["routed_dp_rank"] == 1
    # the router's /get_load passes the groups through
    load = r.client.get("/get_load").json()
    assert [g["dp_rank"] for g in load["decode"][0]["load"]["dp"]] == [0, 1, 2, 3]
    assert load["decode"][0]["dp_size"] == 4 and load["prefill"][0]["dp_size"] == 2


def test_worker_restarted_with_another_dp_size_is_reread(workers, make_router):
    w = workers[2]
    w.dp_size = 2
    r = make_router(worker=[w.url], dp_aware=True)
    assert r.worker(w.url).dp_size == 2
    w.dp_size = 3  # its load now reports three groups
    w.group_loads = [{"num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}] * 3
    wait_until(lambda: r.worker(w.url).dp_size == 3, what="dp_size re-read")
    ranks = []
    for _ in range(3):
        assert r.client.post("/generate", json=GEN).status_code == 200
        body = last_body(w)
        assert "disagg_prefill_dp_rank" not in body and "bootstrap_room" not in body  # colocated
        ranks.append(body["routed_dp_rank"])
    assert sorted(ranks) == [0, 1, 2]


def test_without_the_flag_nothing_is_injected(workers, make_router):
    p, d, w = workers
    p.dp_size = d.dp_size = w.dp_size = 2
    r = make_router(prefill=[(p.url, p.bootstrap_port)], decode=[d.url])
    assert r.client.post("/generate", json=GEN).status_code == 200
    assert not any("dp_rank" in k for k in last_body(p)) and not any(
        "dp_rank" in k for k in last_body(d)
    )
    assert r.worker(d.url).dp_size is None
    r2 = make_router(worker=[w.url])
    raw = b'{"text": "x",   "sampling_params": {}}'
    assert r2.client.post("/generate", content=raw).status_code == 200
    assert w.generation_requests()[-1].body == raw  # colocated: passed on byte for byte


def test_server_info_fallbacks(make_router):
    """A worker with only the old /get_server_info, and one with no server info at all."""

    def app(info_path: str | None) -> tuple[FastAPI, list]:
        bodies: list = []
        a = FastAPI()
        a.add_api_route("/health", lambda: {}, methods=["GET"])
        if info_path:
            a.add_api_route(info_path, lambda: {"dp_size": 2}, methods=["GET"])

        async def generate(request: Request):
            bodies.append(await request.json())
            return {"text": "ok"}

        a.add_api_route("/generate", generate, methods=["POST"])
        return a, bodies

    (old_app, old_bodies), (bare_app, bare_bodies) = app("/get_server_info"), app(None)
    servers = [AppServer(old_app), AppServer(bare_app)]
    try:
        r = make_router(worker=[s.url for s in servers], dp_aware=True)
        old, bare = (r.worker(s.url) for s in servers)
        assert old.dp_size == 2 and bare.dp_size is None
        for _ in range(4):
            assert r.client.post("/generate", json={"text": "x"}).status_code == 200
        assert sorted(b["routed_dp_rank"] for b in old_bodies) == [
            0,
            1,
        ]  # round robin over 2 workers
        assert [b["routed_dp_rank"] for b in bare_bodies] == [0, 0]  # unknown: one group
    finally:
        for s in servers:
            s.stop()
