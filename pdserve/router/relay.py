"""Decode's stream on its way to the client (``dispatch.py`` hands it over once decode's first
event arrived and the 200 went out), with prefill's input logprobs, the timeline and the PD
decision merged into its events as the client asked."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable

from pdserve.router import pd_policy, protocol, timeline
from pdserve.router.legs import EventReader, Leg, LegAborted, UpstreamError

if TYPE_CHECKING:
    from pdserve.router.dispatch import Call


class Relay:
    """Decode's stream on its way to the client, after the 200 went out. ``close`` (always
    called, even if the stream never started) releases both legs; prefill is left to finish
    only when the stream completed."""

    def __init__(
        self,
        call: "Call",
        first: bytes,
        reader: EventReader,
        p_leg: Leg | None,
        d_leg: Leg,
        p_items: list[dict] | None,
        drain: Callable[[Leg], None],
    ):
        self.drain = drain  # lets a prefill leg nobody waits for finish in the background
        self.call = call
        self.first = first
        self.reader = reader
        self.p_leg = p_leg
        self.d_leg = d_leg
        self.p_items = p_items
        self.completed = False
        self.closed = False

    async def chunks(self):
        chunk = self.first
        try:
            while chunk:
                if self.call.rewrites:
                    chunk = b"".join(self.merge(e) for e in protocol.split_events(chunk))
                if self.call.keeper is not None:
                    self.call.keeper.events(chunk)
                yield chunk
                chunk = await self._next()
            self.d_leg.finish(True)
            self.completed = True
        except (
            LegAborted
        ) as e:  # its decode was removed and the drain timed out (router/membership.py)
            self.d_leg.failed(e)
            yield protocol.sse_error_event(503, str(e))
        except UpstreamError as e:
            result = self.d_leg.failed(e)
            yield protocol.sse_error_event(502, f"decode stream broke: {result.error}")

    async def _next(self) -> bytes:
        """Decode's next events; ``Leg.abort`` cancels the wait, which becomes ``LegAborted``."""
        leg = self.d_leg
        if leg.abort_reason is not None:
            raise LegAborted(leg.abort_reason)
        leg.reader = asyncio.current_task()
        try:
            return await self.reader.next()
        except asyncio.CancelledError:
            if leg.abort_reason is None:
                raise
            leg.reader.uncancel()
            raise LegAborted(leg.abort_reason) from None
        finally:
            leg.reader = None

    def merge(self, event: bytes) -> bytes:
        """One of decode's events with prefill's input logprobs and the timeline merged in."""
        if self.call.merge_logprobs and self.p_items is not None:
            event = protocol.merge_logprobs_event(event, self.p_items, self.call.outputs)
        if self.call.timeline:
            event = timeline.merge_event(event, self.p_items, self.call.outputs, self.call.events)
        if self.call.shows_decision:
            event = pd_policy.add_to_meta_event(event, self.call.decision.meta())
        return event

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self.d_leg.close()
        if self.p_leg is not None:
            if self.completed and not self.p_leg.result().done():
                self.drain(self.p_leg)
            else:
                await self.p_leg.close()
