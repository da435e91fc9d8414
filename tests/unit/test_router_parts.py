"""Router pieces without HTTP: arguments, circuit breaker, policies, body rewriting."""

from __future__ import annotations

import json

import pytest

from pdserve.router import protocol
from pdserve.router.args import DEFAULT_BOOTSTRAP_PORT, RouterArgs, parse_args
from pdserve.router.policy import make_policy
from pdserve.router.workers import CircuitBreaker, Worker, bootstrap_host, parse_load


# ---------------------------------------------------------------------------- arguments
def test_parse_prefill_with_and_without_bootstrap_port():
    args = parse_args(
        [
            "--prefill",
            "http://h1:30000",
            "9001",
            "--prefill",
            "h2:30000",
            "--prefill",
            "http://h3:1/",
            "none",
            "--decode",
            "http://d:1",
            "--policy",
            "least_load",
            "--request-timeout-secs",
            "7",
            "--pd-disaggregation",
        ]
    )
    assert args.prefill == [
        ("http://h1:30000", 9001),
        ("http://h2:30000", DEFAULT_BOOTSTRAP_PORT),
        ("http://h3:1", None),
    ]
    assert (
        args.decode == ["http://d:1"] and args.policy == "least_load" and args.request_timeout == 7
    )
    assert args.pd_mode


@pytest.mark.parametrize(
    "argv,field",
    [
        (["--prefill", "http://p:1"], "prefill/decode"),
        (["--decode", "http://d:1"], "prefill/decode"),
        ([], "prefill/decode"),
        (["--prefill", "http://p:1", "--decode", "http://d:1", "--worker", "http://w:1"], "worker"),
        (["--prefill", "http://p:1", "x", "y", "--decode", "http://d:1"], "prefill"),
        (["--prefill", "http://p:1", "port", "--decode", "http://d:1"], "prefill"),
        (["--prefill", "http://p:1", "--decode", "http://p:1"], "worker URLs"),
        (["--worker", "ftp://w:1"], "invalid worker URL"),
        (["--worker", "http://w:1", "--health-check-interval", "0"], "health_check_interval"),
    ],
)
def test_bad_arguments_name_the_problem(argv, field):
    with pytest.raises(ValueError, match=field):
        parse_args(argv)


def test_router_main_reports_bad_arguments(capsys):
    from pdserve.router.app import main

    assert main(["--decode", "http://d:1"]) == 2
    assert "prefill" in capsys.readouterr().err


# ---------------------------------------------------------------------------- circuit breaker
class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_circuit_breaker_opens_cools_down_and_closes():
    clock = Clock()
    cb = CircuitBreaker(threshold=3, cooldown=10, clock=clock)
    for _ in range(2):
        cb.record(False)
    assert cb.state == "closed" and cb.allows()
    cb.record(False)
    assert cb.state == "open" and not cb.allows()
    clock.now = 10
    assert cb.state == "half_open" and cb.allows()
    cb.on_dispatch()
    assert not cb.allows()  # one trial at a time
    cb.record(False)  # trial failed: open again for a full cool-down
    assert cb.state == "open"
    clock.now = 20
    cb.on_dispatch()
    cb.record(True)
    assert cb.state == "closed" and cb.allows() and cb.failures == 0


def test_disabled_circuit_breaker_never_opens():
    cb = CircuitBreaker(threshold=0, cooldown=1)
    for _ in range(100):
        cb.record(False)
    assert cb.allows()


# ---------------------------------------------------------------------------- policies
def workers(n: int) -> list[Worker]:
    return [Worker(f"http://w{i}:1", "decode") for i in range(n)]


def test_round_robin_cycles_over_candidates():
    policy, ws = make_policy("round_robin"), workers(3)
    assert [policy.select(ws).url for _ in range(6)] == [w.url for w in ws] * 2


def test_least_load_uses_polled_load_plus_requests_sent_since():
    policy, (a, b) = make_policy("least_load"), workers(2)
    a.polled_load, a.in_flight_at_poll = (3, 0), 0
    b.polled_load, b.in_flight_at_poll = (1, 0), 0
    assert policy.select([a, b]) is b
    b.in_flight = 3  # sent since b's last poll
    assert b.load_estimate() == (4, 0) and policy.select([a, b]) is a
    a.polled_load = b.polled_load = None  # no poll yet: in-flight counts alone
    a.in_flight = 0
    assert policy.select([a, b]) is a


