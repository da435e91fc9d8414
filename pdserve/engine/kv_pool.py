"""Paged cache pools (one contiguous allocation per cache group and rank) and an O(1) page
allocator; ``cache_kinds.make_pool`` picks the pool of a cache group's spec.

- ``KVPool`` (full attention, sliding window): ``[num_layers, 2 (K|V), num_pages, kv_heads,
  page_size, head_dim]`` ("head-major pages"). One page of one layer's K (or V) is one contiguous
  item of ``kv_heads * page_size * head_dim`` elements, and one head's slice of a page is
  contiguous too: its regions split along the KV heads. A quantized pool (``kv_quant.py``) keeps
  one byte per value, and with int8 the scales ``[num_layers, 2, num_pages, kv_heads,
  page_size]`` float32 after the values in the same allocation, as regions of their own.
- ``LatentPool`` (latent attention): ``[num_layers, num_pages, page_size, latent_dim + rope_dim]``,
  no head axis; every rank of an attention group holds the same latent: its regions are
  replicated.
- ``CompressedPool`` (compressed entries): ``[num_layers, num_pages, entries_per_page, dim]``, a
  ``LatentPool`` whose page holds ``max(1, page_size / rate)`` entries instead of a row per token;
  replicated regions.
- ``StatePool`` (recurrent state, a compressor's state): one slot per request, ``[num_layers,
  num_slots, *shape]`` per state tensor; its regions split along each tensor's own axis, in the
  spec's segments (or replicated, as the spec says: ``region_split``).

Page 0 is reserved as a padding page and is never handed out.
"""

from __future__ import annotations

import abc
from typing import Callable, Optional

import torch

from pdserve.engine.kv_quant import KVQuant, LayerScales, scale_regions
from pdserve.hostmem import huge_empty
from pdserve.kv_region import Region

# (nbytes, device) -> uint8 tensor of exactly nbytes. Lets the transfer layer place the pool in
# shared memory (local backend) or registered memory (RDMA backends).
BufferAllocator = Callable[[int, torch.device], torch.Tensor]


