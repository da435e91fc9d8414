"""Real PD servers for the membership and DNS tests, each on its own loopback address as pods
would be: two prefills on 127.0.0.2 and 127.0.0.3 (one HTTP port, one bootstrap port), two
decodes on 127.0.0.4 and 127.0.0.5 (one HTTP port), so that one DNS name can stand for each
pair; a streaming load; and dnsmasq serving records a test rewrites."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.last_use import until_last_use

PREFILL_HOSTS = ("127.0.0.2", "127.0.0.3")
DECODE_HOSTS = ("127.0.0.4", "127.0.0.5")
SERVED_MODEL_NAME = "tiny-llama"
DNSMASQ = (
    shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
)  # Debian's package (scripts/install.sh --test)
PROMPT = {
    "input_ids": [1, 5, 9, 14, 2, 7],
    "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, "temperature": 0},
    "stream": True,
}


@dataclass
class Servers:
    prefills: list[c.Proc]
    decodes: list[c.Proc]
    http_port: tuple[int, int]  # (prefill, decode)
    bootstrap_port: int
    logs: Path

    def router(self, name: str, prefills: list, decodes: list, *args: str) -> c.Proc:
        return c.router(name, prefills, decodes, self.logs, *args)


def _server(name: str, model: str, logs: Path, host: str, port: int, *args: str) -> c.Proc:
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        "--model-path",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--torch-num-threads",
        "1",
        "--max-total-tokens",
        "16384",
        "--served-model-name",
        SERVED_MODEL_NAME,
        *args,
    ]
    return c.Proc(name, cmd, port, logs, host=host)


@pytest.fixture(scope="session")
def elastic_servers(request, tiny_llama_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("elastic")
    p_port, d_port, b_port = c.free_port(), c.free_port(), c.free_port()
    prefills = [
        _server(
            f"P{i}",
            tiny_llama_path,
            logs,
            h,
            p_port,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(b_port),
        )
        for i, h in enumerate(PREFILL_HOSTS)
    ]
    for p in prefills:
        p.bootstrap_port = b_port
    decodes = [
        _server(f"D{i}", tiny_llama_path, logs, h, d_port, "--disaggregation-mode", "decode")
        for i, h in enumerate(DECODE_HOSTS)
    ]
    stop = until_last_use(request, lambda: [p.stop() for p in prefills + decodes])
    try:
        c.start_all(prefills + decodes)
        yield Servers(prefills, decodes, (p_port, d_port), b_port, logs)
    finally:
        stop()


class StreamLoad:
    """``clients`` threads streaming ``PROMPT`` through a router until stopped. Each result is
    (start, status, text, error): a stream counts as failed if it ends with an error event."""

    def __init__(self, url: str, clients: int = 3, headers: dict | None = None):
        self.url = url
        self.headers = headers or {}
        self.results: list[tuple[float, int, str, str | None]] = []
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(clients)
        self.futures = [self.pool.submit(self._run) for _ in range(clients)]

    def _run(self) -> None:
        import json

        with localhttp.Client(timeout=120, headers=self.headers) as http:
            while not self.stop.is_set():
                t0, text, error, status = time.monotonic(), "", None, 0
                try:
                    with http.stream("POST", self.url + "/generate", json=PROMPT) as resp:
                        status = resp.status_code
                        for line in resp.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            event = json.loads(line[6:])
                            if "error" in event:
                                error = event["error"]["message"]
                            else:
                                text = event.get("text", text)
                        if status != 200:
                            error = resp.read().decode(errors="replace")
                except httpx.HTTPError as e:
                    error = repr(e)
                self.results.append((t0, status, text, error))
                if error is not None:
                    time.sleep(0.05)

    def done_after(self, t: float) -> list:
        return [r for r in self.results if r[0] >= t]

    def failures(self) -> list:
        return [r for r in self.results if r[1] != 200 or r[3] is not None]

    def close(self) -> list:
        self.stop.set()
        for f in self.futures:
            f.result(timeout=120)
        self.pool.shutdown()
        return self.results


def worker_state(router: c.Proc, url: str, headers: dict | None = None) -> dict | None:
    workers = router.http.get("/workers", headers=headers or {}).json()["workers"]
    return next((w for w in workers if w["url"] == url), None)


class DNSServer:
    """dnsmasq on 127.0.0.1:PORT answering for ``*.pd.test`` from a hosts file the test rewrites
    (``set``), NXDOMAIN for other names of that domain; no upstream."""

    def __init__(self, workdir: Path):
        self.port = c.free_port()
        self.hosts = workdir / "hosts"
        self.hosts.write_text("")
        self.log = workdir / "dnsmasq.log"
        import grp
        import pwd

        self.cmd = [
            DNSMASQ,
            "--keep-in-foreground",
            f"--port={self.port}",
            "--listen-address=127.0.0.1",
            "--bind-interfaces",
            "--no-resolv",
            "--no-hosts",
            "--local=/pd.test/",
            f"--addn-hosts={self.hosts}",
            "--pid-file=",
            "--log-facility=-",
            f"--user={pwd.getpwuid(os.getuid()).pw_name}",
            f"--group={grp.getgrgid(os.getgid()).gr_name}",
        ]
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "DNSServer":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        c.wait_for(
            lambda: "read " in self.log.read_text() or self.proc.poll() is not None,
            10,
            "dnsmasq to start",
        )
        assert self.proc.poll() is None, self.log.read_text()
        return self

    def set(self, records: dict[str, list[str]]) -> None:
        """Serve exactly these ``name -> addresses`` from now on."""
        lines = [f"{a} {name}" for name, addresses in records.items() for a in addresses]
        self.hosts.write_text("".join(line + "\n" for line in lines))
        reads = self.log.read_text().count("read ")
        self.proc.send_signal(signal.SIGHUP)
        c.wait_for(
            lambda: self.log.read_text().count("read ") > reads,
            10,
            "dnsmasq to reread its hosts file",
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def dnsmasq_available() -> bool:
    return os.access(DNSMASQ, os.X_OK)
