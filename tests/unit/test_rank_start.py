"""How a server's scheduler ranks start (``SchedulerClient._rank_context``): several CPU ranks on
a node forked from the front end once it imported the entry (one rank too where it is imported
already), one rank otherwise and GPU ranks spawned,
``PDSERVE_RANK_START_METHOD`` choosing spawn or refusing what is neither. The ranks themselves
start in tests/e2e/test_tp.py (one server forked, one spawned, both against the reference)."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from pdserve.server.scheduler_client import SchedulerClient

ENTRY = "tests.unit.test_rank_start:entry_for_tests"


def entry_for_tests(*args) -> None:
    """An entry whose import the fork path makes; never run here."""


def client(device: str, world_size: int, entry: str = ENTRY) -> SchedulerClient:
    out = SchedulerClient(SimpleNamespace(device=device, world_size=world_size), entry)
    os.rmdir(out._ipc_dir)  # its sockets' folder: no socket is made here
    return out


@pytest.mark.parametrize(
    "device, ranks, env, method",
    [
        ("cpu", 2, None, "fork"),
        ("cpu", 4, "fork", "fork"),
        ("cpu", 1, None, "spawn"),
        ("cpu", 2, "spawn", "spawn"),
        ("cuda", 2, None, "spawn"),
        ("cuda:0", 2, "fork", "spawn"),
    ],
)
def test_start_method(monkeypatch, device, ranks, env, method):
    if env is None:
        monkeypatch.delenv("PDSERVE_RANK_START_METHOD", raising=False)
    else:
        monkeypatch.setenv("PDSERVE_RANK_START_METHOD", env)
    monkeypatch.delitem(sys.modules, "tests.unit.test_rank_start", raising=False)
    ctx = client(device, ranks)._rank_context(ranks)
    assert ctx.get_start_method() == method
    # the fork path imported the entry's module here, before any rank starts
    assert ("tests.unit.test_rank_start" in sys.modules) == (method == "fork")


def test_one_rank_is_forked_where_the_entry_is_imported_already(monkeypatch):
    """A process that has the scheduler's modules (one that embeds the server) forks even one
    rank: nothing is left to import, and a spawned rank would import it all again."""
    monkeypatch.delenv("PDSERVE_RANK_START_METHOD", raising=False)
    assert "tests.unit.test_rank_start" in sys.modules
    assert client("cpu", 1)._rank_context(1).get_start_method() == "fork"
    monkeypatch.setenv("PDSERVE_RANK_START_METHOD", "spawn")
    assert client("cpu", 1)._rank_context(1).get_start_method() == "spawn"
    assert client("cuda", 1)._rank_context(1).get_start_method() == "spawn"


def test_an_entry_that_does_not_import_is_spawned_to_report_it(monkeypatch):
    monkeypatch.delenv("PDSERVE_RANK_START_METHOD", raising=False)
    ctx = client("cpu", 2, "pdserve.no_such_module:main")._rank_context(2)
    assert ctx.get_start_method() == "spawn"


def test_an_unknown_method_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("PDSERVE_RANK_START_METHOD", "vfork")
    with pytest.raises(RuntimeError, match="PDSERVE_RANK_START_METHOD='vfork': expected fork"):
        client("cpu", 2)._rank_context(2)
