"""The front end's side of the scheduler link: the scheduler processes (one per tensor-parallel
rank) and rank 0's two ZMQ sockets.

With ``--nnodes N`` this node starts only its own ranks (``nodes.NodeLayout``), the outputs come
over TCP (``--dist-init-addr``'s port + 1, bound on node 0) and rank 0's ready message stands for
every rank of every node (they exchange their start-up outcome first); a node other than 0 has
no sockets, only its ranks.

Contract with a scheduler process (``entry(server_args, in_addr, out_addr, ready_conn, tp_rank,
tp_init)``; ranks join each other at ``tp_init``):
- the front end binds a PULL socket on ``out_addr`` once it started the processes; the scheduler
  binds a PULL on ``in_addr`` (``GenerateReq`` / ``AbortReq`` / ``ControlReq``) and connects a
  PUSH to ``out_addr`` (``BatchOut`` / ``ControlResp``), msgpack as in ``messages.py``;
- every rank sends exactly one dict on its ``ready_conn``: ``{"status": "ready", "info": {...}}`` or
  ``{"status": "error", "message": ...}``, and a rank that loses a peer of a multi-host server a
  last ``{"status": "lost", "message": ...}`` naming it;
- every ``GenerateReq`` ends with a ``TokenOut`` carrying a finish reason, also after an abort;
- every ``ControlReq`` gets one ``ControlResp`` with the same ``req_id``.

- it exits by itself when its parent (the front end) disappears (the entry arms
  ``lifetime.end_with_parent``), so a SIGKILLed front end leaves no orphan; on a normal exit the
  front end terminates it (``stop``: SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import zmq
import zmq.asyncio

from pdserve import envs
from pdserve.lifetime import name_process
from pdserve.ports import reserve_port
from pdserve.server.messages import (
    AbortReq,
    BatchOut,
    ControlReq,
    ControlResp,
    GenerateReq,
    TokenOut,
    decode_from_scheduler,
    encode,
)
from pdserve.server.nodes import NodeLayout, zmq_ipv6

logger = logging.getLogger(__name__)

DEFAULT_ENTRY = "pdserve.server.scheduler_process:run_scheduler_process"


def _load_entry(spec: str) -> Callable:
    module, _, func = spec.partition(":")
    return getattr(importlib.import_module(module), func)


def _scheduler_main(
    entry: str, server_args, in_addr: str, out_addr: str, ready_conn, tp_rank: int, tp_init: str
) -> None:
    # a rank forked from the front end starts with its signal handlers: back to a new process's
    name_process(f"pdserve-tp{tp_rank}")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        fn = _load_entry(entry)
    except Exception as e:  # an import error must still reach the front end as a message
        ready_conn.send(
            {"status": "error", "message": f"cannot load scheduler entry {entry!r}: {e!r}"}
        )
        raise
    fn(server_args, in_addr, out_addr, ready_conn, tp_rank, tp_init)


def _log_send_error(fut: "asyncio.Future") -> None:
    if not fut.cancelled() and fut.exception() is not None:
        logger.error("send to the scheduler failed: %r", fut.exception())


class SchedulerClient:
    """Starts the scheduler process and routes its outputs to per-request callbacks."""

    def __init__(self, server_args, entry: str = DEFAULT_ENTRY):
        self.server_args = server_args
        self.entry = entry
        self.layout = NodeLayout.from_args(server_args)
        self._ipc_dir = tempfile.mkdtemp(prefix="pdserve-")
        self.in_addr = f"ipc://{self._ipc_dir}/in"  # rank 0's, always next to the front end
        self.out_addr = self.layout.output_address or f"ipc://{self._ipc_dir}/out"
        self.procs: list[mp.process.BaseProcess] = []  # one per tensor-parallel rank of this node
        self.ranks: list[int] = []  # their global ranks
        self._ready_readers: list = []  # one pipe per process: its ready message (and a last word)
        self.info: dict[str, Any] = {}
        self._ctx: Optional[zmq.asyncio.Context] = None
        self._pull = self._push = None
        self._control_ids = itertools.count(1)
        self._control_waiters: dict[int, asyncio.Future] = {}
        self.on_output: Callable[[TokenOut], None] = lambda out: None
        self._recv_task: Optional[asyncio.Task] = None
        self._init_port: Optional[socket.socket] = (
            None  # the rendezvous port, held until every rank joined
        )

    # ---- processes ---------------------------------------------------------------------------
    @property
    def proc(self) -> Optional[mp.process.BaseProcess]:
        """Rank 0's process (the one the front end talks to)."""
        return self.procs[0] if self.procs else None

    def start_process(self) -> None:
        """Start this node's ranks, then bind the output socket (the group leaders connect to it:
        ZMQ connects whichever comes first). The sockets come after the ranks because ranks may
        be forked from this process, which must not hold a ZMQ context then."""
        ctx = self._rank_context(len(list(self.layout.ranks())))
        n = getattr(self.server_args, "world_size", 1)  # one process per rank (tp_size x pp_size)
        tp_init = self.layout.init_address
        if not tp_init and n > 1:
            self._init_port = reserve_port()
            tp_init = f"tcp://127.0.0.1:{self._init_port.getsockname()[1]}"
        self._ready_readers = []
        for rank in self.layout.ranks():
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_scheduler_main,
                args=(
                    self.entry,
                    self.server_args,
                    self.in_addr,
                    self.out_addr,
                    writer,
                    rank,
                    tp_init,
                ),
                name=f"pdserve-scheduler-tp{rank}",
            )
            proc.start()
            writer.close()
            self.procs.append(proc)
            self.ranks.append(rank)
            self._ready_readers.append(reader)
            logger.info("scheduler process tp%d started (pid %d)", rank, proc.pid)
        if self.layout.node_rank == 0:  # the front end's node
            self._ctx = zmq.asyncio.Context()
            self._pull = self._ctx.socket(zmq.PULL)
            if self.layout.multi_node:
                self._pull.setsockopt(zmq.IPV6, int(zmq_ipv6(self.out_addr)))
                self._pull.bind(self.layout.output_bind_address())
            else:
                self._pull.bind(self.out_addr)
            self._push = self._ctx.socket(zmq.PUSH)
            self._push.setsockopt(zmq.LINGER, 0)
            self._push.connect(self.in_addr)

    def _rank_context(self, ranks: int):
        """How this node's ranks start: several CPU ranks are forked from this process once it
        imported the entry (torch and the engine: about 2 CPU seconds that every spawned rank
        spends again), and so is one rank where this process has the entry imported already (a
        process that embeds the server); otherwise one rank is spawned (a fresh interpreter: the
        front end stays without torch). This process has run no torch operation and holds no ZMQ
        context or thread of its own by then (``envs.rank_start_method``). GPU ranks are spawned:
        this process may have asked CUDA for its devices (``--device auto``), and a CUDA driver
        initialized before a fork does not work in the child."""
        try:
            method = envs.rank_start_method()
        except ValueError as e:
            raise RuntimeError(str(e)) from None
        cpu = getattr(self.server_args, "device", "cpu") == "cpu"  # CUDA does not survive a fork
        imported = self.entry.partition(":")[0] in sys.modules
        if (
            (ranks > 1 or imported)
            and cpu
            and method == "fork"
            and "fork" in mp.get_all_start_methods()
        ):
            try:
                _load_entry(self.entry)
            except Exception:  # spawned, the rank reports it as its start-up error
                return mp.get_context("spawn")
            return mp.get_context("fork")
        return mp.get_context("spawn")

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Block until every rank of this node reports ready (rank 0: every rank of every node);
        raises RuntimeError on an error, a death or timeout."""
        try:
            return self._wait_ready(timeout)
        finally:
            # joined (a rank is ready only after it joined) or failed: the port is rank 0's now
            if self._init_port is not None:
                self._init_port.close()
                self._init_port = None

    def _wait_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        infos = []
        for rank, proc, reader in zip(self.ranks, self.procs, self._ready_readers):
            while not reader.poll(0.2):
                dead = next((i for i, p in enumerate(self.procs) if not p.is_alive()), None)
                if (
                    dead is not None
                ):  # its error message, when it left one, says more than its exit code
                    try:
                        said = (
                            self._ready_readers[dead].poll(0) and self._ready_readers[dead].recv()
                        )
                    except (EOFError, OSError):
                        said = None
                    if said and said.get("status") == "error":
                        raise RuntimeError(
                            f"scheduler tp{self.ranks[dead]} failed to start: {said.get('message')}"
                        )
                    p = self.procs[dead]
                    raise RuntimeError(
                        f"scheduler process {p.name} exited with code {p.exitcode} before ready"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"scheduler tp{rank} not ready after {timeout:.0f}s")
            try:
                msg = reader.recv()
            except EOFError:
                raise RuntimeError(
                    f"scheduler tp{rank} closed its ready pipe without a message"
                ) from None
            if msg.get("status") != "ready":
                raise RuntimeError(f"scheduler tp{rank} failed to start: {msg.get('message', msg)}")
            infos.append(dict(msg.get("info") or {}))
        self.info = infos[0]
        return self.info

    def is_alive(self) -> bool:
        """Every rank is running (one dead rank stops the whole server)."""
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def sentinels(self) -> list[int]:
        return [p.sentinel for p in self.procs]

    def exit_codes(self) -> str:
        return ", ".join(f"{p.name} {p.exitcode}" for p in self.procs if not p.is_alive())

    def exit_reason(self) -> str:
        """Why the ranks here exited: the lost peer a rank named before it went (multi-host), else
        their exit codes."""
        said = []
        for rank, reader in zip(self.ranks, self._ready_readers):
            try:
                while reader.poll(0):
                    msg = reader.recv()
                    if msg.get("status") == "lost":
                        said.append(f"tp{rank}: {msg.get('message')}")
            except (EOFError, OSError):
                pass
        return "; ".join(said[:1]) or f"scheduler process exited ({self.exit_codes() or 'unknown'})"

    def stop(self, timeout: float = 10.0) -> None:
        if self._init_port is not None:
            self._init_port.close()
            self._init_port = None
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                logger.warning("scheduler %s did not exit after SIGTERM; killing it", p.name)
                p.kill()
                p.join(5)
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        for name in ("in", "out"):
            try:
                os.unlink(os.path.join(self._ipc_dir, name))
            except FileNotFoundError:
                pass
        try:
            os.rmdir(self._ipc_dir)
        except OSError:
            pass

    # ---- messages ----------------------------------------------------------------------
    def start_receiving(self) -> None:
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def _recv_loop(self) -> None:
        while True:
            data = await self._pull.recv()
            try:
                msg = decode_from_scheduler(data)
            except Exception:
                logger.exception("undecodable message from the scheduler (%d bytes)", len(data))
                continue
            if isinstance(msg, BatchOut):
                for out in msg.outs:
                    self.on_output(out)
            elif isinstance(msg, ControlResp):
                fut = self._control_waiters.pop(msg.req_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def send(self, msg: GenerateReq | AbortReq | ControlReq | bytes) -> None:
        """Queue ``msg`` (or a message already encoded) for the scheduler without waiting (order
        is kept; a PUSH never blocks here)."""
        fut = self._push.send(msg if isinstance(msg, bytes) else encode(msg))
        fut.add_done_callback(_log_send_error)

    async def control(self, op: str, args: Optional[dict] = None, timeout: float = 30.0) -> Any:
        """One synchronous control call; raises TimeoutError or RuntimeError (scheduler error)."""
        req_id = next(self._control_ids)
        fut = asyncio.get_running_loop().create_future()
        self._control_waiters[req_id] = fut
        try:
            self.send(ControlReq(req_id=req_id, op=op, args=args or {}))
            resp: ControlResp = await asyncio.wait_for(fut, timeout)
        finally:
            self._control_waiters.pop(req_id, None)
        if not resp.ok:
            raise RuntimeError(resp.error or f"control op {op!r} failed")
        return resp.result

    def fail_controls(self, reason: str) -> None:
        for fut in self._control_waiters.values():
            if not fut.done():
                fut.set_exception(RuntimeError(reason))
        self._control_waiters.clear()
