"""``pdserve serve`` start-up and failure paths (each test runs its own short-lived process)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading

import httpx

from tests.e2e.conftest import child_pids, free_port, is_alive, sse_events, wait_for
from tests.helpers import cluster, localhttp

SERVE = [sys.executable, "-m", "pdserve.cli", "serve", "--torch-num-threads", "1"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(SERVE + args, capture_output=True, text=True, timeout=timeout, env=ENV)


def test_bad_argument_exits_2_naming_the_field():
    r = run(["--model-path", "/unused", "--page-size", "0"])
    assert r.returncode == 2
    assert "page_size" in r.stderr


def test_scheduler_start_failure_exits_1_with_its_reason(tiny_llama_path, tmp_path):
    # a directory with the tokenizer but a config the model loader rejects
    for name in os.listdir(tiny_llama_path):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(tiny_llama_path, name), tmp_path)
    (tmp_path / "config.json").write_text("{}")
    r = run(["--model-path", str(tmp_path), "--port", str(free_port())])
    assert r.returncode == 1
    assert "scheduler failed to start" in r.stderr


def test_scheduler_death_fails_requests_and_stops_the_server(tiny_llama_path):
    port = free_port()
    proc = subprocess.Popen(
        SERVE
        + [
            "--model-path",
            tiny_llama_path,
            "--port",
            str(port),
            "--skip-warmup",
            "--max-total-tokens",
            "16384",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=ENV,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            assert proc.poll() is None, f"server exited with {proc.returncode}"
            try:
                return localhttp.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 300, "the server's /health", interval=0.25)
        events: list = []

        def stream() -> None:
            body = {
                "text": "x",
                "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
                "stream": True,
            }
            with localhttp.stream("POST", url + "/generate", json=body, timeout=60) as r:
                events.extend(sse_events(r.iter_lines()))

        t = threading.Thread(target=stream)
        t.start()
        wait_for(
            lambda: localhttp.get(url + "/get_load").json()[0]["num_reqs"] == 1,
            30,
            "the request to start",
        )
        children = child_pids(proc.pid)
        (scheduler,) = cluster.scheduler_pids(proc.pid)
        os.kill(scheduler, signal.SIGKILL)
        t.join(60)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == 503
        assert "scheduler" in events[-2]["error"]["message"]
        assert proc.wait(timeout=30) == 1
        wait_for(lambda: not any(is_alive(pid) for pid in children), 10, "the children to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
