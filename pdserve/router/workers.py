"""Workers as the router sees them: health, load, in-flight counts and a circuit breaker.

All state here is touched only from the router's event loop, so there are no locks. A worker is
*available* for new requests when its last health checks passed and its breaker lets requests
through. Health checks (``GET /health``) run for every worker; ``GET /get_load`` is polled only
when a load-aware policy or ``--dp-aware`` needs it.

With ``--dp-aware`` the router also picks the data-parallel (DP) group of each worker a request
goes to: a worker's ``dp_size`` comes from ``GET /server_info`` (read before it first counts as
healthy, and again whenever it comes back or its load reports another number of groups; unknown
counts as 1), the group is the least loaded one, ties (and no load known) taken in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from urllib.parse import urlsplit

import httpx

from pdserve.api_key import bearer
from pdserve.router.load_report import parse_bandwidth, parse_group_loads, parse_load  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

PREFILL, DECODE, REGULAR = "prefill", "decode", "worker"
TTFT_SCALE_HALF_LIFE_S = 5.0  # a worker's TTFT estimate correction fades back to 1 this fast


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

    def half_open_now(self) -> None:
        """Skip the rest of the cooldown: the next request is the trial. For a worker seen
        healthy again after it was down (restarted): its old failures say little about it now."""
        if self.opened_at is not None:
            self.opened_at = min(self.opened_at, self.clock() - self.cooldown)
            self.trial_in_flight = False

    def record(self, ok: bool) -> None:
        self.trial_in_flight = False
        if ok:
            self.failures, self.opened_at = 0, None
            return
        self.failures += 1
        if self.threshold and (self.failures >= self.threshold or self.opened_at is not None):
            if self.opened_at is None:
                logger.warning(
                    "circuit breaker opened after %d consecutive failures", self.failures
                )
            self.opened_at = self.clock()


def bootstrap_host(url: str) -> str:
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host  # IPv6 literals stay bracketed


def worker_id(url: str) -> str:
    """A worker's id in the worker API: a UUID derived from its URL, so it is the same in every
    router process and across restarts."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, url))


