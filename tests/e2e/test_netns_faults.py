"""Network faults between PD hosts (network namespaces, tests/helpers/netns.py), mooncake over TCP.

Prefill P in A, decode D in B, routers in C: R talks to D directly, RR through the relay of
tests/helpers/tcp_relay.py (running in the test process, on the bridge) with
``--request-timeout 4`` (how long RR waits for the next bytes of a leg). Real-kernel faults:
``tc tbf`` rate limits on a host's egress and cut cables (``ip link set down`` on the bridge
end of a host's veth). Relay faults (this kernel has no ``netem``): added delay per chunk, a
stalled connection, reset connections, on RR's connection to D.

Every test ends with the link restored and asserts, through ``/debug/integrity`` on both
servers, that no page, metadata slot, room or destination claim leaked, and that the pair
serves again with the same processes. ``MEASURED`` / ``SAMPLE`` lines (``-s``) feed the table in
docs/reliability.md.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.test_faults import Outcome, body, call, prompts, stats
from tests.helpers import cluster as c
from tests.helpers import netns as nx
from tests.helpers.tcp_relay import Relay

HEARTBEAT_S = 3.0  # the servers' defaults: 1 s interval x 3 misses
RR_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def fx(netns_pd, netns_hosts, tmp_path_factory):
    pd = netns_pd("mooncake")
    h, P, D = netns_hosts, pd["prefill"], pd["decode"]
    relay = Relay(h.client_addr, D.host, D.port).start()
    RR = h.router(
        "C",
        "R-relay",
        [P],
        [relay.url],
        pd["logs"],
        "--request-timeout",
        str(RR_TIMEOUT_S),
        "--health-check-interval",
        "1",
    )
    try:
        RR.start()
        yield {**pd, "hosts": h, "relay": relay, "RR": RR, "pids": (P.proc.pid, D.proc.pid)}
    finally:
        RR.stop()
        relay.stop()


@pytest.fixture(autouse=True)
def healed(fx):
    """Whatever a test did to the network is undone, and the pair must be whole afterwards."""
    yield
    h = fx["hosts"]
    for name in h.names:
        h.restore(name)
        h.clear_qdisc(name)
    fx["relay"].passthrough()


@pytest.fixture(scope="module")
def ref(offline_engine):
    cache: dict = {}

    def get(ids: list[int], n: int) -> list[int]:
        if (tuple(ids), n) not in cache:
            cache[(tuple(ids), n)] = offline_engine.generate(
                input_ids=ids,
                sampling_params={"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
            )["output_ids"]
        return cache[(tuple(ids), n)]

    return get


def direct(fx, ids: list[int], n: int, pool: ThreadPoolExecutor, timeout: float = 40):
    """The router's job by hand, from the test process: one body to both servers (decode
    streams)."""
    P, D = fx["prefill"], fx["decode"]
    b = body(
        ids,
        n,
        True,
        bootstrap_host=P.host,
        bootstrap_port=P.bootstrap_port,
        bootstrap_room=random.randrange(2**63),
    )
    return (
        pool.submit(call, P.url, b, False, timeout=timeout),
        pool.submit(call, D.url, b, True, timeout=timeout),
    )


def no_leaks(fx, timeout: float = 30) -> None:
    """Both servers idle: every page free or cached, every metadata slot free, no room, no claim."""
    for proc in (fx["prefill"], fx["decode"]):
        pools = proc.wait_idle(timeout=timeout)
        assert pools["kv_rooms"] == 0 and pools.get("kv_dst_claims", 0) == 0, (proc.name, pools)
        assert pools["metadata_slots_free"] == pools["metadata_slots_total"], (proc.name, pools)


def serves_again(fx, ref, router: c.Proc, seed: int) -> None:
    c.wait_for(
        lambda: router.http.get("/health").status_code == 200, 30, f"{router.name} healthy again"
    )
    ids = prompts(4, 60, seed=seed)
    with ThreadPoolExecutor(4) as pool:
        outs = list(
            pool.map(lambda i: call(router.url, body(ids[i], 8, i % 2 == 0), i % 2 == 0), range(4))
        )
    for i, o in enumerate(outs):
        assert o.ok and o.output_ids == ref(ids[i], 8), o
    assert (fx["prefill"].proc.pid, fx["decode"].proc.pid) == fx["pids"]  # no restart
    no_leaks(fx)


def measured(what: str, seconds: float) -> None:
    print(f"MEASURED {what}: {seconds:.2f}s")


def sample(what: str, o: Outcome) -> None:
    print(
        f"SAMPLE {what}: HTTP {o.status}, {o.token_events} token events, [DONE]={o.done}: "
        f"{o.error[:300]}"
    )


def timed(url: str, ids: list[int], n: int) -> tuple[Outcome, float]:
    t0 = time.monotonic()
    o = call(url, body(ids, n, False), False)
    return o, nx.since(t0)


# ---- real kernel: tc tbf, cut cables -------------------------------------------------------------


def test_rate_limit_slows_the_transfer_and_completes(fx, ref):
    P, R, h = fx["prefill"], fx["router"], fx["hosts"]
    ids = prompts(4, 800, seed=71)
    base = [timed(R.url, x, 2) for x in ids[:2]]
    sent0 = stats(P)["kv_bytes_sent"]
    h.rate_limit("A", "1mbit")  # prefill's egress: the KV, its HTTP answers, its heartbeat answers
    slow = [timed(R.url, x, 2) for x in ids[2:]]
    kv_per_req = (stats(P)["kv_bytes_sent"] - sent0) / 2
    for x, (o, _) in zip(ids, base + slow):
        assert o.ok and o.output_ids == ref(x, 2), o
    t_base, t_slow = sum(t for _, t in base) / 2, sum(t for _, t in slow) / 2
    wire_s = kv_per_req * 8 / 1e6  # the KV alone at 1 Mbit/s
    measured("tbf 1mbit on prefill: request (800-token prompt) without the limit", t_base)
    measured(
        f"tbf 1mbit on prefill: request with the limit ({kv_per_req / 1e3:.0f} kB KV, "
        f"{wire_s:.2f}s at 1 Mbit/s)",
        t_slow,
    )
    assert t_slow > t_base + 0.7 * wire_s, (t_base, t_slow, wire_s)
    h.clear_qdisc("A")
    serves_again(fx, ref, R, seed=72)


def test_cut_prefill_link_during_transfer(fx, ref):
    P, R, h = fx["prefill"], fx["router"], fx["hosts"]
    h.rate_limit("A", "512kbit")  # transfers of 800-token prompts take seconds: cut in the middle
    ids = prompts(4, 800, seed=81)
    with ThreadPoolExecutor(8) as pool:
        routed = [pool.submit(call, R.url, body(x, 4, True), True, timeout=60) for x in ids[:2]]
        pairs = [direct(fx, x, 4, pool) for x in ids[2:]]
        c.wait_for(
            lambda: P.integrity().get("inflight_queue", 0) >= 1,
            30,
            "a transfer in flight on prefill",
        )
        t_cut = time.monotonic()
        h.cut("A")
        d_outs = [d.result() for _, d in pairs]
        r_outs = [f.result() for f in routed]
        t_seen = time.monotonic()
        h.restore("A")
        p_outs = [p.result() for p, _ in pairs]
    for o in d_outs:  # decode's own detection: heartbeats to the prefill go unanswered
        assert not o.ok and "unreachable" in o.error and o.t_end - t_cut < HEARTBEAT_S + 3, (
            o,
            o.t_end - t_cut,
        )
    for o in r_outs:
        assert not o.ok and o.error and o.t_end - t_cut < 30, (o, o.t_end - t_cut)
    sample("cut prefill link, decode stream sent directly", d_outs[0])
    sample("cut prefill link, through the router", r_outs[0])
    sample(
        "cut prefill link, prefill request sent directly (answered after the restore)", p_outs[0]
    )
    measured(
        "cut prefill link mid-transfer -> decode fails the room (heartbeat)",
        max(o.t_end for o in d_outs) - t_cut,
    )
    measured(
        "cut prefill link mid-transfer -> routed clients get their error",
        max(o.t_end for o in r_outs) - t_cut,
    )
    measured("cut prefill link: link down for", t_seen - t_cut)
    h.clear_qdisc("A")
    t0 = time.monotonic()
    no_leaks(fx)
    measured("cut prefill link: both sides idle after the restore", nx.since(t0))
    serves_again(fx, ref, R, seed=82)


def _stream_until_first_token(pool, url: str, ids: list[int], n: int):
    started = threading.Event()
    fut = pool.submit(call, url, body(ids, n, True), True, timeout=90, started=started)
    assert started.wait(30), "the stream did not start"
    return fut


def test_cut_decode_link_during_streaming(fx, ref):
    R, RR, h = fx["router"], fx["RR"], fx["hosts"]
    ids = prompts(2, 20, seed=91)
    cut_s = RR_TIMEOUT_S + 4
    with ThreadPoolExecutor(4) as pool:
        plain = _stream_until_first_token(pool, R.url, ids[0], 3000)
        timed_out = _stream_until_first_token(pool, RR.url, ids[1], 3000)
        t_cut = time.monotonic()
        h.cut("B")
        time.sleep(cut_s)  # the fault itself lasts this long
        h.restore("B")
        t_restore = time.monotonic()
        o_rr, o_r = timed_out.result(), plain.result()
    # RR gives up after its read timeout: a well-formed error event, then [DONE]
    assert o_rr.status == 200 and o_rr.error and o_rr.done and not o_rr.ok, o_rr
    assert RR_TIMEOUT_S - 0.5 < o_rr.t_end - t_cut < RR_TIMEOUT_S + 3, o_rr.t_end - t_cut
    # R (30 min read timeout) waits: TCP retransmits after the restore, and the stream completes
    assert o_r.ok and o_r.output_ids == ref(ids[0], 3000) and o_r.t_end > t_restore, o_r
    sample("decode link cut mid-stream, router with --request-timeout 4", o_rr)
    measured("decode link cut mid-stream -> client error (router read timeout)", o_rr.t_end - t_cut)
    measured(
        f"decode link cut mid-stream for {cut_s:.0f}s -> stream through R resumed and finished "
        "after restore",
        o_r.t_end - t_restore,
    )
    t0 = time.monotonic()
    no_leaks(fx)
    measured("decode link cut: both sides idle after the restore", nx.since(t0))
    for router in (R, RR):
        serves_again(fx, ref, router, seed=92)


# ---- through the relay: delay, stall, reset ------------------------------------------------------


def _ttft(url: str, ids: list[int], n: int) -> tuple[Outcome, float]:
    """One stream; seconds from sending it to its first token event."""
    t0 = time.monotonic()
    o = call(url, body(ids, n, True), True)
    return o, (o.t_first or o.t_end) - t0


def test_relay_delay_on_the_decode_stream(fx, ref):
    RR, relay = fx["RR"], fx["relay"]
    ids = prompts(6, 30, seed=101)
    fast = [_ttft(RR.url, x, 16) for x in ids[:3]]
    relay.delay(100)  # both ways: the request to decode, and every stream chunk back
    slow = [_ttft(RR.url, x, 16) for x in ids[3:]]
    relay.passthrough()
    for x, (o, _) in zip(ids, fast + slow):
        assert o.ok and o.output_ids == ref(x, 16), o
    t_fast, t_slow = min(t for _, t in fast), min(t for _, t in slow)
    measured("relay delay 100 ms each way on router->decode: time to first token, without", t_fast)
    measured("relay delay 100 ms each way on router->decode: time to first token, with", t_slow)
    assert t_slow > t_fast + 0.08, (t_fast, t_slow)  # the first reply at least comes 100 ms later
    serves_again(fx, ref, RR, seed=102)


@pytest.mark.parametrize("fault", ["stall", "reset"])
def test_relay_fault_mid_stream(fx, ref, fault):
    RR, relay, D = fx["RR"], fx["relay"], fx["decode"]
    with ThreadPoolExecutor(2) as pool:
        fut = _stream_until_first_token(pool, RR.url, prompts(1, 20, seed=111)[0], 3000)
        t0 = time.monotonic()
        getattr(relay, fault)()
        o = fut.result()
    assert o.status == 200 and o.error and o.done and not o.ok, o
    sample(f"relay {fault} mid-stream", o)
    measured(f"relay {fault} mid-stream -> client error", o.t_end - t0)
    if fault == "stall":
        assert RR_TIMEOUT_S - 0.5 < o.t_end - t0 < RR_TIMEOUT_S + 3
        relay.passthrough()  # the router's close reaches decode only now
    else:
        assert o.t_end - t0 < 2
    t1 = time.monotonic()
    D.wait_idle(timeout=15)
    measured(
        f"relay {fault} mid-stream -> decode idle (after the relay forwards again)", nx.since(t1)
    )
    no_leaks(fx)
    serves_again(fx, ref, RR, seed=112)


def test_relay_reset_during_transfer(fx, ref):
    D, RR, relay, h = fx["decode"], fx["RR"], fx["relay"], fx["hosts"]
    h.rate_limit("A", "512kbit")
    ids = prompts(1, 800, seed=121)[0]
    with ThreadPoolExecutor(2) as pool:
        fut = pool.submit(call, RR.url, body(ids, 4, False), False, timeout=60)
        c.wait_for(
            lambda: D.integrity().get("transfer_queue", 0) >= 1, 30, "decode waiting for the KV"
        )
        t0 = time.monotonic()
        assert relay.reset() >= 2
        o = fut.result()
    h.clear_qdisc("A")
    sample("relay reset of the router->decode connection during the transfer", o)
    measured("relay reset during transfer -> client answer", o.t_end - t0)
    # the router retries on a fresh connection (same decode, new room) or answers an error naming
    # decode
    assert (o.ok and o.output_ids == ref(ids, 4)) or (
        o.status and o.status >= 500 and "decode" in o.error
    ), o
    print(f"MEASURED relay reset during transfer: outcome {'retried, 200' if o.ok else o.status}")
    no_leaks(fx)
    serves_again(fx, ref, RR, seed=122)
    assert relay.stats()["resets"] >= 2
