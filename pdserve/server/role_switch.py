"""``POST /switch_role``: make a running server a prefill, a decode or a colocated server without
loading its weights again.

Body: ``{"role": "prefill" | "decode" | "colocated", "drain_timeout": seconds (default 30),
"bootstrap_port": port (prefill only; default the server's --disaggregation-bootstrap-port)}``
(``"null"``, the ``--disaggregation-mode`` spelling, means colocated). A decode may add
``"migrate_to": [URL, ...]``: its running requests move to those decodes (``POST /migrate``)
instead of being waited for, and the switch follows at once while their streams go on
through this server's front end (a server of another role has none that could move: the list is
checked, then unused). Guarded by ``--api-key`` like every route but /health and /metrics.
The role the server has is answered 200 with ``"changed": false`` and nothing done; a prefill
given another ``bootstrap_port`` switches to prefill on that port.

1. Checks: an unknown role, a field of the wrong type, a ``migrate_to`` entry that is no server
   URL, or a role this server cannot take (the start-up rules: e.g. ``--nnodes`` > 1 or a decode
   with ``--pp-size`` > 1) answer 400; a ``migrate_to`` entry outside ``--migration-peers`` 403;
   a switch while one runs 409; a prefill's bootstrap port in use 409; a server that is starting
   or lost its scheduler 503. With requests here, each ``migrate_to`` decode is asked whether it
   can take them (400 naming one that cannot).
2. Drain: from now on the generation routes and ``/health_generate`` answer 503 naming the
   switch, and ``/health`` does too, so routers stop choosing the server; requests already here
   run to their end (a prefill's rooms finish their transfers). Requests still running after
   ``drain_timeout`` end with 503 naming the switch.
3. The scheduler ranks re-wire themselves once none holds anything (``disagg/setup.py``,
   ``switch_role``; a decode's ended rooms first wait until no prefill can write into them):
   old role's queues, KV manager and bootstrap server closed, prefix cache flushed, KV pools
   allocated again at the same sizes, the new role's built. The weights stay where they are
   (the ranks assert it; ``/server_info`` ``scheduler_info.weights`` shows the digest).
4. A one-token warm-up in the new role; then ``/health`` is 200 again and ``/server_info`` reports
   the new ``disaggregation_mode`` and ``role_epoch`` one higher (``role_switch`` has the state,
   ``last`` the last switch's outcome and timings).

A switch that cannot be completed leaves the server in its old role, serving, and says why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import socket
import time
from typing import Any, Awaitable, Callable, ClassVar, Optional

import msgspec
from fastapi import FastAPI, Request
from starlette.responses import Response

from pdserve.log import retag, role_tag
from pdserve.server import http_util, migrate_api
from pdserve.server.errors import APIError, bad_request
from pdserve.server.messages import AbortReq
from pdserve.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

# role name in the body -> --disaggregation-mode
ROLES = {"prefill": "prefill", "decode": "decode", "colocated": "null", "null": "null"}
DEFAULT_DRAIN_TIMEOUT_S = 30.0
MAX_DRAIN_TIMEOUT_S = 3600.0
POLL_S = 0.02
MIGRATE_RETRY_S = 0.2  # a drain with migrate_to: how often it tries the requests not moved yet
ABORT_WAIT_S = 10.0  # for the scheduler to end the requests aborted at the drain timeout
RECONFIGURE_TIMEOUT_S = 600.0  # one re-wiring on the scheduler (pools of many GB take a while)
WARMUP_TIMEOUT_S = 120.0


def role_name(mode: str) -> str:
    return "colocated" if mode == "null" else mode


class SwitchRoleRequest(msgspec.Struct, forbid_unknown_fields=True):
    # ``check``'s rules (the server's current role, also refused, is no static fact)
    JSON_SCHEMA: ClassVar[dict[str, Any]] = {
        "additionalProperties": False,
        "properties": {
            "role": {"enum": list(ROLES)},
            "drain_timeout": {"minimum": 0, "maximum": MAX_DRAIN_TIMEOUT_S},
            "bootstrap_port": {
                "anyOf": [{"type": "null"}, {"type": "integer", "minimum": 1, "maximum": 65535}]
            },
            "migrate_to": {
                "anyOf": [
                    {"type": "null"},
                    {"type": "array", "minItems": 1, "items": migrate_api.TARGET},
                ]
            },
        },
        "if": {"properties": {"role": {"not": {"const": "prefill"}}}},
        "then": {"properties": {"bootstrap_port": {"type": "null"}}},
    }

    role: str
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S
    bootstrap_port: Optional[int] = None
    # a decode: move its running requests to these decodes (POST /migrate) instead of waiting
    migrate_to: Optional[list[str]] = None


class RoleSwitch:
    """The front end's side of a switch: refusing work, draining, asking the scheduler, reporting.
    Runs on the event loop only."""

    def __init__(self, tm: TokenizerManager, warm_up: Callable[[float], Awaitable[None]]):
        self.tm = tm
        self.warm_up = warm_up  # one generation in the current role, within a timeout
        self.epoch = 0  # completed switches
        self.current: Optional[dict] = None  # the switch in progress: from, to, since
        self.broken: Optional[str] = None  # a switch that left the server unusable
        self.last: Optional[dict] = None

    # ---- what the other routes ask --------------------------------------------------------------
    def refuse_if_switching(self) -> None:
        if self.current is not None:
            c = self.current
            raise APIError(
                503,
                f"the server is switching its role from {c['from']} to {c['to']} (POST "
                "/switch_role) and takes no new requests; send them to another server",
            )
        if self.broken:
            raise APIError(503, self.broken)

    def describe(self) -> dict:
        state = "switching" if self.current else "failed" if self.broken else "idle"
        return {
            "epoch": self.epoch,
            "state": state,
            **(self.current or {}),
            **({"error": self.broken} if self.broken else {}),
            "last": self.last,
        }

    # ---- the switch ------------------------------------------------------------------------------
    def check(self, body: SwitchRoleRequest) -> tuple[str, int]:
        """The new ``--disaggregation-mode`` and bootstrap port; ``APIError`` (4xx) naming the
        problem."""
        args = self.tm.server_args
        if body.role not in ROLES:
            raise bad_request(f"role: must be one of prefill, decode, colocated; got {body.role!r}")
        mode = ROLES[body.role]
        if self.current is not None:
            raise APIError(
                409,
                f"a switch to {self.current['to']} is in progress (since "
                f"{time.time() - self.current['since']:.1f}s): wait for it to end",
            )
        if not (
            math.isfinite(body.drain_timeout) and 0 <= body.drain_timeout <= MAX_DRAIN_TIMEOUT_S
        ):
            raise bad_request(
                f"drain_timeout: must be in [0, {MAX_DRAIN_TIMEOUT_S:.0f}] seconds, "
                f"got {body.drain_timeout}"
            )
        if body.migrate_to is not None:  # 400/403 before any connection, whatever the role
            migrate_api.allowed_targets(self.tm, body.migrate_to, "migrate_to")
        if body.bootstrap_port is not None and mode != "prefill":
            raise bad_request("bootstrap_port: only a prefill server has a bootstrap server")
        if body.bootstrap_port is not None and not 1 <= body.bootstrap_port <= 65535:
            raise bad_request(f"bootstrap_port: must be in [1, 65535], got {body.bootstrap_port}")
        port = (
            args.disaggregation_bootstrap_port
            if body.bootstrap_port is None
            else body.bootstrap_port
        )
        try:
            # the start-up rules for the new role (multi-host servers, decode with pipeline
            # stages, ...)
            dataclasses.replace(args, disaggregation_mode=mode, disaggregation_bootstrap_port=port)
        except ValueError as e:
            raise bad_request(
                f"this server cannot become {_a(role_name(mode))} server: {e}"
            ) from None
        if self._unchanged(mode, port):
            return mode, port  # nothing to change (``switch`` answers so)
        if mode == "prefill" and args.disaggregation_transfer_backend != "fake":
            why = _port_taken(args.host, port)
            if why:
                raise APIError(
                    409, f"bootstrap_port: {port} on {args.host} is not free ({why}); give another"
                )
        return mode, port

    def _unchanged(self, mode: str, port: int) -> bool:
        """The role (and bootstrap port) the server has and serves in: an idempotent request,
        answered without a switch. A prefill given another port is re-wired on it, and a server
        whose last switch left it unusable is re-wired too."""
        args = self.tm.server_args
        same = (mode, port) == (args.disaggregation_mode, args.disaggregation_bootstrap_port)
        return same and not self.broken

    async def switch(self, body: SwitchRoleRequest) -> dict:
        mode, port = self.check(body)
        args = self.tm.server_args
        old = args.disaggregation_mode
        if self._unchanged(mode, port):
            return {
                "success": True,
                "changed": False,
                "role": role_name(mode),
                "disaggregation_mode": mode,
                "role_epoch": self.epoch,
                "bootstrap_port": port if mode == "prefill" else None,
                "drained_requests": 0,
                "aborted_requests": 0,
            }
        targets = None
        # a decode's requests move (a server of another role runs none that could); the targets
        # are asked, a 400 naming one that cannot take requests, only when requests are here
        if body.migrate_to and old == "decode" and self.tm.states:
            urls = migrate_api.allowed_targets(self.tm, body.migrate_to, "migrate_to")
            targets = await migrate_api.check_targets(self.tm, urls)
        t0 = time.monotonic()
        self.current = {"from": role_name(old), "to": role_name(mode), "since": time.time()}
        logger.info(
            "switching role: %s -> %s (%d request(s) in flight, drain timeout %gs)",
            role_name(old),
            role_name(mode),
            len(self.tm.states),
            body.drain_timeout,
        )
        try:
            drained, aborted = await self._drain(body.drain_timeout, targets)
            t1 = time.monotonic()
            out = await self._reconfigure(mode, port, args)
            t2 = time.monotonic()
            args.disaggregation_mode, args.disaggregation_bootstrap_port = mode, port
            self.tm.client.info = out["info"]
            self.epoch += 1
            retag(role_tag(args.role))
            try:
                await self.warm_up(WARMUP_TIMEOUT_S)
            except (
                Exception
            ) as e:  # the role is built but does not serve: say so until the next switch
                self.broken = (
                    f"the server switched to {role_name(mode)} but its warm-up generation failed: "
                    f"{e!r}"
                )
                logger.error("%s", self.broken)
                raise APIError(500, self.broken) from None
            self.broken = None
        except APIError as e:
            logger.warning("switch to %s not done: %s", role_name(mode), e.message)
            raise
        finally:
            self.current = None
        t3 = time.monotonic()
        self.last = {
            "success": True,
            "changed": True,
            "role": role_name(mode),
            "previous_role": role_name(old),
            "disaggregation_mode": mode,
            "role_epoch": self.epoch,
            "bootstrap_port": port if mode == "prefill" else None,
            "drained_requests": drained,
            "aborted_requests": aborted,
            "finished_at": time.time(),
            # reconfigure_s: the ranks' re-wiring; switch_s: that, plus waiting for them to hold
            # nothing
            "timings": {
                "drain_s": round(t1 - t0, 4),
                "switch_s": round(t2 - t1, 4),
                "reconfigure_s": round(out["reconfigure_s"], 4),
                "warmup_s": round(t3 - t2, 4),
                "total_s": round(t3 - t0, 4),
            },
            "weights": out["weights"],
            "scheduler_start_s": out["info"].get("scheduler_start_s"),
        }
        logger.info(
            "role switch %s -> %s done in %.3fs (drain %.3fs, re-wiring %.3fs, warm-up %.3fs; %d "
            "request(s) drained, %d ended by the drain timeout); role epoch %d",
            role_name(old),
            role_name(mode),
            t3 - t0,
            t1 - t0,
            out["reconfigure_s"],
            t3 - t2,
            drained,
            aborted,
            self.epoch,
        )
        return self.last

    async def _drain(self, timeout: float, targets=None) -> tuple[int, int]:
        """Wait for the requests here to end (with ``targets``, (urls, loads) of decodes: move
        them there, again every ``MIGRATE_RETRY_S`` for those not decoding yet); past
        ``timeout`` end the rest with 503. Returns (requests that ended by themselves or moved,
        requests ended by the timeout)."""
        tm = self.tm
        here = len(tm.states)
        deadline = time.monotonic() + timeout
        next_move = 0.0
        while _unfinished(tm) and time.monotonic() < deadline:
            if targets is not None and time.monotonic() >= next_move:
                next_move = time.monotonic() + MIGRATE_RETRY_S
                try:
                    await migrate_api.move(tm, migrate_api.movable_rids(tm), *targets)
                except APIError as e:  # the rest drains as without targets
                    logger.warning("drain: cannot move requests: %s", e.message)
                    targets = None
            await asyncio.sleep(POLL_S)
        left = _unfinished(tm)
        message = (
            f"the server is switching its role to {self.current['to']} (POST /switch_role) and the "
            f"drain timeout of {timeout:g}s passed before this request finished"
        )
        for state in left:
            tm.client.send(AbortReq(rid=state.rid, message=message, status_code=503))
        if left:
            logger.warning("drain timeout: ending %d request(s) with 503", len(left))
        end = time.monotonic() + ABORT_WAIT_S
        while _unfinished(tm) and time.monotonic() < end:
            await asyncio.sleep(POLL_S)
        if _unfinished(tm):
            raise APIError(
                503,
                f"switch abandoned: {len(_unfinished(tm))} request(s) did not end within "
                f"{ABORT_WAIT_S:.0f}s of their abort; the server keeps its role",
            )
        return here - len(left), len(left)

    async def _reconfigure(self, mode: str, port: int, args) -> dict:
        """Ask the ranks to re-wire until they hold nothing (a decode's ended rooms wait for their
        prefill's last writes, bounded by the waiting timeout and peer death)."""
        grace = (
            args.disaggregation_waiting_timeout
            + args.disaggregation_heartbeat_interval * args.disaggregation_heartbeat_misses
            + 5.0
        )
        deadline = time.monotonic() + grace
        while True:
            try:
                out = await self.tm.client.control(
                    "switch_role",
                    {"mode": mode, "bootstrap_port": port},
                    timeout=RECONFIGURE_TIMEOUT_S,
                )
            except asyncio.TimeoutError:
                self.broken = (
                    f"the scheduler did not finish the switch to {role_name(mode)} within "
                    f"{RECONFIGURE_TIMEOUT_S:.0f}s; the server's role is unknown"
                )
                raise APIError(500, self.broken) from None
            except (
                RuntimeError
            ) as e:  # the ranks went back to the old role (or the scheduler is gone)
                raise APIError(500, f"switch failed: {e}") from None
            if "busy" not in out:
                return out
            if time.monotonic() > deadline:
                raise APIError(
                    503,
                    f"switch abandoned: the scheduler still holds work {grace:.0f}s after the "
                    f"drain ({out['busy']}); the server keeps its role",
                )
            await asyncio.sleep(POLL_S)


def _unfinished(tm: TokenizerManager) -> list:
    """Requests whose final output has not reached the front end (read or not)."""
    return [
        s
        for s in tm.states.values()
        if not s.finished
        and not any(o.finish_reason is not None for o in s.pending)
        # a request that moved to another decode no longer needs this server's scheduler
        and not (s.relay is not None and s.relay.left)
    ]


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _port_taken(host: str, port: int) -> str:
    """Why ``port`` cannot be bound on ``host`` ("" when it can), as the bootstrap server binds
    it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return ""


def add_routes(
    app: FastAPI,
    tm: TokenizerManager,
    switcher: RoleSwitch,
    refuse_if_unavailable: Callable[[], None],
    is_ready: Callable[[], bool],
) -> None:
    @app.post("/switch_role")
    async def switch_role(request: Request) -> Response:
        body = await http_util.read_body(request, tm.server_args.max_body_bytes, SwitchRoleRequest)
        refuse_if_unavailable()  # the scheduler is gone
        if not is_ready() and switcher.current is None and not switcher.broken:
            raise APIError(503, "server is starting: switch its role once /health is 200")
        out = await switcher.switch(body)
        if out["changed"]:
            app.openapi_schema = None  # /openapi.json offers the routes of the new role
        return http_util.json_response(out)


def server_info_fields(switcher: RoleSwitch) -> dict[str, Any]:
    """What ``/server_info`` adds: the role epoch and the switch state (a router that sees the
    epoch change reads the role again)."""
    return {
        "role": role_name(switcher.tm.server_args.disaggregation_mode),
        "role_epoch": switcher.epoch,
        "role_switch": switcher.describe(),
    }
