"""CPU attention over the paged pool with pdserve's kernels (``kernels/csrc``); pages are read in
place, never gathered.

- bf16 compute and KV (at any tier but scalar: AVX-512 BF16 / AMX, or the 8-lane AVX2 / NEON
  code; head_dim a multiple of 16): every row of the batch, decode and prefill alike, in one call
  of the flash kernel (``flash_attention.cpp``).
- otherwise (float32, or the scalar tier): decode rows by the paged decode kernel
  (``paged_attention.cpp``), extend rows as the torch backend does (SDPA over the new tokens and
  the gathered prefix).
- a quantized pool (``--kv-cache-dtype int8|fp8_*``, ``engine/kv_quant.py``) goes where its bf16
  or float32 counterpart goes, the kernels reading its bytes and scales in place
  (``kernel_caches``); int8 scales are copied to scratch pages with their rows.

With ``deterministic`` (``--enable-deterministic-inference``) a row's attention does not depend on
the other rows of the forward, on how its request's rows are split into chunks, or on a cached
prefix: the flash kernel's key blocks start at multiples of 64 (always); without it, every row,
prefill rows too, runs the paged decode kernel as its own query (blocks of 16 keys from position
0), instead of SDPA over the new tokens.

Rows of a speculative tree (``ForwardBatch.trees``) see only their ancestors among the row's
slots. Each of their tokens runs as a one-query row of the kernel that runs decode rows, over a
plain sequence: the request's pages up to the one holding the row's first slot, then scratch
pages (``BaseKVPool.scratch``) into which that page's earlier keys and the token's ancestors'
keys are copied in position order. The kernels' key blocks sit at fixed positions, so each
token's attention has the bits of a plain decode step at its position (speculation gives exactly
the tokens of plain decoding). Without scratch pages (a pool built by hand) they run as the
torch backend runs extend rows, under their mask.

Both kernels take the layer's attention sinks (float32, one per query head): the online softmax
starts from the sink as its running max with a running sum of 1, which is the extra softmax column.

The kernels take no per-KV-head key mask (block-sparse attention, ``AttentionBackend.forward``'s
``key_mask``): such layers run on the torch backend's path (a ``TorchAttnBackend`` set up for the
forward on their first call), the model's other layers on the kernels. Those layers' decode rows
are then batched through SDPA, not independent of the batch: ``deterministic`` refuses such models.
"""

from __future__ import annotations

from typing import Optional

import torch

