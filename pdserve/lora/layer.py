"""What a linear layer adds for LoRA: ``y[rows] += (x[rows] @ A.T) @ B.T`` for the rows of each
adapter in the forward (B carries the scaling), one pair of matmuls per adapter present, whatever
the mix of adapters and base-model rows in the batch.

A merged layer (q/k/v, gate/up) holds one (A, B) per part it adapts, each writing its columns of
the output. Under tensor parallelism each (A, B) is this rank's share, cut like the base weight:
a column-parallel layer keeps A whole and its rows of B; a row-parallel one its columns of A and B
whole, so its partial deltas are summed by the layer's all-reduce like its partial outputs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch


@dataclass
class LoraBatch:
    """The forward's token rows per adapter slot (base-model rows in none)."""

    rows: dict[int, Optional[torch.Tensor]]  # slot -> [n] int64 token rows (None: every row)


_current: Optional[LoraBatch] = None


@contextlib.contextmanager
def active(adapters: Optional[list[int]], extend_lens: list[int]) -> Iterator[None]:
    """The LoRA rows of one forward: request i (``extend_lens[i]`` token rows, in order) runs
    under adapter slot ``adapters[i]`` (-1: the base model)."""
    global _current
    if not adapters or all(a < 0 for a in adapters):
        yield
        return
    per: dict[int, list[int]] = {}
    start = 0
    for slot, n in zip(adapters, extend_lens):
        if slot >= 0:
            per.setdefault(slot, []).extend(range(start, start + n))
        start += n
    if len(per) == 1 and len(next(iter(per.values()))) == start:  # one adapter, every row
        _current = LoraBatch({next(iter(per)): None})
    else:
        _current = LoraBatch({s: torch.tensor(r, dtype=torch.long) for s, r in per.items()})
    try:
        yield
    finally:
        _current = None


class LinearLora:
    """The adapters of one linear layer: per slot, per output part (offset, columns), (A, B)."""

    def __init__(self, part_sizes: list[int]):
        self.offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
        self.part_sizes = list(part_sizes)
        self.slots: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}

    def set(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        if b.shape[0] != self.part_sizes[part]:
            raise ValueError(
                f"B has {b.shape[0]} output rows here, the layer's part has {self.part_sizes[part]}"
            )
        self.slots.setdefault(slot, []).append((self.offsets[part], a, b))

    def drop(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch = _current
        if batch is None or not self.slots:
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for slot, rows in batch.rows.items():
            parts = self.slots.get(slot)
            if parts is None:
                continue
            xs = (x2 if rows is None else x2.index_select(0, rows)).float()
            for offset, a, b in parts:
                delta = (xs @ a.t()) @ b.t()  # [n, r] then [n, part columns]
                out = y2[:, offset : offset + b.shape[0]]
                if rows is None:
                    out += delta.to(y2.dtype)
                else:
                    out.index_add_(0, rows, delta.to(y2.dtype))
        return y