class Worker:
    def __init__(
        self,
        url: str,
        role: str,
        bootstrap_port: int | None = None,
        breaker: CircuitBreaker | None = None,
        source: str = "command line",
    ):
        self.url = url
        self.id = worker_id(url)
        self.role = role
        self.bootstrap_port = bootstrap_port
        self.host = bootstrap_host(url)
        self.breaker = breaker or CircuitBreaker(0, 0.0)
        self.source = (
            source  # how it joined: "command line", "api" or "dns NAME" (router/membership.py)
        )
        self.role_epoch = (
            None  # the server's /server_info role_epoch when last read (POST /switch_role)
        )
        self.draining: str | None = None  # why it is being removed; it then takes no new request
        self.healthy = False  # becomes True on the first passing health check
        self.health_failures = 0
        self.in_flight = 0
        self.dispatched = 0  # legs ever sent to it
        self.legs: set = set()  # its open legs (router/legs.py), aborted when a drain times out
        self.polled_load: tuple[int, int] | None = None  # (requests, tokens) from GET /get_load
        self.kv_bandwidth: float | None = (
            None  # a prefill's KV transfer rate, bytes/s (its /get_load)
        )
        self.info: dict | None = None  # its GET /server_info, when the router needs it
        self.in_flight_at_poll = 0
        # observed / estimated time to first token of its streams (--ttft-slo-ms), smoothed, and
        # when it was last observed
        self._ttft_scale, self._ttft_scale_at = 1.0, time.monotonic()
        # data-parallel groups (--dp-aware)
        self.dp_size: int | None = None  # from GET /server_info; None: not known, treated as 1
        self.dp_size_read_at = -float("inf")  # time.monotonic() of the last GET /server_info
        self.group_loads: list[tuple[int, int]] | None = None  # per group, polled like polled_load
        self.group_in_flight: dict[int, int] = {}  # legs open per group, as in_flight
        self.group_in_flight_at_poll: dict[int, int] = {}
        self._next_group = 0

    @property
    def available(self) -> bool:
        return self.healthy and self.draining is None and self.breaker.allows()

    @property
    def ttft_scale(self) -> float:
        """What the model's TTFT estimates for this worker are multiplied by: observed over
        estimated, smoothed, going back to 1 with a half-life of ``TTFT_SCALE_HALF_LIFE_S``
        without new observations (a worker whose every request is refused must be tried again
        once its queue is gone)."""
        age = time.monotonic() - self._ttft_scale_at
        return 1.0 + (self._ttft_scale - 1.0) * 0.5 ** (age / TTFT_SCALE_HALF_LIFE_S)

    def observe_ttft(self, observed_s: float, estimated_s: float) -> None:
        """A stream's first event came ``observed_s`` after dispatch, where the router estimated
        ``estimated_s`` (unscaled): the scale follows (EWMA, weight 0.2, in [1, 1000]: the model
        counts the prefill's compute and queue only, so the scale adds what it misses and never
        takes away)."""
        ratio = observed_s / max(estimated_s, 1e-4)
        scale = min(1000.0, max(1.0, 0.8 * self.ttft_scale + 0.2 * ratio))
        self._ttft_scale, self._ttft_scale_at = scale, time.monotonic()

    def load_estimate(self) -> tuple[int, int]:
        """(requests, tokens): the last polled load plus what this router sent since the poll."""
        if self.polled_load is None:
            return self.in_flight, 0
        reqs, tokens = self.polled_load
        return max(self.in_flight, reqs + self.in_flight - self.in_flight_at_poll), tokens

    def sent_since_poll(self) -> int:
        """Requests this router sent since the last load poll (all in flight before any poll)."""
        return (
            self.in_flight
            if self.polled_load is None
            else max(0, self.in_flight - self.in_flight_at_poll)
        )

    def set_dp_size(self, value) -> None:
        """``dp_size`` as ``/server_info`` reports it (absent: 1)."""
        size = value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1
        if value is not None and size != value:
            logger.warning("%s %s reports dp_size %r; treating it as 1", self.role, self.url, value)
        if size != self.dp_size:
            logger.info("%s %s has %d data-parallel group(s)", self.role, self.url, size)
            self.dp_size, self.group_loads = size, None

    def group_load(self, rank: int) -> tuple[int, int]:
        """(requests, tokens) of DP group ``rank``, estimated like ``load_estimate``."""
        in_flight = self.group_in_flight.get(rank, 0)
        if self.group_loads is None or len(self.group_loads) != (self.dp_size or 1):
            return in_flight, 0
        reqs, tokens = self.group_loads[rank]
        return max(in_flight, reqs + in_flight - self.group_in_flight_at_poll.get(rank, 0)), tokens

    def choose_dp_rank(self) -> int:
        """The least loaded DP group; among equals the first one after the last choice, so
        groups take turns while their load is equal or unknown."""
        size = self.dp_size or 1
        loads = [self.group_load(g) for g in range(size)]
        best = min(loads)
        rank = next(
            g for g in ((self._next_group + k) % size for k in range(size)) if loads[g] == best
        )
        self._next_group = (rank + 1) % size
        return rank

    def set_health(self, ok: bool, threshold: int, reason: str = "") -> None:
        if ok:
            self.health_failures = 0
            if not self.healthy:
                logger.info("%s %s is healthy", self.role, self.url)
                # back after being out (e.g. restarted): try it at once
                self.breaker.half_open_now()
            self.healthy = True
            return
        self.health_failures += 1
        if self.healthy and self.health_failures >= max(threshold, 1):
            logger.warning("%s %s is unhealthy: %s", self.role, self.url, reason)
            self.healthy = False

    def describe(self) -> dict:
        out = {
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "circuit": self.breaker.state,
            "polled_load": list(self.polled_load) if self.polled_load is not None else None,
        }
        if self.role == PREFILL:
            out["bootstrap_port"] = self.bootstrap_port
        if self.dp_size is not None:
            out["dp_size"] = self.dp_size
        return out


