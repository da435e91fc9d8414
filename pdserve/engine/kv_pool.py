"""Paged KV cache: one contiguous allocation per rank and an O(1) page allocator.

Layout: ``[num_layers, 2 (K|V), num_pages, kv_heads, page_size, head_dim]`` ("head-major pages").
One page of one layer's K (or V) is one contiguous item of ``kv_heads * page_size * head_dim``
elements, and one head's slice of a page is contiguous too. Page 0 is reserved as a padding
page and is never handed out.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pdserve.hostmem import huge_empty

# (nbytes, device) -> uint8 tensor of exactly nbytes. Lets the transfer layer place the pool in
# shared memory (local backend) or registered memory (RDMA backends).
BufferAllocator = Callable[[int, torch.device], torch.Tensor]


def default_allocator(nbytes: int, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        # decode attention streams the pages: 2 MiB pages spare it the TLB misses (zero-filled)
        return huge_empty(nbytes)
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


@dataclass(frozen=True)
class KVBufferInfo:
    """What the transfer layer registers: one entry per (layer, K|V), layer-major."""

    data_ptrs: list[int]
    data_lens: list[int]  # bytes of each (layer, K|V) region
    item_lens: list[int]  # bytes of one page of that region
    page_size: int
    num_pages: int
    kv_heads: int
    head_dim: int
    dtype: str


class PageAllocator:
    """Free-list allocator of page indices 1..num_pages-1 (page 0 is the padding page).

    ``alloc`` and ``free`` are O(1) per page. Not thread-safe: only the scheduler loop calls it.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages: need at least 2 (one is the padding page), got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first
        self._is_free = bytearray(num_pages)
        for p in self._free:
            self._is_free[p] = 1

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> Optional[list[int]]:
        """Return ``n`` pages, or None (and allocate nothing) when fewer are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        for p in out:
            self._is_free[p] = 0
        out.reverse()
        return out

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p <= 0 or p >= self.num_pages:
                raise AssertionError(f"freeing page {p} outside 1..{self.num_pages - 1}")
            if self._is_free[p]:
                raise AssertionError(f"double free of page {p}")
            self._is_free[p] = 1
        self._free.extend(reversed(pages))

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])


class BaseKVPool(abc.ABC):
    """The buffers of one cache group (``kv_spec.CacheGroup``): one allocation (so a transfer
    backend registers it once), an allocator of its items (pages, or per-request slots), and a
    description of its regions for the transfer layer (``buffer_info``). A new cache kind is a
    spec and a subclass; the cache manager, the scheduler and the PD queues see only this."""

    num_pages: int
    page_size: int
    device: torch.device
    allocator: PageAllocator

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of the pool's one allocation."""

    @abc.abstractmethod
    def buffer_info(self) -> KVBufferInfo:
        """Its regions, in the order the transfer layer registers and pairs them."""


class KVPool(BaseKVPool):
    """Full or sliding-window attention: K and V of every layer of the group, per KV head."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        allocator: BufferAllocator = default_allocator,
    ):
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, 2, num_pages, kv_heads, page_size, head_dim)
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = itemsize
        for s in shape:
            nbytes *= s
        raw = allocator(nbytes, self.device)
        if raw.numel() != nbytes or raw.dtype != torch.uint8:
            raise ValueError(f"allocator returned {raw.numel()} {raw.dtype} bytes, expected {nbytes} uint8")
        self._raw = raw
        # [num_layers, 2, num_pages, kv_heads, page_size, head_dim]
        self.buffer = raw.view(dtype).view(shape)
        self.allocator = PageAllocator(num_pages)

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * kv_heads * page_size * head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return self._raw.numel()

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 0]  # [num_pages, kv_heads, page_size, head_dim]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 1]

    @property
    def item_bytes(self) -> int:
        """Bytes of one page of one (layer, K|V)."""
        return self.kv_heads * self.page_size * self.head_dim * self.buffer.element_size()

    def buffer_info(self) -> KVBufferInfo:
        region = self.num_pages * self.item_bytes
        ptrs = [self.buffer[l, kv].data_ptr() for l in range(self.num_layers) for kv in (0, 1)]
        return KVBufferInfo(
            data_ptrs=ptrs,
            data_lens=[region] * len(ptrs),
            item_lens=[self.item_bytes] * len(ptrs),
            page_size=self.page_size,
            num_pages=self.num_pages,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=str(self.dtype).replace("torch.", ""),
        )

    def write(self, layer: int, page_idx: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V. ``page_idx``/``offsets``: [T]; ``k``/``v``: [T, kv_heads, head_dim]."""
        self.buffer[layer, 0][page_idx, :, offsets] = k.to(self.dtype)
        self.buffer[layer, 1][page_idx, :, offsets] = v.to(self.dtype)
