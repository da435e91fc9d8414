"""Multi-host flags (``--nnodes``, ``--node-rank``, ``--dist-init-addr``, ``--dist-timeout``):
parsing, validation naming the flags and values, the rank layout and addresses they give, the
start-up exchange's verdict, and the heartbeats that name a lost node (against a real TCP store)."""

from __future__ import annotations

import argparse
import datetime
import time

import pytest
import torch

from pdserve.config import ServerArgs
from pdserve.distributed import COLLECTIVE_TIMEOUT_S
from pdserve.server.heartbeat import Heartbeat
from pdserve.server.nodes import NodeLayout, gather_start_up
from tests.helpers.cluster import free_port

torch.set_num_threads(1)


def parse(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(
        parser.parse_args(["--model-path", "m", "--device", "cpu", *argv])
    )


def test_defaults_are_one_host_with_the_collective_timeout():
    a = parse([])
    assert (a.nnodes, a.node_rank, a.dist_init_addr, a.dist_timeout) == (
        1,
        0,
        None,
        COLLECTIVE_TIMEOUT_S,
    )
    a = parse(
        [
            "--tp-size",
            "4",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--dist-init-addr",
            "10.0.0.1:5000",
            "--dist-timeout",
            "15",
        ]
    )
    assert (a.nnodes, a.node_rank, a.dist_init_addr, a.dist_timeout) == (
        2,
        1,
        "10.0.0.1:5000",
        15.0,
    )


@pytest.mark.parametrize(
    "kw, field, needles",
    [
        (dict(tp_size=2, nnodes=2), "dist_init_addr", ["--nnodes 2", "--dist-init-addr"]),
        (
            dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1"),
            "node_rank",
            ["[0, --nnodes 2)", "got 2"],
        ),
        (dict(tp_size=2, nnodes=2, node_rank=-1, dist_init_addr="h:1"), "node_rank", ["got -1"]),
        (
            dict(tp_size=2, nnodes=3, dist_init_addr="h:1"),
            "nnodes",
            ["--tp-size 2 x --pp-size 1 = 2", "--nnodes 3"],
        ),
        (dict(tp_size=2, nnodes=2, dist_init_addr="h"), "dist_init_addr", ["HOST:PORT", "'h'"]),
        (dict(tp_size=2, nnodes=2, dist_init_addr="h:port"), "dist_init_addr", ["'h:port'"]),
        (
            dict(tp_size=2, nnodes=2, dist_init_addr="fd00::1:5000"),
            "dist_init_addr",
            ["[fd00::1]:5000"],
        ),
        (
            dict(tp_size=2, nnodes=2, dist_init_addr="h:65535"),
            "dist_init_addr",
            ["[1, 65534]", "'h:65535'"],
        ),
        (dict(dist_timeout=0), "dist_timeout", ["> 0", "got 0"]),
        (dict(nnodes=0), "nnodes", ["must be >= 1", "got 0"]),
        (
            dict(tp_size=2, nnodes=2, dist_init_addr="h:1", disaggregation_mode="decode"),
            "nnodes",
            ["--disaggregation-mode decode"],
        ),
    ],
)
def test_bad_values_name_the_flags_and_values(kw, field, needles):
    with pytest.raises(ValueError, match=f"^{field}:") as e:
        ServerArgs(model_path="m", device="cpu", **kw)
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_layout_ranks_and_addresses():
    a = ServerArgs(
        model_path="m",
        device="cpu",
        tp_size=4,
        nnodes=2,
        node_rank=1,
        dist_init_addr="10.0.0.1:5000",
    )
    lay = NodeLayout.from_args(a)
    assert list(lay.ranks()) == [2, 3] and list(lay.ranks(0)) == [0, 1]
    assert [lay.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert lay.init_address == "tcp://10.0.0.1:5000" and lay.output_address == "tcp://10.0.0.1:5001"
    assert lay.describe() == "node 1 of 2 (ranks 2-3)"
    v6 = NodeLayout.from_args(
        ServerArgs(
            model_path="m", device="cpu", tp_size=2, nnodes=2, dist_init_addr="[fd00::1]:7000"
        )
    )
    assert v6.output_address == "tcp://[fd00::1]:7001" == v6.output_bind_address()
    one = NodeLayout.from_args(ServerArgs(model_path="m", device="cpu", tp_size=2))
    assert list(one.ranks()) == [0, 1] and one.output_address == "" and one.init_address == ""
    assert "--dist-init-addr 10.0.0.1:5000" in " ".join(a.exposure_warnings())


class FakeWorld:
    def __init__(self, others: list[bytes]):
        self.others = others

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return [data, *self.others]


def test_start_up_exchange_names_every_failed_rank():
    lay = NodeLayout(nnodes=2, node_rank=0, world_size=2, host="h", port=1)
    ready = {"status": "ready", "info": {"x": 1}}
    assert gather_start_up(FakeWorld([b'{"ok": true, "message": ""}']), lay, ready) is ready
    out = gather_start_up(FakeWorld([b'{"ok": false, "message": "OSError: no model"}']), lay, ready)
    assert out == {
        "status": "error",
        "message": "failed to start: rank 1 on node 1: OSError: no model",
    }


def test_heartbeats_name_the_node_that_stops_and_a_lost_store():
    port = free_port()
    master = torch.distributed.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=5),
    )
    lay = NodeLayout(nnodes=2, node_rank=0, world_size=4, host="127.0.0.1", port=port)
    verdicts: list[str] = []
    beats = [Heartbeat(lay, r, dist_timeout=0.6, on_lost=verdicts.append) for r in range(4)]
    assert beats[0].lost_after == 0.6 and beats[0].interval == pytest.approx(0.2)
    t0 = time.monotonic()  # before the watchers start: they count the silence from their start
    for hb in beats[:2]:  # node 0's ranks beat; node 1's (ranks 2, 3) never do
        hb.start()
    assert beats[0].wait_lost(5) == "lost node 1 of 2 (ranks 2-3): no heartbeat for 0.6s"
    assert 0.6 <= time.monotonic() - t0 < 3
    # node 1's ranks watch node 0 through the store, which lives in rank 0's process
    watcher = Heartbeat(lay, 2, dist_timeout=0.6, on_lost=verdicts.append).start()
    del master
    verdict = watcher.wait_lost(5)
    assert verdict is not None and verdict.startswith(
        "lost node 0 of 2 (ranks 0-1): its torch.distributed store"
    )
