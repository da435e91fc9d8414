"""``pdserve router --workers 2``: two router processes on one port (SO_REUSEPORT) in front of
fake workers. Both serve requests (each holds its own connections to decode), the worker API
refuses changes naming DNS discovery, and one process dying stops the other and the parent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers import localhttp
from tests.helpers.fake_workers import FakeCluster, free_port, wait_until
from tests.unit.test_router import GEN


@pytest.fixture(scope="module")
def cluster():
    c = FakeCluster()
    c.add("prefill")
    c.add("decode")
    yield c
    c.close()


@pytest.fixture(scope="module")
def router(cluster, tmp_path_factory):
    prefill, decode = cluster.workers
    port = free_port()
    log = tmp_path_factory.mktemp("router-processes") / "router.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                "router",
                "--port",
                str(port),
                "--workers",
                "2",
                "--prefill",
                prefill.url,
                str(prefill.bootstrap_port),
                "--decode",
                decode.url,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PDSERVE_DISABLE_CPU_KERNELS": "1"},
        )
    url = f"http://127.0.0.1:{port}"

    def children_ready() -> bool:
        assert proc.poll() is None, log.read_text()
        kids = [
            k for k in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(k.cmdline())
        ]
        return len(kids) == 2 and all(
            any(
                c.status == psutil.CONN_LISTEN and c.laddr.port == port
                for c in k.net_connections("tcp")
            )
            for k in kids
        )

    wait_until(children_ready, timeout=120, what="both router processes listening")
    yield proc, url, port
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


def serving_processes(proc, upstream_port: int) -> list[int]:
    """Router processes holding a connection to the fake at ``upstream_port``."""
    out = []
    for kid in psutil.Process(proc.pid).children():
        try:
            if any(c.raddr and c.raddr.port == upstream_port for c in kid.net_connections("tcp")):
                out.append(kid.pid)
        except psutil.Error:
            pass
    return out


def test_both_processes_serve_requests(router, cluster):
    proc, url, _ = router
    decode = cluster.workers[1]
    before = len(decode.requests)
    for _ in range(40):  # a new connection each: the kernel spreads them over both sockets
        with localhttp.Client(timeout=30) as c:
            r = c.post(url + "/generate", json=GEN)
            assert r.status_code == 200, r.text
    routed = [json.loads(req.body) for req in decode.requests[before:] if req.path == "/generate"]
    assert len(routed) == 40 and all(b.get("bootstrap_room") is not None for b in routed)
    port = int(decode.url.rsplit(":", 1)[1])
    assert (
        len(serving_processes(proc, port)) == 2
    )  # each process keeps its own pooled connection to decode


def test_worker_api_changes_are_refused(router):
    _, url, _ = router
    r = localhttp.post(
        url + "/workers", json={"url": "http://127.0.0.1:1", "worker_type": "decode"}, timeout=30
    )
    assert r.status_code == 409
    assert "--prefill-dns/--decode-dns" in r.json()["error"]["message"]
    assert localhttp.get(url + "/workers", timeout=30).status_code == 200  # listing still works


def test_a_process_that_dies_stops_the_others(router):
    proc, _, _ = router
    kids = [k for k in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(k.cmdline())]
    kids[0].send_signal(signal.SIGKILL)
    assert proc.wait(30) == 1
    deadline = time.monotonic() + 30
    while (
        time.monotonic() < deadline
        and kids[1].is_running()
        and kids[1].status() != psutil.STATUS_ZOMBIE
    ):
        time.sleep(0.1)
    assert not kids[1].is_running() or kids[1].status() == psutil.STATUS_ZOMBIE
