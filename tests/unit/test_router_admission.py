"""The router's admission control (``router/admission.py``): the token bucket alone, then a real
router in front of fake PD workers whose decode holds its answers until the test lets them go."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest

from pdserve.router.admission import Admission, Refusal
from pdserve.router.args import RouterArgs
from tests.helpers import localhttp
from tests.helpers.fake_workers import wait_until

WORKER_ROLES = ("prefill", "decode", "regular")
GEN = {"text": "one two three", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}


def test_tokens_refill_at_their_rate_and_come_back_at_the_end():
    async def main():
        gate = Admission(capacity=2, rate=10, queue_size=4, timeout_s=5)
        await gate.enter()
        await gate.enter()  # the bucket is empty now
        t0 = time.monotonic()
        await gate.enter()  # one token refilled after ~0.1 s
        refill = time.monotonic() - t0
        # no refill: only a token given back admits the next one, in arrival order
        gate = Admission(capacity=1, rate=0, queue_size=2, timeout_s=5)
        await gate.enter()
        order = []

        async def waiter(name):
            await gate.enter()
            order.append(name)

        tasks = [asyncio.create_task(waiter(n)) for n in ("first", "second")]
        await asyncio.sleep(0.05)
        with pytest.raises(Refusal) as full:  # two wait already: the queue is full
            await gate.enter()
        assert order == [] and gate.queued == 2
        gate.leave()
        await asyncio.sleep(0.02)
        gate.leave()
        await asyncio.gather(*tasks)
        return refill, order, full.value.status, gate.counts

    refill, order, status, counts = asyncio.run(main())
    assert 0.05 < refill < 1.0
    assert order == ["first", "second"] and status == 429
    assert counts == {"admitted": 3, "queued": 2, "rejected": 1, "timed_out": 0}


def test_a_wait_longer_than_the_timeout_is_refused_with_408():
    async def main():
        gate = Admission(capacity=1, rate=0, queue_size=1, timeout_s=0.2)
        await gate.enter()
        with pytest.raises(Refusal) as late:
            await gate.enter()
        gate.leave()  # the token is back and nobody waits: the next one goes at once
        await asyncio.wait_for(gate.enter(), 1)
        return late.value.status, gate.counts

    status, counts = asyncio.run(main())
    assert status == 408
    assert counts == {"admitted": 2, "queued": 1, "rejected": 0, "timed_out": 1}


def test_flags_are_checked():
    for bad in (dict(queue_size=-1), dict(queue_timeout_secs=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RouterArgs(worker=["http://w"], **bad)


def test_the_router_queues_refuses_and_times_out_by_the_bucket(pd, make_router):
    p0, d0, _ = pd
    d0.stream_gate.close()  # decode holds its answers
    r = make_router(
        [p0],
        [d0],
        max_concurrent_requests=2,
        rate_limit_tokens_per_second=0,
        queue_size=1,
        queue_timeout_secs=1.5,
    )
    pool = concurrent.futures.ThreadPoolExecutor(4)

    def post(body=GEN):
        return localhttp.post(r.url + "/generate", json=body, timeout=30)

    held = [pool.submit(post), pool.submit(post, {**GEN, "stream": True})]
    wait_until(lambda: len(d0.generation_requests()) == 2, what="two requests at decode")
    queued = pool.submit(post)
    wait_until(lambda: r.router.admission.queued == 1, what="the third to wait")
    t0 = time.monotonic()
    refused = post()
    assert refused.status_code == 429 and time.monotonic() - t0 < 1.0
    assert refused.headers["Retry-After"] == "1"
    assert "--max-concurrent-requests" in refused.json()["error"]["message"]
    late = queued.result(10)  # its wait ran out with both places still taken
    assert late.status_code == 408, late.text
    assert len(d0.generation_requests()) == 2  # neither reached a worker
    d0.stream_gate.open()
    assert [f.result(10).status_code for f in held] == [200, 200]
    assert post().status_code == 200  # the tokens came back
    metrics = r.client.get("/metrics").text
    for result, n in (("admitted", 3), ("queued", 1), ("rejected", 1), ("timed_out", 1)):
        assert f'pdserve_router_admission_total{{result="{result}"}} {n}.0' in metrics, result


def test_a_stream_holds_its_token_to_its_last_byte_and_the_queue_moves_on(pd, make_router):
    p0, d0, _ = pd
    d0.stream_gate.close()  # a stream stops after its first event
    r = make_router([p0], [d0], max_concurrent_requests=1, queue_size=1, queue_timeout_secs=30)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    stream = pool.submit(
        localhttp.post, r.url + "/generate", json={**GEN, "stream": True}, timeout=30
    )
    wait_until(lambda: len(d0.generation_requests()) == 1, what="the stream at decode")
    waiting = pool.submit(localhttp.post, r.url + "/generate", json=GEN, timeout=30)
    wait_until(lambda: r.router.admission.queued == 1, what="the next to wait")
    time.sleep(0.3)
    assert not waiting.done() and len(d0.generation_requests()) == 1
    d0.stream_gate.open()
    assert stream.result(10).status_code == 200
    assert waiting.result(10).status_code == 200
    assert r.router.admission.queued == 0


def test_waiting_tenants_are_granted_by_their_weights():
    """Two tenants weighted 3:1 each with 40 waiting: 3:1 of the grants while both wait, first
    come first served within a tenant; a tenant that waits again later gets no credit for its
    idle time."""

    async def main():
        gate = Admission(capacity=1, rate=0, queue_size=100, timeout_s=30, weights={"a": 3})
        await gate.enter("a")  # the one token, held
        order = []

        async def one(tenant, i):
            await gate.enter(tenant)
            order.append((tenant, i))

        tasks = [asyncio.create_task(one(t, i)) for i in range(40) for t in ("a", "b")]
        await asyncio.sleep(0.05)
        for _ in range(20):
            gate.leave()  # each gives its token to the next in turn
        await asyncio.sleep(0.05)  # the granted ones run, in the order they were granted
        first = list(order)
        for _ in range(60):  # a drains, then b alone
            gate.leave()
        await asyncio.gather(*tasks)
        later = [asyncio.create_task(one(t, 100 + i)) for i in range(4) for t in ("a", "b")]
        await asyncio.sleep(0.05)
        for _ in range(8):
            gate.leave()
        await asyncio.gather(*later)
        return first, order[80:]

    first, later = asyncio.run(main())
    assert [t for t, _ in first].count("a") == 15, first
    for tenant in "ab":
        mine = [i for t, i in first if t == tenant]
        assert mine == sorted(mine)
    # both wait again, b having been served alone last: 3:1 again, no credit for a's idle time
    assert [t for t, _ in later[:4]].count("a") == 3, later


def test_the_router_shares_its_queue_by_the_tenant_header(pd, make_router):
    p0, d0, _ = pd
    d0.stream_gate.close()
    r = make_router(
        [p0],
        [d0],
        max_concurrent_requests=1,
        rate_limit_tokens_per_second=0,
        queue_size=64,
        tenant_header="x-tenant",
        tenant_weights={"gold": 3},
    )
    pool = concurrent.futures.ThreadPoolExecutor(40)

    def post(tenant: str, i: int):
        body = {**GEN, "text": f"{tenant} {i}"}
        return localhttp.post(
            r.url + "/generate", json=body, headers={"X-Tenant": tenant}, timeout=60
        )

    first = pool.submit(post, "gold", -1)
    wait_until(lambda: len(d0.generation_requests()) == 1, what="the first at decode")
    calls = [pool.submit(post, t, i) for i in range(16) for t in ("gold", "free")]
    wait_until(lambda: r.router.admission.queued == 32, what="32 waiting")
    d0.stream_gate.open()  # one at a time from here: each gives its token to the next
    assert all(f.result(60).status_code == 200 for f in [first, *calls])
    served = [rec.json["text"].split()[0] for rec in d0.generation_requests()[1:]]
    assert served[:16].count("gold") == 12, served


@pytest.mark.parametrize("low_first", [False, True])
def test_the_router_queue_takes_higher_priorities_first(pd, make_router, low_first):
    p0, d0, _ = pd
    d0.stream_gate.close()
    r = make_router(
        [p0],
        [d0],
        max_concurrent_requests=1,
        rate_limit_tokens_per_second=0,
        schedule_low_priority_values_first=low_first,
    )
    pool = concurrent.futures.ThreadPoolExecutor(8)

    def post(name: str, priority=None):
        body = {**GEN, "text": name, **({} if priority is None else {"priority": priority})}
        return localhttp.post(r.url + "/generate", json=body, timeout=60)

    calls = [pool.submit(post, "first")]
    wait_until(lambda: len(d0.generation_requests()) == 1, what="the first at decode")
    for name, priority in (("none", None), ("low", -3), ("high", 7), ("batch", [1, 2])):
        calls.append(pool.submit(post, name, priority))
        wait_until(lambda: r.router.admission.queued == len(calls) - 1, what=f"{name} waiting")
    d0.stream_gate.open()
    assert all(f.result(60).status_code == 200 for f in calls)
    served = [rec.json["text"] for rec in d0.generation_requests()[1:]]
    order = ["high", "batch", "none", "low"]
    assert served == (order[::-1] if low_first else order), served


CALIBRATION = {"calibration": {"prefill_fixed_s": 0.01, "prefill_s_per_token": 0.001}}


@pytest.mark.parametrize("colocated", [False, True])
def test_a_request_over_its_ttft_slo_is_refused_at_once(pd, make_router, colocated):
    """The estimate is the chosen server's queue (its polled tokens and requests at its calibrated
    rates) plus its prefill of the prompt: 100 tokens on an idle server fit 500 ms; a queue of a
    million tokens does not (429 with Retry-After, nothing sent); a request's own x-slo-ttft-ms
    lets it wait; a prompt the router cannot read is not estimated."""
    p0, d0, w0 = pd
    for w in pd:
        w.info_extra = dict(CALIBRATION)
    r = (
        make_router(worker=[w0], ttft_slo_ms=500)
        if colocated
        else make_router([p0], [d0], ttft_slo_ms=500)
    )
    queued = w0 if colocated else p0  # the server that would prefill
    body = {"input_ids": list(range(100, 200)), "sampling_params": {"max_new_tokens": 2}}
    assert r.client.post("/generate", json=body).status_code == 200
    queued.load = {"num_reqs": 3, "num_waiting_reqs": 2, "num_tokens": 1_000_000}
    wait_until(lambda: r.worker(queued.url).load_estimate()[1] == 1_000_000, what="the load polled")
    sent = len(queued.generation_requests())
    t0 = time.monotonic()
    refused = r.client.post("/generate", json=body)
    assert refused.status_code == 429 and time.monotonic() - t0 < 1.0
    assert "over this request's SLO of 0.500 s" in refused.json()["error"]["message"]
    assert int(refused.headers["Retry-After"]) >= 999  # about 1,000 s over
    assert len(queued.generation_requests()) == sent
    patient = r.client.post("/generate", json=body, headers={"x-slo-ttft-ms": "2000000"})
    assert patient.status_code == 200
    unread = r.client.post("/generate", json={**GEN, "text": "no tokenizer here"})
    assert unread.status_code == 200
    assert 'pdserve_router_shed_total{endpoint="/generate"} 1.0' in r.client.get("/metrics").text


def test_the_ttft_estimate_learns_from_the_streams_it_let_through(pd, make_router):
    """The model says 0.11 s (an idle server, 100 tokens at the calibrated rates) against a 300 ms
    SLO, but the worker's streams start 1 s late: after two of them the corrected estimate is
    over the SLO and requests are refused; once the worker is fast again the correction fades
    (half-life 5 s) and requests get through."""
    _, _, w0 = pd
    w0.info_extra = dict(CALIBRATION)
    r = make_router(worker=[w0], ttft_slo_ms=300)
    body = {"input_ids": list(range(100, 200)), "stream": True, "sampling_params": {}}
    w0.first_event_delay_s = 1.0
    statuses = [r.client.post("/generate", json=body).status_code for _ in range(3)]
    assert statuses == [200, 200, 429], statuses
    assert r.worker(w0.url).ttft_scale > 3
    w0.first_event_delay_s = 0.0
    wait_until(
        lambda: r.client.post("/generate", json=body).status_code == 200,
        timeout=30,
        what="a request let through again",
        interval=0.5,
    )
    assert r.worker(w0.url).ttft_scale < 3
