"""Workers as the router sees them: health, load, in-flight counts and a circuit breaker.

All state here is touched only from the router's event loop, so there are no locks. A worker is
*available* for new requests when its last health checks passed and its breaker lets requests
through. Health checks (``GET /health``) run for every worker; ``GET /get_load`` is polled only
when a load-aware policy needs it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import urlsplit

import httpx

logger = logging.getLogger(__name__)

PREFILL, DECODE, REGULAR = "prefill", "decode", "worker"


class CircuitBreaker:
    """closed --N consecutive failures--> open --cooldown--> half-open (one trial request)
    --success--> closed, --failure--> open again. ``threshold == 0`` disables the breaker."""

    def __init__(self, threshold: int, cooldown: float, clock=time.monotonic):
        self.threshold = threshold
        self.cooldown = cooldown
        self.clock = clock
        self.failures = 0
        self.opened_at: float | None = None
        self.trial_in_flight = False

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.clock() - self.opened_at >= self.cooldown else "open"

    def allows(self) -> bool:
        state = self.state
        return state == "closed" or (state == "half_open" and not self.trial_in_flight)

    def on_dispatch(self) -> None:
        if self.state == "half_open":
            self.trial_in_flight = True

    def record(self, ok: bool) -> None:
        self.trial_in_flight = False
        if ok:
            self.failures, self.opened_at = 0, None
            return
        self.failures += 1
        if self.threshold and (self.failures >= self.threshold or self.opened_at is not None):
            if self.opened_at is None:
                logger.warning("circuit breaker opened after %d consecutive failures", self.failures)
            self.opened_at = self.clock()


def bootstrap_host(url: str) -> str:
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host  # IPv6 literals stay bracketed


class Worker:
    def __init__(self, url: str, role: str, bootstrap_port: int | None = None,
                 breaker: CircuitBreaker | None = None):
        self.url = url
        self.role = role
        self.bootstrap_port = bootstrap_port
        self.host = bootstrap_host(url)
        self.breaker = breaker or CircuitBreaker(0, 0.0)
        self.healthy = False  # becomes True on the first passing health check
        self.health_failures = 0
        self.in_flight = 0
        self.polled_load: tuple[int, int] | None = None  # (requests, tokens) from GET /get_load
        self.in_flight_at_poll = 0

    @property
    def available(self) -> bool:
        return self.healthy and self.breaker.allows()

    def load_estimate(self) -> tuple[int, int]:
        """(requests, tokens): the last polled load plus what this router sent since the poll."""
        if self.polled_load is None:
            return self.in_flight, 0
        reqs, tokens = self.polled_load
        return max(self.in_flight, reqs + self.in_flight - self.in_flight_at_poll), tokens

    def set_health(self, ok: bool, threshold: int, reason: str = "") -> None:
        if ok:
            self.health_failures = 0
            if not self.healthy:
                logger.info("%s %s is healthy", self.role, self.url)
                if self.breaker.state != "closed":
                    # back after being out (e.g. restarted): its old failures say nothing about it now
                    self.breaker.failures, self.breaker.opened_at = 0, None
            self.healthy = True
            return
        self.health_failures += 1
        if self.healthy and self.health_failures >= max(threshold, 1):
            logger.warning("%s %s is unhealthy: %s", self.role, self.url, reason)
            self.healthy = False

    def describe(self) -> dict:
        out = {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight,
               "circuit": self.breaker.state}
        if self.role == PREFILL:
            out["bootstrap_port"] = self.bootstrap_port
        return out


def parse_load(payload) -> tuple[int, int]:
    """Sum a ``GET /get_load`` answer: a list of per-DP-rank dicts (pdserve, sglang) or one dict."""
    ranks = payload if isinstance(payload, list) else [payload]
    reqs = tokens = 0
    for r in ranks:
        if not isinstance(r, dict):
            continue
        if "load" in r and "num_reqs" not in r:
            reqs += int(r["load"])
            continue
        reqs += int(r.get("num_reqs", 0)) + int(r.get("num_waiting_reqs", 0))
        tokens += int(r.get("num_tokens", 0))
    return reqs, tokens


class WorkerPool:
    """The router's workers and the background loops that keep their state fresh."""

    def __init__(self, args, poll_loads: bool):
        self.args = args
        self.poll_loads = poll_loads

        def make(url: str, role: str, port: int | None = None) -> Worker:
            return Worker(url, role, port, CircuitBreaker(args.cb_failure_threshold, args.cb_cooldown))

        self.by_role: dict[str, list[Worker]] = {
            PREFILL: [make(u, PREFILL, p) for u, p in args.prefill],
            DECODE: [make(u, DECODE) for u in args.decode],
            REGULAR: [make(u, REGULAR) for u in args.worker],
        }
        self.client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def workers(self) -> list[Worker]:
        return [w for ws in self.by_role.values() for w in ws]

    @property
    def main_role(self) -> str:
        """The role whose answer goes back to the client."""
        return DECODE if self.by_role[PREFILL] else REGULAR

    def available(self, role: str, exclude: set[Worker] = frozenset()) -> list[Worker]:
        return [w for w in self.by_role[role] if w.available and w not in exclude]

    def ready(self) -> bool:
        if self.by_role[PREFILL]:
            return bool(self.available(PREFILL) and self.available(DECODE))
        return bool(self.available(REGULAR))

    def on_connect_error(self, worker: Worker, error: Exception) -> None:
        """A refused connection means the server is gone: take it out now, health checks bring it back."""
        if worker.healthy:
            logger.warning("%s %s unreachable, marking unhealthy: %r", worker.role, worker.url, error)
        worker.healthy = False

    # ------------------------------------------------------------------ background loops
    async def start(self) -> None:
        timeout = httpx.Timeout(self.args.health_check_timeout)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_keepalive_connections=32))
        await self.check_health()
        self._tasks.append(asyncio.create_task(self._health_loop(), name="router-health"))
        if self.poll_loads:
            await self.update_loads()
            self._tasks.append(asyncio.create_task(self._load_loop(), name="router-load"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.client is not None:
            await self.client.aclose()

    async def _health_loop(self) -> None:
        while True:
            # Recheck sooner while a worker is out, so a restarted worker is back in about a second.
            interval = self.args.health_check_interval
            if not all(w.healthy for w in self.workers):
                interval = min(interval, 1.0)
            await asyncio.sleep(interval)
            await self.check_health()

    async def _load_loop(self) -> None:
        while True:
            await asyncio.sleep(self.args.load_poll_interval)
            await self.update_loads()

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check_one(w) for w in self.workers))

    async def _check_one(self, worker: Worker) -> None:
        try:
            resp = await self.client.get(worker.url + "/health")
            ok, reason = resp.status_code == 200, f"GET /health returned {resp.status_code}"
        except httpx.HTTPError as e:
            ok, reason = False, repr(e)
        worker.set_health(ok, self.args.health_failure_threshold, reason)

    async def update_loads(self) -> None:
        await asyncio.gather(*(self._poll_one(w) for w in self.workers if w.healthy))

    async def _poll_one(self, worker: Worker) -> None:
        in_flight = worker.in_flight
        try:
            resp = await self.client.get(worker.url + "/get_load")
            resp.raise_for_status()
            worker.polled_load = parse_load(resp.json())
            worker.in_flight_at_poll = in_flight
        except (httpx.HTTPError, ValueError, TypeError) as e:
            logger.debug("GET %s/get_load failed: %r", worker.url, e)
            worker.polled_load = None

    async def fan_out(self, method: str, path: str, workers: list[Worker], timeout: float | None = None):
        """Send one request to each worker concurrently; returns ``(worker, response | exception)``."""
        async def one(w: Worker):
            try:
                return w, await self.client.request(method, w.url + path, timeout=timeout or httpx.USE_CLIENT_DEFAULT)
            except httpx.HTTPError as e:
                return w, e
        return await asyncio.gather(*(one(w) for w in workers))
