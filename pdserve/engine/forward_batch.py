"""``ForwardBatch``: what one model forward needs, built by the scheduler from a list of ``Req``.

Tokens of all requests are flattened into one sequence of ``T`` tokens; request ``i`` owns the
slice ``extend_starts[i] : extend_starts[i] + extend_lens[i]`` of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from pdserve.engine.dp_attention import DPGather
    from pdserve.engine.kv_pool import KVPool
    from pdserve.layers.attention.base import AttentionBackend


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    prefix_lens: list[int]  # per request: tokens already in the KV pool before this forward
    extend_lens: list[int]  # per request: tokens computed in this forward
    page_table: torch.Tensor  # [B, max_pages] int64 pages of each request (0-padded)
    out_pages: torch.Tensor  # [T] page of each new token's KV
    out_offsets: torch.Tensor  # [T] offset inside that page
    logits_idx: torch.Tensor  # [N] rows of the flattened tokens whose logits are needed
    kv_pool: "KVPool"
    attn_backend: "AttentionBackend"
    dp: Optional["DPGather"] = None  # DP attention: the gather around the MLP
    parts: Optional[tuple] = None  # pipeline parallel: the lists it was made of (to split it)
    _int32: Optional[tuple[torch.Tensor, torch.Tensor]] = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @property
    def extend_starts(self) -> list[int]:
        out, acc = [], 0
        for e in self.extend_lens:
            out.append(acc)
            acc += e
        return out

    def int32_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(page_table [B, max_pages], seq_lens [B]) as int32, what the CPU kernels take; built once."""
        if self._int32 is None:
            self._int32 = (self.page_table.to(torch.int32),
                           torch.tensor(self.seq_lens, dtype=torch.int32, device=self.page_table.device))
        return self._int32

    @property
    def is_decode_only(self) -> bool:
        return all(e == 1 for e in self.extend_lens)
