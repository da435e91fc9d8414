"""Metadata ("aux") buffers: one row per slot carrying what prefill computed besides the KV
(first token, logprobs, cached-token counts, speculative-decoding state) and the room id.

Both sides hold the same layout; prefill fills a row and the transfer layer copies it into the
decode slot, field by field, ``bootstrap_room`` LAST. Decode trusts a row only when its room
equals the request's room (``row_room``), and clears it after use.

All fields live in one allocation (so the local backend needs one shared segment); each field
is its own region ``[num_slots, width]`` so a row of a field is one contiguous item, padded to
at least 64 bytes (the smallest efficient RDMA write).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pdserve.config import MAX_EAGLE_TOPK
from pdserve.engine.kv_pool import BufferAllocator, default_allocator
from pdserve.engine.request import MAX_TOP_LOGPROBS

EMPTY_ROOM = -1  # rooms are in [0, 2^63); -1 marks a row nothing was written to
MIN_ROW_BYTES = 64
ALIGN = 64
MAX_SPEC_TOPK = MAX_EAGLE_TOPK

# output_ids row: [0] first token, [1] number of top logprobs, [2] 1 if a logprob was written,
# [3] the prompt's multimodal RoPE shift (engine/images.py: every later position's)
_OUT_TOKEN, _OUT_NUM_TOP, _OUT_HAS_LOGPROB, _OUT_ROPE_DELTA = 0, 1, 2, 3


@dataclass(frozen=True)
class AuxBufferInfo:
    data_ptrs: list[int]
    data_lens: list[int]
    item_lens: list[int]
    names: list[str]


@dataclass
class MetadataRow:
    room: int
    first_token: int
    logprob: Optional[float]
    top_logprobs: list[tuple[float, int]]
    cached_tokens: tuple[int, int, int, int]  # total, device, host, storage hits
    topk_p: list[float]
    topk_index: list[int]
    hidden_states: Optional[torch.Tensor]
    rope_delta: int = 0


def _fields(hidden_size: int, hidden_dtype: torch.dtype) -> list[tuple[str, torch.dtype, int]]:
    f = [
        ("output_ids", torch.int32, 16),
        ("cached_tokens", torch.int32, 16),
        ("output_token_logprobs_val", torch.float32, 16),
        ("output_token_logprobs_idx", torch.int32, 16),
        ("output_top_logprobs_val", torch.float32, MAX_TOP_LOGPROBS),
        ("output_top_logprobs_idx", torch.int32, MAX_TOP_LOGPROBS),
        ("output_topk_p", torch.float32, MAX_SPEC_TOPK),
        ("output_topk_index", torch.int64, MAX_SPEC_TOPK),
    ]
    if hidden_size > 0:
        f.append(("output_hidden_states", hidden_dtype, hidden_size))
    f.append(("bootstrap_room", torch.int64, 8))  # must stay last: written after everything else
    out = []
    for name, dtype, width in f:
        itemsize = torch.empty((), dtype=dtype).element_size()
        width = max(width, -(-MIN_ROW_BYTES // itemsize))
        out.append((name, dtype, width))
    return out


class MetadataBuffers:
    """Row buffers indexed by slot (see ``SlotAllocator``). Not thread-safe: the scheduler owns
    it; the transfer layer only reads/writes raw rows through the registered pointers."""

    def __init__(
        self,
        num_slots: int,
        hidden_size: int = 0,
        hidden_dtype: torch.dtype = torch.float32,
        allocator: BufferAllocator = default_allocator,
        device: torch.device | str = "cpu",
    ):
        if num_slots < 1:
            raise ValueError(f"num_slots: must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.hidden_size = hidden_size
        self.device = torch.device(device)
        spec = _fields(hidden_size, hidden_dtype)
        offsets, total = [], 0
        for _, dtype, width in spec:
            total = -(-total // ALIGN) * ALIGN
            offsets.append(total)
            total += num_slots * width * torch.empty((), dtype=dtype).element_size()
        raw = allocator(total, self.device)
        if raw.numel() != total or raw.dtype != torch.uint8:
            raise ValueError(
                f"allocator returned {raw.numel()} {raw.dtype} bytes, expected {total} uint8"
            )
        self._raw = raw
        self.names = [name for name, _, _ in spec]
        self.buffers: dict[str, torch.Tensor] = {}
        for (name, dtype, width), off in zip(spec, offsets):
            nbytes = num_slots * width * torch.empty((), dtype=dtype).element_size()
            # [num_slots, width]
            self.buffers[name] = raw[off : off + nbytes].view(dtype).view(num_slots, width)
        self.buffers["bootstrap_room"].fill_(EMPTY_ROOM)

    def __getattr__(self, name: str) -> torch.Tensor:
        buffers = self.__dict__.get("buffers")
        if buffers is not None and name in buffers:
            return buffers[name]
        raise AttributeError(name)

    def buffer_info(self) -> AuxBufferInfo:
        """Per-field (ptr, total bytes, row bytes), in transfer order: ``bootstrap_room`` last."""
        bufs = [self.buffers[n] for n in self.names]
        return AuxBufferInfo(
            data_ptrs=[b.data_ptr() for b in bufs],
            data_lens=[b.numel() * b.element_size() for b in bufs],
            item_lens=[b[0].numel() * b.element_size() for b in bufs],
            names=list(self.names),
        )

    def set_row(
        self,
        slot: int,
        room: int,
        first_token: int,
        logprob: Optional[float] = None,
        top_logprobs: Optional[Sequence[tuple[float, int]]] = None,
        cached_tokens: Sequence[int] = (0, 0, 0, 0),
        topk_p: Optional[Sequence[float]] = None,
        topk_index: Optional[Sequence[int]] = None,
        hidden_states: Optional[torch.Tensor] = None,
        rope_delta: int = 0,
    ) -> None:
        b = self.buffers
        top = list(top_logprobs or [])
        if len(top) > b["output_top_logprobs_val"].shape[1]:
            raise ValueError(
                f"top_logprobs: at most {b['output_top_logprobs_val'].shape[1]}, got {len(top)}"
            )
        for name in self.names:
            if name != "bootstrap_room":
                b[name][slot].zero_()
        b["output_ids"][slot, _OUT_TOKEN] = first_token
        b["output_ids"][slot, _OUT_NUM_TOP] = len(top)
        b["output_ids"][slot, _OUT_ROPE_DELTA] = rope_delta
        if logprob is not None:
            b["output_ids"][slot, _OUT_HAS_LOGPROB] = 1
            b["output_token_logprobs_val"][slot, 0] = logprob
            b["output_token_logprobs_idx"][slot, 0] = first_token
        if top:
            b["output_top_logprobs_val"][slot, : len(top)] = torch.tensor([lp for lp, _ in top])
            b["output_top_logprobs_idx"][slot, : len(top)] = torch.tensor(
                [t for _, t in top], dtype=torch.int32
            )
        cached = list(cached_tokens)[:4]
        b["cached_tokens"][slot, : len(cached)] = torch.tensor(cached, dtype=torch.int32)
        if topk_p is not None:
            b["output_topk_p"][slot, : len(topk_p)] = torch.as_tensor(
                list(topk_p), dtype=torch.float32
            )
        if topk_index is not None:
            b["output_topk_index"][slot, : len(topk_index)] = torch.as_tensor(
                list(topk_index), dtype=torch.int64
            )
        if hidden_states is not None:
            if "output_hidden_states" not in b:
                raise ValueError("hidden_states: these buffers were built with hidden_size=0")
            h = hidden_states.reshape(-1)
            b["output_hidden_states"][slot, : h.numel()] = h
        b["bootstrap_room"][slot, 0] = room  # last

    def get_row(self, slot: int) -> MetadataRow:
        b = self.buffers
        ids = b["output_ids"][slot].tolist()
        n_top = ids[_OUT_NUM_TOP]
        top = list(
            zip(
                b["output_top_logprobs_val"][slot, :n_top].tolist(),
                b["output_top_logprobs_idx"][slot, :n_top].tolist(),
            )
        )
        return MetadataRow(
            room=int(b["bootstrap_room"][slot, 0]),
            first_token=ids[_OUT_TOKEN],
            logprob=float(b["output_token_logprobs_val"][slot, 0])
            if ids[_OUT_HAS_LOGPROB]
            else None,
            top_logprobs=top,
            cached_tokens=tuple(b["cached_tokens"][slot, :4].tolist()),
            topk_p=b["output_topk_p"][slot].tolist(),
            topk_index=b["output_topk_index"][slot].tolist(),
            hidden_states=b["output_hidden_states"][slot, : self.hidden_size].clone()
            if "output_hidden_states" in b
            else None,
            rope_delta=ids[_OUT_ROPE_DELTA],
        )

    def row_room(self, slot: int) -> int:
        return int(self.buffers["bootstrap_room"][slot, 0])

    def clear_row(self, slot: int) -> None:
        """Forget the row's room (call before the slot is freed / reused)."""
        self.buffers["bootstrap_room"][slot, 0] = EMPTY_ROOM


class SlotAllocator:
    """O(1) allocator of slot indices 0..num_slots-1 (metadata rows; used on both sides).
    Not thread-safe: only the scheduler loop calls it."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots: must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._is_free = bytearray(b"\x01" * num_slots)

    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> Optional[int]:
        if not self._free:
            return None
        slot = self._free.pop()
        self._is_free[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise AssertionError(f"freeing slot {slot} outside 0..{self.num_slots - 1}")
        if self._is_free[slot]:
            raise AssertionError(f"double free of slot {slot}")
        self._is_free[slot] = 1
        self._free.append(slot)
