"""Decode frees a failed room's pages only after the prefill session's KV window is fenced, when a
writer may still have bytes under way (mooncake over TCP on loopback, two real schedulers in one
process; the late write itself across a cut link is in tests/e2e/test_netns_late_write.py)."""

from __future__ import annotations

import time

import pytest

from pdserve.disagg.transfer.base import TransferError, get_backend
from pdserve.engine.request import FinishKind
from tests.helpers.cluster import free_port
from tests.unit.test_pd_failures import FAST_HEARTBEAT, Pair, idle, make, step_until


@pytest.fixture(autouse=True)
def _mooncake():
    try:
        get_backend("mooncake")
    except ValueError as e:
        pytest.skip(str(e))


class MooncakePair(Pair):
    def __init__(self, prefill_kw=None):
        import random

        self.bport = free_port()
        self.P = make(
            "prefill",
            "mooncake",
            disaggregation_bootstrap_port=self.bport,
            host="127.0.0.1",
            **FAST_HEARTBEAT,
            **(prefill_kw or {}),
        )
        self.D = make("decode", "mooncake", host="127.0.0.1", **FAST_HEARTBEAT)
        self.rng = random.Random(0)


def role(s):
    return s.pd.mgr.role


def test_pages_of_a_dead_prefill_wait_for_the_fence():
    # a slow transfer keeps the rooms in flight when the prefill goes silent
    pair = MooncakePair(
        prefill_kw=dict(
            disaggregation_fault_prob=1.0,
            disaggregation_fault_mode="delay_transfer",
            disaggregation_fault_delay=1.0,
        )
    )
    P, D = pair.P, pair.D
    backend = D.pd.mgr.backend
    real_fence, refused = backend.fence_window, []

    def failing_fence(key):  # the fence fails for a while: the pages must stay parked meanwhile
        if len(refused) < 20:
            refused.append(key)
            raise OSError("injected: cannot remap")
        return real_fence(key)

    try:
        reqs = [pair.requests(200) for _ in range(3)]
        for rp, rd in reqs:
            P.add_request(rp)
            D.add_request(rd)
        step_until(lambda: all(rd in D.pd.transfer for _, rd in reqs), P, D)
        backend.fence_window = failing_fence
        P.pd.mgr.close()  # no heartbeat answers from here on; its transfer worker may still write
        step_until(lambda: all(rd.finished for _, rd in reqs), D, timeout=10)
        for _, rd in reqs:
            assert "unreachable" in rd.finish_reason.message
        t0 = time.monotonic()
        while len(refused) < 20:  # about one fence attempt per 50 ms tick
            D.step()
            info = D.check_integrity()
            assert info["draining_rooms"] == 3 and info["in_use_pages"] > 0, info
            assert time.monotonic() - t0 < 10
        idle(D)  # fenced now: every page back, exactly once (integrity: free + cached == total)
        info = D.check_integrity()
        assert info["kv_fenced_windows"] == 1 and info["kv_retired_connections"] == 0, info
    finally:
        pair.P.pd.mgr.close()
        pair.P.pd.bootstrap_server.shutdown()
        pair.D.pd.mgr.close()


def test_failed_write_retires_the_connection_and_fences_it():
    pair = MooncakePair()
    P, D = pair.P, pair.D
    backend = P.pd.mgr.backend
    real_write, failed = backend._write, []

    def flaky_write(*a, **kw):  # the backend loses one write: its bytes may still be on the way
        if not failed:
            failed.append(1)
            raise TransferError("injected: connection reset during the write")
        return real_write(*a, **kw)

    try:
        ok_p, ok_d = pair.requests(40, max_new_tokens=30)  # in flight on the same connection
        P.add_request(ok_p)
        D.add_request(ok_d)
        step_until(lambda: ok_d in D.running, P, D)
        backend._write = flaky_write
        bad_p, bad_d = pair.requests(100)
        P.add_request(bad_p)
        D.add_request(bad_d)
        step_until(lambda: bad_d.finished, P, D)
        assert (
            bad_d.finish_reason.kind == FinishKind.ABORT
            and "injected: connection reset" in bad_d.finish_reason.message
        )
        # a new room goes over a new connection (new window), the running request is unharmed
        new_p, new_d = pair.requests(50)
        P.add_request(new_p)
        D.add_request(new_d)
        step_until(lambda: new_d.finished and ok_d.finished, P, D)
        assert (
            new_d.finish_reason.kind == FinishKind.LENGTH
            and ok_d.finish_reason.kind == FinishKind.LENGTH
        )
        idle(P, D)
        info = D.check_integrity()
        assert info["kv_fenced_windows"] == 1 and info["kv_retired_connections"] == 0, info
        assert info["kv_peer_connections"] == 1, info
    finally:
        pair.close()
