"""Start real pdserve servers and routers as subprocesses for end-to-end tests."""

from __future__ import annotations

import atexit
import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import httpx

from tests.helpers import launcher, localhttp
from tests.helpers.ports import free_port  # noqa: F401 (the tests take it from here too)

READY_TIMEOUT_S = 300.0
# PD rooms given up on after 20 s without their peer (a test's failure shows in seconds)
PD_TIMEOUTS = ["--disaggregation-bootstrap-timeout", "20", "--disaggregation-waiting-timeout", "20"]
# a PD server on 16-token pages with room for several long requests and short PD timeouts
PAGED_PD_ARGS = [
    "--page-size",
    "16",
    "--max-total-tokens",
    "16384",
    *PD_TIMEOUTS,
]


# what every process a test starts has in its environment besides the suite's
PROC_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# the environment of a process the suite starts, as it was when the suite began: the preloaded
# launcher's (tests/helpers/launcher.py)
SUITE_ENV = {**os.environ, **PROC_ENV}
# variables read when a process runs, not when torch or pdserve is imported (pdserve reads its
# own through pdserve/envs.py at call time; PDSERVE_CPU_ISA caps the libraries torch loaded;
# torch sets TORCHINDUCTOR_CACHE_DIR in the test's process once it compiled something): a process
# whose environment differs from the launcher's only in these can be forked from it
RUN_TIME_ENV = ("PDSERVE_", "PYTEST_", "MC_", "GLOO_", "TORCHINDUCTOR_")
IMPORT_TIME_ENV = ("PDSERVE_CPU_ISA",)


# how this process's servers and routers started, printed when it ends: forked, and fresh by the
# variables that made them so
STARTS: dict = {"forked": 0, "fresh": collections.Counter()}


def import_time_differences(env: dict) -> list[str]:
    """The variables of ``env`` that keep a process from being forked from the launcher: those
    that differ from the launcher's and may be read at import (none: it can be, given ``env``)."""
    differ = {k for k in env.keys() | SUITE_ENV.keys() if env.get(k) != SUITE_ENV.get(k)}
    return sorted(k for k in differ if not k.startswith(RUN_TIME_ENV) or k in IMPORT_TIME_ENV)


@atexit.register
def _report_starts() -> None:
    if STARTS["forked"] or STARTS["fresh"]:
        fresh = ", ".join(f"{n} for {keys}" for keys, n in STARTS["fresh"].items()) or "none"
        print(
            f"tests: {STARTS['forked']} servers and routers forked; fresh: {fresh}", file=sys.stderr
        )


def wait_for(cond, timeout: float = 10.0, what: str = "condition", interval: float = 0.01):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class Proc:
    """One HTTP process (server or router) started by a test."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        port: int,
        log_dir: Path,
        env: Optional[dict] = None,
        host: str = "127.0.0.1",
    ):
        self.name = name
        self.cmd = cmd
        self.port = port
        self.host = host
        self.url = f"http://{host}:{port}"
        self.log_path = log_dir / f"{name}.log"
        self.env = {**os.environ, **PROC_ENV, **(env or {})}
        self.proc: Optional[subprocess.Popen | launcher.Launched] = None
        self.http = localhttp.Client(base_url=self.url, timeout=120)

    def start(self, wait: bool = True) -> "Proc":
        forked = None
        if self.cmd[:3] == launcher.COMMAND:
            held = import_time_differences(self.env)
            if held:
                STARTS["fresh"][" ".join(held)] += 1
            else:
                forked = launcher.launcher(SUITE_ENV)
        if forked is not None:
            self.proc = forked.start(self.cmd[3:], self.log_path, self.env)
            STARTS["forked"] += 1
        else:
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env
                )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                return self.http.get("/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, timeout, f"{self.name}'s /health", interval=0.25)

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.signal(sig)
        self.wait_stopped()

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait_stopped(self, timeout: float = 30) -> None:
        """Wait for the process to exit (SIGKILL after ``timeout`` seconds)."""
        if self.proc is not None:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill9(self) -> None:
        """SIGKILL the whole process group (front end and scheduler)."""
        if self.proc is not None and self.proc.poll() is None:
            for pid in [self.proc.pid, *children(self.proc.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait()

    def integrity(self) -> dict:
        r = self.http.get("/debug/integrity")
        assert r.status_code == 200, r.text
        return r.json()["integrity"]

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Wait until nothing runs and every KV page and metadata slot is free or cached."""

        def idle():
            body = self.http.get("/debug/integrity").json()
            pools = body["integrity"]
            done = body.get(
                "front_end_requests", 0
            ) == 0 and all(  # every rank's, on a multi-rank server
                p["running"] == 0
                and p["waiting"] == 0
                and p["in_use_pages"] == 0
                and p.get("kv_rooms", 0) == 0
                and p.get("metadata_slots_free", 0) == p.get("metadata_slots_total", 0)
                and all(g["in_use_pages"] == 0 for g in p.get("groups", []))  # every cache group's
                for p in pools.get("ranks") or [pools]
            )
            return pools if done else None

        pools = wait_for(idle, timeout, f"{self.name} to become idle", interval=0.1)
        for g in [pools, *pools.get("groups", [])]:
            assert g["free_pages"] + g["cached_pages"] + g["in_use_pages"] == g["total_pages"], (
                pools
            )
        return pools


