"""Writes to a slow tier (disk, a remote store) off the scheduler's path: a thread draining a
bounded queue. A full queue drops the write (counted): the entry is only a copy, and a server
that cannot keep up with its evictions must not stall on them."""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

from pdserve.engine.kv_tier.base import TierBackend

logger = logging.getLogger(__name__)

_STOP = object()


class TierWriter:
    def __init__(self, backend: TierBackend, max_queued: int, name: str = "kv-tier-writer"):
        self.backend = backend
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued)
        # (key, block) of each finished write, True when it was stored; the scheduler drains it
        self.done: deque = deque()
        self.dropped = 0  # writes refused because the queue was full
        self.failed = 0  # writes the backend refused
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, key: str, data: bytes, block) -> bool:
        """Queue ``data`` for ``key``; False (dropped) when the queue is full. ``block`` comes
        back with the result in ``done``."""
        try:
            self._queue.put_nowait((key, data, block))
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            key, data, block = item
            if key is None:  # flush's marker: everything before it is done
                block.set()
                continue
            try:
                ok = self.backend.put(key, data)
            except Exception:  # a backend must not raise; one that does loses this write only
                logger.exception("tier write of %s raised", key)
                ok = False
            if not ok:
                self.failed += 1
            self.done.append((key, block, ok))

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is done (tests, shutdown); False on timeout."""
        done = threading.Event()
        self._queue.put((None, None, done))  # a marker the backend never sees
        return done.wait(timeout)

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(5.0)
