"""CPU attention over the paged pool with pdserve's kernels (``kernels/csrc``); pages are read in
place, never gathered.

- bf16 compute and KV (on CPUs with avx512_bf16, head_dim a multiple of 16): every row of the batch,
  decode and prefill alike, in one call of the flash kernel (``flash_attention.cpp``).
- otherwise (float32, or no avx512_bf16): decode rows by the paged decode kernel
  (``paged_attention.cpp``), extend rows as the torch backend does (SDPA over the new tokens and
  the gathered prefix).

With ``deterministic`` (``--enable-deterministic-inference``) a row's attention does not depend on
the other rows of the forward, on how its request's rows are split into chunks, or on a cached
prefix: the flash kernel's key blocks start at multiples of 64 (always); without it, every row,
prefill rows too, runs the paged decode kernel as its own query (blocks of 16 keys from position
0), instead of SDPA over the new tokens.

Both kernels take the layer's attention sinks (float32, one per query head): the online softmax
starts from the sink as its running max with a running sum of 1, which is the extra softmax column.
"""

from __future__ import annotations

from typing import Optional

import torch

from pdserve.forward_batch import ForwardBatch
from pdserve.layers.attention.torch_backend import TorchAttnBackend, absorbed_query, write_rows


class CpuAttnBackend(TorchAttnBackend):
    name = "cpu"
    supports_softcap = False  # the kernels have no soft-cap; such models run on the torch backend
    supports_sinks = True  # both kernels take them

    def __init__(
        self,
        ops=None,
        compute_dtype: torch.dtype = torch.bfloat16,
        deterministic: bool = False,
        **_,
    ):
        super().__init__()
        self._absorb: dict[
            int, tuple[list, list]
        ] = {}  # latent layer -> its heads' up-projections (deterministic)
        self.compute_dtype = compute_dtype
        self.deterministic = deterministic
        if ops is None:
            from pdserve import kernels

            ops = kernels.load()
            if ops is None:
                raise RuntimeError(
                    f"attention_backend 'cpu' needs pdserve's CPU kernels: {kernels.unavailable_reason()}"
                )
        self.ops = ops

    def uses_flash(self, fb: ForwardBatch) -> bool:
        return all(
            g.pool.kv_heads
            and g.pool.dtype == self.compute_dtype == torch.bfloat16
            and self.ops.flash_supported(g.pool.head_dim)
            for g in fb.groups
            if g.paged
        )  # no latent pages

    def is_decode_row(self, fb: ForwardBatch, i: int) -> bool:
        # one new token, whatever its prefix: its K/V are in the pool before the kernel runs
        return fb.extend_lens[i] == 1

    def init_forward(self, fb: ForwardBatch) -> None:
        self._flash = None
        self._rowwise = None
        self._row_cache: dict[
            int, tuple[torch.Tensor, torch.Tensor]
        ] = {}  # group -> per-token tables
        if not self.uses_flash(fb):
            if self.deterministic:
                return self._init_rowwise(fb)
            return super().init_forward(fb)
        self._fb = fb
        starts = torch.zeros(fb.batch_size + 1, dtype=torch.int32)
        starts[1:] = torch.tensor(fb.extend_lens, dtype=torch.int32).cumsum(0)
        # per group: (write rows, page table, seq lens)
        self._flash = [
            (write_rows(g, fb.out_offsets), *fb.int32_tables(i)) if g.paged else None
            for i, g in enumerate(fb.groups)
        ]
        self._starts = starts

    def _init_rowwise(self, fb: ForwardBatch) -> None:
        """Every new token as one decode query: its request's page table, its own length."""
        self._fb = fb
        self._rowwise = [
            (write_rows(g, fb.out_offsets), *self._row_tables(fb, i)) if g.paged else None
            for i, g in enumerate(fb.groups)
        ]

    def init_decode(self, fb: ForwardBatch, dec: list[int]) -> None:
        self._dec = None
        if not dec:
            return
        rows = [fb.extend_starts[i] for i in dec]
        tables = [fb.int32_tables(g) for g in range(len(fb.groups))]
        if rows == list(range(len(rows))):  # decode rows lead the batch: views, not copies
            self._dec = (None, len(dec), [(t[: len(dec)], n[: len(dec)]) for t, n in tables])
        else:
            idx = torch.tensor(dec, dtype=torch.long)
            self._dec = (
                torch.tensor(rows, dtype=torch.long),
                len(dec),
                [(t[idx], n[idx]) for t, n in tables],
            )

    def decode(self, out, q, kc, vc, layer, group, sinks) -> None:
        if self._dec is None:
            return
        sel, n, tables = self._dec
        table, lens = tables[group]
        window = layer.sliding_window or 0
        sinks = _float32(sinks)
        if sel is None:
            self.ops.paged_decode_attention(
                out[:n], q[:n], kc, vc, table, lens, layer.scale, window, sinks
            )
        else:
            o = torch.empty((n,) + tuple(q.shape[1:]), dtype=q.dtype)
            self.ops.paged_decode_attention(
                o, q.index_select(0, sel), kc, vc, table, lens, layer.scale, window, sinks
            )
            out[sel] = o

    def forward(self, layer, q, k, v, fb, sinks=None):
        if self._flash is None and self._rowwise is None:
            return super().forward(layer, q, k, v, fb, sinks)
        assert (sinks is not None) == layer.has_sinks, (
            f"layer {layer.layer_id}: sinks must come exactly with has_sinks"
        )
        group = fb.layer_group[layer.layer_id]
        kc, vc = fb.kv(layer.layer_id)  # [P, kv_heads, page, D]
        rows, table, lens = (self._flash or self._rowwise)[group]
        head_dim = kc.shape[3]
        kc.view(-1, head_dim).index_copy_(0, rows, k.reshape(-1, head_dim).to(kc.dtype))
        vc.view(-1, head_dim).index_copy_(0, rows, v.reshape(-1, head_dim).to(vc.dtype))
        out = torch.empty_like(q)
        if self._rowwise is not None:
            self.ops.paged_decode_attention(
                out, q, kc, vc, table, lens, layer.scale, layer.sliding_window or 0, _float32(sinks)
            )
        else:
            self.ops.paged_attention_bf16(
                out,
                q,
                kc,
                vc,
                table,
                lens,
                self._starts,
                layer.scale,
                layer.sliding_window or 0,
                _float32(sinks),
            )
        return out

    # ---- latent attention (MLA) ----------------------------------------------------------------
    def decode_latent(
        self, out, layer, q_nope, q_rope, cache, group, w_kc, w_vc, selection=None
    ) -> None:
        """The decode rows on ``mla_decode_attention`` (the latent pages read in place)."""
        if self._dec is None:
            return
        sel, n, tables = self._dec
        table, lens = tables[group]
        rows = torch.arange(n) if sel is None else sel
        positions = None
        if selection is not None:  # sparse: each row's selected positions, that many
            positions, lens = selection[0][rows].contiguous(), selection[1][rows].contiguous()
        q = absorbed_query(q_nope, q_rope, w_kc, rows).to(cache.dtype)
        o = q.new_empty(q.shape[:2] + (w_kc.shape[2],))
        self.ops.mla_decode_attention(
            o, q.contiguous(), cache, table, lens, layer.scale, w_kc.shape[2], positions
        )
        out[rows] = torch.einsum("bhr,hvr->bhv", o.to(q_nope.dtype), w_vc)

    def forward_latent(self, layer, q_nope, q_rope, latent, fb, w_kc, w_vc, selection=None):
        if self._rowwise is None:
            return super().forward_latent(layer, q_nope, q_rope, latent, fb, w_kc, w_vc, selection)
        # deterministic: every row its own absorbed query on the kernel, the up-projections one
        # k-ordered chain per output (linear_f32), so nothing depends on the rest of the batch
        rows, table, lens = self._rowwise[fb.cache_group(layer.layer_id, "latent_attention")]
        positions = None
        if selection is not None:
            positions, lens = selection
        cache = fb.latent(layer.layer_id)
        dim, rank = cache.shape[-1], w_kc.shape[2]
        cache.view(-1, dim).index_copy_(0, rows, latent.to(cache.dtype))
        kc, vc = self._absorbing(layer.layer_id, w_kc, w_vc)
        q = torch.cat(
            [torch.stack([kc[h](q_nope[:, h]) for h in range(len(kc))], dim=1), q_rope.float()],
            dim=-1,
        )
        o = q.new_empty(q.shape[:2] + (rank,))
        self.ops.mla_decode_attention(o, q, cache, table, lens, layer.scale, rank, positions)
        return torch.stack([vc[h](o[:, h]) for h in range(len(vc))], dim=1).to(q_nope.dtype)

    def index_select(self, layer, q, weights, keys, fb, topk, scale):
        """The indexer on ``indexer_topk``: every new token a row with its request's pages and its
        own length."""
        group = fb.cache_group(layer.layer_id, "index_keys")
        cache = fb.index_keys(layer.layer_id)
        cache.view(-1, cache.shape[-1]).index_copy_(
            0, write_rows(fb.groups[group], fb.out_offsets), keys.to(cache.dtype)
        )
        table, lens = self._row_tables(fb, group)
        positions = torch.empty((q.shape[0], topk), dtype=torch.int32)
        counts = torch.empty(q.shape[0], dtype=torch.int32)
        self.ops.indexer_topk(
            positions,
            counts,
            q.float().contiguous(),
            weights.float().contiguous(),
            cache,
            table,
            lens,
            scale,
        )
        return positions, counts

    def _row_tables(self, fb: ForwardBatch, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per new token: its request's page table and the keys it sees (its position + 1)."""
        if group not in self._row_cache:
            if (
                not self._row_cache
            ):  # the forward's first group: which request each token is, its length
                self._row_req = torch.repeat_interleave(
                    torch.arange(fb.batch_size), torch.tensor(fb.extend_lens)
                )
                self._row_lens = torch.cat(
                    [
                        torch.arange(p + 1, p + e + 1, dtype=torch.int32)
                        for p, e in zip(fb.prefix_lens, fb.extend_lens)
                    ]
                )
            table = fb.int32_tables(group)[0].index_select(0, self._row_req).contiguous()
            self._row_cache[group] = (table, self._row_lens)
        return self._row_cache[group]

    def _absorbing(
        self, layer_id: int, w_kc: torch.Tensor, w_vc: torch.Tensor
    ) -> tuple[list, list]:
        """Per head: ``q_nope -> w_kc[h]^T q_nope`` and ``o -> w_vc[h] o`` as ``PackedF32``."""
        if layer_id not in self._absorb:
            from pdserve.layers.linear import PackedF32

            self._absorb[layer_id] = (
                [PackedF32(w.transpose(0, 1), None, self.ops) for w in w_kc],
                [PackedF32(w, None, self.ops) for w in w_vc],
            )
        return self._absorb[layer_id]


def _float32(sinks: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The sinks as the kernels take them: float32, contiguous (a bf16 model's parameter is cast
    at each call; it is one value per head)."""
    return None if sinks is None else sinks.detach().float().contiguous()
