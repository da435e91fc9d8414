"""One server whose ranks span two hosts (``--nnodes 2``): node 0 (the front end and rank 0) in
network namespace A, node 1 (rank 1, no HTTP) in B (tests/helpers/netns.py), so the rendezvous,
gloo's collectives, the heartbeats and DP group 1's outputs cross veth links, never loopback.

- ``--tp-size 2`` and ``--tp-size 2 --dp-size 2 --enable-dp-attention`` over the two hosts give
  the offline engine's greedy tokens (logprobs within 1e-4), and both ranks' pools are free after;
- node B killed while four streams run (two in each DP group): every stream ends with an error
  event within the bound of docs/reliability.md, ``/health`` and ``/generate`` answer 503 with the
  reason, rank 0's log names the lost node, and the front end exits 1;
- node A killed: node B's ranks name node 0 as lost and ``pdserve serve --node-rank 1`` exits 1;
- a node 0 whose peer never starts fails its start-up after ``--dist-timeout`` with that reason
  (loopback: no namespaces needed).
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.server.heartbeat import HEARTBEAT_INTERVAL_S, lost_after
from tests.e2e.conftest import sse_events
from tests.e2e.test_tp import all_ranks_idle
from tests.helpers import cluster as c
from tests.helpers import localhttp

NEW_TOKENS = 8
DIST_TIMEOUT_S = 10.0
# streams must end this long after the kill: heartbeat verdict (docs/reliability.md), plus slack for
# a loaded 2-core machine
LOST_BOUND_S = lost_after(DIST_TIMEOUT_S) + HEARTBEAT_INTERVAL_S
SLACK_S = 4.0
ARGS = [
    "--page-size",
    "16",
    "--max-total-tokens",
    "16384",
    "--chunked-prefill-size",
    "128",
    "--dist-timeout",
    str(DIST_TIMEOUT_S),
]


def two_node_server(h, name: str, model: str, logs, *args: str) -> tuple[c.Proc, c.Proc]:
    """Node 0 in A (front end on A's address) and node 1 in B, joined at A's address."""
    common = ["--nnodes", "2", "--dist-init-addr", f"{h.addr('A')}:{c.free_port()}", *ARGS, *args]
    node0 = h.server("A", f"{name}-node0", model, logs, *common, "--node-rank", "0")
    node1 = h.proc(
        "B",
        f"{name}-node1",
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "serve",
            "--model-path",
            model,
            "--torch-num-threads",
            "1",
            *common,
            "--node-rank",
            "1",
        ],
        0,
        logs,
    )
    return node0, node1


@pytest.fixture(scope="module")
def nodes(netns_hosts, tiny_llama_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("multinode")
    h = netns_hosts
    servers = {
        "tp": two_node_server(h, "tp2", tiny_llama_path, logs, "--tp-size", "2"),
        "dp": two_node_server(
            h,
            "dp2",
            tiny_llama_path,
            logs,
            "--tp-size",
            "2",
            "--dp-size",
            "2",
            "--enable-dp-attention",
        ),
    }
    procs = [p for pair in servers.values() for p in pair]
    try:
        for p in procs:
            p.start(wait=False)
        for node0, _ in servers.values():
            node0.wait_ready()
        yield {**servers, "hosts": h}
    finally:
        c.stop_all(reversed(procs))


def generate(url: str, ids: list[int], dp_rank: int | None = None) -> dict:
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
    }
    if dp_rank is not None:
        body["routed_dp_rank"] = dp_rank
    r = localhttp.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(1, 300))] for _ in range(n)]


def assert_matches_engine(outs: list[dict], ps: list[list[int]], offline_engine) -> None:
    for ids, out in zip(ps, outs):
        ref = offline_engine.generate(
            input_ids=ids,
            return_logprob=True,
            logprob_start_len=0,
            sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        )
        assert out["output_ids"] == ref["output_ids"], f"prompt of {len(ids)} tokens"
        for a, b in zip(
            out["meta_info"]["output_token_logprobs"], ref["meta_info"]["output_token_logprobs"]
        ):
            assert abs(a[0] - b[0]) < 1e-4


def scheduler_children(proc: c.Proc) -> list[int]:
    return c.scheduler_pids(proc.proc.pid)


def test_tp2_over_two_hosts_matches_offline_engine(nodes, offline_engine):
    node0, node1 = nodes["tp"]
    info = node0.http.get("/server_info").json()
    assert (info["nnodes"], info["tp_size"]) == (2, 2)
    assert (
        len(scheduler_children(node0)) == len(scheduler_children(node1)) == 1
    )  # one rank per host
    assert "node 1 of 2 (rank 1) ready" in node1.log_tail(200)
    ps = prompts(8, seed=5)
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda ids: generate(node0.url, ids), ps))
    assert_matches_engine(outs, ps, offline_engine)
    all_ranks_idle(node0)  # rank 1's accounting comes from host B through the collective


def test_dp_attention_over_two_hosts_matches_offline_engine(nodes, offline_engine):
    node0, _ = nodes["dp"]
    ps = prompts(8, seed=6)
    with ThreadPoolExecutor(
        4
    ) as ex:  # group 1's leader is rank 1, on host B: its outputs come over TCP
        outs = list(ex.map(lambda i: generate(node0.url, ps[i], dp_rank=i % 2), range(len(ps))))
    assert_matches_engine(outs, ps, offline_engine)
    assert [g["dp_rank"] for g in node0.http.get("/get_load").json()] == [0, 1]
    all_ranks_idle(node0)


def test_lost_node_fails_every_stream_and_the_front_end_answers_503(nodes):
    node0, node1 = nodes["dp"]
    events: dict[int, list] = {}
    first_token = [threading.Event() for _ in range(4)]

    def stream(i: int) -> None:
        body = {
            "input_ids": [7 + i, 8, 9],
            "stream": True,
            "routed_dp_rank": i % 2,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
        }
        out: list = []
        with localhttp.stream("POST", node0.url + "/generate", json=body, timeout=60) as r:
            for line in r.iter_lines():
                out.extend(sse_events([line]))
                if out:
                    first_token[i].set()
        events[i] = out

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in first_token), "every stream should be running before the kill"
    t0 = time.monotonic()
    node1.kill9()  # host B's processes: its CLI and rank 1
    for t in threads:
        t.join(LOST_BOUND_S + SLACK_S + 30)
    elapsed = time.monotonic() - t0
    print(
        f"MEASURED node B killed: all 4 streams ended {elapsed:.2f}s after the kill (bound "
        f"{LOST_BOUND_S:g}s)"
    )
    assert sorted(events) == [0, 1, 2, 3], "a stream hung"
    for i, out in events.items():
        assert out[-1] == "[DONE]" and "error" in out[-2], (i, out[-3:])
        assert (
            out[-2]["error"]["code"] == 503
            and "lost node 1 of 2 (rank 1)" in out[-2]["error"]["message"]
        ), out[-2]
    assert elapsed < LOST_BOUND_S + SLACK_S, elapsed
    # the front end stays up a few seconds to say why, then exits 1
    health = node0.http.get("/health")
    assert (
        health.status_code == 503
        and "lost node 1 of 2 (rank 1)" in health.json()["error"]["message"]
    ), health.text
    r = node0.http.post(
        "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    )
    assert r.status_code == 503, r.text
    print(
        f"SAMPLE after the loss: /health {health.status_code} {health.json()['error']['message']}"
    )
    assert node0.proc.wait(timeout=30) == 1
    log = node0.log_tail(300)
    assert "lost node 1 of 2 (rank 1)" in log, log


def test_lost_node_0_stops_node_1(nodes):
    node0, node1 = nodes["tp"]
    node0.kill9()
    t0 = time.monotonic()
    assert node1.proc.wait(timeout=LOST_BOUND_S + SLACK_S + 30) == 1
    print(
        "MEASURED node A killed: node B's `serve --node-rank 1` exited after "
        f"{time.monotonic() - t0:.2f}s"
    )
    log = node1.log_tail(200)
    assert "lost node 0 of 2 (rank 0)" in log, log
    assert "node 1 of 2 (rank 1) stops" in log, log


def test_node_that_never_joins_fails_the_start_up(tiny_llama_path):
    addr = f"127.0.0.1:{c.free_port()}"
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        "--model-path",
        tiny_llama_path,
        "--port",
        str(c.free_port()),
        "--torch-num-threads",
        "1",
        "--tp-size",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--dist-init-addr",
        addr,
        "--dist-timeout",
        "3",
    ]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    print(
        f"MEASURED node 1 never started: node 0 exited {r.returncode} after "
        f"{time.monotonic() - t0:.1f}s"
    )
    assert r.returncode == 1, r.stderr[-3000:]
    assert f"did not all join at tcp://{addr} within --dist-timeout 3s" in r.stderr, r.stderr[
        -3000:
    ]