class WorkerPool:
    """The router's workers and the background loops that keep their state fresh."""

    def __init__(self, args, poll_loads: bool, needs_info: bool = False):
        self.args = args
        self.dp_aware = args.dp_aware
        self.poll_loads = poll_loads or self.dp_aware
        self.needs_info = (
            needs_info or self.dp_aware
        )  # read each worker's /server_info when it comes up
        # PD: check its role at every health check too, so a server that switched role
        # (POST /switch_role) is moved to its new role (router/membership.py)
        self.follow_roles = args.pd_mode
        self.info_listeners: list = []  # called with (worker, info) after each read

        def make(url: str, role: str, port: int | None = None) -> Worker:
            return Worker(
                url, role, port, CircuitBreaker(args.cb_failure_threshold, args.cb_cooldown)
            )

        self.make = make
        self.pd_mode = args.pd_mode
        # the workers that take new requests, by role; workers being drained are in ``draining``
        self.by_role: dict[str, list[Worker]] = {
            PREFILL: [make(u, PREFILL, p) for u, p in args.prefill],
            DECODE: [make(u, DECODE) for u in args.decode],
            REGULAR: [make(u, REGULAR) for u in args.worker],
        }
        self.draining: list[Worker] = []
        self.forget_listeners: list = []  # called with (worker) once a removed worker is gone
        self.client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task] = []
        self._worker_out = asyncio.Event()  # set when a request found a worker gone: recheck soon

    @property
    def workers(self) -> list[Worker]:
        """Every worker the router knows, those being drained included."""
        return [w for ws in self.by_role.values() for w in ws] + self.draining

    @property
    def main_role(self) -> str:
        """The role whose answer goes back to the client."""
        return DECODE if self.pd_mode else REGULAR

    def find(self, url: str) -> Worker | None:
        return next((w for w in self.workers if w.url == url), None)

    def add(self, worker: Worker, info: dict | None) -> None:
        """Let a worker checked by ``router/membership.py`` take requests."""
        worker.set_health(True, self.args.health_failure_threshold)
        if info is not None:
            self.accept_info(worker, info)
        self.by_role[worker.role].append(worker)

    def start_draining(self, worker: Worker, reason: str) -> None:
        """Take ``worker`` out of selection; what it runs goes on (``router/membership.py``)."""
        worker.draining = reason
        self.by_role[worker.role].remove(worker)
        self.draining.append(worker)

    def forget(self, worker: Worker) -> None:
        self.draining.remove(worker)
        for listener in self.forget_listeners:
            listener(worker)

    def available(self, role: str, exclude: set[Worker] = frozenset()) -> list[Worker]:
        """Healthy workers of ``role`` whose breaker lets a request through. The only worker of
        its role is never turned away by its breaker while its health checks pass: there is no
        other worker to send the request to, and a 503 would only hide that it recovered."""
        workers = self.by_role[role]
        if len(workers) == 1:
            return [w for w in workers if w.healthy and w not in exclude]
        return [w for w in workers if w.available and w not in exclude]

    def ready(self) -> bool:
        if self.pd_mode:
            return bool(self.available(PREFILL) and self.available(DECODE))
        return bool(self.available(REGULAR))

    def on_connect_error(self, worker: Worker, error: Exception) -> None:
        """A refused connection, or one closed in the middle of a request, means the server is
        gone: take it out now, health checks bring it back (see ``Worker.set_health``)."""
        if worker.healthy:
            logger.warning(
                "%s %s unreachable, marking unhealthy: %r", worker.role, worker.url, error
            )
        worker.healthy = False
        self._worker_out.set()

    # ------------------------------------------------------------------ background loops
    async def start(self) -> None:
        timeout = httpx.Timeout(self.args.health_check_timeout)
        self.client = httpx.AsyncClient(
            timeout=timeout,
            limits=httpx.Limits(max_keepalive_connections=32),
            headers=bearer(self.args.worker_api_key),
        )
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
            with contextlib.suppress(
                asyncio.TimeoutError
            ):  # a worker taken out by a request ends the wait
                await asyncio.wait_for(self._worker_out.wait(), interval)
            self._worker_out.clear()
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
        if ok and self.needs_info and (worker.info is None or not worker.healthy):
            await self.read_info(worker)  # a worker that (re)starts may have another configuration
        elif ok and self.follow_roles:
            await self.check_role(worker)
        worker.set_health(ok, self.args.health_failure_threshold, reason)

    async def read_info(self, worker: Worker) -> None:
        """Read ``worker``'s server info: its dp_size (``--dp-aware``), its KV events endpoints
        and calibration. On failure it keeps what it had (dp_size never known: 1), and it is
        asked again at the next health check."""
        worker.dp_size_read_at = time.monotonic()
        try:
            resp = await self.client.get(worker.url + "/server_info")
            if resp.status_code == 404:
                resp = await self.client.get(worker.url + "/get_server_info")  # older sglang
            resp.raise_for_status()
            info = resp.json()
        except (httpx.HTTPError, ValueError) as e:
            level = (
                logging.DEBUG if worker.healthy else logging.WARNING
            )  # said once, when it comes up
            logger.log(
                level,
                "%s %s: no server info (%r); dp_size stays %s",
                worker.role,
                worker.url,
                e,
                worker.dp_size or "unknown (1)",
            )
            return
        self.accept_info(worker, info if isinstance(info, dict) else {})

    async def check_role(self, worker: Worker) -> None:
        """Read ``worker``'s server info again and take it (its listeners run) only when its role
        or role epoch changed since the last read (``POST /switch_role``); the rest of the info is
        read when a worker comes up."""
        try:
            resp = await self.client.get(worker.url + "/server_info")
            resp.raise_for_status()
            info = resp.json()
        except (httpx.HTTPError, ValueError) as e:
            logger.debug("%s %s: no server info (%r)", worker.role, worker.url, e)
            return
        if not isinstance(info, dict):
            return
        old = worker.info or {}
        if worker.info is None or any(
            info.get(k) != old.get(k) for k in ("disaggregation_mode", "role_epoch")
        ):
            self.accept_info(worker, info)

    def accept_info(self, worker: Worker, info: dict) -> None:
        worker.info = info
        if self.dp_aware:
            worker.set_dp_size(info.get("dp_size"))
        for listener in self.info_listeners:
            listener(worker, info)

    async def update_loads(self) -> None:
        await asyncio.gather(*(self._poll_one(w) for w in self.workers if w.healthy))

    async def _poll_one(self, worker: Worker) -> None:
        in_flight, group_in_flight = worker.in_flight, dict(worker.group_in_flight)
        try:
            resp = await self.client.get(worker.url + "/get_load")
            resp.raise_for_status()
            payload = resp.json()
            worker.polled_load = parse_load(payload)
            worker.kv_bandwidth = parse_bandwidth(payload)
            worker.in_flight_at_poll = in_flight
            worker.group_loads = parse_group_loads(payload) if self.dp_aware else None
            worker.group_in_flight_at_poll = group_in_flight
        except (httpx.HTTPError, ValueError, TypeError) as e:
            logger.debug("GET %s/get_load failed: %r", worker.url, e)
            worker.polled_load = worker.group_loads = None
            return
        stale = worker.group_loads is not None and len(worker.group_loads) != (worker.dp_size or 1)
        if stale and time.monotonic() - worker.dp_size_read_at >= self.args.health_check_interval:
            await self.read_info(worker)  # restarted with another dp_size since it was read?

    async def fan_out(
        self, method: str, path: str, workers: list[Worker], timeout: float | None = None
    ):
        """Send one request to each worker concurrently; returns
        ``(worker, response | exception)``."""

        async def one(w: Worker):
            try:
                return w, await self.client.request(
                    method, w.url + path, timeout=timeout or httpx.USE_CLIENT_DEFAULT
                )
            except httpx.HTTPError as e:
                return w, e

        return await asyncio.gather(*(one(w) for w in workers))
