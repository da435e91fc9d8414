"""``pdserve router --workers N``: N router processes on one port, sharing nothing.

Each process binds its own listening socket with ``SO_REUSEPORT``, so the kernel spreads new
client connections over them, and each runs the whole router: its own worker pool, health
checks, load polls, KV index, metrics. Any process can serve any request because nothing a
request needs lives in another process:

- PD pairing: a process picks prefill and decode and sends both the same fresh random
  ``bootstrap_room`` (63 bits); the servers meet on the room, never on router state;
- load: each process counts only its own legs in flight; ``least_load`` adds them to the load
  every worker reports on ``GET /get_load`` (polled by every process), which counts all
  routers' requests, so the processes' views differ only by what each sent since the last poll;
  ``round_robin`` and ``random`` need no shared counter to spread load evenly;
- the cache-aware index: every process subscribes to each worker's KV events itself (ZMQ
  PUB/SUB, any number of subscribers) and so builds the same index;
- health and circuit breakers: each process checks and counts failures on its own; a worker
  that dies is noticed by each process at its first failed leg or health check;
- membership: workers discovered through DNS (``--prefill-dns``/``--decode-dns``) are resolved by
  every process. A worker API call (``POST``/``DELETE /workers``) would reach one process only,
  so with N > 1 it is refused (409) naming DNS discovery; listing still works (per process).

What stays per process: ``/metrics`` and the in-flight counts in ``/server_info`` and
``/workers`` describe the process that answered (the kernel picks one per connection); the
workers' own metrics count the requests of every router process.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket

from pdserve import lifetime
from pdserve.router.protocol import error_body

logger = logging.getLogger(__name__)

MUTATING = ("POST", "PUT", "DELETE")
FROZEN = (
    "the worker list cannot change at run time with --workers N > 1: each router process keeps its "
    "own; let every process find workers through --prefill-dns/--decode-dns, or run one process"
)


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEPORT, for one of the router processes."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(addr)
    sock.set_inheritable(True)
    return sock


class FrozenMembership:
    """ASGI middleware: refuse worker API changes (see the module doc)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] in MUTATING
            and scope["path"].startswith("/workers")
        ):
            body = json.dumps(error_body(409, FROZEN, "invalid_request_error")).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 409,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def _child(args, index: int, parent_pid: int) -> None:
    lifetime.end_with_parent(parent_pid)
    from pdserve.router.app import serve  # imported here: app.py starts these processes

    serve(args, role=f"router-{index}", sockets=[reuse_port_socket(args.host, args.port)])


def run(args) -> int:
    """Start ``args.workers`` router processes and wait. SIGINT/SIGTERM stop them all; one that
    exits on its own stops the others too (exit code 1), so a supervisor sees the failure."""
    ctx = multiprocessing.get_context(
        "spawn"
    )  # a fresh interpreter each: no event loop or sockets inherited
    procs = [
        ctx.Process(target=_child, args=(args, i, os.getpid()), name=f"router-{i}")
        for i in range(args.workers)
    ]
    stopping = False

    def stop(signum, _frame) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                os.kill(p.pid, signal.SIGTERM)

    lifetime.handle_stop_signals(stop)
    for p in procs:
        p.start()
    logger.info("%d router processes on %s:%d (SO_REUSEPORT)", len(procs), args.host, args.port)
    sentinels = {p.sentinel: p for p in procs}
    failed = None
    while sentinels:
        for s in multiprocessing.connection.wait(list(sentinels)):
            p = sentinels.pop(s)
            p.join()
            if not stopping:
                failed = failed or p
                logger.error("%s exited with code %s; stopping the others", p.name, p.exitcode)
                stop(signal.SIGTERM, None)
    return 1 if failed is not None else 0
