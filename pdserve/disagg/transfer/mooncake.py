"""``mooncake`` backend: the Mooncake Transfer Engine, prefill and decode on any hosts.

One ``TransferEngine`` per backend object (one per scheduler rank), initialised with
``P2PHANDSHAKE`` metadata: no metadata server, each engine listens on its own RPC port and its
session id ``host:rpc_port`` travels to the peer in ``Register`` (``describe()``/``connect()``).
Protocol ``--disaggregation-mooncake-protocol`` (default ``rdma`` when the host has an RDMA
device, else ``tcp``); ``--disaggregation-ib-device`` picks the NICs for ``rdma``.

Memory: prefill registers every KV, aux and state region in ONE ``batch_register_memory`` call
at start-up. Decode on CPU keeps its pool and metadata buffers in memfd files and registers one
window of them per prefill session instead (``window.py``): fencing a session unregisters its
window, so the TCP receiver refuses any later write header into it (it checks every header
against the registered buffers) and the connection closes, and remaps it to scratch memory, so a
write whose header was accepted before the fence finishes there. Decode's device memory
(GPUDirect RDMA) is registered directly, without windows.

Writes are one-sided pushes, ``batch_transfer_sync_write`` (the GIL is released while it runs),
split into calls of at most ``MAX_DESCRIPTORS_PER_CALL`` descriptors: a call larger than the
engine's per-peer queue (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` /
``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER``) fails AND leaves that peer's TCP lane unusable for
later calls, so this module also raises both limits (unless the environment sets them) before it
creates an engine, which covers several worker threads writing to one peer at once. A non-zero
return code becomes a ``TransferError`` naming the peer, which fails the room.

Install: ``pip install 'pdserve[mooncake]'`` (``mooncake-transfer-engine``, CUDA hosts) or
``pip install 'pdserve[mooncake-cpu]'`` (``mooncake-transfer-engine-non-cuda``) plus
``apt-get install -y --no-install-recommends libibverbs1``; see scripts/install.sh.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any, Optional

import numpy as np

from pdserve.disagg.transfer.base import (
    CompletedHandle,
    TransferBackend,
    TransferError,
    TransferHandle,
)
from pdserve.disagg.transfer.window import Window, memfd_allocator
from pdserve.engine.kv_pool import BufferAllocator

try:
    from mooncake.engine import TransferEngine
except ImportError as e:  # the registry turns this into "backend 'mooncake' is not available: ..."
    hint = (
        "apt-get install -y --no-install-recommends libibverbs1"
        if "libibverbs" in str(e)
        else "pip install 'pdserve[mooncake]' (GPU hosts) "
        "or 'pdserve[mooncake-cpu]' (CPU-only hosts)"
    )
    raise ImportError(
        f"mooncake-transfer-engine cannot be imported ({e}); install it with: {hint}"
    ) from e

logger = logging.getLogger(__name__)

MAX_DESCRIPTORS_PER_CALL = 512
# set before the first engine is created unless the environment already has them
ENGINE_ENV_DEFAULTS = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    "MC_LOG_LEVEL": "WARNING",  # the engine logs every segment it opens at INFO
}
PROTOCOLS = ("tcp", "rdma")


def rdma_devices() -> list[str]:
    """Names of the host's RDMA devices (``/sys/class/infiniband``), e.g. ``["mlx5_0"]``."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def local_host(server_args: Any) -> str:
    """The address peers use to reach this engine: ``--host`` unless it is a wildcard, else the
    address of this host's name (loopback when it has none)."""
    host = str(getattr(server_args, "host", "") or "")
    if host and host not in ("0.0.0.0", "::"):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class MooncakeBackend(TransferBackend):
    name = "mooncake"

    def __init__(self, role: str, device: str = "cpu", **options: Any):
        super().__init__(role, device, **options)
        sa = options.get("server_args")
        protocol = options.get("protocol") or getattr(sa, "disaggregation_mooncake_protocol", None)
        self.protocol = (protocol or ("rdma" if rdma_devices() else "tcp")).lower()
        if self.protocol not in PROTOCOLS:
            raise ValueError(
                f"disaggregation_mooncake_protocol: must be one of {PROTOCOLS}, got {protocol!r}"
            )
        self.ib_device = (
            options.get("ib_device") or getattr(sa, "disaggregation_ib_device", None) or ""
        )
        if str(device).startswith("cuda") and self.protocol == "tcp":
            logger.warning(
                "Mooncake over tcp with the KV pool in GPU memory: Mooncake's maintainers do not "
                "support GPU buffers over tcp; use --disaggregation-mooncake-protocol rdma with "
                "GPUDirect"
            )
        self.max_descriptors = int(
            options.get("max_descriptors_per_call", MAX_DESCRIPTORS_PER_CALL)
        )
        host = options.get("host") or local_host(sa)
        for key, value in ENGINE_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        self.engine = TransferEngine()
        rc = self.engine.initialize(
            host, "P2PHANDSHAKE", self.protocol, self.ib_device if self.protocol == "rdma" else ""
        )
        if rc != 0:
            raise TransferError(
                f"Mooncake TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', {self.protocol!r}, "
                f"{self.ib_device!r}) failed with return code {rc}"
            )
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._sessions: dict[str, str] = {}  # peer_id -> the peer engine's session id
        self._closed = threading.Event()
        logger.info(
            "Mooncake engine %s (%s%s)",
            self.session_id,
            self.protocol,
            f", devices {self.ib_device}" if self.ib_device else "",
        )

    supports_windows = True

    @classmethod
    def buffer_allocator(cls, device: Optional[str] = None) -> BufferAllocator:
        return memfd_allocator

    # ---- lifecycle ---------------------------------------------------------------------
    def _register_window(self, win: Window, regions: list[tuple[int, int]]) -> None:
        rc = self.engine.batch_register_memory([p for p, _ in regions], [n for _, n in regions])
        if rc != 0:
            raise TransferError(
                f"Mooncake batch_register_memory of a window ({len(regions)} regions) failed "
                f"with return code {rc}"
            )
        win.registered = [p for p, _ in regions]

    def _unregister_window(self, win: Window) -> None:
        ptrs = win.registered or []
        if ptrs:
            rc = self.engine.batch_unregister_memory(ptrs)
            if rc != 0:
                logger.warning(
                    "Mooncake batch_unregister_memory of window %s returned %d", win.key, rc
                )
            win.registered = []

    def _register(self, regions: list[tuple[int, int]]) -> None:
        regions = [(int(p), int(n)) for p, n in regions if n > 0]
        if not regions:
            return
        ptrs, lens = [p for p, _ in regions], [n for _, n in regions]
        rc = self.engine.batch_register_memory(ptrs, lens)
        if rc != 0:
            raise TransferError(
                f"Mooncake batch_register_memory of {len(ptrs)} regions "
                f"({sum(lens)} bytes) failed with return code {rc}"
            )
        self._registered = ptrs

    def describe(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "protocol": self.protocol}

    def _connect(self, peer_id: str, info: dict[str, Any]) -> None:
        session = info.get("session_id")
        if not session:
            raise TransferError(
                "peer described no Mooncake session id (is decode using the mooncake backend?)"
            )
        if info.get("protocol", self.protocol) != self.protocol:
            raise TransferError(
                f"Mooncake protocol mismatch: this side {self.protocol}, peer {info['protocol']}"
            )
        with self._lock:
            self._sessions[peer_id] = session

    def _disconnect(self, peer_id: str) -> None:
        with self._lock:
            self._sessions.pop(peer_id, None)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        super().close()
        if self._registered:
            rc = self.engine.batch_unregister_memory(self._registered)
            if rc != 0:
                logger.warning("Mooncake batch_unregister_memory returned %d", rc)
            self._registered = []

    # ---- data path -----------------------------------------------------------------------
    def _write(
        self, peer_id: str, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray
    ) -> TransferHandle:
        with self._lock:
            session = self._sessions.get(peer_id)
        if session is None:
            raise TransferError(f"not connected to peer {peer_id}")
        step = self.max_descriptors
        for i in range(0, len(src), step):
            rc = self.engine.batch_transfer_sync_write(
                session,
                src[i : i + step].tolist(),
                dst[i : i + step].tolist(),
                lengths[i : i + step].tolist(),
            )
            if rc != 0:
                n = len(src)
                return CompletedHandle(
                    f"Mooncake write to {session} failed (return code {rc}) at descriptors "
                    f"{i}..{min(i + step, n) - 1} of {n}: peer unreachable, exited, or "
                    "destination not registered there"
                )
        return CompletedHandle()
