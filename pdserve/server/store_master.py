"""The Mooncake Store master (``mooncake_master``) as a child process: ``pdserve launch --kv-store
mooncake`` starts one for its servers, tests start one of their own.

The master places and finds the store's objects; the servers hold the values in the memory
segments they contribute, and find each other through the master's P2P handshake (no separate
metadata server). It listens on ``rpc_port`` (its clients' ``master_server_address``) and serves
Prometheus metrics on ``metrics_port``. Ready when the RPC port accepts connections. It gets
SIGTERM from the kernel if the process that started it dies (``PR_SET_PDEATHSIG``), so it never
outlives its launcher.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from typing import Optional

from pdserve import lifetime

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0


def master_binary() -> str:
    """``mooncake_master`` on PATH, else the one the ``mooncake`` package ships."""
    found = shutil.which("mooncake_master")
    if found:
        return found
    try:
        import mooncake
    except ImportError:
        raise RuntimeError(
            "mooncake_master not found: install the Mooncake package (pip install "
            "mooncake-transfer-engine) or put mooncake_master on PATH"
        ) from None
    path = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"mooncake_master not found on PATH nor at {path}")
    return path


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class StoreMaster:
    """A running ``mooncake_master``; ``stop()`` (or the context manager) ends it."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        rpc_port: Optional[int] = None,
        metrics_port: Optional[int] = None,
        log_path: Optional[str] = None,
        extra_flags: tuple[str, ...] = (),
    ):
        self.host = host
        self.rpc_port = rpc_port or _free_port(host)
        self.metrics_port = metrics_port or _free_port(host)
        cmd = [
            master_binary(),
            f"-rpc_address={host}",
            f"-rpc_port={self.rpc_port}",
            f"-metrics_port={self.metrics_port}",
            f"-metrics_host={host}",
            "-rpc_thread_num=4",
            *extra_flags,
        ]
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=lifetime.set_parent_death_signal,
        )
        logger.info("mooncake_master (pid %d) starting at %s", self.proc.pid, self.address)

    @property
    def address(self) -> str:
        """The ``master_server_address`` clients use."""
        return f"{self.host}:{self.rpc_port}"

    def client_config(self, **overrides) -> dict:
        """The servers' ``--hicache-storage-backend-extra-config`` for this master."""
        return {"master_server_address": self.address, **overrides}

    def client_config_json(self, **overrides) -> str:
        return json.dumps(self.client_config(**overrides))

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> "StoreMaster":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"mooncake_master exited with code {self.proc.returncode} before it was ready "
                    f"(port {self.rpc_port} taken?)"
                )
            try:
                with socket.create_connection((self.host, self.rpc_port), timeout=1):
                    logger.info("mooncake_master ready at %s", self.address)
                    return self
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"mooncake_master not ready at {self.address} after {timeout:.0f} s")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would end it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("mooncake_master did not stop after SIGTERM; killing it")
                self.kill()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
            self._log = subprocess.DEVNULL

    def __enter__(self) -> "StoreMaster":
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()


KV_STORES = ("mooncake",)
STORE_FLAGS = ("--hicache-storage-backend", "--hicache-storage-backend-extra-config")


def server_store_flags(master: StoreMaster, extra: list[str]) -> list[str]:
    """The flags that put a server of ``pdserve launch --kv-store mooncake`` on ``master``'s
    store (nothing the user gave is repeated: a flag of theirs wins)."""
    given = {a.split("=")[0] for a in extra}
    if given & set(STORE_FLAGS):
        raise ValueError(
            "--kv-store starts the store and configures the servers for it: drop "
            f"{', '.join(sorted(given & set(STORE_FLAGS)))} (or --kv-store)"
        )
    flags = [] if "--enable-hierarchical-cache" in given else ["--enable-hierarchical-cache"]
    return [
        *flags,
        "--hicache-storage-backend",
        "mooncake",
        "--hicache-storage-backend-extra-config",
        master.client_config_json(),
    ]
