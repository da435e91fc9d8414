"""A preloaded launcher for the tests' servers and routers.

A fresh ``python -m pdserve.cli serve`` spends about 1 CPU second importing the front end's
modules, and its spawned scheduler about 2 more importing torch and the engine, before it loads
a model; the suite starts several hundred servers. One launcher per pytest process imports all of
it once and forks each ``pdserve.cli`` command a test starts: the fork runs ``pdserve.cli.main``
with the command's arguments, its output in the test's log file, and forks its scheduler rank in
turn (``SchedulerClient._rank_context``: the entry is imported already). What a test then talks
to is the same server, started from the same arguments, without the imports.

``cluster.Proc`` uses it for ``pdserve.cli`` commands whose environment differs from the
launcher's (the suite's, when it began) only in variables read at run time
(``cluster.import_time_differences``); the fork then runs with the command's own environment. A
test that sets any other variable (torch reads some when it is imported) gets a fresh
interpreter, as does every command with ``PDSERVE_TEST_LAUNCHER=0``. The real command line's
start-up is tested by ``tests/e2e/test_launch.py`` and ``test_server_launch.py``, which start
their processes themselves.

Protocol, JSON lines: the test process writes ``{"argv": [...], "log": PATH, "cwd": DIR, "env":
{...}}`` to the
launcher's stdin and reads ``{"pid": N}``; the launcher reaps its children and writes
``{"exited": N, "code": C}`` (``C`` as ``Popen.returncode``: the exit status, or minus the
signal). It exits when its stdin closes (its test process ended).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
# the modules a server's front end, a router and a scheduler rank import before they serve
PRELOAD = (
    "pdserve.cli",
    "pdserve.server.launch",
    "pdserve.server.app",
    "pdserve.server.metrics",
    "pdserve.server.tokenizer_manager",
    "pdserve.server.scheduler_process",
    "pdserve.router.app",
    "pdserve.tokenizer",
)
COMMAND = [sys.executable, "-m", "pdserve.cli"]


def enabled() -> bool:
    return os.environ.get("PDSERVE_TEST_LAUNCHER", "1") != "0"


class Launched:
    """A process the launcher forked, with the part of ``subprocess.Popen`` the tests use."""

    def __init__(self, launcher: "Launcher", pid: int, args: list[str]):
        self.launcher = launcher
        self.pid = pid
        self.args = args
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self.launcher.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.poll() is None:
            code = self.launcher.wait_exit(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Launcher:
    """The test process's side: starts the launcher, asks it for processes, records their ends."""

    def __init__(self, env: dict):
        self.env = env
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.launcher"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
        if self.proc.stdout.readline().strip() != b"ready":
            self.proc.kill()
            raise RuntimeError(f"the test launcher did not start (exit {self.proc.wait()})")
        self._lock = threading.Lock()  # one request at a time
        self._ends = threading.Condition()
        self._exits: dict[int, int] = {}
        self._pids: list[int] = []
        self._reader = threading.Thread(target=self._read, name="test-launcher", daemon=True)
        self._reader.start()
        atexit.register(self.close)

    def close(self) -> None:
        """End the launcher (the processes it started go on until their tests stop them)."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._ends:
                if "pid" in msg:
                    self._pids.append(msg["pid"])
                else:
                    self._exits[msg["exited"]] = msg["code"]
                self._ends.notify_all()
        with self._ends:  # the launcher is gone: nothing more will be reported
            self._ends.notify_all()

    def start(self, argv: list[str], log: Path, env: dict) -> Launched:
        with self._lock:
            with self._ends:
                seen = len(self._pids)
            request = {"argv": argv, "log": str(log), "cwd": os.getcwd(), "env": env}
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            with self._ends:
                if (
                    not self._ends.wait_for(
                        lambda: len(self._pids) > seen or self.proc.poll() is not None, 60
                    )
                    or len(self._pids) == seen
                ):
                    raise RuntimeError("the test launcher did not start the process")
                pid = self._pids[seen]
        return Launched(self, pid, [*COMMAND, *argv])

    def exit_code(self, pid: int) -> Optional[int]:
        with self._ends:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        with self._ends:
            self._ends.wait_for(lambda: pid in self._exits or self.proc.poll() is not None, timeout)
            return self._exits.get(pid)


_launcher: Optional[Launcher] = None
_failed = False
_launcher_lock = threading.Lock()


def launcher(env: dict) -> Optional[Launcher]:
    """This process's launcher, started on first use with ``env``; None where it is turned off,
    could not start or has ended (the caller starts a fresh interpreter then)."""
    global _launcher, _failed
    if not enabled():
        return None
    with _launcher_lock:
        if _launcher is None and not _failed:
            try:
                _launcher = Launcher(env)
            except (OSError, RuntimeError) as e:
                print(f"tests: no preloaded launcher ({e}); fresh interpreters", file=sys.stderr)
                _failed = True
        if _launcher is not None and _launcher.proc.poll() is not None:
            print("tests: the preloaded launcher ended; fresh interpreters", file=sys.stderr)
            _launcher, _failed = None, True
        return _launcher


# ---- the launcher process ----------------------------------------------------------------------


def _run_child(request: dict, wake_fds: tuple[int, int]) -> None:
    """In the fork: become ``python -m pdserve.cli ARGV``, its output in the log; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for fd in wake_fds:
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import random

        random.seed()  # not the launcher's sequence, shared by every fork
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        import pdserve.cli as cli

        sys.argv = [cli.__file__, *request["argv"]]
        sys.modules["__main__"] = cli  # as `python -m pdserve.cli` (what a spawned child imports)
        code = cli.main(request["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        import logging

        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _reap(out: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        msg = {"exited": pid, "code": os.waitstatus_to_exitcode(status)}
        os.write(out, json.dumps(msg).encode() + b"\n")


def serve() -> None:
    import importlib

    import torch  # noqa: F401 (the largest import of them all)

    for name in PRELOAD:
        importlib.import_module(name)
    # what every fork inherits stays out of the forks' cycle collections (which would walk torch's
    # and FastAPI's objects again and again) and so shares its pages with the launcher
    gc.collect()
    gc.freeze()
    out = sys.stdout.fileno()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    os.write(out, b"ready\n")
    pending = b""
    while True:
        try:
            readable, _, _ = select.select([0, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in readable:
            os.read(wake_r, 4096)
            _reap(out)
        if 0 in readable:
            data = os.read(0, 65536)
            if not data:
                return  # the test process ended
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _run_child(request, (wake_r, wake_w))
                os.write(out, json.dumps({"pid": pid}).encode() + b"\n")


if __name__ == "__main__":
    serve()
