"""Router recovery for real: the only prefill is killed (SIGKILL) under load and restarted on
the same HTTP and bootstrap ports; requests succeed again within seconds of it being healthy,
not after the circuit breaker's cooldown, and decode is left with nothing leaked."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.e2e.conftest import SERVED_MODEL_NAME
from tests.helpers import cluster as c
from tests.helpers import localhttp

COOLDOWN_S = 30.0  # the breaker's default; recovery must not wait for it
RECOVERY_LIMIT_S = 8.0
CLIENTS = 3


class Load:
    """``CLIENTS`` threads sending small generations until stopped; records (start, end, status)."""

    def __init__(self, url: str):
        self.url = url
        self.results: list[tuple[float, float, int]] = []
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(CLIENTS)
        self.futures = [self.pool.submit(self._run, i) for i in range(CLIENTS)]

    def _run(self, i: int) -> None:
        body = {
            "text": f"client {i} says hello",
            "sampling_params": {"max_new_tokens": 8, "ignore_eos": True},
        }
        with localhttp.Client(timeout=60) as http:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    status = http.post(self.url + "/generate", json=body).status_code
                except httpx.HTTPError:
                    status = 0
                self.results.append((t0, time.monotonic(), status))
                if status != 200:
                    time.sleep(0.05)  # no busy loop against a router that answers at once

    def ok_after(self, t: float) -> list:
        return [r for r in self.results if r[0] >= t and r[2] == 200]

    def close(self) -> None:
        self.stop.set()
        for f in self.futures:
            f.result(timeout=90)
        self.pool.shutdown()


def test_only_prefill_killed_and_restarted_under_load(tmp_path_factory, tiny_llama_path):
    logs = tmp_path_factory.mktemp("restart")
    common = [
        "--max-total-tokens",
        "16384",
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--disaggregation-bootstrap-timeout",
        "5",
        "--disaggregation-waiting-timeout",
        "5",
    ]
    P, _ = c.prefill("RP", tiny_llama_path, logs, *common)
    D = c.decode("RD", tiny_llama_path, logs, *common)
    procs = [P, D]
    load = None
    try:
        c.start_all((P, D))
        # A breaker that opens after two failed legs, with the default cooldown; health checks far
        # apart, so that they cannot notice the outage by themselves (as with a quick restart).
        R = c.router(
            "RR",
            [P],
            [D],
            logs,
            "--cb-failure-threshold",
            "2",
            "--cb-cooldown",
            str(COOLDOWN_S),
            "--health-check-interval",
            "120",
        )
        procs.append(R.start())
        load = Load(R.url)
        c.wait_for(lambda: len(load.ok_after(0)) >= 6, 60, "requests to succeed before the kill")

        P.kill9()
        killed = time.monotonic()
        c.wait_for(
            lambda: any(r[0] >= killed and r[2] != 200 for r in load.results),
            30,
            "requests to fail while the prefill is down",
        )
        P.start(wait=False)  # same command: same HTTP and bootstrap ports
        P.wait_ready()
        healthy = time.monotonic()

        c.wait_for(
            lambda: load.ok_after(healthy),
            RECOVERY_LIMIT_S,
            "a success after the prefill is healthy",
        )
        first = min(load.ok_after(healthy), key=lambda r: r[1])
        assert first[1] - healthy < RECOVERY_LIMIT_S < COOLDOWN_S
        # and from then on it keeps serving: the last requests all succeed
        c.wait_for(lambda: len(load.ok_after(first[1])) >= 6, 30, "six more successes")
        load.close()
        tail = [r[2] for r in sorted(load.results)[-CLIENTS * 2 :]]
        assert tail == [200] * len(tail), tail
        load = None
        D.wait_idle(
            timeout=30
        )  # the requests that lost their prefill left nothing behind on decode
        P.wait_idle(timeout=30)
        router_view = R.http.get("/server_info").json()
        assert all(w["healthy"] for role in ("prefill", "decode") for w in router_view[role])
    finally:
        if load is not None:
            load.close()
        c.stop_all(reversed(procs))
