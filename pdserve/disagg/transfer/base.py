"""Transfer backend interface and registry.

Contract (one backend object per KV manager, i.e. per scheduler rank):

1. ``register_regions(regions)``: the (ptr, nbytes) ranges of this rank's own KV / aux / state
   buffers. Sources of writes must lie inside them. The caller keeps the memory alive until
   ``close()``.
2. ``describe()``: a msgpack-able dict sent to the peer inside ``Register.backend_info`` (for the
   local backend the shared-memory segments; for RDMA backends an agent/session description).
3. ``connect(peer_id, info, regions)``: the writer side (prefill) attaches to a peer from its
   ``describe()`` output; ``regions`` are the peer's registered buffers (from ``Register``).
   Every later write to that peer is checked against them before any byte moves.
4. ``write(peer_id, src, dst, lengths)``: submit one batch of one-sided writes (numpy int64
   arrays of equal length). Returns a ``TransferHandle``; ``wait()`` raises ``TransferError`` on
   failure. Writes of one batch may land in any order; a later batch starts only after the caller
   waited for the earlier one, which is how "bootstrap_room last" is ordered.
5. ``disconnect(peer_id)`` / ``close()``: detach from a peer / deregister everything. ``close``
   of the side that owns shared buffers also releases them (e.g. unlinks shm segments).
6. Written side, backends with ``supports_windows``: ``open_window(key)`` gives one peer session
   its own view of the registered buffers (``window.py``; the peer is told only its window's
   addresses, and only windows are registered); ``fence_window(key)`` deregisters it and points
   it at scratch memory, after which no write of that session, however late, reaches the
   buffers. ``open_window`` returns None where windows are impossible (device memory), and the
   buffers themselves are registered as before.

Threading: ``write`` and ``wait`` may be called from several transfer worker threads at once,
``connect``/``disconnect`` from the manager's I/O thread; implementations lock what they share.
Backends never know about requests, rooms or layouts: the KV manager turns pages into
(src, dst, len) descriptors.

``buffer_allocator(device)`` returns the ``BufferAllocator`` the *written* side (decode) must use
for its KV pool and metadata buffers so that they are visible to the backend.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Optional, Sequence

import numpy as np

from pdserve.disagg.transfer.window import Window, forget_files, windows_possible
from pdserve.engine.kv_pool import BufferAllocator, default_allocator


class TransferError(RuntimeError):
    pass


class TransferHandle:
    """Completion of one submitted batch."""

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self, timeout: Optional[float] = None) -> None:
        raise NotImplementedError


class CompletedHandle(TransferHandle):
    """For backends that finish the batch inside ``write`` (or fail it there)."""

    def __init__(self, error: Optional[str] = None):
        self.error = error

    def done(self) -> bool:
        return True

    def wait(self, timeout: Optional[float] = None) -> None:
        if self.error:
            raise TransferError(self.error)


class RegionSet:
    """Sorted, merged address ranges; answers "does every [addr, addr+len) lie inside one range"
    for a whole batch at once."""

    def __init__(self, regions: Sequence[tuple[int, int]]):
        spans = sorted((int(p), int(p) + int(n)) for p, n in regions if n > 0)
        merged: list[list[int]] = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.starts = np.array([m[0] for m in merged], dtype=np.int64)
        self.ends = np.array([m[1] for m in merged], dtype=np.int64)

    def first_outside(self, addrs: np.ndarray, lens: np.ndarray) -> int:
        """Index of the first range not fully inside a region, or -1."""
        if len(addrs) == 0:
            return -1
        if len(self.starts) == 0:
            return 0
        i = np.searchsorted(self.starts, addrs, side="right") - 1
        ok = (i >= 0) & (lens > 0) & (addrs + lens <= self.ends[np.maximum(i, 0)])
        bad = np.flatnonzero(~ok)
        return int(bad[0]) if len(bad) else -1


class TransferBackend:
    name = "base"

    def __init__(self, role: str, device: str = "cpu", **options: Any):
        if role not in ("prefill", "decode"):
            raise ValueError(f"role: must be 'prefill' or 'decode', got {role!r}")
        self.role = role
        self.device = device
        self.options = options
        self._own = RegionSet([])
        self._own_regions: list[tuple[int, int]] = []
        self._windowed = False  # written side: peers write through windows only
        self._windows: dict[str, Window] = {}
        self._peers: dict[str, RegionSet] = {}
        self._lock = threading.Lock()

    @classmethod
    def buffer_allocator(cls, device: Optional[str] = None) -> BufferAllocator:
        return default_allocator

    # -- lifecycle ---------------------------------------------------------------------------
    def register_regions(self, regions: Sequence[tuple[int, int]]) -> None:
        self._own = RegionSet(regions)
        self._own_regions = [(int(p), int(n)) for p, n in regions if n > 0]
        self._windowed = (
            self.role == "decode" and self.supports_windows and windows_possible(self._own_regions)
        )
        if not self._windowed:
            self._register(list(regions))

    def describe(self) -> dict[str, Any]:
        return {}

    def connect(
        self, peer_id: str, info: dict[str, Any], regions: Sequence[tuple[int, int]]
    ) -> None:
        self._connect(peer_id, info)
        with self._lock:
            self._peers[peer_id] = RegionSet(regions)

    def disconnect(self, peer_id: str) -> None:
        with self._lock:
            self._peers.pop(peer_id, None)
        self._disconnect(peer_id)

    def close(self) -> None:
        for peer in list(self._peers):
            self.disconnect(peer)
        with self._lock:
            windows, self._windows = list(self._windows.values()), {}
        for win in windows:
            if not win.fenced:
                self._unregister_window(win)
            win.release()
        if self._windowed:
            forget_files(self._own_regions)  # the pools go with their last tensor (a role switch)

    # -- written side: one fenceable window per peer session ---------------------------------
    supports_windows = False

    def open_window(self, key: str) -> Optional[Window]:
        """A new window over every registered buffer for peer session ``key``, registered with
        the backend; None when this side registers its buffers directly (no windows)."""
        if not self._windowed:
            return None
        win = Window(key, self._own_regions)
        try:
            self._register_window(win, win.regions(self._own_regions))
        except BaseException:
            win.release()
            raise
        with self._lock:
            self._windows[key] = win
        return win

    def fence_window(self, key: str) -> bool:
        """Deregister session ``key``'s window and point it at scratch memory. True once fenced
        (also when it already was); False when there is no such window."""
        with self._lock:
            win = self._windows.get(key)
        if win is None:
            return False
        if not win.fenced:
            self._unregister_window(win)  # first: an RDMA NIC must lose the pages before the remap
            win.fence()
        return True

    # -- data path ---------------------------------------------------------------------------
    # Backends that can deliver a message to the written side once a write has landed
    # (``notify`` of ``write``; the peer reads them with ``take_notifications``).
    supports_notify = False

    def write(
        self,
        peer_id: str,
        src: np.ndarray,
        dst: np.ndarray,
        lengths: np.ndarray,
        notify: Optional[bytes] = None,
    ) -> TransferHandle:
        """Validate the whole batch, then hand it to the backend. Nothing moves if any
        descriptor is out of bounds. ``notify`` reaches the peer after the batch landed, on
        backends with ``supports_notify`` (ignored elsewhere)."""
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        if not (len(src) == len(dst) == len(lengths)):
            raise TransferError(
                f"descriptor arrays differ in length: {len(src)}, {len(dst)}, {len(lengths)}"
            )
        with self._lock:
            peer = self._peers.get(peer_id)
        if peer is None:
            raise TransferError(f"not connected to peer {peer_id}")
        bad = peer.first_outside(dst, lengths)
        if bad >= 0:
            raise TransferError(
                f"destination [{dst[bad]:#x}, +{lengths[bad]}) is outside the peer's "
                "registered buffers"
            )
        bad = self._own.first_outside(src, lengths)
        if bad >= 0:
            raise TransferError(
                f"source [{src[bad]:#x}, +{lengths[bad]}) is outside this rank's registered buffers"
            )
        if len(src) == 0:
            return CompletedHandle()
        if notify is not None and self.supports_notify:
            return self._write(peer_id, src, dst, lengths, notify=notify)
        return self._write(peer_id, src, dst, lengths)

    # -- what implementations provide --------------------------------------------------------
    def _register(self, regions: list[tuple[int, int]]) -> None:
        pass

    def _connect(self, peer_id: str, info: dict[str, Any]) -> None:
        pass

    def _disconnect(self, peer_id: str) -> None:
        pass

    def _register_window(self, win: Window, regions: list[tuple[int, int]]) -> None:
        raise NotImplementedError

    def _unregister_window(self, win: Window) -> None:
        """Must not raise: a failure is logged, and the remap still fences the window."""

    def _write(
        self, peer_id: str, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray
    ) -> TransferHandle:
        raise NotImplementedError


# name -> "module:Class", imported on first use so optional dependencies stay optional
_REGISTRY = {
    "local": "pdserve.disagg.transfer.local:LocalBackend",
    "fake": "pdserve.disagg.transfer.fake:FakeBackend",
    "mooncake": "pdserve.disagg.transfer.mooncake:MooncakeBackend",
    "nixl": "pdserve.disagg.transfer.nixl:NixlBackend",
}


def register_backend(name: str, target: str) -> None:
    """Add or replace a backend: ``target`` is ``"module:Class"``."""
    _REGISTRY[name] = target


def backend_names() -> list[str]:
    return list(_REGISTRY)


def get_backend(name: str) -> type[TransferBackend]:
    target = _REGISTRY.get(name)
    if target is None:
        raise ValueError(f"unknown transfer backend {name!r}; known: {', '.join(_REGISTRY)}")
    module, _, cls = target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"transfer backend {name!r} is not available: {e}") from e
    return getattr(mod, cls)
