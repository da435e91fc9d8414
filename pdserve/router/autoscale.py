"""``--autoscale``: move servers between prefill and decode when the queues show the split is off.

Every ``--autoscale-interval`` seconds the router reads each prefill and decode server's
``GET /get_load`` and takes its *backlog*: the requests it holds but does not compute yet. For a
prefill, those not prefilled yet (``num_waiting_reqs``); for a decode, those waiting for KV pages
(``prealloc_queue``) or for a place in the running batch (``num_waiting_reqs``). A request whose
KV is under way is in neither: it waits for the link, not for a server. A server with a capped
queue (``--max-queued-requests``) also counts the requests it refused or shed since the last
sample (``num_shed_reqs``): past the cap its queue stops growing, and the refused demand is the
part of its backlog it could not hold. A role keeps up while its servers hold no backlog; the
role that falls behind shows one, whatever the cause (long prompts, long outputs, a burst).

The decision (``decide``) looks at the samples of the last ``--autoscale-window`` seconds, taken
while the split stayed the same. One server moves from role B to role A when

- every sample shows role A a backlog of at least ``--autoscale-queue`` requests per server
  (a lasting one, not a burst), and
- moving it shortens the longer queue: with the backlog spread over one more server of A and
  one fewer of B, ``max(backlog_A * n_A / (n_A + 1), backlog_B * n_B / (n_B - 1))`` is below
  today's ``max(backlog_A, backlog_B)`` (so a split where both fall behind stays: moving would
  only move the backlog), and
- B keeps ``--autoscale-min-prefill`` / ``--autoscale-min-decode`` servers.

The move itself (``Autoscaler._move``): the least loaded server of B is drained from the router
(no new request; what it runs finishes, ``--drain-timeout``), asked to ``POST /switch_role`` (it
drains itself too, re-wires its pools, keeps its weights), and added back as A with the checks
of ``POST /workers`` (health, bootstrap port, pairing). A server that refuses the switch is put
back in its old role and not asked again for that role. After a move the samples start again and
``--autoscale-cooldown`` passes before the next decision: the queues need time to show the new
split.

What it does not see: a role that keeps up with no queue but slowly (a decode batch so large that
TPOT misses its target) shows no backlog; ``pdserve plan`` predicts TTFT and TPOT for a split.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import httpx

from pdserve.router.drain_migrate import peer_targets
from pdserve.router.membership import WORKER_TYPES, Membership, MembershipError
from pdserve.router.workers import DECODE, PREFILL, Worker, WorkerPool

logger = logging.getLogger(__name__)

ROLES = (PREFILL, DECODE)
# POST /switch_role answers after the server's drain, its re-wiring (600 s at most) and warm-up
SWITCH_EXTRA_S = 660.0
HISTORY = 20


def shed_total(payload) -> int:
    """Requests a server refused or shed from its full queue since it started (429s), from its
    ``GET /get_load`` answer."""
    groups = payload if isinstance(payload, list) else [payload]
    return sum(int(g.get("num_shed_reqs", 0)) for g in groups if isinstance(g, dict))


def demand(role: str, payload, seen: Optional[int]) -> tuple[int, int]:
    """(the server's backlog plus the requests it refused since its shed count was ``seen``, its
    shed count now). A full queue (``--max-queued-requests``) stops growing and refuses the rest:
    what it refused is demand the role did not keep up with (none counted at the first sample)."""
    shed = shed_total(payload)
    return backlog(role, payload) + (max(0, shed - seen) if seen is not None else 0), shed


def backlog(role: str, payload) -> int:
    """Requests a server holds but does not compute yet, from its ``GET /get_load`` answer (a
    list of per-DP-group dicts, or one dict)."""
    groups = payload if isinstance(payload, list) else [payload]
    total = 0
    for g in groups:
        if not isinstance(g, dict):
            continue
        total += int(g.get("num_waiting_reqs", 0))
        if role == DECODE:
            total += int(g.get("prealloc_queue", 0))
    return total


@dataclass
class Sample:
    t: float
    per_server: dict[str, float]  # role -> mean backlog per server of that role
    servers: dict[str, int]  # role -> servers sampled


@dataclass
class Move:
    source: str  # the role that gives a server
    target: str  # the role that gets it
    before: float  # the longer queue per server now
    after: float  # and predicted after the move

    def describe(self) -> str:
        return (
            f"{self.target} falls behind: the longer queue per server would go from "
            f"{self.before:.1f} to {self.after:.1f} requests with one {self.source} server fewer"
        )


def decide(samples: list[Sample], queue: float, minimum: dict[str, int]) -> Optional[Move]:
    """The move the samples call for, or None (see the module's docstring). ``samples`` cover
    one split (the same servers per role in each)."""
    if not samples:
        return None
    n = samples[-1].servers
    mean = {r: sum(s.per_server[r] for s in samples) / len(samples) for r in ROLES}
    before = max(mean.values())
    best: Optional[Move] = None
    for target, source in ((PREFILL, DECODE), (DECODE, PREFILL)):
        if n[source] <= minimum[source] or any(s.per_server[target] < queue for s in samples):
            continue
        after = max(
            mean[target] * n[target] / (n[target] + 1), mean[source] * n[source] / (n[source] - 1)
        )
        if after < before and (best is None or after < best.after):
            best = Move(source, target, before, after)
    return best


@dataclass
class Switch:
    """One move, as ``GET /autoscale`` lists it."""

    url: str
    source: str
    target: str
    reason: str
    started: float = field(default_factory=time.time)
    seconds: Optional[float] = None
    outcome: str = "running"

    def to_json(self) -> dict:
        return {
            "url": self.url,
            "from": WORKER_TYPES[self.source],
            "to": WORKER_TYPES[self.target],
            "reason": self.reason,
            "started": self.started,
            "seconds": self.seconds,
            "outcome": self.outcome,
        }


class Autoscaler:
    def __init__(self, pool: WorkerPool, membership: Membership, args):
        self.pool, self.membership, self.args = pool, membership, args
        self.minimum = {PREFILL: args.autoscale_min_prefill, DECODE: args.autoscale_min_decode}
        self.samples: deque[Sample] = deque()
        self.since: Optional[float] = None  # when the samples of this split began
        self.history: deque[Switch] = deque(maxlen=HISTORY)
        self.refused: set[tuple[str, str]] = set()  # (url, role) switches a server refused
        self.last_move = -float("inf")
        self.moving: Optional[Switch] = None
        self._task: Optional[asyncio.Task] = None
        self.shed_seen: dict[str, int] = {}  # url -> its shed count at the last sample

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="router-autoscale")
        logger.info(
            "autoscaling: queues sampled every %gs; a backlog of %g requests per server for %gs "
            "moves a server (cooldown %gs; at least %d prefill and %d decode)",
            self.args.autoscale_interval,
            self.args.autoscale_queue,
            self.args.autoscale_window,
            self.args.autoscale_cooldown,
            self.minimum[PREFILL],
            self.minimum[DECODE],
        )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def state(self) -> dict:
        last = self.samples[-1] if self.samples else None
        return {
            "enabled": True,
            "interval_s": self.args.autoscale_interval,
            "window_s": self.args.autoscale_window,
            "cooldown_s": self.args.autoscale_cooldown,
            "queue": self.args.autoscale_queue,
            "min_prefill": self.minimum[PREFILL],
            "min_decode": self.minimum[DECODE],
            "backlog_per_server": (
                {WORKER_TYPES[r]: last.per_server[r] for r in ROLES} if last else None
            ),
            "servers": {WORKER_TYPES[r]: len(self.pool.available(r)) for r in ROLES},
            "samples_in_window": len(self.samples),
            "switching": self.moving.to_json() if self.moving else None,
            "switches": [s.to_json() for s in self.history],
        }

    # ------------------------------------------------------------------ sampling and deciding
    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.args.autoscale_interval)
            try:
                await self.step()
            except Exception:  # the loop must outlive one bad round
                logger.exception("autoscale round failed")

    async def step(self) -> None:
        sample = await self._sample()
        now = time.monotonic()
        if sample is None or (self.samples and sample.servers != self.samples[-1].servers):
            self._restart()  # a server came, went or did not answer: another split from here on
        if sample is None:
            return
        self.samples.append(sample)
        self.since = self.since if self.since is not None else sample.t
        while self.samples[0].t < now - self.args.autoscale_window:
            self.samples.popleft()
        if (
            now - self.since < self.args.autoscale_window
            or now - self.last_move < self.args.autoscale_cooldown
        ):
            return
        move = decide(list(self.samples), self.args.autoscale_queue, self.minimum)
        if move is None:
            return
        donor = self._donor(move)
        if donor is None:
            return
        self.moving = Switch(donor.url, move.source, move.target, move.describe())
        try:
            await self._move(donor, move)
        finally:
            self.history.append(self.moving)
            self.moving = None
            self._restart()
            self.last_move = time.monotonic()

    def _restart(self) -> None:
        self.samples.clear()
        self.since = None

    async def _sample(self) -> Optional[Sample]:
        workers = {r: self.pool.available(r) for r in ROLES}
        if any(not ws for ws in workers.values()):
            return None

        async def one(role: str, w: Worker) -> Optional[int]:
            try:
                resp = await self.pool.client.get(
                    w.url + "/get_load", timeout=self.args.health_check_timeout
                )
                resp.raise_for_status()
                wanted, self.shed_seen[w.url] = demand(role, resp.json(), self.shed_seen.get(w.url))
                return wanted
            except (httpx.HTTPError, ValueError, TypeError) as e:
                logger.debug("autoscale: GET %s/get_load failed: %r", w.url, e)
                return None

        got = {r: await asyncio.gather(*(one(r, w) for w in ws)) for r, ws in workers.items()}
        if any(v is None for vs in got.values() for v in vs):
            return None
        return Sample(
            time.monotonic(),
            {r: sum(vs) / len(vs) for r, vs in got.items()},
            {r: len(vs) for r, vs in got.items()},
        )

    def _donor(self, move: Move) -> Optional[Worker]:
        candidates = [
            w for w in self.pool.available(move.source) if (w.url, move.target) not in self.refused
        ]
        return min(candidates, key=lambda w: w.load_estimate()[0], default=None)

    # ------------------------------------------------------------------ moving a server
    async def _move(self, worker: Worker, move: Move) -> None:
        sw, t0 = self.moving, time.monotonic()
        target = WORKER_TYPES[move.target]
        logger.info(
            "autoscale: switching %s %s to %s: %s",
            WORKER_TYPES[move.source],
            worker.url,
            target,
            sw.reason,
        )
        self.membership.remove(worker, f"autoscale: becoming a {target} server")
        await self.membership.drained(worker)
        body = {"role": target, "drain_timeout": self.args.drain_timeout}
        others = peer_targets(worker, [w.url for w in self.pool.available(DECODE)])
        if self.args.drain_migrate and move.source == DECODE and others:
            body["migrate_to"] = others  # whatever the router's drain left there moves too
        try:
            resp = await self._switch(worker, body)
            if resp.status_code == 403 and "migrate_to" in body:
                # the decode may not move requests to the others (its --migration-peers): the
                # switch waits for them instead
                logger.warning(
                    "autoscale: %s refused migrate_to (%s); switching without moving its requests",
                    worker.url,
                    _message(resp),
                )
                body.pop("migrate_to")
                resp = await self._switch(worker, body)
            ok, said = resp.status_code == 200, _message(resp)
        except httpx.HTTPError as e:
            ok, said = False, repr(e)
        role = move.target if ok else move.source
        if not ok:
            self.refused.add((worker.url, move.target))
            logger.warning(
                "autoscale: %s refused to become a %s server (%s); back as %s",
                worker.url,
                target,
                said,
                WORKER_TYPES[role],
            )
        try:
            await self.membership.add(worker.url, WORKER_TYPES[role], source=worker.source)
            sw.outcome = "switched" if ok else f"refused: {said}"
        except MembershipError as e:
            sw.outcome = (
                f"switched, not taken back: {e}" if ok else f"refused ({said}), not taken back: {e}"
            )
            logger.warning(
                "autoscale: %s not taken back as %s: %s", worker.url, WORKER_TYPES[role], e
            )
        sw.seconds = round(time.monotonic() - t0, 3)
        logger.info("autoscale: %s %s after %.1fs", worker.url, sw.outcome, sw.seconds)

    async def _switch(self, worker: Worker, body: dict) -> httpx.Response:
        return await self.pool.client.post(
            worker.url + "/switch_role", json=body, timeout=self.args.drain_timeout + SWITCH_EXTRA_S
        )


def _message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return f"HTTP {resp.status_code}: {resp.text[:200]}"
    err = body.get("error") if isinstance(body, dict) else None
    msg = (
        err.get("message")
        if isinstance(err, dict)
        else (body.get("message") if isinstance(body, dict) else None)
    )
    return f"HTTP {resp.status_code}: {msg or body}"
