"""KV manager: one per scheduler rank; owns the control socket, the transfer backend and the
per-room state. The role-specific halves live in ``prefill_role.py`` and ``decode_role.py``, the
per-room handles the scheduler holds in ``sender.py`` and ``receiver.py``; ``fake.py`` has the
no-protocol variant used for warmup and scheduler tests.

Threads per manager:
- the caller's (scheduler) thread: constructs senders/receivers and calls their methods;
- one I/O thread: receives every control message on the PULL socket, answers handshakes and
  heartbeats, and runs periodic work (heartbeats, sweeps) through ``role.tick``;
- prefill only: transfer worker threads that turn chunks into backend writes;
- decode only: a small pool that does bootstrap look-ups and registration off the scheduler.
Shared state (status table, rooms, connections) is guarded by ``mgr.lock``; sockets to peers by
one lock each. Nothing here blocks the scheduler on the network.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, Optional

import zmq

from pdserve.config import server_option
from pdserve.disagg.faults import FaultInjector
from pdserve.disagg.kv_args import KVArgs
from pdserve.disagg.messages import AuthError, Message, MessageCodec, ProtocolError
from pdserve.disagg.poll import KVPoll, StatusTable
from pdserve.disagg.transfer.base import get_backend
from pdserve.host import route_ip

logger = logging.getLogger(__name__)

TICK_S = 0.05


def _is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")


class KVManager:
    def __init__(
        self,
        kv_args: KVArgs,
        mode: str,
        server_args: Any = None,
        backend_name: str = "local",
        bootstrap_host: Optional[str] = None,
    ):
        if mode not in ("prefill", "decode"):
            raise ValueError(f"mode: must be 'prefill' or 'decode', got {mode!r}")
        self.kv_args = kv_args
        self.mode = mode
        self.server_args = server_args
        self.backend_name = backend_name
        self.bootstrap_timeout = float(
            server_option(server_args, "disaggregation_bootstrap_timeout")
        )
        self.waiting_timeout = float(server_option(server_args, "disaggregation_waiting_timeout"))
        self.heartbeat_interval = float(
            server_option(server_args, "disaggregation_heartbeat_interval")
        )
        self.heartbeat_misses = int(server_option(server_args, "disaggregation_heartbeat_misses"))
        host = str(server_option(server_args, "host"))
        self.bootstrap_host = bootstrap_host or ("127.0.0.1" if _is_wildcard(host) else host)
        self.bootstrap_port = int(server_option(server_args, "disaggregation_bootstrap_port"))
        self.secret = server_option(server_args, "disaggregation_secret") or None
        self.codec = MessageCodec(self.secret.encode() if self.secret else None)
        self.faults = FaultInjector.from_args(server_args, kv_args.global_rank)
        self.rejected_messages = 0  # undecodable or unauthenticated control messages
        self.name = f"{mode}-tp{kv_args.engine_rank}"
        self.session_prefix = uuid.uuid4().hex[:12]

        self.lock = threading.RLock()
        self.status = StatusTable()
        self.backend = get_backend(backend_name)(
            mode, device=kv_args.device, server_args=server_args
        )
        self.backend.register_regions(kv_args.buffers())

        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._wildcard = _is_wildcard(host)
        self.port = self._pull.bind_to_random_port("tcp://*" if self._wildcard else f"tcp://{host}")
        self.ip = route_ip(self.bootstrap_host) if self._wildcard else host
        self._push: dict[str, tuple[zmq.Socket, threading.Lock]] = {}
        self._push_lock = threading.Lock()
        self._closed = threading.Event()

        if mode == "prefill":
            from pdserve.disagg.prefill_role import PrefillRole

            self.role: Any = PrefillRole(self)
        else:
            from pdserve.disagg.decode_role import DecodeRole

            self.role = DecodeRole(self)
        self._io = threading.Thread(target=self._io_loop, name=f"pd-io-{self.name}", daemon=True)
        self._io.start()
        if mode == "prefill":
            self.role.register_to_bootstrap()
        logger.info(
            "KV manager %s: control endpoint %s, backend %s",
            self.name,
            self.endpoint(),
            backend_name,
        )

    # ---- endpoints and sockets ------------------------------------------------------------
    def local_ip(self, peer_host: Optional[str] = None) -> str:
        """The address a peer on ``peer_host`` should dial to reach this rank."""
        return route_ip(peer_host) if (self._wildcard and peer_host) else self.ip

    def endpoint(self, peer_host: Optional[str] = None) -> str:
        """This rank's control endpoint (``tcp://ip:port``) as seen from ``peer_host``."""
        return f"tcp://{self.local_ip(peer_host)}:{self.port}"

    def send(self, endpoint: str, msg: Message) -> bool:
        """Queue ``msg`` to ``endpoint`` without blocking; False when it cannot be queued."""
        data = self.codec.encode(msg)
        with self._push_lock:
            if self._closed.is_set():
                return False
            entry = self._push.get(endpoint)
            if entry is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 100_000)
                sock.connect(endpoint)
                entry = self._push[endpoint] = (sock, threading.Lock())
        sock, lock = entry
        with lock:
            try:
                sock.send(data, zmq.NOBLOCK)
                return True
            except zmq.ZMQError as e:
                logger.warning(
                    "%s: cannot send %s to %s: %s", self.name, type(msg).__name__, endpoint, e
                )
                return False

    def drop_peer(self, endpoint: str) -> None:
        """Close the socket to a peer declared dead (a restarted peer gets a fresh one)."""
        with self._push_lock:
            entry = self._push.pop(endpoint, None)
        if entry is not None:
            with entry[1]:
                entry[0].close(linger=0)

    # ---- room status (callers may hold self.lock; it is re-entrant) -------------------------
    def get_status(self, room: int) -> Optional[KVPoll]:
        with self.lock:
            return self.status.get(room)

    def update_status(
        self, room: int, state: KVPoll, reason: str = "", create: bool = False
    ) -> bool:
        """Apply ``state``; True when the room's state changed."""
        with self.lock:
            changed = self.status.update(room, state, reason, create)
        if changed and state == KVPoll.Failed:
            logger.debug("%s: room %d failed: %s", self.name, room, reason)
        return changed

    def failure_reason(self, room: int) -> str:
        with self.lock:
            return self.status.reason(room)

    # ---- I/O thread -----------------------------------------------------------------------
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._closed.is_set():
            try:
                if poller.poll(int(TICK_S * 1000)):
                    while True:
                        try:
                            data = self._pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._dispatch(data)
                self.role.tick(time.monotonic())
            except zmq.ZMQError:
                if self._closed.is_set():
                    return
                raise
            except Exception:  # keep the thread alive: one bad message must not stop the rank
                logger.exception("%s: error in the control loop", self.name)

    def _dispatch(self, data: bytes) -> None:
        try:
            msg = self.codec.decode(data)
        except ProtocolError as e:
            self.rejected_messages += 1
            n = self.rejected_messages
            if n <= 10 or n % 1000 == 0:  # a flood of bad messages must not flood the log
                kind = "rejected unauthenticated" if isinstance(e, AuthError) else "dropped"
                logger.warning("%s: %s control message (%d so far): %s", self.name, kind, n, e)
            return
        self.role.on_message(msg)

    def counts(self) -> dict:
        """Room and peer counts for integrity checks (no room may outlive its request)."""
        with self.lock:
            return {
                "kv_rooms": len(self.status),
                **self.role.counts(),
                "rejected_control_messages": self.rejected_messages,
            }

    # ---- shutdown -------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._io.join(timeout=5)
        self.role.close()
        self.backend.close()
        with self._push_lock:  # no socket is created after this (send() checks _closed)
            socks = list(self._push.values())
            self._push.clear()
        for sock, lock in socks:
            with lock:
                sock.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()


