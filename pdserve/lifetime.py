"""Processes that end with their parent, however the parent ends (a signal, a crash, SIGKILL).

A child calls ``end_with_parent(parent_pid)`` as early as it can. On Linux the kernel then sends
it SIGTERM when its parent exits (``prctl(PR_SET_PDEATHSIG)``, kept across ``exec``). The
signal fires when the parent *thread* that forked the child exits, not the parent process, so
pdserve starts its children from the main thread only. Where prctl is unavailable a daemon
thread watches the parent pid instead. Either way a parent that died before the child got this
far is caught by comparing ``os.getppid()`` with the pid the parent gave.

``handle_stop_signals`` is for a process that must react to Ctrl-C and SIGTERM even when it was
started with SIGINT ignored (a shell's background job ignores it, and Python then keeps it
ignored).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PR_SET_NAME = 15
WATCH_INTERVAL_S = 0.5


def name_process(name: str) -> None:
    """This process's name as ``ps -o comm``, ``top`` and ``/proc/PID/comm`` show it (Linux: the
    first 15 bytes); nothing elsewhere."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
        except (OSError, AttributeError):
            pass


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel for ``sig`` when the parent exits; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the C library this process already runs on
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def end_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> str:
    """Make this process receive ``sig`` when ``parent_pid`` (its parent) exits; at once if the
    parent is already gone. Returns how: ``"prctl"`` or ``"watch"``."""
    how = "prctl" if set_parent_death_signal(sig) else "watch"
    if how == "watch":
        threading.Thread(
            target=_watch, args=(parent_pid, sig), name="parent-watch", daemon=True
        ).start()
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os.kill(os.getpid(), sig)
    return how


def _watch(parent_pid: int, sig: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(WATCH_INTERVAL_S)
    logger.error("parent process %d is gone; exiting", parent_pid)
    os.kill(os.getpid(), sig)


def handle_stop_signals(handler: Callable[[int, object], None]) -> None:
    """Install ``handler`` for SIGINT and SIGTERM, whatever this process inherited (SIG_IGN too)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def raise_interrupt(signum: int, frame: object) -> None:
    """A handler that stops the main thread the way Ctrl-C does (SIGTERM included)."""
    raise KeyboardInterrupt(signal.Signals(signum).name)
