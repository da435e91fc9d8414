"""The router's admission control, with sglang-router's flags and behaviour: a token bucket of
``--max-concurrent-requests`` tokens (off when <= 0) refilled at ``--rate-limit-tokens-per-second``
(default: the capacity) up to its capacity. A generation request takes a token for as long as it
runs (a stream: until its last byte) and gives it back at its end. Without a free token it waits
in a FIFO queue of ``--queue-size`` requests (0: no queue) for at most ``--queue-timeout-secs``;
a full queue answers 429 at once (with ``Retry-After``), a wait that runs out answers 408.

Waiting requests go by their body's ``priority`` first (larger first, as the servers take it,
or smaller with ``--schedule-low-priority-values-first``; absent: 0), then by tenant. Tenants
share the queue by weight: a request names its tenant in ``--tenant-header`` (the
Gateway API Inference Extension's ``x-gateway-inference-fairness-id`` by default; without it, the
default tenant "") and ``--tenant-weights T=W ...`` gives tenants their shares (1 each by default).
A freed token goes to the waiting tenant that has been served least for its weight (stride
scheduling: each grant advances the tenant's pass by 1 / weight; a tenant that starts waiting
joins at the current pass, so idle time earns no credit), first come first served within a
tenant. Under contention two tenants weighted 3:1 get 3:1 of the grants.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Optional

RETRY_AFTER_S = 1


def priority_of(body: object, args) -> int:
    """A request's place among priorities (smaller first): its body's ``priority`` (a batch's most
    urgent), 0 when absent or no integer."""
    sign = 1 if args.schedule_low_priority_values_first else -1
    p = body.get("priority") if isinstance(body, dict) else None
    values = p if isinstance(p, list) else [p]
    ranks = [sign * x for x in values if isinstance(x, int) and not isinstance(x, bool)]
    return min(ranks, default=0)


class Refusal(Exception):
    """A request the router does not admit: ``status`` 429 (queue full) or 408 (waited too
    long)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class Admission:
    """One router's token bucket and queue; all methods run on the event loop."""

    def __init__(
        self,
        capacity: int,
        rate: Optional[float],
        queue_size: int,
        timeout_s: float,
        weights: Optional[dict[str, float]] = None,
    ):
        self.capacity = float(capacity)
        self.rate = float(capacity if rate is None else rate)
        self.queue_size = queue_size
        self.timeout_s = timeout_s
        self.weights = dict(weights or {})
        self.tokens = self.capacity
        self.stamp = time.monotonic()
        # waiting requests by (priority rank, tenant), each in arrival order; each tenant's pass
        # (stride scheduling)
        self.waiters: dict[tuple[int, str], collections.deque[asyncio.Future]] = {}
        self.passes: dict[str, float] = {}
        self.now_pass = 0.0  # the pass of the last grant: where a tenant that starts waiting joins
        self.waiting = 0  # requests in ``waiters`` that still wait
        self.timer: Optional[asyncio.TimerHandle] = None
        self.counts = {"admitted": 0, "queued": 0, "rejected": 0, "timed_out": 0}

    @property
    def queued(self) -> int:
        return self.waiting

    def _take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False

    async def enter(self, tenant: str = "", rank: int = 0) -> None:
        """Return once the request holds a token; ``Refusal`` when it may not run. ``rank``: its
        priority's place (``priority_of``: smaller first)."""
        waiting = self.waiting
        if not waiting and self._take():
            self.counts["admitted"] += 1
            return
        if waiting >= self.queue_size:
            self.counts["rejected"] += 1
            raise Refusal(
                429,
                f"too many requests: {waiting} already wait for one of the router's "
                f"{int(self.capacity)} places (--max-concurrent-requests, --queue-size)",
            )
        fut = asyncio.get_running_loop().create_future()
        queue = self.waiters.setdefault((rank, tenant), collections.deque())
        while queue and queue[0].done():
            queue.popleft()
        if not any(q for (_, t), q in self.waiters.items() if t == tenant):
            # starts waiting: no credit for the time it was idle
            self.passes[tenant] = max(self.passes.get(tenant, 0.0), self.now_pass)
        queue.append(fut)
        self.waiting += 1
        self.counts["queued"] += 1
        self._wake_later()
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except asyncio.TimeoutError:
            if fut.done() and not fut.cancelled():  # granted as the wait ran out: keep it
                self.counts["admitted"] += 1
                return
            fut.cancel()
            self.waiting -= 1
            self.counts["timed_out"] += 1
            raise Refusal(
                408, f"waited {self.timeout_s:g} s in the router's queue (--queue-timeout-secs)"
            ) from None
        except BaseException:  # the client left while it waited: a token it got goes back
            if fut.done() and not fut.cancelled():
                self.leave()
            else:
                fut.cancel()
                self.waiting -= 1
            raise
        self.counts["admitted"] += 1

    def leave(self) -> None:
        """A request that held a token ended: the token goes to the next waiter, if any."""
        self.tokens = min(self.capacity, self.tokens + 1)
        self._grant()

    def _next(self) -> Optional[tuple[int, str]]:
        """The queue to serve: of the first priority that waits, the tenant served least for its
        weight (dropping requests that gave up)."""
        best = None
        for key, queue in list(self.waiters.items()):
            while queue and queue[0].done():  # timed out or left
                queue.popleft()
            if not queue:
                del self.waiters[key]
                continue
            if best is None or (key[0], self.passes[key[1]]) < (best[0], self.passes[best[1]]):
                best = key
        return best

    def _grant(self) -> None:
        while (key := self._next()) is not None and self._take():
            tenant = key[1]
            self.now_pass = self.passes[tenant]
            self.passes[tenant] += 1.0 / self.weights.get(tenant, 1.0)
            self.waiters[key].popleft().set_result(None)
            self.waiting -= 1
        self._wake_later()

    def _wake_later(self) -> None:
        """While requests wait and tokens refill, grant again when the next token is due."""
        if self.timer is not None or not self.waiters or self.rate <= 0:
            return
        due = max(0.0, (1 - self.tokens) / self.rate)

        def wake() -> None:
            self.timer = None
            self._grant()

        self.timer = asyncio.get_running_loop().call_later(due, wake)
