"""One upstream request of a routed request ("leg"), and the streaming response sent back.

A ``Leg`` owns one HTTP request to one worker: it counts as in flight on that worker (and on
the worker's DP group, when it goes to one) from creation until ``close()``, records its outcome
once in the worker's circuit breaker, and ``close()`` tears the connection down unless the
answer was read to its end (closing cancels the request on pdserve servers; a whole answer
leaves the connection to the next leg). ``abort(reason)`` ends it early (a worker whose drain
timed out, ``router/membership.py``): whoever waits on it gets ``LegAborted`` naming the reason.

Legs go through aiohttp's client (C parser, a connection pool looked up by host): httpcore's
pool checks every pooled connection on each request, 41 % of the router's samples at 64
concurrent requests (docs/benchmarks.md, "Router overhead"). Its errors become
``UpstreamError`` here, so the rest of the router names one error type.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import aiohttp
from starlette.responses import StreamingResponse

from pdserve.keepalive import CLIENT_IDLE_S
from pdserve.router.protocol import event_boundary
from pdserve.router.workers import Worker

logger = logging.getLogger(__name__)

PEER_FAILED = 502  # a pdserve PD server's "my peer (the other leg) failed"
SHED = 429  # a server's "my request queue is full": another pair may have room
RETRY_AFTER_S = 1  # what a client refused by every pair is told to wait, when no worker said
# the client's errors that end a leg; asyncio.TimeoutError waiting for a pooled connection
CLIENT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class UpstreamError(Exception):
    """A leg's HTTP request failed without a whole answer; ``cause`` is the client's error."""

    def __init__(self, cause: BaseException | None = None, message: str | None = None):
        super().__init__(message or repr(cause))
        self.cause = cause

    @property
    def timed_out(self) -> bool:
        """The worker stopped answering (read timeout, no free connection in time); a connect
        timeout is not one: nothing was sent, another worker may take the request."""
        c = self.cause
        return isinstance(c, asyncio.TimeoutError) and not isinstance(
            c, aiohttp.ConnectionTimeoutError
        )

    @property
    def worker_gone(self) -> bool:
        """The worker's process is gone: the connection was refused, or closed or reset in the
        middle of a request (a killed server); a timeout is not one of them."""
        c = self.cause
        return isinstance(
            c,
            (
                aiohttp.ClientConnectorError,
                aiohttp.ServerDisconnectedError,
                aiohttp.ClientPayloadError,
                aiohttp.ClientOSError,
                ConnectionError,
            ),
        ) and not isinstance(c, asyncio.TimeoutError)


class LegAborted(UpstreamError):
    """The router ended the leg itself; the message says why."""

    def __init__(self, reason: str):
        super().__init__(message=reason)


def new_session(timeout: float, headers: dict) -> aiohttp.ClientSession:
    """The client of the legs: ``timeout`` for each read and for a free connection, connecting
    within 10 s; bodies passed on as they come (no decompression)."""
    limits = aiohttp.TCPConnector(limit=4096, limit_per_host=0, keepalive_timeout=CLIENT_IDLE_S)
    return aiohttp.ClientSession(
        connector=limits,
        headers=headers,
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(
            total=None, connect=timeout, sock_connect=min(10.0, timeout), sock_read=timeout
        ),
    )


@dataclass
class LegResult:
    status: int | None  # None: no HTTP answer (connection error or timeout)
    body: bytes = b""
    content_type: str | None = None
    error: str = ""
    timed_out: bool = False
    retry_after: str | None = None  # a 429's Retry-After

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def retryable(self) -> bool:
        """Worth another pair: the worker broke (5xx or transport error) or shed the request
        (429: its queue is full), not the request itself (other 4xx)."""
        return (self.status is None and not self.timed_out) or (
            self.status is not None and (self.status >= 500 or self.status == SHED)
        )


class Leg:
    def __init__(
        self,
        client: aiohttp.ClientSession,
        worker: Worker,
        path: str,
        payload: bytes,
        headers: dict,
        on_connect_error,
        metrics,
        dp_rank: int | None = None,
    ):
        self.worker = worker
        self.dp_rank = dp_rank
        self.metrics = metrics
        self.on_connect_error = on_connect_error
        self.started = time.monotonic()
        self.response: aiohttp.ClientResponse | None = None
        self.complete = (
            False  # the answer was read to its end: its connection can serve another leg
        )
        self.outcome: bool | None = None
        self.closed = False
        self.abort_reason: str | None = None
        self.reader: asyncio.Task | None = (
            None  # the task reading its stream, while it waits for bytes
        )
        worker.in_flight += 1
        worker.dispatched += 1
        worker.legs.add(self)
        if dp_rank is not None:
            worker.group_in_flight[dp_rank] = worker.group_in_flight.get(dp_rank, 0) + 1
        worker.breaker.on_dispatch()
        self.headers_task = asyncio.create_task(
            self._send(client, worker.url + path, payload, headers)
        )
        self._result_task: asyncio.Task | None = None

    async def _send(
        self, client: aiohttp.ClientSession, url: str, payload: bytes, headers: dict
    ) -> aiohttp.ClientResponse:
        """The answer's status and headers (its body is read by ``_read`` or ``chunks``)."""
        try:
            self.response = await client.post(url, data=payload, headers=headers)
        except CLIENT_ERRORS as e:
            raise UpstreamError(e) from e
        except asyncio.CancelledError:
            if self.abort_reason is None:
                raise
            raise LegAborted(self.abort_reason) from None
        return self.response

    def abort(self, reason: str) -> None:
        """End the leg now: its waiters get ``LegAborted(reason)`` (a relay reading its stream
        too)."""
        if self.closed or self.abort_reason is not None:
            return
        self.abort_reason = reason
        for task in (self.headers_task, self._result_task, self.reader):
            if task is not None and not task.done():
                task.cancel()

    def result(self) -> asyncio.Task:
        """Task resolving to the whole answer as a ``LegResult`` (started on first call)."""
        if self._result_task is None:
            self._result_task = asyncio.create_task(self._read())
        return self._result_task

    async def _read(self) -> LegResult:
        try:
            resp = await self.headers_task
            try:
                body = await resp.read()
            except CLIENT_ERRORS as e:
                raise UpstreamError(e) from e
        except UpstreamError as e:
            return self.failed(e)
        except asyncio.CancelledError:
            if self.abort_reason is None:
                raise
            return self.failed(LegAborted(self.abort_reason))
        self.complete = True
        self.finish(resp.status < 500 or resp.status == PEER_FAILED)  # a 502 blames the peer leg
        return LegResult(
            resp.status,
            body,
            resp.headers.get("content-type"),
            retry_after=resp.headers.get("retry-after"),
        )

    async def chunks(self) -> AsyncIterator[bytes]:
        """The answer's body as it arrives (after ``headers_task``); ``UpstreamError`` when it
        breaks."""
        content = self.response.content
        while True:
            try:
                if content.exception() is not None and getattr(content, "_buffer", None):
                    # aiohttp raises a broken connection's error before handing out the bytes
                    # that came ahead of it (its private buffer, checked by
                    # tests/unit/test_router_legs.py): those go out first, as the server sent them
                    chunk = content._read_nowait(-1)
                else:
                    chunk = await content.readany()
            except CLIENT_ERRORS as e:
                raise UpstreamError(e) from e
            if not chunk:
                self.complete = True
                return
            yield chunk

    def failed(self, error: UpstreamError) -> LegResult:
        self.finish(False)
        if error.worker_gone:
            self.on_connect_error(self.worker, error.cause)
        message = (
            str(error)
            if isinstance(error, LegAborted)
            else f"{self.worker.role} {self.worker.url} failed: {error}"
        )
        logger.warning(message)
        return LegResult(None, error=message, timed_out=error.timed_out)

    def finish(self, ok: bool) -> None:
        if self.outcome is not None:
            return
        self.outcome = ok
        self.worker.breaker.record(ok)
        self.metrics.upstream_latency.labels(self.worker.role).observe(
            time.monotonic() - self.started
        )
        if not ok:
            self.metrics.upstream_errors.labels(self.worker.role).inc()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        tasks = [t for t in (self._result_task, self.headers_task) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks)
        for t in tasks:
            if not t.cancelled():
                t.exception()  # retrieved: an error here was already handled or is moot
        if self.response is not None:
            if self.complete:
                self.response.release()  # back to the pool for the next leg
            else:
                self.response.close()  # drops the connection: the server cancels the request
        self.worker.in_flight -= 1
        self.worker.legs.discard(self)
        if self.dp_rank is not None:
            self.worker.group_in_flight[self.dp_rank] -= 1
        if self.outcome is None:
            self.worker.breaker.trial_in_flight = False  # abandoned, not failed


