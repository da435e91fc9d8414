"""Fenceable views of the written side's buffers, one per peer session (``Window``).

The problem they solve: a network backend's write is one-sided, and bytes of a write that failed
(cut link, peer declared dead) can still be queued in the writer's TCP send buffer or in its
transfer engine, to land whenever the link returns. Decode cannot check such a write against the
room it was meant for, so once it has reused the room's pages for another request a late write
corrupts that request. Closing it needs every late byte of a session sent somewhere harmless.

How: on CPU, decode's KV pool and metadata buffers live in memfd files (``memfd_allocator``),
so each file can be mapped a second time at a fresh address. Each prefill session is told (in
``Register``) only the addresses of its own window, and the backend registers only those. To
fence the session the backend first deregisters the window (a remote write that arrives later
is refused where the transport checks, e.g. Mooncake's TCP receiver, and an RDMA NIC can no
longer reach the pages), then ``fence()`` replaces every mapping of the window in place
(``MAP_FIXED``) with anonymous scratch memory. From then on a write into the window, whichever
path delivers it (the kernel's ``recv`` into the address, a memcpy on an agent's progress
thread, a peer's ``process_vm_writev``), lands in the scratch pages and never in the pool:
the pool's pages are reachable only through the main mapping and the windows still open.

A fenced window keeps its address range (scratch pages are allocated only where late bytes land)
until the backend closes, so no later mapping can take the addresses a stale peer still writes to.
Device (CUDA) memory cannot be mapped twice this way: there ``open`` returns ``None``, and the
caller keeps registering the buffers themselves.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

logger = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MADV_HUGEPAGE = 14


@dataclass
class _File:
    fd: int
    base: int  # address of the main mapping (the tensor's storage)
    size: int


_files: list[_File] = []
_files_lock = threading.Lock()


def memfd_allocator(nbytes: int, device: torch.device) -> torch.Tensor:
    """``BufferAllocator``: a zeroed uint8 tensor in a memfd file that windows can map again (CPU);
    device memory comes from torch as usual (no windows there)."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    size = max(nbytes, 1)
    fd = os.memfd_create("pdserve-kv", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)  # fail now (ENOSPC / memory limit), not with SIGBUS later
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        os.close(fd)
        raise MemoryError(
            f"cannot reserve {nbytes} bytes for the KV pool in a memfd file: {e}"
        ) from e
    tensor = (
        torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
        if nbytes
        else torch.empty(0, dtype=torch.uint8)
    )
    if nbytes:
        # decode attention streams the pages: ask for 2 MiB pages where the kernel allows them
        # for shared memory (transparent_hugepage/shmem_enabled); without, 4 KiB pages
        _libc.madvise(tensor.data_ptr(), size, _MADV_HUGEPAGE)
        with _files_lock:
            _files.append(_File(fd, tensor.data_ptr(), nbytes))
    else:
        os.close(fd)
    return tensor


def forget_files(regions: Sequence[tuple[int, int]]) -> None:
    """Close the memfd descriptors of the files holding ``regions`` (their pools are being dropped:
    the memory goes with the last mapping)."""
    with _files_lock:
        keep = []
        for f in _files:
            if any(f.base <= p < f.base + f.size for p, _ in regions):
                os.close(f.fd)
            else:
                keep.append(f)
        _files[:] = keep


def _files_for(regions: Sequence[tuple[int, int]]) -> Optional[list[_File]]:
    """The memfd files covering every region, or None when one lies outside them."""
    with _files_lock:
        files = list(_files)
    used: dict[int, _File] = {}
    for ptr, n in regions:
        if n <= 0:
            continue
        # newest first: a dropped pool's file may still be listed over addresses reused since
        hit = next(
            (f for f in reversed(files) if f.base <= ptr and ptr + n <= f.base + f.size), None
        )
        if hit is None:
            return None
        used[hit.base] = hit
    return sorted(used.values(), key=lambda f: f.base)


def windows_possible(regions: Sequence[tuple[int, int]]) -> bool:
    return _files_for(regions) is not None


class Window:
    """One peer session's mapping of every file: ``spans`` are (main base, window base, size)."""

    def __init__(self, key: str, regions: Sequence[tuple[int, int]]):
        files = _files_for(regions)
        if files is None:
            raise ValueError(
                "buffers outside memfd files cannot be windowed (allocate them with "
                "memfd_allocator)"
            )
        self.key = key
        self.spans: list[tuple[int, int, int]] = []
        self.fenced = False
        self.registered: Any = None  # what the backend needs to deregister the window
        try:
            for f in files:
                addr = _libc.mmap(
                    None, f.size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, f.fd, 0
                )
                if addr in (None, _MAP_FAILED):
                    raise OSError(
                        ctypes.get_errno(),
                        f"mmap of a KV window: {os.strerror(ctypes.get_errno())}",
                    )
                self.spans.append((f.base, addr, f.size))
        except BaseException:
            self.release()
            raise

    def translate(self, ptr: int) -> int:
        """The window's address of main-mapping address ``ptr``. A buffer's end may be a pointer
        one past a file's last byte; it counts as that file's only when no file holds ``ptr``
        itself: files are often mapped back to back, and the next file's first byte has the
        same address as the previous file's end (taken for it, a region's bytes would go to the
        window of the file before it)."""
        for base, win, size in self.spans:
            if base <= ptr < base + size:
                return win + (ptr - base)
        for base, win, size in self.spans:
            if ptr == base + size and size:
                return win + size
        raise ValueError(f"address {ptr:#x} is not in a windowed buffer")

    def regions(self, regions: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        return [(self.translate(p), n) for p, n in regions if n > 0]

    def fence(self) -> None:
        """Point every address of the window at scratch memory: nothing written through it from
        now on reaches the buffers. Idempotent."""
        if self.fenced:
            return
        for _, win, size in self.spans:
            addr = _libc.mmap(
                win,
                size,
                mmap.PROT_READ | mmap.PROT_WRITE,
                mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE,
                -1,
                0,
            )
            if addr != win:  # cannot happen for a range we mapped; never leave the pool reachable
                err = ctypes.get_errno()
                raise OSError(err, f"cannot fence KV window {self.key}: {os.strerror(err)}")
        self.fenced = True

    def release(self) -> None:
        """Unmap the window (backend close)."""
        for _, win, size in self.spans:
            _libc.munmap(win, size)
        self.spans = []
