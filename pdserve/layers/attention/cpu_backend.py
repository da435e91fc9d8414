"""CPU attention: decode rows by pdserve's paged kernel, which reads each request's KV pages in
place (no gather, online softmax; ``kernels/csrc/paged_attention.cpp``); extend rows (prefill)
as the torch backend does, with SDPA's flash kernel over the new tokens (and the gathered prefix
when there is one).
"""

from __future__ import annotations

from typing import Optional

import torch

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.layers.attention.torch_backend import TorchAttnBackend


class CpuAttnBackend(TorchAttnBackend):
    def __init__(self, ops=None, **_):
        super().__init__()
        if ops is None:
            from pdserve import kernels

            ops = kernels.load()
            if ops is None:
                raise RuntimeError(f"attention_backend 'cpu' needs pdserve's CPU kernels: {kernels.unavailable_reason()}")
        self.ops = ops

    def is_decode_row(self, fb: ForwardBatch, i: int) -> bool:
        # one new token, whatever its prefix: its K/V are in the pool before the kernel runs
        return fb.extend_lens[i] == 1

    def init_decode(self, fb: ForwardBatch, dec: list[int]) -> None:
        self._dec = None
        if not dec:
            return
        rows = [fb.extend_starts[i] for i in dec]
        table, lens = fb.int32_tables()
        if rows == list(range(len(rows))):  # decode rows lead the batch: views, not copies
            self._dec = (None, len(dec), table[: len(dec)], lens[: len(dec)])
        else:
            idx = torch.tensor(dec, dtype=torch.long)
            self._dec = (torch.tensor(rows, dtype=torch.long), len(dec), table[idx], lens[idx])

    def decode(self, out: torch.Tensor, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float,
               sliding_window: Optional[int]) -> None:
        if self._dec is None:
            return
        sel, n, table, lens = self._dec
        if sel is None:
            self.ops.paged_decode_attention(out[:n], q[:n], kc, vc, table, lens, scale, sliding_window or 0)
        else:
            o = torch.empty((n,) + tuple(q.shape[1:]), dtype=q.dtype)
            self.ops.paged_decode_attention(o, q.index_select(0, sel), kc, vc, table, lens, scale, sliding_window or 0)
            out[sel] = o
