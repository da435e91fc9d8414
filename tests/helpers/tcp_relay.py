"""A fault-injecting TCP relay for the faults that ``tc tbf`` and a downed link cannot make.

``Relay(listen_host, target_host, target_port).start()`` accepts connections on
``listen_host:relay.port`` and forwards each to the target, both directions, from an asyncio loop
in a daemon thread. The mode applies to every connection, current and new, and can change at any
time from the test:

- ``passthrough()``: forward as read;
- ``delay(ms)``: forward every chunk ``ms`` milliseconds after it arrived (added one-way
  latency in both directions, like ``netem delay``; throughput is not limited);
- ``stall()``: stop forwarding (and reading, so TCP flow control pushes back on the sender) until
  the mode changes: a peer that went silent with its connection still open;
- ``reset()``: abort every open connection with a TCP RST on both sides (new connections are
  accepted as before): dropped connections.

``stats()`` counts connections and bytes. Nothing here knows about HTTP or pdserve.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from typing import Optional


class Relay:
    def __init__(self, listen_host: str, target_host: str, target_port: int, listen_port: int = 0):
        self.listen_host, self.listen_port = listen_host, listen_port
        self.target = (target_host, target_port)
        self.port = 0
        self._delay_s = 0.0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._open: Optional[asyncio.Event] = None  # set: forwarding; clear: stalled
        self._server: Optional[asyncio.AbstractServer] = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._thread: Optional[threading.Thread] = None
        self.counts = {"connections": 0, "bytes_up": 0, "bytes_down": 0, "resets": 0}

    # -- control (any thread) -------------------------------------------------------------------
    def start(self) -> "Relay":
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._open = asyncio.Event()
            self._open.set()
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._accept, self.listen_host, self.listen_port)
            )
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="tcp-relay", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the relay did not start")
        return self

    @property
    def url(self) -> str:
        return f"http://{self.listen_host}:{self.port}"

    def passthrough(self) -> None:
        self._call(self._set, 0.0, True)

    def delay(self, ms: float) -> None:
        self._call(self._set, ms / 1000.0, True)

    def stall(self) -> None:
        self._call(self._set, self._delay_s, False)

    def reset(self) -> int:
        """RST every open connection; returns how many were open."""
        return self._call(self._reset_all)

    def stats(self) -> dict:
        return dict(self.counts, open=len(self._conns))

    def stop(self) -> None:
        if self._loop is None:
            return
        self._call(self._reset_all)
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop = None

    def _call(self, fn, *args):
        async def run():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    # -- inside the loop ------------------------------------------------------------------------
    def _set(self, delay_s: float, forwarding: bool) -> None:
        self._delay_s = delay_s
        (self._open.set if forwarding else self._open.clear)()

    def _reset_all(self) -> int:
        n = 0
        for w in list(self._conns):
            sock = w.get_extra_info("socket")
            if sock is not None:  # linger 0: close() sends RST instead of FIN
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.transport.abort()
            n += 1
        self._conns.clear()
        self.counts["resets"] += n
        return n

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            target_r, target_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.transport.abort()
            return
        self.counts["connections"] += 1
        self._conns.update((client_w, target_w))
        await asyncio.gather(
            self._pipe(client_r, target_w, "bytes_up"), self._pipe(target_r, client_w, "bytes_down")
        )
        for w in (client_w, target_w):
            self._conns.discard(w)
            w.close()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counter: str
    ) -> None:
        """Chunks are read as they come and each is written ``delay`` after it arrived (added
        latency, like ``netem delay``, not a rate limit); b"" marks the end of the stream."""
        queue: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            data = b""
            try:
                while True:
                    await self._open.wait()
                    data = await reader.read(65536)
                    if not data:
                        break
                    queue.put_nowait((self._loop.time(), data))
            except (ConnectionError, OSError):
                data = b""
            queue.put_nowait((self._loop.time(), data))

        reading = asyncio.ensure_future(read())
        try:
            while True:
                arrived, data = await queue.get()
                wait = arrived + self._delay_s - self._loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._open.wait()
                if not data:
                    break
                writer.write(data)
                await writer.drain()
                self.counts[counter] += len(data)
            if writer in self._conns and writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError, RuntimeError):
            if writer in self._conns:
                writer.transport.abort()
        finally:
            reading.cancel()
