"""Host memory in 2 MiB pages, for the large read-mostly buffers of a CPU engine.

Decode on a CPU streams the weights (and the KV pages) from DRAM every step. With 4 KiB pages
the TLB misses of that stream cost a third of the bandwidth on this project's machines (a bf16
weight read went from ~19 to ~28 GB/s on one core with 2 MiB pages). ``huge_empty`` maps
private anonymous memory aligned to 2 MiB and asks the kernel for transparent huge pages
(``MADV_HUGEPAGE``, honoured when THP is ``always`` or ``madvise``); where that is not possible it
is still correct memory, just with small pages.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20


def huge_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised (zero-filled) uint8 tensor of ``nbytes``, 2 MiB aligned."""
    size = max(nbytes, 1) + HUGE_PAGE
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP disabled on this host: small pages
    whole = torch.frombuffer(buf, dtype=torch.uint8)  # keeps ``buf`` alive
    skip = (-whole.data_ptr()) % HUGE_PAGE
    return whole[skip : skip + nbytes]


def huge_like(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor ``t`` in 2 MiB pages."""
    return huge_copies([t])[0]


def huge_copies(tensors: list[torch.Tensor], align: int = 64) -> list[torch.Tensor]:
    """Contiguous copies of CPU ``tensors`` side by side in one buffer of 2 MiB pages (each at an
    ``align``-byte offset): many weights of a layer (an MoE layer's experts) in huge pages without
    rounding each up to a page."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // align) * align
    buf = huge_empty(total)
    out = []
    for t, off, size in zip(tensors, offsets, sizes):
        copy = buf[off : off + size].view(t.dtype).view(t.shape)
        copy.copy_(t)
        out.append(copy)
    return out
