"""Calls to a remote store that cannot stall the server: each runs on a small pool of worker
threads and is waited for at most a deadline, and a circuit breaker stops calling a store that
failed or timed out until a cool-down has passed.

States: closed (calls go through), open (calls are refused at once, as misses, until
``retry_at``), half-open (the first call after the cool-down is let through as a probe; its
success closes the breaker, its failure opens it again with the cool-down doubled up to
``max_cooldown_s``). ``failures`` consecutive failed calls open it; one timed-out call opens it at
once (a stopped or partitioned store holds every call for its own, much longer, timeouts).

A call that timed out keeps its worker thread until the store answers or its own timeout ends;
with every worker stuck, the next probe waits in the pool's queue and times out in turn, so the
breaker stays open and nothing waits longer than ``timeout_s``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Callable, Optional, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    """Thread-safe; ``allow()`` before a call, then ``record(ok)`` (or ``record_timeout()``)."""

    def __init__(
        self,
        name: str,
        failures: int = 3,
        cooldown_s: float = 2.0,
        max_cooldown_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if failures < 1:
            raise ValueError(f"{name}: circuit breaker failures must be >= 1, got {failures}")
        if cooldown_s <= 0 or max_cooldown_s < cooldown_s:
            raise ValueError(
                f"{name}: circuit breaker cool-down must be > 0 and <= its maximum, got "
                f"{cooldown_s} s (max {max_cooldown_s} s)"
            )
        self.name = name
        self.threshold = failures
        self.base_cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self.state = CLOSED
        self._consecutive = 0
        self._cooldown_s = cooldown_s
        self.retry_at = 0.0
        self._probing = False
        self.opened = 0  # times it opened (metrics, tests)

    def allow(self) -> bool:
        """Whether a call may go to the store now (in half-open, only one probe at a time)."""
        with self._lock:
            if self.state == CLOSED:
                return True
            if self.state == OPEN and self._clock() >= self.retry_at:
                self.state = HALF_OPEN
                self._probing = False
            if self.state == HALF_OPEN and not self._probing:
                self._probing = True
                return True
            return False

    def record(self, ok: bool) -> None:
        with self._lock:
            if ok:
                if self.state != CLOSED:
                    logger.info("%s: store answers again, calls resume", self.name)
                self.state, self._consecutive, self._probing = CLOSED, 0, False
                self._cooldown_s = self.base_cooldown_s
                return
            self._consecutive += 1
            if self.state == HALF_OPEN or self._consecutive >= self.threshold:
                self._open_locked(f"{self._consecutive} call(s) in a row failed")

    def record_timeout(self, why: str = "a call timed out") -> None:
        """Open at once (a call timed out, or the store could not be joined)."""
        with self._lock:
            self._open_locked(why)

    def _open_locked(self, why: str) -> None:
        if self.state == HALF_OPEN:  # the probe failed: wait longer before the next one
            self._cooldown_s = min(self._cooldown_s * 2, self.max_cooldown_s)
        self.state, self._probing = OPEN, False
        self.retry_at = self._clock() + self._cooldown_s
        self.opened += 1
        logger.warning(
            "%s: %s; calls stop for %.1f s (recompute locally meanwhile)",
            self.name,
            why,
            self._cooldown_s,
        )


class GuardedCalls:
    """Runs store calls with a deadline behind a ``CircuitBreaker``. ``call`` returns the call's
    result, or ``default`` when the breaker is open, the call raised, timed out or its result
    was judged a failure by ``failed``."""

    def __init__(self, breaker: CircuitBreaker, timeout_s: float, workers: int = 2):
        if timeout_s <= 0:
            raise ValueError(f"{breaker.name}: call timeout must be > 0, got {timeout_s}")
        self.breaker = breaker
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix=f"{breaker.name}-call"
        )
        self.refused = 0  # calls not made: breaker open
        self.timeouts = 0
        self.errors = 0  # calls that raised or returned a failure

    def call(
        self,
        fn: Callable[[], T],
        default: T,
        failed: Optional[Callable[[T], bool]] = None,
        what: str = "call",
    ) -> T:
        if not self.breaker.allow():
            self.refused += 1
            return default
        future = self._pool.submit(fn)
        try:
            result = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            self.timeouts += 1
            self.breaker.record_timeout()
            logger.warning("%s: %s timed out after %.1f s", self.breaker.name, what, self.timeout_s)
            return default
        except Exception as e:  # a store binding that raises is a failed call, not a crash
            self.errors += 1
            self.breaker.record(False)
            logger.warning("%s: %s raised %s: %s", self.breaker.name, what, type(e).__name__, e)
            return default
        if failed is not None and failed(result):
            self.errors += 1
            self.breaker.record(False)
            return default
        self.breaker.record(True)
        return result

    def close(self) -> None:
        # stuck workers are not waited for: they end with the store's own timeouts
        self._pool.shutdown(wait=False, cancel_futures=True)
