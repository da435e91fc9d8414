"""A KV compressor over paged entries (DeepSeek-V4's compressed attention, paper §2.3): each closed
window of ``rate`` tokens becomes one entry of ``dim``, kept in a ``CompressedPool`` on the logical
page where the window closes (``kv_spec.CompressedEntries``); what a request carries between
forwards lives in its slot of the layer's ``CompressorState`` pool.

For token t, ``kv = kv_proj(h_t)`` and ``gate = gate_proj(h_t)``. A window w's entry is
``norm(sum_j softmax_j(gate_j + bias_j) * kv_j)`` over its tokens j (softmax in float32, per
channel), rotated (interleaved pairs of the trailing ``rope_dim`` channels) at position
``w * rate``:

- without overlap (heavily compressed attention, one entry per 128 tokens) the window is its own
  ``rate`` tokens;
- with overlap (compressed sparse attention, and its indexer's keys) ``kv`` and ``gate`` have
  ``2 * dim`` channels, two series: entry w reads the second series (``[dim:]``) of window w and
  the first (``[:dim]``) of window w - 1, ``2 * rate`` slots (window 0: only its own).

The state (``state_parts``), per request and layer, ``name`` prefixing each part:

- ``kv`` / ``gate`` [rate, width]: the projections of the tokens of the window still open (rows
  ``0 .. n % rate - 1`` after n tokens; the gate before its bias);
- with overlap, ``overlap_kv`` / ``overlap_gate`` [rate, dim]: the first series of the last closed
  window, the gate with its bias (float32, as the biased gate is); read only once a window has
  closed (n >= rate), so a fresh slot needs no clearing.

With the prefix cache on, the state at the last page boundary an extend crosses is written into
the request's snapshot slot (``layers/state_snapshots.py``), so a prefix hit can end on any page.
``Indexer``: DeepSeek-V4's lightning indexer, which keeps its own compressor's keys and picks the
entries each query of a compressed-sparse layer attends to.

The arithmetic follows HF's ``DeepseekV4HCACompressor`` / ``DeepseekV4CSACompressor`` /
``DeepseekV4Indexer`` step for step, so float32 entries match to the bit and bf16 ones round at
the same places.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from pdserve.forward_batch import ForwardBatch
from pdserve.kv_spec import CompressedEntries
from pdserve.layers.linear import Linear
from pdserve.layers.norm import GptOssRMSNorm

CSA = "compressed_sparse_attention"  # the layer kind whose compress rate the indexer takes


def rotate_trailing(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float = 1.0,
    inverse: bool = False,
) -> torch.Tensor:
    """RoPE on interleaved pairs of the last ``2 * len(inv_freq)`` channels of ``x`` [T, ..., D]
    at ``positions`` [T], the leading channels untouched (DeepSeek-V4's layout: ``[nope | rope]``);
    ``inverse``: the rotation back (by minus the angle). The angles' cos and sin are rounded to
    ``x``'s dtype and the rotation taken in float32, as HF does."""
    freqs = positions[:, None].float() * inv_freq.float()
    cos = (freqs.cos() * scaling).to(x.dtype).repeat_interleave(2, dim=-1)
    sin = (freqs.sin() * scaling).to(x.dtype).repeat_interleave(2, dim=-1)
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    r = cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    out = (rope.float() * cos + rotated.float() * sin).to(x.dtype)
    return torch.cat([nope, out], dim=-1)


class Compressor(nn.Module):
    """One compressor of a layer (its entries: ``spec``); ``overlap``: two overlapping series
    (compressed sparse attention); ``inv_freq`` / ``scaling``: the rotary table of the compressed
    positions; ``name``: the prefix of its state parts (a layer's indexer keeps its own beside the
    attention's compressor)."""

    def __init__(
        self,
        hidden: int,
        spec: CompressedEntries,
        overlap: bool,
        eps: float,
        inv_freq: torch.Tensor,
        scaling: float = 1.0,
        name: str = "",
    ):
        super().__init__()
        self.spec, self.dim, self.rate, self.overlap = spec, spec.dim, spec.rate, overlap
        self.width = 2 * spec.dim if overlap else spec.dim
        self.name = name
        self.kv_proj = Linear(hidden, self.width, bias=False)
        self.gate_proj = Linear(hidden, self.width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(self.rate, self.width, dtype=torch.float32))
        self.norm = GptOssRMSNorm(self.dim, eps)
        self.inv_freq = inv_freq.float().clone()  # not a buffer: float32 in any model dtype
        self.scaling = scaling

    # ---- the per-request state ------------------------------------------------------------------
    def state_parts(self, dtype: str) -> tuple[tuple[str, ...], tuple, tuple[str, ...]]:
        """(names, shapes, dtypes) of this compressor's parts of a ``CompressorState`` for a model
        of ``dtype`` (a ``kv_spec.DTYPE_BYTES`` name)."""
        r, w, d, n = self.rate, self.width, self.dim, self.name
        parts = [(f"{n}kv", (r, w), dtype), (f"{n}gate", (r, w), dtype)]
        if self.overlap:
            parts += [(f"{n}overlap_kv", (r, d), dtype), (f"{n}overlap_gate", (r, d), "float32")]
        names, shapes, dtypes = zip(*parts)
        return names, shapes, dtypes

    def _state(self, pool: Any, index: int) -> dict[str, torch.Tensor]:
        parts = ("kv", "gate") + (("overlap_kv", "overlap_gate") if self.overlap else ())
        return {p: pool.state(f"{self.name}{p}", index) for p in parts}

    # ---- the forward ----------------------------------------------------------------------------
    def forward(
        self,
        h: torch.Tensor,
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        state_pool: Any,
        state_index: int,
        slots: Sequence[int],
        entries: torch.Tensor,
        page_tables: Sequence[Sequence[int]],
        page_size: int,
        snapshots: Optional[Sequence[int]] = None,
    ) -> None:
        """Compress the new tokens ``h`` [T, hidden] of a batch (request i: ``extend_lens[i]``
        tokens after ``prefix_lens[i]``): write the entries of the windows they close into
        ``entries`` [num_pages, entries_per_page, dim] at the pages ``page_tables[i]`` (logical
        page -> pool page) and carry the open window into the request's state slot
        ``slots[i]`` (and, with ``snapshots[i]``, the state at the last page boundary crossed
        into that slot)."""
        kv_all, gate_all = self.kv_proj(h), self.gate_proj(h)
        state = self._state(state_pool, state_index)
        start = 0
        for i, (prefix, n) in enumerate(zip(prefix_lens, extend_lens)):
            if n:
                self._one(
                    kv_all[start : start + n],
                    gate_all[start : start + n],
                    prefix,
                    state,
                    int(slots[i]),
                    entries,
                    page_tables[i],
                    page_size,
                    int(snapshots[i]) if snapshots is not None else 0,
                )
            start += n

    def _one(self, kv_new, gate_new, prefix, state, slot, entries, pages, page_size, snapshot):
        r, d = self.rate, self.dim
        held = prefix % r  # the open window's tokens before this extend
        seq_kv = torch.cat([state["kv"][slot, :held].to(kv_new.dtype), kv_new])
        seq_gate = torch.cat([state["gate"][slot, :held].to(gate_new.dtype), gate_new])
        origin = prefix - held  # the absolute position of seq row 0 (a window's first token)
        windows, first = seq_kv.shape[0] // r, prefix // r
        old_overlap = None
        if self.overlap and first >= 1:
            old_overlap = (state["overlap_kv"][slot].clone(), state["overlap_gate"][slot].clone())
        chunk_kv = chunk_gate = None
        if windows:
            chunk_kv = seq_kv[: windows * r].view(windows, r, self.width)
            chunk_gate = seq_gate[: windows * r].view(windows, r, self.width) + self.position_bias
            if self.overlap:
                kv = chunk_kv.new_zeros((windows, 2 * r, d))
                gate = chunk_gate.new_full((windows, 2 * r, d), float("-inf"))
                kv[:, r:], gate[:, r:] = chunk_kv[..., d:], chunk_gate[..., d:]
                kv[1:, :r], gate[1:, :r] = chunk_kv[:-1, :, :d], chunk_gate[:-1, :, :d]
                if old_overlap is not None:
                    kv[0, :r] = old_overlap[0].to(kv.dtype)
                    gate[0, :r] = old_overlap[1].to(gate.dtype)
            else:
                kv, gate = chunk_kv, chunk_gate
            pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
            positions = (torch.arange(windows, device=kv.device) + first) * r
            out = rotate_trailing(self.norm(pooled), positions, self.inv_freq, self.scaling)
            page, row = self.spec.entry_location(positions // r, page_size)
            ids = torch.as_tensor(pages, device=entries.device)[page]
            entries[ids, row] = out.to(entries.dtype)
        if snapshot:
            boundary = (prefix + kv_new.shape[0]) // page_size * page_size
            if boundary > prefix:
                self._write(
                    state, snapshot, seq_kv, seq_gate, origin, boundary, first,
                    chunk_kv, chunk_gate, old_overlap,
                )  # fmt: skip
        self._write(
            state, slot, seq_kv, seq_gate, origin, prefix + kv_new.shape[0], first,
            chunk_kv, chunk_gate, old_overlap,
        )  # fmt: skip

    def _write(self, state, slot, seq_kv, seq_gate, origin, tokens, first, chunk_kv, chunk_gate,
               old_overlap) -> None:  # fmt: skip
        """Slot ``slot`` takes the state after ``tokens`` tokens of the sequence (the open window's
        rows are seq rows from ``origin``; the windows closed in this extend, from ``first``, are
        ``chunk_kv`` / ``chunk_gate``)."""
        r = self.rate
        lo = tokens - tokens % r - origin
        rows = tokens % r
        if rows:
            state["kv"][slot, :rows] = seq_kv[lo : lo + rows].to(state["kv"].dtype)
            state["gate"][slot, :rows] = seq_gate[lo : lo + rows].to(state["gate"].dtype)
        if not self.overlap:
            return
        last = tokens // r - 1  # the last window closed after ``tokens`` tokens
        if last >= first:
            src = (chunk_kv[last - first, :, : self.dim], chunk_gate[last - first, :, : self.dim])
        elif last >= 0 and old_overlap is not None:
            src = old_overlap
        else:
            return  # no window closed yet: nothing the next entry reads
        state["overlap_kv"][slot] = src[0].to(state["overlap_kv"].dtype)
        state["overlap_gate"][slot] = src[1].to(state["overlap_gate"].dtype)


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer: its compressor's keys (``index_k``), its queries from
    the attention's low-rank query, and per query the ``index_topk`` entries of the highest
    ``sum_h w_h relu(q_h . k)`` among those closed."""

    def __init__(self, config, inv_freq: torch.Tensor, scaling: float):
        super().__init__()
        self.heads, self.dim, self.topk = (
            config.index_n_heads,
            config.index_head_dim,
            config.index_topk,
        )
        self.rate = config.compress_rates[CSA]
        self.wq_b = Linear(config.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = Linear(config.hidden_size, self.heads, bias=False)
        spec = CompressedEntries(self.dim, self.rate, part="index_k")
        self.compressor = Compressor(
            config.hidden_size, spec, True, config.rms_norm_eps, inv_freq, scaling, "index_"
        )
        self.inv_freq = inv_freq.float().clone()  # not a buffer: float32 in any model dtype
        self.scaling = scaling

    def masks(self, h, q_resid, fb: ForwardBatch, keys: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per request, [extend, entries] True at the entries each new token attends to."""
        t = h.shape[0]
        q = self.wq_b(q_resid).view(t, self.heads, self.dim)
        q = rotate_trailing(q, fb.positions, self.inv_freq, self.scaling)
        weights = self.weights_proj(h).float() * self.heads**-0.5
        out = []
        for i, (start, ext) in enumerate(zip(fb.extend_starts, fb.extend_lens)):
            k = keys[i].float().t()  # [dim, E]
            pos = fb.positions[start : start + ext]
            score = torch.empty((ext, k.shape[1]), dtype=torch.float32)
            rows = max(1, (1 << 24) // max(1, self.heads * k.shape[1]))  # [rows, H, E] at a time
            for a in range(0, ext, rows):
                b = min(ext, a + rows)
                part = torch.relu(torch.matmul(q[start + a : start + b].float(), k))
                part = part * self.dim**-0.5  # [rows, H, E]
                score[a:b] = (part * weights[start + a : start + b].unsqueeze(-1)).sum(dim=1)
            closed = torch.arange(k.shape[1])[None, :] < ((pos + 1) // self.rate)[:, None]
            score = score.masked_fill(~closed, float("-inf"))
            keep = torch.zeros_like(closed)
            n = min(self.topk, k.shape[1])
            if n:
                # the highest scores, the lowest entry first among equal ones
                order = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :n]
                keep.scatter_(1, order, True)
            out.append(keep & closed)
        return out