# ---- factory ------------------------------------------------------------------------------

KV_CLASS_KINDS = ("kv_args", "manager", "sender", "receiver", "bootstrap_server")


def get_kv_class(backend: str, kind: str):
    """The class implementing ``kind`` for transfer backend ``backend``. ``fake`` gives the
    no-protocol Fake* classes (warmup, scheduler tests); every other backend shares the real
    manager/sender/receiver, which pick the backend by the name given to ``KVManager``."""
    from pdserve.disagg.transfer.base import backend_names

    if kind not in KV_CLASS_KINDS:
        raise ValueError(f"kind: must be one of {KV_CLASS_KINDS}, got {kind!r}")
    if backend not in backend_names():
        raise ValueError(
            f"unknown transfer backend {backend!r}; known: {', '.join(backend_names())}"
        )
    if kind == "kv_args":
        return KVArgs
    if kind == "bootstrap_server":
        from pdserve.disagg.bootstrap import BootstrapServer

        return BootstrapServer
    if backend == "fake":
        from pdserve.disagg import fake

        return {
            "manager": fake.FakeKVManager,
            "sender": fake.FakeKVSender,
            "receiver": fake.FakeKVReceiver,
        }[kind]
    if kind == "manager":
        return KVManager
    if kind == "sender":
        from pdserve.disagg.sender import KVSender

        return KVSender
    from pdserve.disagg.receiver import KVReceiver

    return KVReceiver


def buffer_allocator(backend: str, mode: str):
    """The ``BufferAllocator`` for this side's KV pool and ``MetadataBuffers``: the written side
    (decode) needs backend-visible memory (shared memory for ``local``); prefill and the fake
    backend use ordinary memory."""
    from pdserve.engine.kv_pool import default_allocator

    if mode != "decode" or backend == "fake":
        return default_allocator
    return get_backend(backend).buffer_allocator()
