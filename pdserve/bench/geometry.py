"""The sizes of a KV transfer benchmark (``pdserve bench-transfer``): how many pages of what shape,
and the size arguments it parses and prints."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

import numpy as np

UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 16KiB, 4MiB, 1GiB)")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def fmt_size(n: int) -> str:
    unit, k = next(
        ((u, k) for u, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)) if n % k == 0),
        ("B", 1),
    )
    return f"{n // k} {unit}"


@dataclass
class Geometry:
    """KV pools on both sides: [layers, 2, pool_pages, heads, page_size, head_dim] bf16;
    ``pages`` pages are sent, source pages 1..pages, destinations a random permutation."""

    layers: int
    heads: int
    head_dim: int
    page_size: int
    pages: int
    seed: int = 0

    def __post_init__(self) -> None:
        self.item_bytes = self.heads * self.page_size * self.head_dim * 2
        self.total_bytes = self.layers * 2 * self.pages * self.item_bytes
        self.pool_pages = self.pages + 1  # page 0 stays unused, like the padding page

    def src_pages(self) -> list[int]:
        return list(range(1, self.pages + 1))

    def dst_pages(self) -> list[int]:
        return [int(p) for p in np.random.default_rng(self.seed).permutation(self.pages) + 1]

    @classmethod
    def for_page_bytes(cls, size: int, page_bytes: int) -> "Geometry":
        if page_bytes % 1024:
            raise ValueError(f"page size must be a multiple of 1 KiB, got {page_bytes}")
        pages = max(1, size // (2 * page_bytes))
        return cls(layers=1, heads=1, head_dim=512, page_size=page_bytes // 1024, pages=pages)