class EventReader:
    """Hands out decode's stream bytes cut at SSE event boundaries, so an upstream that dies
    mid-event never leaves half an event in front of the router's error event."""

    def __init__(self, chunks: AsyncIterator[bytes]):
        self.chunks = chunks
        self.buf = bytearray()
        self.eof = False

    async def next(self) -> bytes:
        """The next whole events (or the unterminated tail at the end); b"" when finished."""
        while True:
            cut = event_boundary(self.buf)
            if cut:
                out = bytes(self.buf[:cut])
                del self.buf[:cut]
                return out
            if self.eof:
                out = bytes(self.buf)
                self.buf.clear()
                return out
            try:
                self.buf += await self.chunks.__anext__()
            except StopAsyncIteration:
                self.eof = True


async def wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class ProxyStream(StreamingResponse):
    """A streaming response that stops as soon as the client disconnects. ``on_close`` runs
    once it is over, however it ended (also when it is never sent: call ``abandon``)."""

    def __init__(self, content, *, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def abandon(self) -> None:
        await self.body_iterator.aclose()
        await self.on_close()

    async def __call__(self, scope, receive, send) -> None:
        """Send the stream in this task; a watcher task cancels it when the client disconnects."""
        me = asyncio.current_task()
        left = False

        async def watch() -> None:
            nonlocal left
            await wait_disconnect(receive)
            left = True
            me.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left:
                raise
            me.uncancel()
        except OSError as e:
            logger.debug("client went away while streaming: %r", e)
        finally:
            watcher.cancel()
            await self.abandon()
