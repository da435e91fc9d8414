"""tests/helpers/file_queue.py with scripts/test_shards.py's layout: two pytest processes share
one queue of test files; every test runs once, a unit of several files runs in one process, each
process takes files until the queue is empty, and a session fixture registered with
``until_last_use`` stops in a process as soon as no file left in the queue uses it, before that
process runs its next file."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.helpers.file_queue import QUEUE_ENV, write_queue

REPO = Path(__file__).resolve().parents[2]

CONFTEST = """
import os, time
import pytest
from tests.helpers.last_use import (  # noqa: F401
    pytest_collection_modifyitems, pytest_runtest_teardown, until_last_use)

def event(what):
    with open(os.environ["EVENTS"], "a") as f:
        f.write(f"{os.getpid()} {time.monotonic():.6f} {what}\\n")

@pytest.fixture(scope="session")
def server(request):
    event("server start")
    stop = until_last_use(request, lambda: event("server stop"))
    try:
        yield
    finally:
        stop()
"""

TEST = """
import time
from conftest import event

def test_{name}_1({fixture}):
    event("{name}"); time.sleep({sleep})

def test_{name}_2({fixture}):
    event("{name}"); time.sleep({sleep})
"""


def test_two_processes_share_the_queue(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    files = {"a": ("server", 0.5), "b": ("server", 0.5), "c": ("", 0.2), "d": ("", 0.2)}
    files.update({"e": ("", 0.2), "f": ("", 0.2), "g": ("", 0.2)})
    for name, (fixture, sleep) in files.items():
        body = TEST.format(name=name, fixture=fixture, sleep=sleep)
        (tmp_path / f"test_{name}.py").write_text(body)
    units = [["test_a.py"], ["test_b.py"], ["test_c.py", "test_d.py"], ["test_e.py"]]
    units += [["test_f.py"], ["test_g.py"]]
    write_queue(tmp_path / "queue", units)
    events = tmp_path / "events"
    env = {
        **os.environ,
        QUEUE_ENV: str(tmp_path / "queue"),
        "EVENTS": str(events),
        "PYTHONPATH": str(REPO),
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p"]
    cmd += ["tests.helpers.file_queue", "--rootdir", str(tmp_path)]
    procs = [
        subprocess.Popen(
            [*cmd, f"--junitxml={tmp_path / f'{i}.xml'}", *sorted(f"test_{n}.py" for n in files)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    for p in procs:
        out = p.communicate(timeout=120)[0]
        assert p.returncode == 0, out
    ran = [
        case.get("name")
        for i in range(2)
        for case in ET.parse(tmp_path / f"{i}.xml").getroot().iter("testcase")
    ]
    assert sorted(ran) == sorted(f"test_{n}_{k}" for n in files for k in (1, 2))
    by_pid: dict[str, list[str]] = {}
    for line in events.read_text().splitlines():
        pid, _, what = line.split(" ", 2)
        by_pid.setdefault(pid, []).append(what)
    assert len(by_pid) == 2, by_pid  # both processes took files
    for pid, seq in by_pid.items():
        if "server start" in seq:
            assert seq.count("server start") == seq.count("server stop") == 1, seq
            stop = seq.index("server stop")
            # nothing queued after a and b uses the server: it stops before the next file runs
            assert set(seq[stop + 1 :]) <= set("cdefg"), seq
            assert all(w in ("a", "b") for w in seq[seq.index("server start") + 1 : stop]), seq
    together = [pid for pid, seq in by_pid.items() if "c" in seq or "d" in seq]
    assert len(together) == 1, by_pid  # one unit: one process
