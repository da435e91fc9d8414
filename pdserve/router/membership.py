"""Workers that join and leave while the router runs (the worker API, ``router/worker_api.py``,
and DNS discovery, ``router/discovery.py``, both come here).

Joining: a worker is checked before it takes any request. It must answer ``GET /health`` with
200 within ``--add-worker-timeout`` (asked again every half second until then, so a server that
finishes warming up meanwhile is taken) and ``GET /server_info``; what it reports must agree
with the role it is added as (``disaggregation_mode``) and, for a prefill, the bootstrap port
(default: the one it reports) must accept a TCP connection; it must be able to work with the
workers of the other role already there (``pairing.py``). Only then is it added to the pool,
healthy, and policies see it from the next request on.

Leaving is a drain: the worker is taken out of selection at once (no new request goes to it),
its open legs go on until they end, and once none is left it is forgotten (its KV index too). A
leg still open ``--drain-timeout`` seconds after the removal is aborted with an error naming the
removal (``Leg.abort``): an attempt that has produced nothing yet is retried on another worker,
a stream that has ends with an SSE error event.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from pdserve.router import pairing
from pdserve.router.args import DEFAULT_BOOTSTRAP_PORT, normalize_url
from pdserve.router.drain_migrate import migrate_away
from pdserve.router.workers import DECODE, PREFILL, REGULAR, Worker, WorkerPool

logger = logging.getLogger(__name__)

ROLES = {
    "prefill": PREFILL,
    "decode": DECODE,
    "regular": REGULAR,
}  # worker_type (sglang-router) -> role
WORKER_TYPES = {role: name for name, role in ROLES.items()}
_MODES = {
    "prefill": PREFILL,
    "decode": DECODE,
    "null": REGULAR,
    None: REGULAR,
}  # /server_info's disaggregation_mode
_ABORT_GRACE_S = (
    10.0  # aborted legs close at once; a removed worker is forgotten after this at the latest
)
_HEALTH_RETRY_S = 0.5


class MembershipError(Exception):
    """A worker that cannot be added or removed; ``status`` and ``code`` go to the client."""

    def __init__(self, message: str, status: int = 400, code: str = "BAD_REQUEST"):
        super().__init__(message)
        self.status = status
        self.code = code


class Membership:
    def __init__(self, pool: WorkerPool, args):
        self.pool = pool
        self.args = args
        self.adding: set[str] = set()  # URLs being checked
        self._drains: dict[Worker, asyncio.Task] = {}
        self._rejoins: dict[str, asyncio.Task] = {}
        pool.info_listeners.append(self._follow_role)

    def roles(self) -> tuple[str, ...]:
        return (PREFILL, DECODE) if self.pool.pd_mode else (REGULAR,)

    # ------------------------------------------------------------------ joining
    async def add(
        self,
        url: str,
        worker_type: str | None = None,
        bootstrap_port: int | None = None,
        source: str = "api",
    ) -> Worker:
        """Check a worker and add it; raises ``MembershipError`` naming what is wrong."""
        try:
            url = normalize_url(url)
        except ValueError as e:
            raise MembershipError(f"url: {e}") from None
        role = None
        if worker_type is not None:
            role = ROLES.get(worker_type)
            if role is None:
                raise MembershipError(
                    f"worker_type: unknown {worker_type!r}, choose from {', '.join(ROLES)}"
                )
            self._check_role(role)
        if bootstrap_port is not None and not 0 < bootstrap_port < 65536:
            raise MembershipError(f"bootstrap_port: {bootstrap_port} is not a TCP port")
        known = self.pool.find(url)
        if known is not None or url in self.adding:
            state = (
                "being added"
                if known is None
                else ("being removed" if known.draining else "already a worker")
            )
            raise MembershipError(
                f"{url} is {state}" + (f" (id {known.id})" if known else ""), 409, "WORKER_EXISTS"
            )
        self.adding.add(url)
        try:
            info = await self._probe(url)
            role = self._role_of(url, role, info)
            port = self._bootstrap_port(url, role, bootstrap_port, info)
            worker = self.pool.make(url, role, port)
            worker.source = source
            worker.info = info
            if role == PREFILL:
                await self._check_bootstrap(worker)
            self._check_pairing(worker)
        finally:
            self.adding.discard(url)
        self.pool.add(worker, info)
        logger.info(
            "added %s %s (%s): %d %s worker(s) now",
            role,
            url,
            source,
            len(self.pool.by_role[role]),
            role,
        )
        return worker

    def _check_role(self, role: str) -> None:
        if role not in self.roles():
            mode = (
                "PD mode (prefill and decode workers)"
                if self.pool.pd_mode
                else "colocated mode (regular workers)"
            )
            raise MembershipError(
                f"worker_type: this router runs in {mode}; it takes no {WORKER_TYPES[role]} worker"
            )

    async def _probe(self, url: str) -> dict:
        """The worker's ``/server_info`` once its ``/health`` answers 200, within the timeout."""
        timeout = self.args.add_worker_timeout
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            left = deadline - time.monotonic()
            try:
                resp = await self.pool.client.get(url + "/health", timeout=max(left, 0.1))
                if resp.status_code == 200:
                    break
                last = f"GET /health answered {resp.status_code}"
            except httpx.HTTPError as e:
                last = f"GET /health failed: {e!r}"
            if time.monotonic() + _HEALTH_RETRY_S >= deadline:
                raise MembershipError(
                    f"{url} is not healthy after {timeout:g} s (--add-worker-timeout): {last}"
                )
            await asyncio.sleep(_HEALTH_RETRY_S)
        try:
            resp = await self.pool.client.get(
                url + "/server_info", timeout=max(deadline - time.monotonic(), 1.0)
            )
            if resp.status_code == 404:  # older sglang
                resp = await self.pool.client.get(
                    url + "/get_server_info", timeout=max(deadline - time.monotonic(), 1)
                )
            resp.raise_for_status()
            info = resp.json()
        except (httpx.HTTPError, ValueError) as e:
            raise MembershipError(
                f"{url} answers /health but not GET /server_info: {e!r}"
            ) from None
        if not isinstance(info, dict):
            raise MembershipError(f"{url}: GET /server_info did not answer a JSON object")
        return info

    def _role_of(self, url: str, role: str | None, info: dict) -> str:
        mode = info.get("disaggregation_mode", "unknown")
        reported = _MODES.get(mode)
        if role is None:  # not given: the server says what it is
            if reported is None:
                raise MembershipError(
                    f"worker_type: {url} reports disaggregation_mode {mode!r}; give "
                    "worker_type (prefill, decode or regular)"
                )
            self._check_role(reported)
            return reported
        if reported is not None and reported != role:
            raise MembershipError(
                f"worker_type: {url} was added as {WORKER_TYPES[role]} but runs with "
                f"disaggregation_mode {info['disaggregation_mode']}"
            )
        return role

    @staticmethod
    def _bootstrap_port(url: str, role: str, given: int | None, info: dict) -> int | None:
        if role != PREFILL:
            if given is not None:
                raise MembershipError(
                    f"bootstrap_port: only a prefill worker has one ({url} is not a prefill)"
                )
            return None
        reported = info.get("disaggregation_bootstrap_port")
        reported = (
            reported if isinstance(reported, int) and not isinstance(reported, bool) else None
        )
        if given is not None and reported is not None and given != reported:
            raise MembershipError(
                f"bootstrap_port: {url} reports bootstrap port {reported}, not {given}"
            )
        return given or reported or DEFAULT_BOOTSTRAP_PORT

    async def _check_bootstrap(self, worker: Worker) -> None:
        """Decode finds a room's KV through this port: it must be open."""
        host = worker.host.strip("[]")
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(host, worker.bootstrap_port), self.args.add_worker_timeout
            )
        except (OSError, asyncio.TimeoutError) as e:
            raise MembershipError(
                f"bootstrap_port: prefill {worker.url}'s bootstrap port {worker.bootstrap_port} "
                f"does not accept connections ({e!r})"
            ) from None
        writer.close()

    def _check_pairing(self, worker: Worker) -> None:
        if worker.role == REGULAR:
            return
        others = self.pool.by_role[DECODE if worker.role == PREFILL else PREFILL]
        reasons = [
            pairing.why_not(worker, o) if worker.role == PREFILL else pairing.why_not(o, worker)
            for o in others
        ]
        if others and all(reasons):
            raise MembershipError(
                f"{worker.url} cannot be paired with any {others[0].role} worker: {reasons[0]}"
            )

    # ------------------------------------------------------------------ role switches
    def _follow_role(self, worker: Worker, info: dict) -> None:
        """A server that switched role (its ``disaggregation_mode`` or ``role_epoch`` changed)
        leaves its old role and joins again with the checks of ``add``: the new role's bootstrap
        port and pairing. It drained itself before switching, so its drain here is short."""
        epoch = info.get("role_epoch")
        known, worker.role_epoch = worker.role_epoch, epoch
        reported = _MODES.get(info.get("disaggregation_mode", "unknown"))
        changed = reported is not None and reported != worker.role
        if not changed and (known is None or epoch == known):
            return
        if worker.draining is not None or worker.url in self._rejoins:
            return
        why = f"switched to {info.get('disaggregation_mode')} (role epoch {epoch})"
        self._rejoins[worker.url] = asyncio.create_task(
            self._rejoin(worker, why), name=f"router-rejoin-{worker.url}"
        )

    async def _rejoin(self, worker: Worker, why: str) -> None:
        try:
            self.remove(worker, why)
            drain = self._drains.get(worker)
            if drain is not None:
                await drain
            try:
                await self.add(worker.url, source=worker.source)
            except MembershipError as e:
                logger.warning(
                    "%s %s: not taken back after it %s: %s", worker.role, worker.url, why, e
                )
        finally:
            self._rejoins.pop(worker.url, None)

    # ------------------------------------------------------------------ leaving
    def remove(self, worker: Worker, reason: str) -> None:
        """Start draining ``worker`` (at once; it is forgotten once its legs have ended)."""
        if worker.draining is not None:
            return
        self.pool.start_draining(worker, reason)
        logger.info(
            "draining %s %s (%s): %d leg(s) in flight",
            worker.role,
            worker.url,
            reason,
            worker.in_flight,
        )
        self._drains[worker] = asyncio.create_task(
            self._drain(worker), name=f"router-drain-{worker.url}"
        )

    async def drained(self, worker: Worker) -> None:
        """Wait until ``worker``, being removed, is forgotten."""
        task = self._drains.get(worker)
        if task is not None:
            await asyncio.shield(task)

    async def _drain(self, worker: Worker) -> None:
        timeout = self.args.drain_timeout
        deadline = time.monotonic() + timeout
        try:
            if self.args.drain_migrate and worker.role == DECODE and worker.in_flight > 0:
                if await migrate_away(self.pool, worker, deadline):
                    self.pool.forget(worker)  # its legs go on, relayed by its front end
                    return
            while worker.in_flight > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if worker.in_flight > 0:
                why = (
                    f"{worker.role} {worker.url} was removed from the router ({worker.draining}) "
                    f"and its drain timeout of {timeout:g} s (--drain-timeout) passed"
                )
                logger.warning("%s: aborting %d leg(s)", why, len(worker.legs))
                for leg in list(worker.legs):
                    leg.abort(why)
                grace = time.monotonic() + _ABORT_GRACE_S
                while (
                    worker.in_flight > 0 and time.monotonic() < grace
                ):  # aborted legs close at once
                    await asyncio.sleep(0.05)
            self.pool.forget(worker)
            logger.info(
                "removed %s %s: %d %s worker(s) left",
                worker.role,
                worker.url,
                len(self.pool.by_role[worker.role]),
                worker.role,
            )
        finally:
            self._drains.pop(worker, None)

    async def stop(self) -> None:
        for task in list(self._drains.values()) + list(self._rejoins.values()):
            task.cancel()
        await asyncio.gather(
            *self._drains.values(), *self._rejoins.values(), return_exceptions=True
        )
