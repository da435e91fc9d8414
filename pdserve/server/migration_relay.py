"""The client's stream of a request that moved to another decode (``POST /migrate``).

The source decode's front end keeps the client's connection, its detokenizer, stop strings,
parsers and usage counts; it asks the target decode for the request (``POST /migrate_in``,
which streams the target scheduler's raw ``TokenOut`` messages as JSON lines) and feeds those
into the request's state as if its own scheduler had produced them. Routers and clients see
one stream, whatever the API (OpenAI or /generate).

Ordering: the target's output is held back until this scheduler says the request left
(its ``migrated`` finish, which the client never sees); if instead this scheduler sends the
request's next tokens (the move failed and it went on here), the target's output is dropped.
A target stream that ends without a finish after the move ends the request with 502.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

import httpx
import msgspec

from pdserve.server.messages import TokenOut

logger = logging.getLogger(__name__)

MIGRATED = "migrated"
CONNECT_TIMEOUT_S = 10.0


class Relay:
    """The relay of one request (``ReqState.relay``); runs on the front end's event loop."""

    def __init__(self, tm, state, target: str, body: dict[str, Any]):
        self.tm, self.state, self.target, self.body = tm, state, target, body
        self.left = False  # the source scheduler let the request go
        self.held: list[TokenOut] = []
        self.final_seen = False
        self.task: Optional[asyncio.Task] = asyncio.get_running_loop().create_task(
            self._run(), name=f"migration-relay-{state.rid}"
        )

    # ---- outputs of this server's scheduler --------------------------------------------
    def source_output(self, out: TokenOut) -> bool:
        """Whether ``out`` (from this server's scheduler) goes to the client."""
        if out.finish_reason is not None and out.finish_reason.get("type") == MIGRATED:
            self.left = True
            held, self.held = self.held, []
            for o in held:
                self._deliver(o)
            if self.task is None and not self.final_seen:
                self._fail("the target decode's stream ended before the request finished")
            return False
        if not self.left:  # the move failed: the request goes on here
            logger.warning("rid=%s: migration to %s failed, it goes on here", out.rid, self.target)
            self.state.relay = None
            self.cancel()
        return True

    # ---- outputs of the target ----------------------------------------------------------
    def _deliver(self, out: TokenOut) -> None:
        out.rid = self.state.rid
        self.final_seen = self.final_seen or out.finish_reason is not None
        self.state.pending.append(out)
        self.state.event.set()

    def _target_output(self, out: TokenOut) -> None:
        if self.state.relay is not self:
            return
        if self.left:
            self._deliver(out)
        else:
            self.held.append(out)

    def _fail(self, why: str) -> None:
        message = f"migrated to {self.target}: {why}"
        fin = {"type": "abort", "message": message, "status_code": 502}
        self._deliver(TokenOut(rid=self.state.rid, new_ids=[], finish_reason=fin))

    async def _run(self) -> None:
        why = "the stream ended without a finish"
        try:
            timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
            async with httpx.AsyncClient(timeout=timeout) as client:
                async with client.stream(
                    "POST", f"{self.target}/migrate_in", json=self.body
                ) as resp:
                    if resp.status_code != 200:
                        why = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                    else:
                        async for line in resp.aiter_lines():
                            if line:
                                self._target_output(msgspec.json.decode(line, type=TokenOut))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the target is gone: the request fails (after the move)
            why = f"{type(e).__name__}: {e}"
        finally:
            self.task = None
        if self.state.relay is self and self.left and not self.final_seen:
            self._fail(why)
        elif not self.left and not self.held:
            # the target never took it: end the room on this server, the request goes on here
            logger.warning("rid=%s: %s refused the move: %s", self.state.rid, self.target, why)
            try:
                await self.tm.client.control(
                    "migrate_out", {"cancel": self.state.rid, "reason": why}, timeout=10.0
                )
            except (RuntimeError, asyncio.TimeoutError) as e:  # the bootstrap timeout ends it
                logger.warning("rid=%s: could not cancel the move: %s", self.state.rid, e)

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None
