"""The bootstrap server's room -> prefill DP rank table: POST /register_dp_rank and
POST /query_dp_ranks against a real server on a free port, and the table's expiry."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from pdserve.disagg.bootstrap import (
    AUTH_HEADER,
    TIME_HEADER,
    BootstrapError,
    BootstrapNotReady,
    BootstrapServer,
    fetch_prefill_info,
    fetch_rank_info,
    query_dp_ranks,
    register_dp_rank,
    register_rank,
    registration_tag,
)
from pdserve.disagg.dp_rooms import MAX_QUERY_ROOMS, DPRoomTable
from tests.helpers.cluster import wait_for
from tests.unit.test_disagg_bootstrap import rank_info

HOST = "127.0.0.1"
SECRET = "s3cret"
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def post(port: int, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://{HOST}:{port}{path}",
        data=data,
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with _opener.open(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def server():
    s = BootstrapServer(HOST, 0, expected_ranks=1)
    yield s
    s.shutdown()


def test_known_unknown_and_overwritten_rooms(server):
    assert query_dp_ranks(HOST, server.port, [1, 2]) == {}
    register_dp_rank(HOST, server.port, 1, 0)
    register_dp_rank(HOST, server.port, 2**63 - 1, 3)
    assert query_dp_ranks(HOST, server.port, [1, 2, 2**63 - 1]) == {1: 0, 2**63 - 1: 3}
    register_dp_rank(HOST, server.port, 1, 2)  # re-registering a room overwrites it
    assert query_dp_ranks(HOST, server.port, [1]) == {1: 2}
    # the wire format: room numbers as JSON object keys
    assert post(server.port, "/query_dp_ranks", {"bootstrap_rooms": [1, 7]}) == (200, {"1": 2})
    assert post(server.port, "/register_dp_rank", {"bootstrap_room": 7, "dp_rank": 1}) == (
        200,
        {"ok": True},
    )
    assert query_dp_ranks(HOST, server.port, []) == {}


def test_client_splits_large_queries(server):
    register_dp_rank(HOST, server.port, 5, 1)
    register_dp_rank(HOST, server.port, MAX_QUERY_ROOMS + 100, 0)
    rooms = range(MAX_QUERY_ROOMS + 500)  # more than one request may carry
    assert query_dp_ranks(HOST, server.port, rooms) == {5: 1, MAX_QUERY_ROOMS + 100: 0}


def test_rooms_expire_on_the_server():
    ttl = 0.3
    s = BootstrapServer(HOST, 0, expected_ranks=1, entry_ttl_s=ttl)
    try:
        start = time.monotonic()
        register_dp_rank(HOST, s.port, 11, 1)
        wait_for(
            lambda: query_dp_ranks(HOST, s.port, [11]) == {}, timeout=10, what="room 11 to expire"
        )
        assert time.monotonic() - start >= ttl  # not before its time
    finally:
        s.shutdown()
    with pytest.raises(ValueError, match="entry_ttl_s"):
        BootstrapServer(HOST, 0, entry_ttl_s=0)


def test_table_expiry_and_purge_with_a_clock():
    now = [100.0]
    table = DPRoomTable(ttl_s=10.0, clock=lambda: now[0])
    for room in range(1000):
        table.put(room, room % 4)
    now[0] += 5.0
    table.put(1, 3)  # refreshed: lives 10 s from now
    assert table.get_many([0, 1, 2, 5000]) == {0: 0, 1: 3, 2: 2}
    now[0] += 5.0  # the first registrations are exactly ttl old: expired
    assert table.get_many([0, 1, 2]) == {1: 3}
    assert len(table) == 1  # expired entries were dropped, not kept
    now[0] += 20.0
    table.put(7, 1)  # a write purges too
    assert len(table) == 1 and table.get_many([1, 7]) == {7: 1}


@pytest.mark.parametrize(
    "body, status, field",
    [
        ({"dp_rank": 0}, 400, "bootstrap_room"),
        ({"bootstrap_room": -1, "dp_rank": 0}, 400, "bootstrap_room"),
        ({"bootstrap_room": 2**63, "dp_rank": 0}, 400, "bootstrap_room"),
        ({"bootstrap_room": True, "dp_rank": 0}, 400, "bootstrap_room"),
        ({"bootstrap_room": "5", "dp_rank": 0}, 400, "bootstrap_room"),
        ({"bootstrap_room": 5}, 400, "dp_rank"),
        ({"bootstrap_room": 5, "dp_rank": -1}, 400, "dp_rank"),
        ({"bootstrap_room": 5, "dp_rank": 1.0}, 400, "dp_rank"),
        ({"bootstrap_room": 5, "dp_rank": False}, 400, "dp_rank"),
        ([5, 0], 400, "JSON object"),
        (b"{not json", 400, "JSON"),
    ],
)
def test_bad_registrations(server, body, status, field):
    code, answer = post(server.port, "/register_dp_rank", body)
    assert code == status and field in answer["error"]
    assert query_dp_ranks(HOST, server.port, [5]) == {}


@pytest.mark.parametrize(
    "body, field",
    [
        ({}, "bootstrap_rooms"),
        ({"bootstrap_rooms": 5}, "bootstrap_rooms"),
        ({"bootstrap_rooms": [1, "2"]}, "bootstrap_rooms"),
        ({"bootstrap_rooms": [1, -2]}, "bootstrap_rooms"),
        ({"bootstrap_rooms": [True]}, "bootstrap_rooms"),
        ({"bootstrap_rooms": list(range(MAX_QUERY_ROOMS + 1))}, "at most"),
        ("rooms", "JSON object"),
    ],
)
def test_bad_queries(server, body, field):
    code, answer = post(server.port, "/query_dp_ranks", body)
    assert code == 400 and field in answer["error"]


def test_client_errors_name_the_cause(server):
    with pytest.raises(BootstrapError, match="dp_rank: must be an integer >= 0"):
        register_dp_rank(HOST, server.port, 1, -1)
    port = server.port
    server.shutdown()
    with pytest.raises(BootstrapError, match="unreachable"):
        register_dp_rank(HOST, port, 1, 0, timeout=1)
    with pytest.raises(BootstrapNotReady, match="unreachable"):
        query_dp_ranks(HOST, port, [1], timeout=1)


def test_registration_needs_the_secret():
    s = BootstrapServer(HOST, 0, expected_ranks=1, secret=SECRET)
    try:
        body = json.dumps({"bootstrap_room": 9, "dp_rank": 1}).encode()
        assert post(s.port, "/register_dp_rank", body)[0] == 401
        with pytest.raises(BootstrapError, match="not authenticated"):
            register_dp_rank(HOST, s.port, 9, 1)
        with pytest.raises(BootstrapError, match="bad HMAC"):
            register_dp_rank(HOST, s.port, 9, 1, secret="wrong")
        ts = f"{time.time():.3f}"
        forged = {TIME_HEADER: ts, AUTH_HEADER: registration_tag(SECRET.encode(), ts, b"{}")}
        assert post(s.port, "/register_dp_rank", body, forged)[0] == 401  # a tag of another body
        with pytest.raises(BootstrapError, match="401"):  # look-ups are signed too
            query_dp_ranks(HOST, s.port, [9])
        assert query_dp_ranks(HOST, s.port, [9], secret=SECRET) == {}
        register_dp_rank(HOST, s.port, 9, 1, secret=SECRET)
        signed = {TIME_HEADER: ts, AUTH_HEADER: registration_tag(SECRET.encode(), ts, body)}
        assert post(s.port, "/register_dp_rank", body, signed) == (200, {"ok": True})
        assert query_dp_ranks(HOST, s.port, [9], secret=SECRET) == {9: 1}
    finally:
        s.shutdown()


def test_dp_rank_checked_against_the_registered_dp_size(server):
    register_dp_rank(HOST, server.port, 1, 5)  # no rank registered yet: the dp_size is unknown
    register_rank(HOST, server.port, rank_info(0, tp_size=1, dp_size=2, dp_rank=0))
    with pytest.raises(
        BootstrapError, match="dp_rank: 2 out of range for the instance's dp_size 2"
    ):
        register_dp_rank(HOST, server.port, 2, 2)
    register_dp_rank(HOST, server.port, 2, 1)
    assert query_dp_ranks(HOST, server.port, [1, 2]) == {1: 5, 2: 1}


def test_instance_info_waits_for_every_dp_group(server):
    # expected_ranks=1 (one TP rank), but the registrations say there are two DP groups
    register_rank(HOST, server.port, rank_info(0, tp_size=1, dp_size=2, dp_rank=1, port=41001))
    with pytest.raises(BootstrapNotReady, match="1 of 2"):
        fetch_prefill_info(HOST, server.port)
    register_rank(HOST, server.port, rank_info(0, tp_size=1, dp_size=2, dp_rank=0, port=41000))
    assert fetch_prefill_info(HOST, server.port)["dp_size"] == 2
    assert fetch_rank_info(HOST, server.port, 1, 0, 0)["rank_port"] == 41001
    assert fetch_rank_info(HOST, server.port, 0, 0, 0)["rank_port"] == 41000
