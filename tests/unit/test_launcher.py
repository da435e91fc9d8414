"""The tests' preloaded launcher (``tests/helpers/launcher.py``): a forked ``pdserve.cli`` command
writes its output to its log and reports its exit as ``Popen`` would (the status, or minus the
signal); a variable a test sets that is read at run time reaches the fork, one read at import
(by torch) gets a fresh interpreter instead."""

from __future__ import annotations

import signal
import subprocess

import pytest

from tests.helpers import cluster as c
from tests.helpers import launcher
from tests.helpers.checkpoints import build_tiny_checkpoint


@pytest.fixture(scope="module")
def forks():
    if not launcher.enabled():
        pytest.skip("PDSERVE_TEST_LAUNCHER=0")
    out = launcher.launcher(c.SUITE_ENV)
    assert out is not None
    return out


def test_a_command_writes_its_log_and_reports_its_exit_status(forks, tmp_path):
    p = forks.start(["serve", "--no-such-flag"], tmp_path / "bad.log", c.SUITE_ENV)
    assert p.wait(timeout=60) == 2
    assert p.poll() == 2
    assert "--no-such-flag" in (tmp_path / "bad.log").read_text()


def test_a_signalled_server_reports_minus_the_signal_and_its_rank_ends(forks, tmp_path):
    server = c.server("S", build_tiny_checkpoint("llama"), tmp_path)
    server.start()
    try:
        assert isinstance(server.proc, launcher.Launched)
        (rank,) = c.scheduler_pids(server.proc.pid)  # forked: the launcher has its modules
        with pytest.raises(subprocess.TimeoutExpired):
            server.proc.wait(timeout=0.2)
        server.proc.send_signal(signal.SIGKILL)
        assert server.proc.wait(timeout=30) == -signal.SIGKILL
        c.wait_for(lambda: not c.is_alive(rank), 30, "the rank to end with its front end")
    finally:
        server.stop()


def test_a_variable_read_at_run_time_reaches_the_fork(forks, tmp_path):
    server = c.server("S", build_tiny_checkpoint("llama"), tmp_path)
    server.env["PDSERVE_RANK_START_METHOD"] = "spawn"  # read when the server starts its rank
    server.start()
    try:
        assert isinstance(server.proc, launcher.Launched)
        (rank,) = c.scheduler_pids(server.proc.pid)
        assert b"spawn_main" in open(f"/proc/{rank}/cmdline", "rb").read()
    finally:
        server.stop()


def test_a_variable_read_at_import_gets_a_fresh_interpreter(tmp_path):
    server = c.server("S", build_tiny_checkpoint("llama"), tmp_path)
    server.env["OMP_NUM_THREADS"] = "2"
    server.start()
    try:
        assert isinstance(server.proc, subprocess.Popen)
        assert (
            b"spawn_main"
            in open(f"/proc/{c.scheduler_pids(server.proc.pid)[0]}/cmdline", "rb").read()
        )
    finally:
        server.stop()
    assert server.proc.returncode == 0
