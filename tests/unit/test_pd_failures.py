"""Failure handling of the PD queues between two real schedulers in one process (local backend):
cancellation both ways, dead peers, backpressure, injected transfer faults. Every test ends
with both sides' pools and rooms back to idle."""

from __future__ import annotations

import random
import time

import pytest
import torch

from pdserve.config import ServerArgs
from pdserve.disagg.poll import KVPoll
from pdserve.disagg.setup import attach_disaggregation
from pdserve.engine.request import FinishKind
from tests.helpers.checkpoints import build_tiny_checkpoint
from tests.helpers.cluster import free_port
from tests.unit.test_pd_queues import req

torch.set_num_threads(1)

FAST_HEARTBEAT = dict(disaggregation_heartbeat_interval=0.2, disaggregation_heartbeat_misses=2)


def make(mode: str, backend: str, **kw):
    kw = {
        "max_total_tokens": 4096,
        "disaggregation_waiting_timeout": 3,
        "disaggregation_bootstrap_timeout": 3,
        **kw,
    }
    args = ServerArgs(
        model_path=build_tiny_checkpoint("llama"),
        page_size=16,
        chunked_prefill_size=64,
        torch_num_threads=1,
        disaggregation_mode=mode,
        disaggregation_transfer_backend=backend,
        **kw,
    )
    return attach_disaggregation(args)