def default_allocator(nbytes: int, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        # decode attention streams the pages: 2 MiB pages spare it the TLB misses (zero-filled)
        return huge_empty(nbytes)
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


class PageAllocator:
    """Free-list allocator of page indices 1..num_pages-1 (page 0 is the padding page).

    ``alloc`` and ``free`` are O(1) per page. Not thread-safe: only the scheduler loop calls it.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(
                f"num_pages: need at least 2 (one is the padding page), got {num_pages}"
            )
        self.num_pages = num_pages
        self.set_aside_pages = 0  # taken out for good (``set_aside``)
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first
        self._is_free = bytearray(num_pages)
        for p in self._free:
            self._is_free[p] = 1

    @property
    def capacity(self) -> int:
        return self.num_pages - 1 - self.set_aside_pages

    def set_aside(self, n: int) -> list[int]:
        """Take ``n`` free pages out of the allocator for good (scratch the engine writes
        itself); the capacity shrinks by as many, so the pool's accounting stays exact."""
        pages = self.alloc(n)
        if pages is None:
            raise ValueError(f"cannot set aside {n} pages: {len(self._free)} are free")
        self.set_aside_pages += n
        return pages

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
    description of its regions for the transfer layer (``regions``). A new cache kind is a
    spec and a subclass; the cache manager, the scheduler and the PD queues see only this."""

    num_pages: int
    page_size: int
    device: torch.device
    dtype: torch.dtype
    allocator: PageAllocator
    kv_heads: int = 0  # KV heads of this rank in a "heads"-split region's item (0: none)
    # pages no request holds, where an attention backend lays out a speculative tree token's
    # keys as a plain sequence (engine/speculative/, layers/attention/cpu_backend.py)
    scratch: tuple[int, ...] = ()

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of the pool's one allocation."""

    @abc.abstractmethod
    def regions(self, group) -> list[Region]:
        """Its regions for the transfer layer, as the pool of cache group ``group``
        (``kv_spec.CacheGroup``: the ids and the spec of its layers, in pool order)."""

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")

    def page_bytes(self) -> list[torch.Tensor]:
        """Every tensor holding the pages' bytes as a ``[regions, num_pages, item_bytes]`` uint8
        view (a page's entry in the tiers below the pool is its items: ``kv_tier/pages.py``)."""
        return [self.buffer.view(torch.uint8).reshape(-1, self.num_pages, self.item_bytes)]

    def move(self, src: tuple[torch.Tensor, torch.Tensor], dst: tuple[torch.Tensor, torch.Tensor]):
        """Copy every layer's cache of tokens at ``src`` (pages, offsets: [N] each) to ``dst``
        (a speculative tree's accepted path moved to the sequence's slots); a paged pool's."""
        raise NotImplementedError(f"{type(self).__name__} keeps no tokens to move")


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
        quant: Optional[KVQuant] = None,
    ):
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.quant = quant
        self.dtype = dtype if quant is None else quant.storage
        self.device = torch.device(device)
        shape = (num_layers, 2, num_pages, kv_heads, page_size, head_dim)
        # [num_layers, 2, num_pages, kv_heads, page_size, head_dim]
        self._raw, self.buffer = _allocate(
            shape,
            self.dtype,
            self.device,
            allocator,
            (4 * _numel(shape[:-1]) if self.per_token else 0),
        )
        # int8: [num_layers, 2, num_pages, kv_heads, page_size] float32, after the values
        self.scales: Optional[torch.Tensor] = None
        if self.per_token:
            self.scales = self._raw[self.buffer.numel() :].view(torch.float32).view(shape[:-1])
        # fp8: per layer of the pool, (k_scale, v_scale) (``set_tensor_scales``)
        self.tensor_scales = [(1.0, 1.0)] * num_layers
        self.allocator = PageAllocator(num_pages)

    @property
    def per_token(self) -> bool:
        return self.quant is not None and self.quant.per_token

    def page_bytes(self) -> list[torch.Tensor]:
        out = super().page_bytes()
        if self.scales is not None:  # [num_layers, 2, num_pages, kv_heads, page_size] float32
            out.append(
                self.scales.view(torch.uint8).reshape(
                    -1, self.num_pages, 4 * self.kv_heads * self.page_size
                )
            )
        return out

    @property
    def dtype_name(self) -> str:
        return self.quant.name if self.quant is not None else super().dtype_name

    def set_tensor_scales(self, scales: list[tuple[float, float]]) -> None:
        """fp8: the (k_scale, v_scale) of each layer of the pool (from the checkpoint)."""
        if len(scales) != self.num_layers:
            raise AssertionError(f"{len(scales)} scale pairs for {self.num_layers} layers")
        self.tensor_scales = list(scales)

    def layer_scales(self, layer: int) -> Optional[LayerScales]:
        """What dequantizes layer ``layer``'s K and V (None: a float pool)."""
        if self.quant is None:
            return None
        k_tensor, v_tensor = self.tensor_scales[layer]
        if self.scales is None:
            return LayerScales(self.quant, k_tensor=k_tensor, v_tensor=v_tensor)
        return LayerScales(self.quant, self.scales[layer, 0], self.scales[layer, 1])

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
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

    def regions(self, group) -> list[Region]:
        nbytes, final = (
            self.num_pages * self.item_bytes,
            "last_chunk" if group.spec.drops_pages else "per_chunk",
        )
        out = [
            Region(
                ptr=self.buffer[i, kv].data_ptr(),
                nbytes=nbytes,
                item_bytes=self.item_bytes,
                group=group.id,
                layer=layer,
                part=part,
                final=final,
                split="heads",
            )
            for i, layer in enumerate(group.layers)
            for kv, part in ((0, "k"), (1, "v"))
        ]
        if self.scales is not None:
            out += scale_regions(self.scales, group, final)
        return out

    def as_group(self, first_layer: int = 0):
        """The full-attention cache group of this pool's layers (a pool built without a model)."""
        from pdserve.kv_spec import CacheGroup, FullAttention

        return CacheGroup(
            0,
            FullAttention(self.kv_heads, self.head_dim),
            tuple(range(first_layer, first_layer + self.num_layers)),
        )

    @classmethod
    def for_spec(
        cls,
        spec,
        num_layers: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device,
        allocator: BufferAllocator = default_allocator,
        quant: Optional[KVQuant] = None,
    ) -> "KVPool":
        return cls(
            num_layers,
            num_pages,
            page_size,
            spec.num_kv_heads,
            spec.head_dim,
            dtype,
            device,
            allocator,
            quant,
        )

    def move(self, src, dst) -> None:
        # [layers, 2, pages, heads, page, dim]: the token axes are 2 and 4
        self.buffer[:, :, dst[0], :, dst[1]] = self.buffer[:, :, src[0], :, src[1]]
        if self.scales is not None:  # [layers, 2, pages, heads, page]
            self.scales[:, :, dst[0], :, dst[1]] = self.scales[:, :, src[0], :, src[1]]

    def write(
        self,
        layer: int,
        page_idx: torch.Tensor,
        offsets: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store new tokens' K/V (quantized in a quantized pool). ``page_idx``/``offsets``: [T];
        ``k``/``v``: [T, kv_heads, head_dim]."""
        scales = self.layer_scales(layer)
        if scales is not None:
            heads = torch.arange(self.kv_heads, device=page_idx.device)
            rows = (page_idx[:, None] * self.kv_heads + heads) * self.page_size + offsets[:, None]
            scales.store(self.buffer[layer, 0], self.buffer[layer, 1], rows.reshape(-1), k, v)
            return
        self.buffer[layer, 0][page_idx, :, offsets] = k.to(self.dtype)
        self.buffer[layer, 1][page_idx, :, offsets] = v.to(self.dtype)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _allocate(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    allocator: BufferAllocator,
    extra_bytes: int = 0,
):
    """One allocation of ``shape`` in ``dtype`` (and ``extra_bytes`` after it): (raw, view)."""
    size = torch.empty((), dtype=dtype).element_size() * _numel(shape)
    nbytes = size + extra_bytes
    raw = allocator(nbytes, device)
    if raw.numel() != nbytes or raw.dtype != torch.uint8:
        raise ValueError(
            f"allocator returned {raw.numel()} {raw.dtype} bytes, expected {nbytes} uint8"
        )
    return raw, raw[:size].view(dtype).view(shape)


class LatentPool(BaseKVPool):
    """Latent attention (MLA): per layer and token one compressed latent (``latent_dim``) and its
    rotary key part (``rope_dim``), stored together; the same on every TP rank. Also the pool of
    other per-token vectors without a head axis (``IndexKeys``: ``rope_dim`` 0, regions named
    ``part``)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        latent_dim: int,
        rope_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        allocator: BufferAllocator = default_allocator,
        part: str = "latent",
        rows: Optional[int] = None,
    ):
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.latent_dim, self.rope_dim, self.part = latent_dim, rope_dim, part
        self.rows = page_size if rows is None else rows  # vectors a page holds
        self.dtype, self.device = dtype, torch.device(device)
        # [num_layers, num_pages, rows, latent_dim + rope_dim]
        self._raw, self.buffer = _allocate(
            (num_layers, num_pages, self.rows, latent_dim + rope_dim), dtype, self.device, allocator
        )
        self.allocator = PageAllocator(num_pages)

    @classmethod
    def for_spec(
        cls,
        spec,
        num_layers: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device,
        allocator: BufferAllocator = default_allocator,
    ) -> "LatentPool":
        if spec.kind == "index_keys":
            return cls(
                num_layers,
                num_pages,
                page_size,
                spec.dim,
                0,
                dtype,
                device,
                allocator,
                part="index_k",
            )
        return cls(
            num_layers,
            num_pages,
            page_size,
            spec.latent_dim,
            spec.rope_dim,
            dtype,
            device,
            allocator,
        )

    @property
    def nbytes(self) -> int:
        return self._raw.numel()

    @property
    def item_bytes(self) -> int:
        """Bytes of one page of one layer."""
        return self.rows * (self.latent_dim + self.rope_dim) * self.buffer.element_size()

    def latent_cache(self, layer: int) -> torch.Tensor:
        return self.buffer[layer]  # [num_pages, page_size, latent_dim + rope_dim]

    index_cache = latent_cache  # an IndexKeys group's vectors

    def regions(self, group) -> list[Region]:
        nbytes, final = (
            self.num_pages * self.item_bytes,
            "last_chunk" if group.spec.drops_pages else "per_chunk",
        )
        return [
            Region(
                ptr=self.buffer[i].data_ptr(),
                nbytes=nbytes,
                item_bytes=self.item_bytes,
                group=group.id,
                layer=layer,
                part=self.part,
                final=final,
                split="replicated",
            )
            for i, layer in enumerate(group.layers)
        ]

    def move(self, src, dst) -> None:
        self.buffer[:, dst[0], dst[1]] = self.buffer[:, src[0], src[1]]

    def write(
        self, layer: int, page_idx: torch.Tensor, offsets: torch.Tensor, latent: torch.Tensor
    ) -> None:
        """Store new tokens' latents. ``page_idx``/``offsets``: [T]; ``latent``: [T,
        latent_dim + rope_dim]."""
        self.buffer[layer][page_idx, offsets] = latent.to(self.dtype)


