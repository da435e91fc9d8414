"""``local`` backend: prefill and decode on one host.

Decode places its KV pool and metadata buffers in shared memory with ``buffer_allocator()``:
on CPU a file in /dev/shm mapped with mmap and exposed as a uint8 tensor; on CUDA device memory
shared through CUDA IPC handles (``cuda_ipc.py``). ``describe()`` lists those segments;
prefill maps each one in ``connect()`` and writes with plain memmoves (or device copies), one
descriptor per page run, translating decode addresses to its own mapping. One-sided: decode's
CPU does nothing during a transfer.

One host means one kernel and one network namespace: ``describe()`` carries the kernel's boot id
and the network namespace of decode (``host_identity()``), and prefill refuses to attach to a
decode whose identity differs from its own, naming the network backends to use instead. Servers
in separate network namespaces behave as separate hosts (containers, the namespace tests).

Segment lifetime: a decode process unlinks its segment files in ``close()`` and at exit; files
left behind by a killed process are removed by the next process that allocates (names carry the
pid namespace and pid of their owner).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import mmap
import os
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from pdserve.disagg.transfer.base import (
    CompletedHandle,
    TransferBackend,
    TransferError,
    TransferHandle,
)
from pdserve.engine.kv_pool import BufferAllocator
from pdserve.host import host_identity

logger = logging.getLogger(__name__)

_PREFIX = "pdserve-kv"


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _pidns() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


# ---- decode side: segments this process created -------------------------------------------


@dataclass
class _Segment:
    kind: str  # "shm" | "cuda_ipc"
    name: str
    base: int
    size: int
    mm: Optional[mmap.mmap] = None
    share: Optional[dict[str, Any]] = None  # cuda_ipc: the handle fields
    unlinked: bool = False


_segments: list[_Segment] = []
_segments_lock = threading.Lock()
_swept = False


def _sweep_stale() -> None:
    """Remove segment files whose owner process (same pid namespace) no longer exists."""
    d, ns = _shm_dir(), _pidns()
    try:
        names = os.listdir(d)
    except OSError:
        return
    for name in names:
        parts = name.split("-")  # pdserve-kv-<ns>-<pid>-<rand>
        if (
            not name.startswith(_PREFIX + "-")
            or len(parts) != 5
            or parts[2] != ns
            or not parts[3].isdigit()
        ):
            continue
        try:
            os.kill(int(parts[3]), 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(d, name))
                logger.info("removed stale shared KV segment %s", name)
            except OSError:
                pass
        except PermissionError:
            pass  # alive, owned by someone else


def _unlink(seg: _Segment) -> None:
    if seg.kind == "shm" and not seg.unlinked:
        seg.unlinked = True
        try:
            os.unlink(os.path.join(_shm_dir(), seg.name))
        except FileNotFoundError:
            pass


@atexit.register
def _unlink_all() -> None:
    with _segments_lock:
        for seg in _segments:
            _unlink(seg)


def shm_allocator(nbytes: int, device: torch.device) -> torch.Tensor:
    """``BufferAllocator``: a zeroed uint8 tensor of ``nbytes`` in a shared segment."""
    global _swept
    device = torch.device(device)
    if device.type == "cuda":
        from pdserve.disagg.transfer import cuda_ipc

        tensor, share = cuda_ipc.allocate(nbytes, device)
        seg = _Segment(
            "cuda_ipc", f"cuda-{uuid.uuid4().hex[:12]}", tensor.data_ptr(), nbytes, share=share
        )
        with _segments_lock:
            _segments.append(seg)
        return tensor
    if device.type != "cpu":
        raise ValueError(f"local transfer backend: unsupported device {device}")
    with _segments_lock:
        if not _swept:
            _swept = True
            _sweep_stale()
    name = f"{_PREFIX}-{_pidns()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    path = os.path.join(_shm_dir(), name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        size = max(nbytes, 1)
        try:
            os.posix_fallocate(fd, 0, size)  # fail now (ENOSPC), not with SIGBUS on first touch
        except OSError as e:
            os.unlink(path)
            raise MemoryError(
                f"cannot reserve {nbytes} bytes of shared memory in {_shm_dir()}: {e}"
            ) from e
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    tensor = (
        torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
        if nbytes
        else torch.empty(0, dtype=torch.uint8)
    )
    seg = _Segment("shm", name, tensor.data_ptr() if nbytes else 0, nbytes, mm=mm)
    with _segments_lock:
        _segments.append(seg)
    return tensor


def _own_segments_for(regions: list[tuple[int, int]]) -> list[_Segment]:
    with _segments_lock:
        segs = list(_segments)
    used: dict[str, _Segment] = {}
    for ptr, n in regions:
        hit = next((s for s in segs if s.base <= ptr and ptr + n <= s.base + s.size), None)
        if hit is None:
            raise TransferError(
                f"buffer [{ptr:#x}, +{n}) is not in shared memory: allocate decode's KV pool and "
                "metadata buffers with get_backend('local').buffer_allocator()"
            )
        used[hit.name] = hit
    return list(used.values())


# ---- prefill side: mappings of a peer's segments -------------------------------------------


@dataclass
class _PeerMap:
    remote_starts: np.ndarray
    remote_ends: np.ndarray
    local_bases: np.ndarray
    kinds: list[str]
    keepalive: list[Any] = field(default_factory=list)  # mmaps / numpy views / cuda storages
    users: int = 0
    closed: bool = False


class LocalBackend(TransferBackend):
    name = "local"

    def __init__(self, role: str, device: str = "cpu", **options: Any):
        super().__init__(role, device, **options)
        self._own_segments: list[_Segment] = []
        self._maps: dict[str, _PeerMap] = {}
        self._cond = threading.Condition(self._lock)

    @classmethod
    def buffer_allocator(cls, device: Optional[str] = None) -> BufferAllocator:
        return shm_allocator

    def _register(self, regions: list[tuple[int, int]]) -> None:
        if self.role == "decode":
            self._own_segments = _own_segments_for(regions)

    def describe(self) -> dict[str, Any]:
        segs = []
        for s in self._own_segments:
            d = {"kind": s.kind, "name": s.name, "base": s.base, "size": s.size}
            if s.share is not None:
                d["share"] = s.share
            segs.append(d)
        return {"pid": os.getpid(), "dir": _shm_dir(), "segments": segs, "host": host_identity()}

    def _connect(self, peer_id: str, info: dict[str, Any]) -> None:
        self._disconnect(peer_id)
        peer_host, own_host = info.get("host"), host_identity()
        if peer_host != own_host:
            raise TransferError(
                "the local transfer backend needs prefill and decode on one host, and decode is on "
                f"another (host {peer_host}, prefill {own_host}: boot id / network namespace); "
                "start both servers with --disaggregation-transfer-backend mooncake (or nixl)"
            )
        segs = sorted(info.get("segments", []), key=lambda s: s["base"])
        if not segs:
            raise TransferError(
                "peer described no shared segments (is decode using the local backend?)"
            )
        keep, bases, kinds = [], [], []
        try:
            for s in segs:
                if s["kind"] == "shm":
                    path = os.path.join(info.get("dir", _shm_dir()), s["name"])
                    fd = os.open(path, os.O_RDWR)
                    try:
                        mm = mmap.mmap(
                            fd, max(s["size"], 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
                        )
                    finally:
                        os.close(fd)
                    view = np.frombuffer(mm, dtype=np.uint8)
                    keep += [mm, view]
                    bases.append(view.ctypes.data)
                elif s["kind"] == "cuda_ipc":
                    from pdserve.disagg.transfer import cuda_ipc

                    tensor = cuda_ipc.open_shared(s["share"])
                    keep.append(tensor)
                    bases.append(tensor.data_ptr())
                else:
                    raise TransferError(f"unknown segment kind {s['kind']!r}")
                kinds.append(s["kind"])
        except FileNotFoundError as e:
            raise TransferError(
                f"decode's shared segment {e.filename} not found: decode exited, or it runs on "
                "another host (the local backend needs prefill and decode on one host)"
            ) from None
        except OSError as e:
            raise TransferError(f"cannot map peer's shared segment: {e}") from None
        pm = _PeerMap(
            remote_starts=np.array([s["base"] for s in segs], dtype=np.int64),
            remote_ends=np.array([s["base"] + s["size"] for s in segs], dtype=np.int64),
            local_bases=np.array(bases, dtype=np.int64),
            kinds=kinds,
            keepalive=keep,
        )
        with self._cond:
            self._maps[peer_id] = pm

    def _disconnect(self, peer_id: str) -> None:
        with self._cond:
            pm = self._maps.pop(peer_id, None)
            if pm is None:
                return
            pm.closed = True
            while pm.users:  # never unmap under a running copy
                self._cond.wait()
        mms = [k for k in pm.keepalive if isinstance(k, mmap.mmap)]
        pm.keepalive.clear()  # drops the numpy views, so the mmaps can close
        for mm in mms:
            try:
                mm.close()
            except BufferError:
                pass  # a view is still referenced somewhere; the GC unmaps it later

    def _write(
        self, peer_id: str, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray
    ) -> TransferHandle:
        with self._cond:
            pm = self._maps.get(peer_id)
            if pm is None or pm.closed:
                raise TransferError(f"not connected to peer {peer_id}")
            pm.users += 1
        try:
            seg = np.searchsorted(pm.remote_starts, dst, side="right") - 1
            inside = (seg >= 0) & (dst + lengths <= pm.remote_ends[np.maximum(seg, 0)])
            if not inside.all():
                i = int(np.flatnonzero(~inside)[0])
                raise TransferError(
                    f"destination [{dst[i]:#x}, +{lengths[i]}) is not in a shared segment"
                )
            local = pm.local_bases[seg] + (dst - pm.remote_starts[seg])
            if all(k == "shm" for k in pm.kinds) and not self.device.startswith("cuda"):
                memmove = ctypes.memmove  # releases the GIL while copying
                for d, s, n in zip(local.tolist(), src.tolist(), lengths.tolist()):
                    memmove(d, s, n)
            else:
                from pdserve.disagg.transfer import cuda_ipc

                cuda_ipc.copy_batch(local, src, lengths, self.device)
        finally:
            with self._cond:
                pm.users -= 1
                self._cond.notify_all()
        return CompletedHandle()

    def close(self) -> None:
        super().close()
        for peer in list(self._maps):
            self._disconnect(peer)
        with _segments_lock:
            for seg in self._own_segments:
                _unlink(seg)
            # forgotten here too: the memory goes with the last tensor over it (a role switch
            # drops the pools; a process that exits does not care)
            own = {id(seg) for seg in self._own_segments}
            _segments[:] = [seg for seg in _segments if id(seg) not in own]