def test_random_policy_only_picks_candidates_and_unknown_policy_fails():
    ws = workers(2)
    assert {make_policy("random").select(ws) for _ in range(50)} <= set(ws)
    with pytest.raises(ValueError, match="policy"):
        make_policy("no_such_policy")


def test_worker_helpers():
    assert bootstrap_host("http://10.0.0.5:30000") == "10.0.0.5"
    assert bootstrap_host("http://[::1]:30000") == "[::1]"
    assert parse_load(
        [
            {"dp_rank": 0, "num_reqs": 2, "num_waiting_reqs": 1, "num_tokens": 50},
            {"dp_rank": 1, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 7},
        ]
    ) == (4, 57)
    assert parse_load({"load": 5}) == (5, 0)
    w = Worker("http://x:1", "decode")
    assert not w.available  # unknown until the first health check
    w.set_health(True, threshold=2)
    w.set_health(False, threshold=2)
    assert w.available
    w.set_health(False, threshold=2)
    assert not w.available


# ---------------------------------------------------------------------------- body rewriting
def test_with_bootstrap_scalar_and_batch():
    body = {"text": "x", "stream": False}
    single = protocol.with_bootstrap(body, "h", 8998, None)
    assert single["bootstrap_host"] == "h" and single["bootstrap_port"] == 8998
    assert 0 <= single["bootstrap_room"] < 2**63 and "bootstrap_room" not in body
    batch = protocol.with_bootstrap(body, "h", None, 3)
    assert batch["bootstrap_port"] == [None] * 3 and len(set(batch["bootstrap_room"])) == 3


@pytest.mark.parametrize("raw", [b"{", b"[]", b"1", b'{"a": Infinity}', b"\x80"])
def test_parse_body_rejects_non_objects(raw):
    with pytest.raises(protocol.BadRequest):
        protocol.parse_body(raw)


def test_merge_json_per_item_and_with_samples():
    p_items = [
        {"meta_info": {"input_token_logprobs": [[-1, 1, None]]}},
        {"meta_info": {"input_token_logprobs": [[-2, 2, None]]}},
    ]
    decode = [{"meta_info": {"input_token_logprobs": []}} for _ in range(4)]  # 2 inputs x n=2
    merged = json.loads(protocol.merge_logprobs_json(json.dumps(decode).encode(), p_items))
    assert [m["meta_info"]["input_token_logprobs"][0][1] for m in merged] == [1, 1, 2, 2]
    assert protocol.merge_logprobs_json(b"not json", p_items) is None


def test_prefill_items_from_json_or_sse():
    obj = {"meta_info": {"input_token_logprobs": [[-1, 5, None]]}}
    assert protocol.prefill_items(json.dumps(obj).encode()) == [obj]
    sse = (
        f"data: {json.dumps({'meta_info': {}})}\n\ndata: {json.dumps(obj)}\n\ndata: [DONE]\n\n"
    ).encode()
    assert protocol.prefill_items(sse) == [obj]
    assert protocol.prefill_items(b"garbage") == []


def test_merge_event_leaves_other_events_alone():
    p_items = [{"meta_info": {"input_token_logprobs": [[-1, 5, None]]}}]
    event = b'data: {"meta_info": {"input_token_logprobs": [[-3, 6, null]]}, "index": 0}\n\n'
    merged = protocol.merge_logprobs_event(event, p_items, 1)
    assert merged.endswith(b"\n\n")
    assert json.loads(merged[6:])["meta_info"]["input_token_logprobs"] == [
        [-1, 5, None],
        [-3, 6, None],
    ]
    for untouched in (b"data: [DONE]\n\n", b": keep-alive\n\n", b'data: {"choices":  []}\n\n'):
        assert protocol.merge_logprobs_event(untouched, p_items, 1) == untouched


def test_event_boundaries():
    assert protocol.event_boundary(b"") == 0
    assert protocol.event_boundary(b"data: 1\n\ndata: 2") == len(b"data: 1\n\n")
    assert protocol.event_boundary(b"data: 1\r\n\r\n") == len(b"data: 1\r\n\r\n")
    assert protocol.split_events(b"data: 1\n\n: c\n\ndata: 2\n\n") == [
        b"data: 1\n\n",
        b": c\n\n",
        b"data: 2\n\n",
    ]


def test_router_args_defaults_are_valid():
    args = RouterArgs(worker=["localhost:9"])
    assert args.worker == ["http://localhost:9"] and not args.pd_mode and args.max_retries == 1
