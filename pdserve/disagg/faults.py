"""Fault injection in the prefill transfer layer, for tests and chaos runs.

``--disaggregation-fault-prob P`` gives each room a fault with probability P (decided once, when
its first transfer job runs); the fault's kind is drawn from ``--disaggregation-fault-mode``
(a comma-separated list). Every fault happens where the real failure would:

- ``fail_transfer``: a chunk's write fails as if the backend reported an error;
- ``drop_status``: the Success status for the room is never sent (a lost control message);
- ``delay_transfer``: every chunk of the room waits ``--disaggregation-fault-delay`` seconds on
  the transfer worker before it is written (a slow link; delays the rooms queued behind it too);
- ``corrupt_aux_room``: the metadata row lands with a wrong ``bootstrap_room`` (another row's);
- ``kill_transfer_thread``: the transfer worker thread dies while handling the room's chunk.

``--disaggregation-fault-ranks 1`` limits the faults to those TP ranks of the server (default:
every rank). With P = 0 (the default) nothing here runs.
"""

from __future__ import annotations

import random
import threading
from typing import Any, Optional

from pdserve.config import server_option

FAIL_TRANSFER = "fail_transfer"
DROP_STATUS = "drop_status"
DELAY_TRANSFER = "delay_transfer"
CORRUPT_AUX_ROOM = "corrupt_aux_room"
KILL_TRANSFER_THREAD = "kill_transfer_thread"


class InjectedThreadDeath(BaseException):
    """Raised inside a transfer worker to kill it (BaseException: no handler there catches it)."""


class FaultInjector:
    def __init__(
        self, prob: float = 0.0, modes: str = FAIL_TRANSFER, delay_s: float = 1.0, seed: int = 0
    ):
        self.prob = float(prob)
        self.modes = [m.strip() for m in modes.split(",") if m.strip()]
        self.delay_s = float(delay_s)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._rooms: dict[int, Optional[str]] = {}
        self.injected: dict[str, int] = {m: 0 for m in self.modes}

    @classmethod
    def from_args(cls, server_args: Any, tp_rank: int = 0) -> "FaultInjector":
        """The injector of one rank: off on ranks outside ``--disaggregation-fault-ranks``."""
        ranks = server_option(server_args, "disaggregation_fault_ranks")
        on = ranks is None or tp_rank in {int(r) for r in str(ranks).split(",") if r.strip()}
        return cls(
            server_option(server_args, "disaggregation_fault_prob") if on else 0.0,
            server_option(server_args, "disaggregation_fault_mode"),
            server_option(server_args, "disaggregation_fault_delay"),
            int(server_option(server_args, "random_seed")),
        )

    @property
    def enabled(self) -> bool:
        return self.prob > 0

    def mode(self, room: int) -> Optional[str]:
        """The fault chosen for ``room`` (None for most rooms); the same answer every call."""
        if not self.enabled:
            return None
        with self._lock:
            if room not in self._rooms:
                hit = self._rng.random() < self.prob
                mode = self._rng.choice(self.modes) if hit else None
                self._rooms[room] = mode
                if mode is not None:
                    self.injected[mode] += 1
            return self._rooms[room]

    def is_(self, room: int, mode: str) -> bool:
        return self.enabled and self.mode(room) == mode

    def forget(self, room: int) -> None:
        if self.enabled:
            with self._lock:
                self._rooms.pop(room, None)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"prob": self.prob, "modes": list(self.modes), "injected": dict(self.injected)}
