"""CPU attention over the paged pool with pdserve's kernels (``kernels/csrc``); pages are read in
place, never gathered.

- bf16 compute and KV (on CPUs with avx512_bf16, head_dim a multiple of 16): every row of the batch,
  decode and prefill alike, in one call of the flash kernel (``flash_attention.cpp``).
- otherwise (float32, or no avx512_bf16): decode rows by the paged decode kernel
  (``paged_attention.cpp``), extend rows as the torch backend does (SDPA over the new tokens and
  the gathered prefix).
"""

from __future__ import annotations

from typing import Optional

import torch

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.layers.attention.torch_backend import TorchAttnBackend


class CpuAttnBackend(TorchAttnBackend):
    def __init__(self, ops=None, compute_dtype: torch.dtype = torch.bfloat16, **_):
        super().__init__()
        self.compute_dtype = compute_dtype
        if ops is None:
            from pdserve import kernels

            ops = kernels.load()
            if ops is None:
                raise RuntimeError(f"attention_backend 'cpu' needs pdserve's CPU kernels: {kernels.unavailable_reason()}")
        self.ops = ops

    def uses_flash(self, fb: ForwardBatch) -> bool:
        pool = fb.kv_pool
        return pool.dtype == self.compute_dtype == torch.bfloat16 and self.ops.flash_supported(pool.head_dim)

    def is_decode_row(self, fb: ForwardBatch, i: int) -> bool:
        # one new token, whatever its prefix: its K/V are in the pool before the kernel runs
        return fb.extend_lens[i] == 1

    def init_forward(self, fb: ForwardBatch) -> None:
        self._flash = None
        if not self.uses_flash(fb):
            return super().init_forward(fb)
        self._fb = fb
        page, kv_heads = fb.kv_pool.page_size, fb.kv_pool.kv_heads
        heads = torch.arange(kv_heads)
        self._write_rows = ((fb.out_pages[:, None] * kv_heads + heads[None, :]) * page
                            + fb.out_offsets[:, None]).reshape(-1)
        table, lens = fb.int32_tables()
        starts = torch.zeros(fb.batch_size + 1, dtype=torch.int32)
        starts[1:] = torch.tensor(fb.extend_lens, dtype=torch.int32).cumsum(0)
        self._flash = (table, lens, starts)

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

    def forward(self, layer_id, q, k, v, fb, scale, sliding_window=None):
        if self._flash is None:
            return super().forward(layer_id, q, k, v, fb, scale, sliding_window)
        pool = fb.kv_pool
        kc, vc = pool.k_cache(layer_id), pool.v_cache(layer_id)  # [P, kv_heads, page, D]
        head_dim = kc.shape[3]
        kc.view(-1, head_dim).index_copy_(0, self._write_rows, k.reshape(-1, head_dim).to(kc.dtype))
        vc.view(-1, head_dim).index_copy_(0, self._write_rows, v.reshape(-1, head_dim).to(vc.dtype))
        out = torch.empty_like(q)
        table, lens, starts = self._flash
        self.ops.paged_attention_bf16(out, q, kc, vc, table, lens, starts, scale, sliding_window or 0)
        return out