class CompressedPool(LatentPool):
    """Compressed entries (``kv_spec.CompressedEntries``): a page of ``page_size`` tokens holds
    the entries of the windows that close in it, ``entries_per_page`` rows of ``dim``."""

    @classmethod
    def for_spec(
        cls,
        spec,
        num_layers: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device,
        allocator: BufferAllocator = default_allocator,
    ) -> "CompressedPool":
        spec.check_page_size(page_size)
        return cls(
            num_layers,
            num_pages,
            page_size,
            spec.dim,
            0,
            dtype,
            device,
            allocator,
            part=spec.part,
            rows=spec.entries_per_page(page_size),
        )

    def entries(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s (index in the group) entries: [num_pages, entries_per_page, dim]."""
        return self.buffer[layer]


class LedgerPool(BaseKVPool):
    """The pages of a ``PositionLedger``: an allocator and nothing to hold (no regions, no bytes;
    ``dtype`` is the model's, as the anchor pool's stands for the cache's)."""

    item_bytes = 0

    def __init__(self, num_pages: int, page_size: int, dtype: torch.dtype, device):
        self.num_pages, self.page_size, self.dtype = num_pages, page_size, dtype
        self.device = torch.device(device)
        self.allocator = PageAllocator(num_pages)

    @classmethod
    def for_spec(
        cls,
        spec,
        num_layers: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device,
        allocator: BufferAllocator = default_allocator,
    ) -> "LedgerPool":
        return cls(num_pages, page_size, dtype, device)

    @property
    def nbytes(self) -> int:
        return 0

    def regions(self, group) -> list[Region]:
        return []

    def page_bytes(self) -> list[torch.Tensor]:
        return []


class StatePool(BaseKVPool):
    """Recurrent states (linear-attention layers): one slot per running request, holding each
    state tensor of every layer of the group; ``num_pages`` counts the slots, slot 0 the padding
    slot. Part i is one allocation ``[num_layers, num_slots, *shapes[i]]`` in its own dtype; an
    item of its regions is one request's tensor of one layer, split across TP in the pieces the
    spec declares along its axis 0 (``segments``)."""

    page_size = 1  # a slot is a request's, whatever its length

    def __init__(
        self,
        spec,
        num_layers: int,
        num_slots: int,
        device: torch.device | str,
        allocator: BufferAllocator = default_allocator,
    ):
        self.spec, self.num_layers, self.num_pages = spec, num_layers, num_slots
        self.device = torch.device(device)
        self.parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, shape, dtype in zip(spec.parts, spec.shapes, spec.dtypes):
            self.parts[name] = _allocate(
                (num_layers, num_slots, *shape), getattr(torch, dtype), self.device, allocator
            )
        self.dtype = getattr(torch, spec.dtypes[0])
        self.allocator = PageAllocator(num_slots)

    @classmethod
    def for_spec(
        cls,
        spec,
        num_layers: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device,
        allocator: BufferAllocator = default_allocator,
    ) -> "StatePool":
        return cls(spec, num_layers, num_pages, device, allocator)

    @property
    def nbytes(self) -> int:
        return sum(raw.numel() for raw, _ in self.parts.values())

    def state(self, part: str, layer: int) -> torch.Tensor:
        """Layer ``layer``'s (index in the group) tensor ``part`` of every slot:
        [num_slots, *shape]."""
        return self.parts[part][1][layer]

    def copy_slot(self, src: int, dst: int) -> None:
        """Slot ``dst`` takes slot ``src``'s state, every part of every layer."""
        for _, parts in self.parts.values():
            parts[:, dst].copy_(parts[:, src])

    def clear(self, part: str, layer: int, slots: torch.Tensor) -> None:
        """Zero ``slots``' tensor ``part`` of layer ``layer`` (a request's state starts at zero)."""
        self.parts[part][1][layer].index_fill_(0, slots, 0)

    def regions(self, group) -> list[Region]:
        out = []
        for i, name in enumerate(self.spec.parts):
            item = self.spec.part_bytes(i)
            buf = self.parts[name][1]
            out += [
                Region(
                    ptr=buf[j].data_ptr(),
                    nbytes=self.num_pages * item,
                    item_bytes=item,
                    group=group.id,
                    layer=layer,
                    part=name,
                    final="last_chunk",
                    split=self.spec.region_split,
                    segments=(
                        self.spec.segment_bytes(i) if self.spec.region_split == "segments" else ()
                    ),
                    pieces=(
                        self.spec.segment_pieces(i) if self.spec.region_split == "segments" else ()
                    ),
                )
                for j, layer in enumerate(group.layers)
            ]
        return out
