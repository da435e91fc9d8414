"""The suite's files as a queue that several pytest processes share (scripts/test_shards.py):
each process collects every file, then takes the next file from the queue whenever it finishes
one, so the processes end within one file of each other however the files' times shift with what
runs beside them. The queue is a list of units (a file, or files that must run in one process),
longest first, and a counter under a file lock in the folder ``$PDSERVE_TEST_QUEUE`` names.

Between files, the session fixtures that hold servers (tests/helpers/last_use.py) stop once no
file still in the queue uses them; a process takes its next file before it runs the last test of
the current one, so pytest tears down the current module's fixtures knowing what comes next.
Loaded with ``-p tests.helpers.file_queue``; without the variable it changes nothing."""

from __future__ import annotations

import fcntl
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Optional

import pytest

QUEUE_ENV = "PDSERVE_TEST_QUEUE"
UNITS = "units.json"  # [[file, ...], ...]: paths relative to the repository, longest unit first
COUNTER = "next"  # the index of the next unit to take


def write_queue(folder: Path, units: list[list[str]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / UNITS).write_text(json.dumps(units))
    (folder / COUNTER).write_text("0")


class Queue:
    def __init__(self, folder: str):
        self.folder = Path(folder)
        self.units: list[list[str]] = json.loads((self.folder / UNITS).read_text())

    def _advance(self, by: int) -> int:
        with open(self.folder / COUNTER, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            i = int(f.read().strip() or 0)
            if by:
                f.seek(0)
                f.truncate()
                f.write(str(i + by))
                f.flush()
            return i

    def take(self) -> Optional[int]:
        """The next unit's index, or None when every unit is taken."""
        i = self._advance(1)
        return i if i < len(self.units) else None

    def untaken(self) -> range:
        return range(min(self._advance(0), len(self.units)), len(self.units))


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session):
    folder = os.environ.get(QUEUE_ENV)
    if not folder:
        return None
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted(f"{session.testsfailed} errors during collection")
    if session.config.option.collectonly:
        return True
    from tests.helpers.last_use import stop_unneeded

    queue = Queue(folder)
    root = session.config.rootpath
    by_file: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in session.items:
        by_file[str(item.path.relative_to(root))].append(item)
    items = [[it for f in unit for it in by_file.get(f, [])] for unit in queue.units]
    uses = [{name for it in unit for name in getattr(it, "fixturenames", ())} for unit in items]

    def take() -> Optional[int]:
        while (i := queue.take()) is not None and not items[i]:
            pass  # a unit whose tests were all deselected
        return i

    current = take()
    while current is not None:
        unit = items[current]
        for j, item in enumerate(unit):
            if j + 1 < len(unit):
                nextitem = unit[j + 1]
            else:
                following = take()
                nextitem = items[following][0] if following is not None else None
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
        if following is not None:
            needed = set(uses[following]).union(*(uses[i] for i in queue.untaken()))
            stop_unneeded(needed)
        current = following
    return True
