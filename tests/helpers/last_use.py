"""Session fixtures that hold servers stop after the last collected test that uses them, not at
the end of the session: the suite runs module by module, and servers a later module no longer
needs would otherwise stay alive (and hold memory) until every test has run.

A fixture registers its teardown with ``until_last_use(request, stop)`` and calls the returned
function in its own ``finally`` too (it runs once). The e2e conftest imports the two hooks below.

When the files come from a queue several processes share (tests/helpers/file_queue.py), no
process knows which tests it will run next: that plugin calls ``stop_unneeded`` between files
instead, with the fixtures that the files not yet taken use.
"""

from __future__ import annotations

import os
from typing import Callable

import pytest

from tests.helpers.file_queue import QUEUE_ENV

_last_user: dict[str, str] = {}  # fixture name -> node id of the last collected test using it
_due: list[tuple[str, Callable[[], None]]] = []  # (fixture name, its stop), in setup order


def until_last_use(request: pytest.FixtureRequest, stop: Callable[[], None]) -> Callable[[], None]:
    """``stop`` made to run once, after the last test that uses ``request``'s fixture."""
    done = False

    def once() -> None:
        nonlocal done
        if not done:
            done = True
            stop()

    _due.append((request.fixturename, once))
    return once


@pytest.hookimpl(trylast=True)  # after any hook that reorders the tests
def pytest_collection_modifyitems(session, config, items) -> None:
    _last_user.clear()
    for item in items:
        for name in getattr(item, "fixturenames", ()):
            _last_user[name] = item.nodeid


def stop_unneeded(needed: set[str]) -> None:
    """Stop every registered fixture whose name is not in ``needed``, latest set up first."""
    for entry in reversed([e for e in _due if e[0] not in needed]):
        _due.remove(entry)
        entry[1]()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem) -> None:
    if os.environ.get(QUEUE_ENV):
        return  # the queue decides between files (stop_unneeded)
    ending = [entry for entry in _due if _last_user.get(entry[0]) == item.nodeid]
    for entry in reversed(ending):  # a fixture set up later may use one set up earlier
        _due.remove(entry)
        entry[1]()
