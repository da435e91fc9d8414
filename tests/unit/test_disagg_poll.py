import multiprocessing as mp

from pdserve.disagg.poll import KVPoll, StatusTable, advance, poll_and_all_reduce
from tests.helpers.ports import free_port


class Const:
    def __init__(self, state, reason=""):
        self.state = state
        self.reason = reason
        self.aborted = None

    def poll(self):
        return self.state

    def failure_reason(self):
        return self.reason

    def abort(self, reason):
        self.aborted = reason


def test_advance_is_monotone_and_failed_wins():
    assert advance(None, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    assert advance(KVPoll.Transferring, KVPoll.WaitingForInput) == KVPoll.Transferring
    assert advance(KVPoll.Bootstrapping, KVPoll.Success) == KVPoll.Success
    assert advance(KVPoll.Success, KVPoll.Failed) == KVPoll.Failed
    assert advance(KVPoll.Failed, KVPoll.Success) == KVPoll.Failed


def test_status_table_does_not_recreate_cleared_rooms():
    t = StatusTable()
    t.add(7)
    assert t.update(7, KVPoll.Transferring)
    assert not t.update(7, KVPoll.WaitingForInput)
    assert t.get(7) == KVPoll.Transferring
    assert t.update(7, KVPoll.Failed, "first reason")
    t.update(7, KVPoll.Failed, "second reason")
    assert t.reason(7) == "first reason"
    t.clear(7)
    assert not t.update(7, KVPoll.Failed, "late")
    assert 7 not in t and t.get(7) is None
    assert t.update(7, KVPoll.Failed, "create", create=True) and t.get(7) == KVPoll.Failed
    t.add(8, KVPoll.WaitingForInput)
    t.add(8)  # adding again never moves backwards
    assert t.get(8) == KVPoll.WaitingForInput


def test_poll_and_all_reduce_without_group_is_identity():
    states = [KVPoll.Success, KVPoll.Failed, KVPoll.Bootstrapping]
    assert poll_and_all_reduce([Const(s) for s in states]) == states
    assert poll_and_all_reduce([]) == []


def _rank_main(rank, port, values, out):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1], backend="gloo")
        pollers = [
            Const(KVPoll(v), f"rank {rank} failed room {i}" if v == 0 else "")
            for i, v in enumerate(values)
        ]
        states = [int(v) for v in poll_and_all_reduce(pollers, group)]
        out.put((rank, states, [p.aborted for p in pollers]))
    finally:
        dist.destroy_process_group()


def test_poll_and_all_reduce_min_over_gloo():
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rank_values = [[4, 3, 2, 4, 0], [4, 4, 1, 0, 4]]
    procs = [ctx.Process(target=_rank_main, args=(r, port, rank_values[r], out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=60) for _ in procs]
        got = {rank: states for rank, states, _ in results}
        aborted = {rank: a for rank, _, a in results}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    expected = [4, 3, 1, 0, 0]
    assert got == {0: expected, 1: expected}
    # a room failed on one rank is aborted on the other with the failing rank's reason
    assert aborted[0] == [None, None, None, "rank 1 failed room 3", None]
    assert aborted[1] == [None, None, None, None, "rank 0 failed room 4"]
    assert all(p.exitcode == 0 for p in procs)
