"""Heartbeats between the ranks of a multi-host server, through rank 0's torch.distributed store.

Each rank bumps its counter ``pdserve/heartbeat/<rank>`` in the store every ``interval`` seconds
from a thread of its own and reads every other rank's. A rank whose counter stood still for
``lost_after`` seconds is lost, and so is node 0 when the store (in rank 0's process) stops
answering. That names the lost node and ranks, which a failed collective does not (gloo names an
address, NCCL often nothing), and it catches a peer that went silent without closing its
connections (a cut cable) sooner than ``--dist-timeout``.

On a verdict the watcher calls ``on_lost`` (the scheduler process logs it and exits). The
scheduler loop, whose collective failed first, asks ``wait_lost`` for the verdict before it
exits, so its last log line names the peer too.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Callable, Optional

from pdserve.server.nodes import NodeLayout

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_LOST_S = 5.0  # at most: a shorter --dist-timeout shortens it


def first_line(error: Exception) -> str:
    """An exception's message without the C++ stack torch.distributed appends to it."""
    return (str(error).strip().splitlines() or [""])[0]


def lost_after(dist_timeout: float) -> float:
    """Seconds without a heartbeat after which a peer counts as lost."""
    return min(HEARTBEAT_LOST_S, dist_timeout)


class Heartbeat:
    def __init__(
        self,
        layout: NodeLayout,
        rank: int,
        dist_timeout: float,
        on_lost: Optional[Callable[[str], None]] = None,
    ):
        import torch.distributed as dist

        self.layout = layout
        self.rank = rank
        self.lost_after = lost_after(dist_timeout)
        self.interval = min(HEARTBEAT_INTERVAL_S, self.lost_after / 3)
        self.on_lost = on_lost or (lambda verdict: None)
        self.verdict: Optional[str] = None
        self._decided = threading.Event()
        # a client of its own: the process group's store is not used from two threads at once
        self.store = dist.TCPStore(
            layout.host,
            layout.port,
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.lost_after),
        )
        self.keys = [f"pdserve/heartbeat/{r}" for r in range(layout.world_size)]
        self.store.add(
            self.keys[rank], 1
        )  # exists before the start-up exchange: multi_get never waits

    def start(self) -> "Heartbeat":
        threading.Thread(target=self._run, name="pdserve-heartbeat", daemon=True).start()
        return self

    def wait_lost(self, timeout: float) -> Optional[str]:
        """The verdict, waiting up to ``timeout`` seconds for one (None: every peer still beats)."""
        self._decided.wait(timeout)
        return self.verdict

    def _run(self) -> None:
        seen = {r: (0, time.monotonic()) for r in range(self.layout.world_size) if r != self.rank}
        while self.verdict is None:
            try:
                self.store.add(self.keys[self.rank], 1)
                counts = self.store.multi_get([self.keys[r] for r in seen])
            except Exception as e:  # the store lives in rank 0's process
                self._decide(
                    f"lost {self.layout.describe(0)}: its torch.distributed store at "
                    f"{self.layout.init_address} stopped answering ({type(e).__name__}: "
                    f"{first_line(e)})"
                )
                break
            now = time.monotonic()
            stale = []
            for (r, (count, since)), raw in zip(list(seen.items()), counts):
                value = int(raw)
                if value != count:
                    seen[r] = (value, now)
                elif now - since > self.lost_after:
                    stale.append(r)
            if stale:
                self._decide(f"lost {self._name(stale)}: no heartbeat for {self.lost_after:g}s")
                break
            time.sleep(self.interval)

    def _name(self, ranks: list[int]) -> str:
        parts = []
        for node in sorted({self.layout.node_of(r) for r in ranks}):
            gone = [r for r in ranks if self.layout.node_of(r) == node]
            whole = len(gone) == len(self.layout.ranks(node))
            parts.append(
                self.layout.describe(node)
                if whole
                else f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} on node "
                f"{node}"
            )
        return " and ".join(parts)

    def _decide(self, verdict: str) -> None:
        self.verdict = verdict
        self._decided.set()
        self.on_lost(verdict)