from pdserve.forward_batch import ForwardBatch, GroupTable
from pdserve.layers.attention.torch_backend import (
    TorchAttnBackend,
    absorbed_query,
    page_heads,
    write_rows,
)


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
                    "attention_backend 'cpu' needs pdserve's CPU kernels: "
                    f"{kernels.unavailable_reason()}"
                )
        self.ops = ops

    def check_supported(self, cache_kinds, layers, model: str) -> None:
        layers = list(layers)
        super().check_supported(cache_kinds, layers, model)
        # (read only for such layers: the rest of the check needs no instance state)
        if any(layer.key_masked for layer in layers) and self.deterministic:
            raise ValueError(
                f"enable_deterministic_inference: the block-sparse attention layers of {model} "
                "(a key mask per KV head) run on the torch path, whose rows are not independent "
                "of the batch"
            )

    def uses_flash(self, fb: ForwardBatch) -> bool:
        return all(
            g.pool.kv_heads
            and self.compute_dtype == torch.bfloat16
            and (g.pool.dtype == torch.bfloat16 or getattr(g.pool, "quant", None) is not None)
            and self.ops.flash_supported(g.pool.head_dim)
            for g in fb.groups
            if g.paged
        )  # no latent pages; a quantized pool's blocks are dequantized by the kernel

    def is_decode_row(self, fb: ForwardBatch, i: int) -> bool:
        # one new token, whatever its prefix: its K/V are in the pool before the kernel runs
        return fb.extend_lens[i] == 1 and not fb.is_tree(i)

    def init_forward(self, fb: ForwardBatch) -> None:
        self._flash = None
        self._rowwise = None
        self._masked: Optional[TorchAttnBackend] = None  # the torch path of key-masked layers
        self._virtual = self._init_virtual(fb) if fb.trees else None
        self._row_cache: dict[
            int, tuple[torch.Tensor, torch.Tensor]
        ] = {}  # group -> per-token tables
        if not self.uses_flash(fb):
            if self.deterministic:
                return self._init_rowwise(fb)
            return super().init_forward(fb)
        self._fb = fb
        self._ext_masks = {}
        rows = [i for i in range(fb.batch_size) if not fb.is_tree(i)]
        lens = [fb.extend_lens[i] for i in rows]
        starts = torch.zeros(len(rows) + 1, dtype=torch.int32)
        starts[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
        self._starts = starts
        # the tokens of the kernel's rows (None: every token) and the tree rows
        self._flash_tokens, self._trees = None, []
        if len(rows) < fb.batch_size:
            first = fb.extend_starts
            self._flash_tokens = torch.tensor(
                [t for i in rows for t in range(first[i], first[i] + fb.extend_lens[i])],
                dtype=torch.long,
            )
            if self._virtual is None:  # under their masks
                self._trees = [
                    (i, first[i], fb.extend_lens[i], fb.prefix_lens[i]) for i in sorted(fb.trees)
                ]
        sel = None if self._flash_tokens is None else torch.tensor(rows, dtype=torch.long)
        # per group: (write rows, page table, seq lens) of the kernel's rows
        self._flash = []
        for i, g in enumerate(fb.groups):
            if not g.paged:
                self._flash.append(None)
                continue
            table, seq = fb.int32_tables(i)
            if sel is not None:
                table, seq = table[sel], seq[sel]
            self._flash.append((write_rows(g, fb.out_offsets), table, seq))

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
        window = layer.span or 0
        sinks = _float32(sinks)
        kc, vc, quant = kernel_caches(kc, vc, self._scales)
        if sel is None:
            self.ops.paged_decode_attention(
                out[:n], q[:n], kc, vc, table, lens, layer.scale, window, sinks, **quant
            )
        else:
            o = torch.empty((n,) + tuple(q.shape[1:]), dtype=q.dtype)
            self.ops.paged_decode_attention(
                o, q.index_select(0, sel), kc, vc, table, lens, layer.scale, window, sinks, **quant
            )
            out[sel] = o

    def rows_elsewhere(self, fb: ForwardBatch) -> set[int]:
        return set(fb.trees) if self._virtual is not None else set()

    # ---- tree rows as one-query rows over scratch pages ---------------------------------------
    def _init_virtual(self, fb: ForwardBatch) -> Optional[list]:
        """Per turn (as many tree tokens as the scratch pages hold): (the tokens [V], per group
        (source rows, scratch rows, page table [V, W], lengths [V]) or None, query starts)."""
        paged = [g for g in fb.groups if g.paged]
        if any(not g.pool.scratch for g in paged):
            return None
        page = paged[0].pool.page_size
        first = fb.extend_starts
        items = []  # (row, token index, position, row's first slot, the key slots from it)
        for i in sorted(fb.trees):
            tree = fb.trees[i]
            for t in range(fb.extend_lens[i]):
                keys = tree.visible[t].nonzero().flatten().tolist()
                keys.sort(key=lambda s: int(tree.key_positions[s]))
                pos = int(fb.positions[first[i] + t])
                if [int(tree.key_positions[s]) for s in keys] != list(range(tree.base, pos + 1)):
                    raise AssertionError(f"row {i} token {t}: its keys are not positions to {pos}")
                items.append((i, first[i] + t, pos, tree.base, keys))
        room = min(len(g.pool.scratch) for g in paged)
        turns, turn, used = [], [], 0
        for item in items:
            need = -(-(item[2] + 1 - item[3] // page * page) // page)
            if used + need > room:
                turns.append(turn)
                turn, used = [], 0
            turn.append((item, used, need))
            used += need
        turns.append(turn)
        return [self._virtual_turn(fb, turn, page) for turn in turns]

    def _virtual_turn(self, fb: ForwardBatch, turn: list, page: int) -> tuple:
        tokens = torch.tensor([item[1] for item, _, _ in turn], dtype=torch.long)
        lens = torch.tensor([item[2] + 1 for item, _, _ in turn], dtype=torch.int32)
        width = max(item[3] // page + need for item, _, need in turn)
        groups = []
        for g in fb.groups:
            if not g.paged:
                groups.append(None)
                continue
            table = torch.zeros((len(turn), width), dtype=torch.int32)
            src, dst = [], []
            for v, ((i, _, _, base, keys), at, need) in enumerate(turn):
                real = g.page_table[i].tolist()
                full, scratch = base // page, g.pool.scratch[at : at + need]
                table[v, :full] = torch.tensor(real[:full], dtype=torch.int32)
                table[v, full : full + need] = torch.tensor(scratch, dtype=torch.int32)
                for j, p in enumerate(list(range(full * page, base)) + [base + s for s in keys]):
                    src.append((real[p // page], p % page))
                    dst.append((scratch[j // page], j % page))
            groups.append((_rows(g, src), _rows(g, dst), table, lens))
        return tokens, groups, torch.arange(len(turn) + 1, dtype=torch.int32)

    def _virtual_rows(self, out, q, kc, vc, layer, group, sinks) -> None:
        head_dim = kc.shape[3]
        kf, vf = kc.view(-1, head_dim), vc.view(-1, head_dim)
        scales = self._scales  # a quantized pool's: int8 scales are copied with their rows
        per_row = [] if scales is None or scales.k is None else [scales.k, scales.v]
        kq, vq, quant = kernel_caches(kc, vc, scales)
        for tokens, groups, starts in self._virtual:
            src, dst, table, lens = groups[group]
            for flat in (kf, vf, *(t.view(-1) for t in per_row)):
                flat.index_copy_(0, dst, flat.index_select(0, src))
            qq = q.index_select(0, tokens)
            o = torch.empty_like(qq)
            window = layer.span or 0
            if self._flash is not None:  # as the flash kernel runs decode rows
                self.ops.paged_attention_bf16(
                    o, qq, kq, vq, table, lens, starts, layer.scale, window, sinks, **quant
                )
            else:
                self.ops.paged_decode_attention(
                    o, qq, kq, vq, table, lens, layer.scale, window, sinks, **quant
                )
            out[tokens] = o

    def _virtual_latent(self, out, layer, q_nope, q_rope, cache, group, w_kc, w_vc) -> None:
        flat = cache.view(-1, cache.shape[-1])
        for tokens, groups, _ in self._virtual:
            src, dst, table, lens = groups[group]
            flat.index_copy_(0, dst, flat.index_select(0, src))
            q = absorbed_query(q_nope, q_rope, w_kc, tokens).to(cache.dtype)
            o = q.new_empty(q.shape[:2] + (w_kc.shape[2],))
            self.ops.mla_decode_attention(
                o, q.contiguous(), cache, table, lens, layer.scale, w_kc.shape[2], None
            )
            out[tokens] = torch.einsum("bhr,hvr->bhv", o.to(q_nope.dtype), w_vc)

    def drop_forward_state(self) -> None:
        super().drop_forward_state()
        self._masked = None

    def forward(self, layer, q, k, v, fb, sinks=None, key_mask=None):
        if key_mask is not None:  # the kernels take no key mask: the torch path
            if self._masked is None:
                self._masked = TorchAttnBackend()
                self._masked.init_forward(fb)
            return self._masked.forward(layer, q, k, v, fb, sinks, key_mask)
        if self._flash is None and self._rowwise is None:
            out = super().forward(layer, q, k, v, fb, sinks)
            if self._virtual is not None:
                kc, vc = fb.kv(layer.layer_id)
                group = fb.layer_group[layer.layer_id]
                self._virtual_rows(out, q, kc, vc, layer, group, _float32(sinks))
            return out
        assert (sinks is not None) == layer.has_sinks, (
            f"layer {layer.layer_id}: sinks must come exactly with has_sinks"
        )
        group = fb.layer_group[layer.layer_id]
        kc, vc = fb.kv(layer.layer_id)  # [P, kv_heads, page, D]
        rows, table, lens = (self._flash or self._rowwise)[group]
        head_dim = kc.shape[3]
        scales = self._scales = fb.kv_scales(layer.layer_id)  # (tree rows' _extend_row reads it)
        if layer.stores_kv:  # (not: another layer's cache, which that layer wrote)
            if scales is not None:  # a quantized pool
                scales.store(kc, vc, rows, k, v)
            else:
                kc.view(-1, head_dim).index_copy_(0, rows, k.reshape(-1, head_dim).to(kc.dtype))
                vc.view(-1, head_dim).index_copy_(0, rows, v.reshape(-1, head_dim).to(vc.dtype))
        out = torch.empty_like(q)
        if self._rowwise is not None:
            kq, vq, quant = kernel_caches(kc, vc, scales)
            self.ops.paged_decode_attention(
                out,
                q,
                kq,
                vq,
                table,
                lens,
                layer.scale,
                layer.span or 0,
                _float32(sinks),
                **quant,
            )
        else:
            sel = self._flash_tokens
            if sel is None or sel.numel():
                o = out if sel is None else torch.empty((sel.numel(),) + q.shape[1:], dtype=q.dtype)
                kq, vq, quant = kernel_caches(kc, vc, scales)
                self.ops.paged_attention_bf16(
                    o,
                    q if sel is None else q.index_select(0, sel),
                    kq,
                    vq,
                    table,
                    lens,
                    self._starts,
                    layer.scale,
                    layer.span or 0,
                    _float32(sinks),
                    **quant,
                )
                if sel is not None:
                    out[sel] = o
            if self._virtual is not None:
                self._virtual_rows(out, q, kc, vc, layer, group, _float32(sinks))
            page, pages = kc.shape[2], fb.groups[group].page_table
            for row, start, ext, prefix in self._trees:
                mine = pages[row, : -(-(prefix + ext) // page)]
                self._extend_row(out, q, k, v, kc, vc, mine, row, start, ext, prefix, layer, sinks)
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
            out = super().forward_latent(layer, q_nope, q_rope, latent, fb, w_kc, w_vc, selection)
            if self._virtual is not None:
                group = fb.cache_group(layer.layer_id, "latent_attention")
                cache = fb.latent(layer.layer_id)
                self._virtual_latent(out, layer, q_nope, q_rope, cache, group, w_kc, w_vc)
            return out
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


def _rows(g: GroupTable, where: list[tuple[int, int]]) -> torch.Tensor:
    """Rows of (page, offset) pairs, every head of each, in the pool's [rows, dim] view."""
    heads, page = page_heads(g.pool), g.pool.page_size
    at = torch.tensor(where, dtype=torch.long).view(-1, 2)
    h = torch.arange(heads)
    return ((at[:, :1] * heads + h[None, :]) * page + at[:, 1:]).reshape(-1)


def kernel_caches(kc: torch.Tensor, vc: torch.Tensor, scales) -> tuple:
    """(K, V, keyword arguments) as the decode kernel reads a pool's caches: fp8 bits as their
    float8 dtype with the layer's scales, int8 with its per-row scales (``kv_quant.LayerScales``;
    None: a float pool, as it is)."""
    if scales is None:
        return kc, vc, {}
    if scales.quant.per_token:
        return kc, vc, {"k_scales": scales.k, "v_scales": scales.v}
    fmt = scales.quant.values
    return kc.view(fmt), vc.view(fmt), {"k_scale": scales.k_tensor, "v_scale": scales.v_tensor}


def _float32(sinks: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The sinks as the kernels take them: float32, contiguous (a bf16 model's parameter is cast
    at each call; it is one value per head)."""
    return None if sinks is None else sinks.detach().float().contiguous()
