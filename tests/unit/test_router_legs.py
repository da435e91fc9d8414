"""A leg's stream from a worker whose connection breaks: the bytes that came before the break
are handed out first, then the break is an ``UpstreamError`` that says the worker is gone."""

from __future__ import annotations

import asyncio
import types

import pytest

from pdserve.router.legs import Leg, UpstreamError, new_session
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers import DECODE, Worker

EVENT = b'data: {"text": "first"}\n\n'


async def _one_event_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    await reader.readexactly(2)  # the body: {}
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n" % (len(EVENT), EVENT)
    )  # one chunk, then the connection ends mid-stream
    await writer.drain()
    writer.close()


@pytest.mark.parametrize(
    "wait_s", [0.0, 0.3]
)  # 0.3: the chunk and the close are both in before the read
def test_bytes_before_a_broken_connection_come_out_first(wait_s):
    async def run():
        server = await asyncio.start_server(_one_event_then_close, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        worker = Worker(f"http://127.0.0.1:{port}", DECODE)
        gone = []
        session = new_session(10.0, {})
        try:
            leg = Leg(
                session,
                worker,
                "/generate",
                b"{}",
                {"content-type": "application/json"},
                lambda w, e: gone.append(e),
                RouterMetrics(types.SimpleNamespace(workers=[])),
            )
            resp = await leg.headers_task
            assert resp.status == 200
            await asyncio.sleep(wait_s)
            got = b""
            with pytest.raises(UpstreamError) as err:
                async for chunk in leg.chunks():
                    got += chunk
            assert got == EVENT
            assert err.value.worker_gone and not err.value.timed_out
            result = leg.failed(err.value)
            assert result.status is None and "failed:" in result.error and gone
            await leg.close()
            assert worker.in_flight == 0
        finally:
            await session.close()
            server.close()
            await server.wait_closed()

    asyncio.run(run())