def greedy_body(
    ids: list[int], new_tokens: int, prefill: Optional[Proc] = None, room: int = 0
) -> dict:
    """A greedy ``/generate`` body of ``new_tokens`` tokens; with ``prefill``, the PD fields a
    router adds (that prefill's bootstrap server, room ``room``)."""
    out = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
    }
    if prefill is not None:
        out.update(
            bootstrap_host="127.0.0.1", bootstrap_port=prefill.bootstrap_port, bootstrap_room=room
        )
    return out


def post_pd(prefill: Proc, decode: Proc, body: dict) -> tuple[httpx.Response, httpx.Response]:
    """``body`` (with its PD fields) to prefill and decode at once, as a router sends it."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as ex:
        fp = ex.submit(localhttp.post, prefill.url + "/generate", json=body, timeout=120)
        fd = ex.submit(localhttp.post, decode.url + "/generate", json=body, timeout=120)
        return fp.result(), fd.result()


def start_all(procs) -> None:
    """Start every process at once, then wait until each is ready (servers load in parallel)."""
    procs = list(procs)
    for p in procs:
        p.start(wait=False)
    for p in procs:
        p.wait_ready()


def stop_all(procs) -> None:
    """Stop every process at once (None entries skipped): all are signalled, then waited for, so
    a cluster's processes shut down side by side rather than one after another."""
    procs = [p for p in procs if p is not None]
    for p in procs:
        if isinstance(p, Proc):
            p.signal()
        else:
            p.stop()
    for p in procs:
        if isinstance(p, Proc):
            p.wait_stopped()


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            kids += [int(p) for p in (task / "children").read_text().split()]
    except OSError:
        pass
    return kids


def scheduler_pids(pid: int) -> list[int]:
    """The scheduler ranks a server's front end ``pid`` started (each names itself
    ``pdserve-tpN``, spawned or forked)."""
    out = []
    for kid in children(pid):
        try:
            if Path(f"/proc/{kid}/comm").read_text().startswith("pdserve-tp"):
                out.append(kid)
        except OSError:
            pass
    return out


def server(
    name: str, model_path: str, log_dir: Path, *args: str, port: Optional[int] = None
) -> Proc:
    port = port or free_port()
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        "--model-path",
        model_path,
        "--port",
        str(port),
        "--torch-num-threads",
        "1",
        *args,
    ]
    return Proc(name, cmd, port, log_dir)


def prefill(name: str, model_path: str, log_dir: Path, *args: str) -> tuple[Proc, int]:
    bport = free_port()
    p = server(
        name,
        model_path,
        log_dir,
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-bootstrap-port",
        str(bport),
        *args,
    )
    p.bootstrap_port = bport
    return p, bport


def decode(name: str, model_path: str, log_dir: Path, *args: str) -> Proc:
    return server(name, model_path, log_dir, "--disaggregation-mode", "decode", *args)


def router(name: str, prefills: list[Proc], decodes: list[Proc], log_dir: Path, *args: str) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "router", "--port", str(port), *args]
    for p in prefills:
        cmd += ["--prefill", p.url, str(p.bootstrap_port)]
    for d in decodes:
        cmd += ["--decode", d.url]
    return Proc(name, cmd, port, log_dir)


def running(procs: dict[str, Proc]) -> Iterator[dict[str, Proc]]:
    """``procs`` started together, yielded, and stopped after the ``yield`` (a module fixture's
    body: ``yield from c.running({...})``)."""
    try:
        start_all(procs.values())
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def tp_pairs(path: str, logs, *args: str) -> Iterator[dict[str, Proc]]:
    """One- and two-rank prefill (``P1``, ``P2``) and decode (``D1``, ``D2``) servers of ``path``
    with ``args``, started together; stopped after the ``yield`` (a module fixture's body)."""
    tp2 = ["--tp-size", "2"]
    yield from running(
        {
            "P1": prefill("P1", path, logs, *args)[0],
            "P2": prefill("P2", path, logs, *args, *tp2)[0],
            "D1": decode("D1", path, logs, *args),
            "D2": decode("D2", path, logs, *args, *tp2),
        }
    )


def kv_bytes_sent(server: Proc) -> list[int]:
    """The KV bytes each of a prefill server's ranks has written so far."""
    integrity = server.http.get("/debug/integrity").json()["integrity"]
    return [r["kv_bytes_sent"] for r in integrity.get("ranks") or [integrity]]
