"""The router's admission control (``router/admission.py``): the token bucket alone, then a real
router in front of fake PD workers whose decode holds its answers until the test lets them go."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import httpx
import pytest

from pdserve.router.admission import Admission, Refusal
from pdserve.router.args import RouterArgs
from tests.helpers.fake_workers import wait_until

WORKER_ROLES = ("prefill", "decode")
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
    p0, d0 = pd
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
        return httpx.post(r.url + "/generate", json=body, timeout=30)

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
    p0, d0 = pd
    d0.stream_gate.close()  # a stream stops after its first event
    r = make_router([p0], [d0], max_concurrent_requests=1, queue_size=1, queue_timeout_secs=30)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    stream = pool.submit(httpx.post, r.url + "/generate", json={**GEN, "stream": True}, timeout=30)
    wait_until(lambda: len(d0.generation_requests()) == 1, what="the stream at decode")
    waiting = pool.submit(httpx.post, r.url + "/generate", json=GEN, timeout=30)
    wait_until(lambda: r.router.admission.queued == 1, what="the next to wait")
    time.sleep(0.3)
    assert not waiting.done() and len(d0.generation_requests()) == 1
    d0.stream_gate.open()
    assert stream.result(10).status_code == 200
    assert waiting.result(10).status_code == 200
    assert r.router.admission.queued == 0