def step_until(cond, *schedulers, timeout: float = 20.0) -> float:
    """Step the schedulers until ``cond()``; returns the seconds it took."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        for s in schedulers:
            s.step()
        time.sleep(0.002)
    return time.monotonic() - t0


def idle(*schedulers) -> None:
    for s in schedulers:
        step_until(lambda: not s.pd.has_work and not s.running and not s.waiting, s, timeout=15)
        info = s.check_integrity()
        assert info["in_use_pages"] == 0, info
        assert info["metadata_slots_free"] == info["metadata_slots_total"], info
        assert info["kv_rooms"] == 0, info
        assert info.get("kv_dst_claims", 0) == 0, info


class Pair:
    def __init__(self, prefill_kw=None, decode_kw=None):
        self.bport = free_port()
        self.P = make(
            "prefill",
            "local",
            disaggregation_bootstrap_port=self.bport,
            **FAST_HEARTBEAT,
            **(prefill_kw or {}),
        )
        self.D = make("decode", "local", **FAST_HEARTBEAT, **(decode_kw or {}))
        self.rng = random.Random(0)

    def requests(self, n_tokens: int, **sp):
        room = self.rng.randrange(2**63)
        ids = [self.rng.randrange(100, 40000) for _ in range(n_tokens)]
        rid = f"r{room}"
        return req("p" + rid, ids, room, port=self.bport, **sp), req(
            "d" + rid, ids, room, port=self.bport, **sp
        )

    def close(self):
        for s in (self.P, self.D):
            s.pd.mgr.close()
        self.P.pd.bootstrap_server.shutdown()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def test_prefill_side_abort_reaches_decode_at_once(pair):
    P, D = pair.P, pair.D
    # decode asked already: the Failed status goes to that decode rank for its generation
    rp, rd = pair.requests(300)
    P.add_request(rp)
    D.add_request(rd)
    step_until(
        lambda: rd in D.pd.transfer and rp.disagg.sender.poll() >= KVPoll.WaitingForInput, P, D
    )
    P.abort(rp.rid)
    took = step_until(lambda: rd.finished, D)
    assert rd.finish_reason.kind == FinishKind.ABORT and rd.finish_reason.status_code == 502
    assert "prefill request aborted: aborted by client" in rd.finish_reason.message
    assert took < 2.0
    # decode has not asked yet (its request is still before preallocation): every session hears it
    rp, rd = pair.requests(40)
    D.add_request(rd)  # receiver exists, nothing sent to prefill yet (D is not stepped)
    P.add_request(rp)
    P.step()
    P.abort(rp.rid)
    step_until(lambda: rd.finished, D, timeout=5)
    assert "prefill request aborted" in rd.finish_reason.message
    idle(P, D)


def test_decode_abort_stops_the_prefill_mid_prompt(pair):
    P, D = pair.P, pair.D
    rp, rd = pair.requests(1200)  # 19 chunks of 64 tokens
    P.add_request(rp)
    D.add_request(rd)
    step_until(lambda: rp in P.running and rp.kv_len > 0, P, D)
    D.abort(rd.rid, "client went away")
    step_until(lambda: rp.finished, P, D, timeout=5)
    assert rp.finish_reason.kind == FinishKind.ABORT
    assert "aborted by decode: client went away" in rp.finish_reason.message
    assert not rp.output_ids  # prefill stopped instead of finishing a prompt nobody will read
    idle(P, D)


def test_dead_decode_fails_its_rooms_on_prefill():
    # a slow link keeps the rooms in transfer when the decode goes away
    pair = Pair(
        prefill_kw=dict(
            disaggregation_fault_prob=1.0,
            disaggregation_fault_mode="delay_transfer",
            disaggregation_fault_delay=0.5,
        )
    )
    try:
        P, D = pair.P, pair.D
        reqs = [pair.requests(400) for _ in range(4)]
        for rp, rd in reqs:
            P.add_request(rp)
            D.add_request(rd)
        step_until(lambda: all(rd in D.pd.transfer for _, rd in reqs), P, D)
        D.pd.mgr.close()  # the decode's control plane is gone: no heartbeats, no answers
        t0 = time.monotonic()
        step_until(lambda: all(rp.finished for rp, _ in reqs), P, timeout=10)
        took = time.monotonic() - t0
        for rp, _ in reqs:
            assert rp.finish_reason.kind == FinishKind.ABORT
            assert (
                "decode instance" in rp.finish_reason.message
                and "unreachable" in rp.finish_reason.message
            )
        assert took < 0.2 * 2 + 1.5
        idle(P)
        assert P.check_integrity()["kv_peer_sessions"] == 0
    finally:
        pair.P.pd.mgr.close()
        pair.P.pd.bootstrap_server.shutdown()


def test_dead_prefill_fails_rooms_and_a_restarted_one_is_picked_up():
    pair = Pair()
    try:
        P, D = pair.P, pair.D
        rp, rd = pair.requests(50)
        P.add_request(rp)
        D.add_request(rd)
        step_until(lambda: rd.finished and rp.finished, P, D)
        assert rd.finish_reason.kind == FinishKind.LENGTH
        # the prefill goes away while decode waits for a room
        lonely = pair.requests(50)[1]
        D.add_request(lonely)
        step_until(lambda: lonely in D.pd.transfer, D)
        P.pd.mgr.close()
        P.pd.bootstrap_server.shutdown()
        took = step_until(lambda: lonely.finished, D, timeout=10)
        assert (
            f"prefill instance 127.0.0.1:{pair.bport} unreachable" in lonely.finish_reason.message
        )
        assert took < 0.2 * 2 + 1.5
        idle(D)
        # a new prefill on the same bootstrap port: decode looks it up again and re-registers
        pair.P = P2 = make(
            "prefill", "local", disaggregation_bootstrap_port=pair.bport, **FAST_HEARTBEAT
        )
        rp, rd = pair.requests(50)
        P2.add_request(rp)
        D.add_request(rd)
        step_until(lambda: rd.finished and rp.finished, P2, D)
        assert rd.finish_reason.kind == FinishKind.LENGTH and len(rd.output_ids) == 6
        idle(P2, D)
    finally:
        pair.close()


def test_decode_backpressure_fails_fast_and_frees_the_prefill():
    pair = Pair(
        decode_kw=dict(
            max_total_tokens=512,
            num_reserved_decode_tokens=256,
            disaggregation_prealloc_timeout=0.5,
            disaggregation_max_prealloc_queue=2,
        )
    )
    try:
        P, D = pair.P, pair.D
        # one running decode keeps 256 tokens in reserve: a 300-token prompt cannot be preallocated
        long_p, long_d = pair.requests(20, max_new_tokens=400)
        P.add_request(long_p)
        D.add_request(long_d)
        step_until(lambda: long_d in D.running, P, D)
        rp, rd = pair.requests(300)
        P.add_request(rp)
        D.add_request(rd)
        took = step_until(lambda: rd.finished and rp.finished, P, D, timeout=10)
        assert (
            rd.finish_reason.status_code == 503
            and "decode is overloaded" in rd.finish_reason.message
        )
        assert "aborted by decode: decode is overloaded" in rp.finish_reason.message
        assert rp.finish_reason.status_code == 502  # the peer's fault, as the router reads it
        assert took < 3  # not the 3 s bootstrap timeout of the prefill
        # over the queue limit: refused on arrival
        more = [pair.requests(300) for _ in range(3)]
        for _, d in more:
            D.add_request(d)
        step_until(lambda: more[2][1].finished, D, timeout=2)
        assert "requests already wait" in more[2][1].finish_reason.message
        D.abort("")
        P.abort("")
        idle(P, D)
    finally:
        pair.close()


@pytest.mark.parametrize(
    "mode, expect",
    [
        ("fail_transfer", "injected fault: the backend reported a failed write"),
        ("corrupt_aux_room", "the KV cannot be trusted"),
        ("kill_transfer_thread", "prefill transfer worker died"),
        ("drop_status", "timed out after"),
        ("delay_transfer", None),
    ],
)
def test_injected_faults_end_the_request_with_a_reason(mode, expect):
    pair = Pair(
        prefill_kw=dict(
            disaggregation_fault_prob=1.0,
            disaggregation_fault_mode=mode,
            disaggregation_fault_delay=0.3,
        )
    )
    try:
        P, D = pair.P, pair.D
        reqs = [pair.requests(n) for n in (10, 100)]
        for rp, rd in reqs:
            P.add_request(rp)
            D.add_request(rd)
        step_until(lambda: all(rd.finished and rp.finished for rp, rd in reqs), P, D, timeout=15)
        for rp, rd in reqs:
            if expect is None:
                assert rd.finish_reason.kind == FinishKind.LENGTH and len(rd.output_ids) == 6
            else:
                assert (
                    rd.finish_reason.kind == FinishKind.ABORT and expect in rd.finish_reason.message
                ), rd.finish_reason
                assert rd.output_ids == []  # no token from an untrusted or missing transfer
                assert (
                    rd.finish_reason.status_code == 502
                )  # its KV did not come: the prefill's fault
                if mode in ("fail_transfer", "kill_transfer_thread"):
                    assert (
                        rp.finish_reason.status_code == 503 and expect in rp.finish_reason.message
                    )
        assert P.pd.mgr.faults.stats()["injected"][mode] == 2
        if mode == "kill_transfer_thread":
            assert P.pd.mgr.role.workers.restarts >= 1
        # the same servers work again once the faults stop
        P.pd.mgr.faults.prob = 0.0
        rp, rd = pair.requests(30)
        P.add_request(rp)
        D.add_request(rd)
        step_until(lambda: rd.finished and rp.finished, P, D)
        assert rd.finish_reason.kind == FinishKind.LENGTH
        idle(P, D)
    finally:
        pair.close()


@pytest.mark.parametrize("small", ["prefill", "decode"])
def test_a_request_refused_by_one_side_ends_the_room_on_the_other(small):
    kw = dict(max_total_tokens=256)
    pair = Pair(
        prefill_kw=kw if small == "prefill" else None, decode_kw=kw if small == "decode" else None
    )
    try:
        P, D = pair.P, pair.D
        rp, rd = pair.requests(400)  # more than the small side's whole KV pool
        refusing, refused, other, waiting = (P, rp, D, rd) if small == "prefill" else (D, rd, P, rp)
        other.add_request(waiting)
        with pytest.raises(ValueError, match="KV cache capacity") as e:
            refusing.add_request(refused)
        # what the scheduler process does with a refused PD request
        refusing.pd.reject("127.0.0.1", pair.bport, refused.bootstrap_room, f"refused: {e.value}")
        took = step_until(lambda: waiting.finished, P, D, timeout=5)
        assert f"{small} request refused: prompt" in waiting.finish_reason.message, (
            waiting.finish_reason
        )
        assert took < 2  # not the other side's 3 s timeout
        idle(P, D)
    finally:
        pair.close()
