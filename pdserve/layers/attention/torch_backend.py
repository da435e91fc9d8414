"""Attention on the paged KV pool with ``torch.nn.functional.scaled_dot_product_attention``.

Decode rows (one new token with a prefix) are batched: their pages are gathered into a padded
[B, kv_heads, max_len, head_dim] tensor with a length mask. Extend rows (prefill, chunked
prefill, prefill after a prefix-cache hit) run one request at a time with a causal mask offset
by the prefix length. Correct on CPU and CUDA; the ``cpu`` backend replaces the decode part
with a kernel that reads the pages in place.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.layers.attention.base import AttentionBackend


class TorchAttnBackend(AttentionBackend):
    def __init__(self, **_):
        self._fb: Optional[ForwardBatch] = None

    def is_decode_row(self, fb: ForwardBatch, i: int) -> bool:
        """Rows that take the batched decode path (the rest run as extends)."""
        return fb.extend_lens[i] == 1 and fb.prefix_lens[i] > 0

    def init_forward(self, fb: ForwardBatch) -> None:
        self._fb = fb
        page = fb.kv_pool.page_size
        kv_heads = fb.kv_pool.kv_heads
        # Row of each (new token, head) in the [num_pages * kv_heads * page_size, head_dim] view
        # of one layer's K (or V): ((page * kv_heads + head) * page_size + offset). [T * kv_heads]
        heads = torch.arange(kv_heads, device=fb.input_ids.device)
        self._write_rows = ((fb.out_pages[:, None] * kv_heads + heads[None, :]) * page
                            + fb.out_offsets[:, None]).reshape(-1)
        starts = fb.extend_starts
        seq_lens = fb.seq_lens
        dec = [i for i in range(fb.batch_size) if self.is_decode_row(fb, i)]
        self.init_decode(fb, dec)
        dec_set = set(dec)
        # (row start, extend len, prefix len, pages of the whole sequence)
        self._ext = []
        for i in range(fb.batch_size):
            if i in dec_set:
                continue
            n_pages = (seq_lens[i] + page - 1) // page
            self._ext.append((starts[i], fb.extend_lens[i], fb.prefix_lens[i], fb.page_table[i, :n_pages]))
        self._ext_masks: dict[tuple[int, Optional[int]], torch.Tensor] = {}

    # ---- decode rows: gather + SDPA -------------------------------------------------------------
    def init_decode(self, fb: ForwardBatch, dec: list[int]) -> None:
        page = fb.kv_pool.page_size
        kv_heads = fb.kv_pool.kv_heads
        device = fb.input_ids.device
        starts = fb.extend_starts
        seq_lens = fb.seq_lens
        self._dec_rows = torch.tensor([starts[i] for i in dec], dtype=torch.long, device=device)
        self._dec_masks: dict[Optional[int], torch.Tensor] = {}
        if dec:
            heads = torch.arange(kv_heads, device=device)
            max_len = max(seq_lens[i] for i in dec)
            max_pages = (max_len + page - 1) // page
            dec_pages = fb.page_table[dec, :max_pages]  # [Bd, max_pages]
            self._dec_lens = torch.tensor([seq_lens[i] for i in dec], device=device)
            self._dec_kpos = torch.arange(max_pages * page, device=device)  # [L]
            tok_page = dec_pages[:, self._dec_kpos // page]  # [Bd, L]
            # rows of every (request, head, position) to gather: [Bd, kv_heads, L]
            self._dec_gather = ((tok_page[:, None, :] * kv_heads + heads[None, :, None]) * page
                                + (self._dec_kpos % page)[None, None, :])

    def _decode_mask(self, window: Optional[int]) -> torch.Tensor:
        m = self._dec_masks.get(window)
        if m is None:
            kpos = self._dec_kpos[None, :]  # [1, L]
            lens = self._dec_lens[:, None]  # [Bd, 1]; the query sits at position len - 1
            m = kpos < lens
            if window is not None:
                m &= (lens - 1 - kpos) < window
            m = m[:, None, None, :]  # [Bd, 1, 1, L]
            self._dec_masks[window] = m
        return m

    def decode(self, out: torch.Tensor, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float,
               sliding_window: Optional[int]) -> None:
        """Attention of the decode rows, written into their rows of ``out``."""
        if not self._dec_rows.numel():
            return
        head_dim = kc.shape[3]
        k_rows, v_rows = kc.view(-1, head_dim), vc.view(-1, head_dim)
        kk = k_rows[self._dec_gather]  # [Bd, kv_heads, L, D]
        vv = v_rows[self._dec_gather]
        qq = q[self._dec_rows].unsqueeze(2)  # [Bd, heads, 1, D]
        o = F.scaled_dot_product_attention(
            qq, kk.to(q.dtype), vv.to(q.dtype), attn_mask=self._decode_mask(sliding_window),
            scale=scale, enable_gqa=True,
        )
        out[self._dec_rows] = o.squeeze(2)

    # ---- extend rows ------------------------------------------------------------------------------
    def _extend_mask(self, idx: int, ext: int, prefix: int, window: Optional[int], device) -> Optional[torch.Tensor]:
        if prefix == 0 and window is None:
            return None  # plain causal
        key = (idx, window)
        m = self._ext_masks.get(key)
        if m is None:
            qpos = torch.arange(ext, device=device)[:, None] + prefix  # [ext, 1]
            kpos = torch.arange(prefix + ext, device=device)[None, :]  # [1, seq]
            m = kpos <= qpos
            if window is not None:
                m &= (qpos - kpos) < window
            self._ext_masks[key] = m
        return m

    def forward(self, layer_id, q, k, v, fb, scale, sliding_window=None):
        pool = fb.kv_pool
        kc, vc = pool.k_cache(layer_id), pool.v_cache(layer_id)  # [P, kv_heads, page, D]
        kv_heads, head_dim = kc.shape[1], kc.shape[3]
        k_rows, v_rows = kc.view(-1, head_dim), vc.view(-1, head_dim)
        k_rows.index_copy_(0, self._write_rows, k.reshape(-1, head_dim).to(kc.dtype))
        v_rows.index_copy_(0, self._write_rows, v.reshape(-1, head_dim).to(vc.dtype))
        out = torch.empty_like(q)
        self.decode(out, q, kc, vc, scale, sliding_window)

        for idx, (start, ext, prefix, pages) in enumerate(self._ext):
            qq = q[start:start + ext].transpose(0, 1).unsqueeze(0)  # [1, heads, ext, D]
            if prefix == 0:
                kk = k[start:start + ext].transpose(0, 1)  # [kv_heads, ext, D]
                vv = v[start:start + ext].transpose(0, 1)
            else:
                seq = prefix + ext
                # [n_pages, kv_heads, page, D] -> [kv_heads, n_pages * page, D] -> first seq tokens
                kk = kc[pages].permute(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, :seq]
                vv = vc[pages].permute(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, :seq]
            mask = self._extend_mask(idx, ext, prefix, sliding_window, q.device)
            o = F.scaled_dot_product_attention(
                qq, kk.unsqueeze(0).to(q.dtype), vv.unsqueeze(0).to(q.dtype), attn_mask=mask,
                is_causal=mask is None, scale=scale, enable_gqa=True,
            )
            out[start:start + ext] = o[0].transpose(0, 1)
        return out
