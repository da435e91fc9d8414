"""Start the reference Rust router (PyPI ``sglang-router``) in PD mode for compatibility tests.

Install: ``pip install sglang-router==0.3.2`` (a prebuilt abi3 wheel; its deps are setproctitle,
aiohttp, orjson, uvicorn, fastapi, none of them torch). Tests that use it should skip when
``sglang_router_available()`` is false.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

from tests.helpers.ports import free_port


def sglang_router_available() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def start_sglang_router(
    prefill_urls_with_bootstrap_ports: list[tuple[str, int | None]],
    decode_urls: list[str],
    port: int,
    *,
    policy: str = "random",
    extra_args: list[str] | None = None,
    timeout: float = 60.0,
    log_path: str | None = None,
) -> subprocess.Popen:
    """Launch ``python -m sglang_router.launch_router --pd-disaggregation`` on 127.0.0.1:port.

    Returns once ``GET /readiness`` answers 200, i.e. the router has accepted the workers
    (each must already answer ``GET /health`` with 200). Raises ``RuntimeError`` with the log
    tail if it exits or is not ready within ``timeout``; the process is killed in that case.
    The caller owns the returned process: ``proc.terminate(); proc.wait()``.
    """
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--pd-disaggregation",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--worker-startup-check-interval",
        "1",
        "--worker-startup-timeout-secs",
        str(int(timeout)),
        "--health-check-interval-secs",
        "1",
        "--log-level",
        "warn",
    ]
    for url, bootstrap_port in prefill_urls_with_bootstrap_ports:
        cmd += ["--prefill", url] + ([str(bootstrap_port)] if bootstrap_port is not None else [])
    for url in decode_urls:
        cmd += ["--decode", url]
    cmd += extra_args or []
    log = open(log_path or os.devnull, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if _get(base + "/readiness") == 200:
            return proc
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    tail = ""
    if log_path and os.path.exists(log_path):
        with open(log_path, "rb") as f:
            tail = f.read()[-4000:].decode(errors="replace")
    raise RuntimeError(
        f"sglang-router on port {port} not ready (exit code {proc.returncode}):\n{tail}"
    )
