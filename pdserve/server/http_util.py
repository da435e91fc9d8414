"""HTTP plumbing shared by the native and OpenAI routes: bodies, JSON, SSE, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pdserve import json_body
from pdserve.server.errors import APIError, bad_request, from_abort
from pdserve.server.tokenizer_manager import ReqState, TokenizerManager

logger = logging.getLogger(__name__)
T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"


async def read_body(request: Request, max_bytes: int, type_: type[T]) -> T:
    """Read and decode a JSON body into ``type_``: 413 when larger than ``max_bytes``, 400 when
    malformed or of the wrong shape (the message names the field)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(
            413, f"request body of {declared} bytes exceeds the limit of {max_bytes} bytes"
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise bad_request("request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as e:
        raise bad_request(f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise bad_request(_undecodable(body, e)) from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None


def _undecodable(body: bytes, error: Exception) -> str:
    """What is wrong with a body msgspec could not read: Python's laxer reader may still read it
    (a lone surrogate, a number beyond a float), and then the field can be named."""
    try:
        problem = json_body.problem(json.loads(body))
    except (ValueError, RecursionError):
        problem = None
    return problem or f"malformed JSON: {error}"


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def sse_event(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def sse_named_event(kind: str, obj: Any) -> bytes:
    """An event with its type on an ``event:`` line (the Responses and Messages APIs)."""
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(obj) + b"\n\n"


class _SSEResponse(StreamingResponse):
    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(
            _guarded(events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()  # synchronous: runs even when the stream was cancelled


def sse_response(
    tm: TokenizerManager, states: list[ReqState], events: AsyncIterator[bytes]
) -> StreamingResponse:
    """Stream ``events``; whatever ends the stream (finish, error, client gone), requests of
    ``states`` that did not finish are aborted."""
    return _SSEResponse(events, on_close=lambda: tm.release(states))


async def _guarded(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Once a stream has started, a failure can only be reported as an SSE error event."""
    try:
        async for event in events:
            yield event
    except APIError as e:
        yield e.sse()
    except Exception as e:
        logger.exception("stream failed")
        yield APIError(500, f"internal error: {e!r}").sse()


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; if the client goes away first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise APIError(499, "client disconnected")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def wait_all(tm: TokenizerManager, states: list[ReqState]) -> list[ReqState]:
    """Wait until every state finished; raises the first error an abort stands for."""
    await asyncio.gather(*(tm.wait(s) for s in states))
    raise_if_failed(states)
    return states


def error_of(state: ReqState) -> Optional[APIError]:
    """The error a finished state's abort stands for (None when it ended normally)."""
    return from_abort(state.finish_reason) if state.finished else None


def raise_if_failed(states: list[ReqState]) -> None:
    for s in states:
        err = error_of(s)
        if err is not None:
            raise err


async def stream_all(
    tm: TokenizerManager, states: list[ReqState]
) -> AsyncIterator[tuple[int, ReqState]]:
    """``(index, state)`` after each update of any of ``states`` until all finished.

    Stopping early (client gone, an error) aborts the ones still running."""
    if len(states) == 1:
        async for s in tm.updates(states[0]):
            yield 0, s
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, state: ReqState) -> None:
        try:
            async for s in tm.updates(state):
                queue.put_nowait((i, s))
        finally:
            queue.put_nowait((i, end))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(states)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
