"""Attention on the paged KV cache with ``torch.nn.functional.scaled_dot_product_attention``.

Decode rows (one new token with a prefix) are batched: their pages are gathered into a padded
[B, kv_heads, max_len, head_dim] tensor with a length mask. Extend rows (prefill, chunked
prefill, prefill after a prefix-cache hit) run one request at a time with a causal mask offset
by the prefix length. Layers with logit soft-capping or attention sinks run the same math written
out (SDPA has neither), a block of query rows at a time so the scores stay small. Correct on CPU
and CUDA; the ``cpu`` backend replaces the decode part with a kernel that reads the pages in place.

A quantized pool (``engine/kv_quant.py``) is quantized as it is written and dequantized as it is
gathered; extend rows then read every key from the pool, the new tokens' too.

Rows of a speculative tree (``ForwardBatch.trees``) run as extend rows under their tree's mask:
each token sees the sequence and its ancestors in the row, whatever their slots.

Per-forward state is kept per cache group (each group has its own pool and page ids); which rows
are decode rows is the same for every group.

Latent attention (MLA, ``forward_latent``): a latent page is one row per token (no head axis).
Decode rows attend in the absorbed form (the key up-projection folded into the query: one shared
key of R + r dims, values its first R, the value up-projection after), extend rows in the
decompressed form (per-head keys and values built from the sequence's latents), which is cheaper
where many queries share the keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from pdserve.forward_batch import ForwardBatch, GroupTable
from pdserve.layers.attention.base import AttentionBackend, AttnLayer
from pdserve.layers.attention.block_select import select_paged

# scores (float32) of at most this many (head, query, key) triples at a time on the written-out path
_MATH_BLOCK = 1 << 25


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
    softcap: Optional[float],
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``q`` [B, H, Lq, D], ``k``/``v`` [B, KVH, Lk, D], ``mask`` bool (True: attend; [..., Lq or 1,
    Lk]) or None for causal with Lq == Lk (a prefill), or one row per KV head ([B, KVH, Lq, Lk]),
    ``sinks`` [H] or None; returns [B, H, Lq, D]."""
    if mask is not None and mask.dim() == 4 and mask.shape[1] not in (1, q.shape[1]):
        mask = mask.repeat_interleave(q.shape[1] // mask.shape[1], dim=1)  # to each query head
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    lq, lk = q.shape[2], k.shape[2]
    if mask is None:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    rows = max(1, _MATH_BLOCK // (q.shape[0] * q.shape[1] * lk))
    if rows >= lq:
        return _written_out(q, k, v, mask, scale, softcap, sinks)
    out = q.new_empty(q.shape[:3] + (v.shape[3],))
    for a in range(0, lq, rows):
        block_mask = mask if mask.shape[-2] == 1 else mask[..., a : a + rows, :]
        out[:, :, a : a + rows] = _written_out(
            q[:, :, a : a + rows], k, v, block_mask, scale, softcap, sinks
        )
    return out


def _written_out(q, k, v, mask, scale, softcap, sinks) -> torch.Tensor:
    """The attention math with ``k``/``v`` already at q's head count; softmax in float32."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        # one more column per row holding its head's sink; the softmax covers it, then it is dropped
        b, h, lq, _ = scores.shape
        sink = sinks.to(device=q.device, dtype=torch.float32).view(1, h, 1, 1).expand(b, h, lq, 1)
        probs = torch.softmax(torch.cat([scores.float(), sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


@dataclass
class _Group:
    write_rows: (
        torch.Tensor
    )  # [T * kv_heads] rows of the new tokens in the pool's [rows, head_dim] view
    dec_gather: Optional[torch.Tensor]  # [Bd, kv_heads, L] rows of the decode rows' keys
    ext_pages: list[torch.Tensor]  # per extend row: the pages of its whole sequence


def page_heads(pool) -> int:
    """Rows per token in a page: its KV heads; a latent page has no head axis (one row)."""
    return pool.kv_heads or 1


def write_rows(g: GroupTable, out_offsets: torch.Tensor) -> torch.Tensor:
    """Row of each (new token, head) in the [num_pages * kv_heads * page_size, head_dim] view of
    one layer's K (or V): ((page * kv_heads + head) * page_size + offset). [T * kv_heads]"""
    page, kv_heads = g.pool.page_size, page_heads(g.pool)
    heads = torch.arange(kv_heads, device=out_offsets.device)
    return (
        (g.out_pages[:, None] * kv_heads + heads[None, :]) * page + out_offsets[:, None]
    ).reshape(-1)


class TorchAttnBackend(AttentionBackend):
    name = "torch"
    cache_kinds = frozenset(
        {
            "full_attention",
            "sliding_window",
            "chunked_attention",
            "latent_attention",
            "index_keys",
            "latent_window",
            "compressed",
        }
    )

    def __init__(self, **_):
        self._fb: Optional[ForwardBatch] = None
        self._scales = None  # the layer being attended's ``kv_quant.LayerScales`` (quantized KV)

    def is_decode_row(self, fb: ForwardBatch, i: int) -> bool:
        """Rows that take the batched decode path (the rest run as extends)."""
        return fb.extend_lens[i] == 1 and fb.prefix_lens[i] > 0 and not fb.is_tree(i)

    def init_forward(self, fb: ForwardBatch) -> None:
        self._fb = fb
        device = fb.input_ids.device
        starts, seq_lens = fb.extend_starts, fb.seq_lens
        dec = [i for i in range(fb.batch_size) if self.is_decode_row(fb, i)]
        skip = set(dec) | self.rows_elsewhere(fb)
        self._ext_rows = [i for i in range(fb.batch_size) if i not in skip]
        # (row, row start, extend len, prefix len) of each extend row
        self._ext = [(i, starts[i], fb.extend_lens[i], fb.prefix_lens[i]) for i in self._ext_rows]
        self._ext_masks: dict[tuple[int, Optional[int]], torch.Tensor] = {}
        self._dec_rows = torch.tensor([starts[i] for i in dec], dtype=torch.long, device=device)
        self._dec_masks: dict[Optional[int], torch.Tensor] = {}
        self._dec = dec
        if dec:
            page = fb.groups[fb.anchor].pool.page_size
            max_len = max(seq_lens[i] for i in dec)
            self._dec_lens = torch.tensor([seq_lens[i] for i in dec], device=device)
            self._dec_kpos = torch.arange(-(-max_len // page) * page, device=device)  # [L]
        self._groups = [self._init_group(fb, g) if g.paged else None for g in fb.groups]
        self.init_decode(fb, dec)

    def _init_group(self, fb: ForwardBatch, g: GroupTable) -> _Group:
        page, kv_heads = g.pool.page_size, page_heads(g.pool)
        seq_lens = fb.seq_lens
        gather = None
        if self._dec:
            kpos = self._dec_kpos
            dec_pages = g.page_table[self._dec, : kpos.numel() // page]  # [Bd, max_pages]
            tok_page = dec_pages[:, kpos // page]  # [Bd, L]
            heads = torch.arange(kv_heads, device=kpos.device)
            gather = (tok_page[:, None, :] * kv_heads + heads[None, :, None]) * page + (
                kpos % page
            )[None, None, :]
        ext_pages = [g.page_table[i, : -(-seq_lens[i] // page)] for i in self._ext_rows]
        return _Group(write_rows(g, fb.out_offsets), gather, ext_pages)

    def rows_elsewhere(self, fb: ForwardBatch) -> set[int]:
        """Rows a subclass attends itself after this backend's work (the ``cpu`` backend's tree
        rows)."""
        return set()

    def init_decode(self, fb: ForwardBatch, dec: list[int]) -> None:
        """Extra per-forward state for the decode rows (the ``cpu`` backend's kernel tables)."""

    # ---- decode rows: gather + SDPA -------------------------------------------------------------
    def _decode_mask(self, span: Optional[int]) -> torch.Tensor:
        """[Bd, 1, 1, L]: the keys each decode row sees (``AttnLayer.span``)."""
        m = self._dec_masks.get(span)
        if m is None:
            kpos = self._dec_kpos[None, :]  # [1, L]
            lens = self._dec_lens[:, None]  # [Bd, 1]; the query sits at position len - 1
            m = kpos < lens
            if span is not None:
                m &= in_span(lens - 1, kpos, span)
            m = m[:, None, None, :]  # [Bd, 1, 1, L]
            self._dec_masks[span] = m
        return m

    def decode(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        layer: AttnLayer,
        group: int,
        sinks: Optional[torch.Tensor],
        key_mask=None,
    ) -> None:
        """Attention of the decode rows, written into their rows of ``out``."""
        if not self._dec_rows.numel():
            return
        gather = self._groups[group].dec_gather
        head_dim = kc.shape[3]
        if self._scales is not None:  # a quantized pool: dequantized as gathered
            kk = self._scales.rows(kc, "k", gather, q.dtype)  # [Bd, kv_heads, L, D]
            vv = self._scales.rows(vc, "v", gather, q.dtype)
        else:
            kk = kc.view(-1, head_dim)[gather]  # [Bd, kv_heads, L, D]
            vv = vc.view(-1, head_dim)[gather]
        qq = q[self._dec_rows].unsqueeze(2)  # [Bd, heads, 1, D]
        mask = self._decode_mask(layer.span)
        if key_mask is not None:  # [Bd, kv_heads, 1, L]
            mask = mask & key_mask.rows(self._dec_rows, mask.shape[-1])[:, :, None, :]
        o = attention(
            qq,
            kk.to(q.dtype),
            vv.to(q.dtype),
            mask,
            layer.scale,
            layer.logit_softcap,
            sinks,
        )
        out[self._dec_rows] = o.squeeze(2)

    # ---- extend rows -----------------------------------------------------------------------------
    def _extend_mask(
        self, fb: ForwardBatch, row: int, start: int, ext: int, prefix: int, window, device
    ) -> Optional[torch.Tensor]:
        """[ext, prefix + ext] keys each of row ``row``'s tokens sees (None: plain causal)."""
        tree = fb.trees.get(row) if fb.trees else None
        if prefix == 0 and window is None and tree is None:
            return None  # plain causal
        key = (row, window)
        m = self._ext_masks.get(key)
        if m is None:
            m = extend_mask(fb, row, start, ext, prefix, window, device)
            self._ext_masks[key] = m
        return m

    def _extend_row(
        self, out, q, k, v, kc, vc, pages, row, start, ext, prefix, layer, sinks, key_mask=None
    ):
        """One extend row's attention, written into its rows of ``out``."""
        kv_heads, head_dim = kc.shape[1], kc.shape[3]
        qq = q[start : start + ext].transpose(0, 1).unsqueeze(0)  # [1, heads, ext, D]
        seq = prefix + ext
        if self._scales is not None:
            # a quantized pool: every key as the cache holds it, the new tokens' too, so a row's
            # attention does not depend on how its prompt was chunked or cached
            kp = self._scales.pages(kc, "k", pages, q.dtype)  # [n_pages, kv_heads, page, D]
            vp = self._scales.pages(vc, "v", pages, q.dtype)
            kk = kp.permute(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, :seq]
            vv = vp.permute(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, :seq]
        elif prefix == 0:
            kk = k[start : start + ext].transpose(0, 1)  # [kv_heads, ext, D]
            vv = v[start : start + ext].transpose(0, 1)
        else:
            # [n_pages, kv_heads, page, D] -> [kv_heads, n_pages * page, D] -> first seq tokens
            kk = kc[pages].permute(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, :seq]
            vv = vc[pages].permute(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, :seq]
        mask = self._extend_mask(self._fb, row, start, ext, prefix, layer.span, q.device)
        if key_mask is not None:  # [1, kv_heads, ext, seq]
            if mask is None:
                mask = extend_mask(self._fb, row, start, ext, prefix, None, q.device)
            tokens = torch.arange(start, start + ext, device=q.device)
            mask = (mask & key_mask.rows(tokens, seq).transpose(0, 1)).unsqueeze(0)
        o = attention(
            qq,
            kk.unsqueeze(0).to(q.dtype),
            vv.unsqueeze(0).to(q.dtype),
            mask,
            layer.scale,
            layer.logit_softcap,
            sinks,
        )
        out[start : start + ext] = o[0].transpose(0, 1)

    def store(self, layer: AttnLayer, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch):
        """Write the new tokens' K/V into the layer's pool; returns (group, K cache, V cache)."""
        group = fb.layer_group[layer.layer_id]
        kc, vc = fb.kv(layer.layer_id)  # [P, kv_heads, page, D]
        head_dim = kc.shape[3]
        rows = self._groups[group].write_rows
        self._scales = fb.kv_scales(layer.layer_id)
        if not layer.stores_kv:  # another layer's cache, which that layer wrote
            return group, kc, vc
        if self._scales is not None:  # quantized on write
            self._scales.store(kc, vc, rows, k, v)
            return group, kc, vc
        kc.view(-1, head_dim).index_copy_(0, rows, k.reshape(-1, head_dim).to(kc.dtype))
        vc.view(-1, head_dim).index_copy_(0, rows, v.reshape(-1, head_dim).to(vc.dtype))
        return group, kc, vc

    def forward(self, layer, q, k, v, fb, sinks=None, key_mask=None):
        assert (sinks is not None) == layer.has_sinks, (
            f"layer {layer.layer_id}: sinks must come exactly with has_sinks"
        )
        group, kc, vc = self.store(layer, k, v, fb)
        out = torch.empty_like(q)
        if key_mask is None:
            self.decode(out, q, kc, vc, layer, group, sinks)
        else:  # the gather path, whatever decode a subclass runs
            TorchAttnBackend.decode(self, out, q, kc, vc, layer, group, sinks, key_mask)
        ext_pages = self._groups[group].ext_pages
        for idx, (row, start, ext, prefix) in enumerate(self._ext):
            pages = ext_pages[idx]
            self._extend_row(
                out, q, k, v, kc, vc, pages, row, start, ext, prefix, layer, sinks, key_mask
            )
        return out

    # ---- latent attention (MLA) ------------------------------------------------------------------
    def forward_latent(self, layer, q_nope, q_rope, latent, fb, w_kc, w_vc, selection=None):
        group = fb.cache_group(layer.layer_id, "latent_attention")
        cache = fb.latent(layer.layer_id)  # [P, page, R + r]
        dim, rank = cache.shape[-1], w_kc.shape[2]
        cache.view(-1, dim).index_copy_(0, self._groups[group].write_rows, latent.to(cache.dtype))
        out = q_nope.new_empty(q_nope.shape[:2] + (w_vc.shape[1],))
        self.decode_latent(out, layer, q_nope, q_rope, cache, group, w_kc, w_vc, selection)
        ext_pages = self._groups[group].ext_pages
        for idx, (row, start, ext, prefix) in enumerate(self._ext):  # decompressed, per request
            seq = prefix + ext
            lat = (
                latent[start : start + ext]
                if prefix == 0
                else cache[ext_pages[idx]].reshape(-1, dim)[:seq].to(q_nope.dtype)
            )  # [S, R + r]
            c, k_rope = lat[:, :rank], lat[:, rank:]
            k = torch.cat(
                [
                    torch.einsum("sr,hnr->hsn", c, w_kc),
                    k_rope.unsqueeze(0).expand(w_kc.shape[0], -1, -1),
                ],
                dim=-1,
            )  # [H, S, N + r]
            v = torch.einsum("sr,hvr->hsv", c, w_vc)  # [H, S, V]
            q = torch.cat(
                [q_nope[start : start + ext], q_rope[start : start + ext]], dim=-1
            ).transpose(0, 1)
            mask = self._extend_mask(fb, row, start, ext, prefix, layer.span, q.device)
            if selection is not None:  # sparse attention: the indexer's keys only
                mask = selected_mask(selection, torch.arange(start, start + ext), seq)
            o = attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask, layer.scale, None)
            out[start : start + ext] = o[0].transpose(0, 1)
        return out

    def decode_latent(
        self, out, layer, q_nope, q_rope, cache, group, w_kc, w_vc, selection=None
    ) -> None:
        """The decode rows in the absorbed form: one shared key head of R + r dims, values its
        first R, written into their rows of ``out``."""
        if not self._dec_rows.numel():
            return
        dim, rank = cache.shape[-1], w_kc.shape[2]
        lat = cache.view(-1, dim)[self._groups[group].dec_gather].to(
            q_nope.dtype
        )  # [Bd, 1, L, R + r]
        rows = self._dec_rows
        q = absorbed_query(q_nope, q_rope, w_kc, rows)
        mask = self._decode_mask(layer.span)
        if selection is not None:
            mask = mask & selected_mask(selection, rows, mask.shape[-1])[:, None, None, :]
        o = attention(
            q.unsqueeze(2), lat, lat[..., :rank], mask, layer.scale, None
        )  # [Bd, H, 1, R]
        out[rows] = torch.einsum("bhr,hvr->bhv", o.squeeze(2), w_vc)

    # ---- a window over one key-and-value head (DeepSeek-V4) --------------------------------------
    def forward_window_kv(self, layer, q, kv, fb, sinks, extra=None):
        group, slot = fb.layer_caches[layer.layer_id]["latent_window"]
        cache = fb.groups[group].pool.latent_cache(slot)  # [P, page, D]
        dim, page, window = cache.shape[-1], cache.shape[1], layer.sliding_window
        cache.view(-1, dim).index_copy_(0, self._groups[group].write_rows, kv.to(cache.dtype))
        table = fb.groups[group].page_table
        out = torch.empty_like(q)
        for i, (start, ext) in enumerate(zip(fb.extend_starts, fb.extend_lens)):
            if not ext:
                continue
            prefix = fb.prefix_lens[i]
            seq, lo = prefix + ext, max(0, prefix - window + 1)  # the first key a new token sees
            base = lo // page * page  # only the window's pages are read
            keys = cache[table[i, base // page : -(-seq // page)]].reshape(-1, dim)
            keys = keys[lo - base : seq - base].to(q.dtype)
            qpos = torch.arange(prefix, seq, device=q.device)[:, None]
            kpos = torch.arange(lo, seq, device=q.device)[None, :]
            mask = (kpos <= qpos) & (qpos - kpos < window)
            if extra is not None:
                more, seen = extra[i]
                keys = torch.cat([keys, more.to(q.dtype)])
                mask = torch.cat([mask, seen.to(mask.device)], dim=1)
            qq = q[start : start + ext].transpose(0, 1)  # [H, ext, D]
            out[start : start + ext] = one_head_attention(qq, keys, mask, layer.scale, sinks)
        return out

    # ---- the sparse-attention indexer (DeepSeek-V3.2) -------------------------------------------
    def index_select(self, layer, q, weights, keys, fb, topk, scale):
        group = fb.cache_group(layer.layer_id, "index_keys")
        cache = fb.index_keys(layer.layer_id)  # [P, page, D]
        dim, page = cache.shape[-1], cache.shape[1]
        cache.view(-1, dim).index_copy_(0, self._groups[group].write_rows, keys.to(cache.dtype))
        positions = torch.zeros((q.shape[0], topk), dtype=torch.int32)
        counts = torch.zeros(q.shape[0], dtype=torch.int32)
        table = fb.groups[group].page_table
        for i, (start, ext) in enumerate(zip(fb.extend_starts, fb.extend_lens)):
            seq = fb.prefix_lens[i] + ext
            k = cache[table[i, : -(-seq // page)]].reshape(-1, dim)[:seq].double()  # [S, D]
            rel = torch.relu(
                torch.einsum("thd,sd->ths", q[start : start + ext].double(), k) * scale
            )
            score = torch.einsum(
                "th,ths->ts", weights[start : start + ext].double(), rel
            )  # [ext, S]
            for j in range(ext):
                n = fb.prefix_lens[i] + j + 1  # the keys this token sees
                chosen = rule_topk(score[j, :n], topk)
                positions[start + j, : len(chosen)] = chosen.to(torch.int32)
                counts[start + j] = len(chosen)
        return positions, counts

    # ---- block-sparse attention's indexer (MiniMax M3) ------------------------------------------
    def index_select_blocks(self, layer, q, keys, fb, block_size, topk, local):
        group = fb.cache_group(layer.layer_id, "index_keys")
        cache = fb.index_keys(layer.layer_id)  # [P, page, D]
        rows = write_rows(fb.groups[group], fb.out_offsets)
        cache.view(-1, cache.shape[-1]).index_copy_(0, rows, keys.to(cache.dtype))
        return select_paged(fb, group, cache, q, block_size, topk, local)


def one_head_attention(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """Attention of ``q`` [H, n, D] over one head's ``keys`` [L, D], which are also the values
    (no copy per query head), ``mask`` [n, L] (True: attend), with a sink per head (float32
    softmax, the sink's column dropped after it); a block of query rows at a time so the scores
    stay small. Returns [n, H, D]."""
    h, n, _ = q.shape
    out = q.new_empty((n, h, keys.shape[1]))
    sink = sinks.to(device=q.device, dtype=torch.float32).view(h, 1, 1)
    rows = max(1, _MATH_BLOCK // max(1, h * keys.shape[0]))
    for a in range(0, n, rows):
        b = min(n, a + rows)
        scores = torch.matmul(q[:, a:b], keys.t()) * scale  # [H, rows, L]
        scores = scores.masked_fill(~mask[a:b], float("-inf")).float()
        col = sink.expand(h, b - a, 1)
        probs = torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]
        out[a:b] = torch.matmul(probs.to(q.dtype), keys).transpose(0, 1)
    return out


def extend_mask(
    fb: ForwardBatch, row: int, start: int, ext: int, prefix: int, window, device
) -> torch.Tensor:
    """[ext, prefix + ext] bool: the keys each new token of row ``row`` sees: causal by slot
    (the tokens before it), or its tree's mask; within the layer's span (window or chunk,
    ``AttnLayer.span``) by position."""
    tree = fb.trees.get(row) if fb.trees else None
    if tree is None:
        qpos = torch.arange(ext, device=device)[:, None] + prefix  # [ext, 1]
        kpos = torch.arange(prefix + ext, device=device)[None, :]  # [1, seq]
        m = kpos <= qpos
        if window is not None:
            m &= in_span(qpos, kpos, window)
        return m
    seen = torch.ones((ext, tree.base), dtype=torch.bool, device=device)
    m = torch.cat([seen, tree.visible.to(device)], dim=1)
    if window is not None:
        qpos = fb.positions[start : start + ext].to(device)[:, None]
        kpos = torch.cat([torch.arange(tree.base, device=device), tree.key_positions.to(device)])
        m &= in_span(qpos, kpos[None, :], window)
    return m


def in_span(qpos: torch.Tensor, kpos: torch.Tensor, span: int) -> torch.Tensor:
    """Whether a query at ``qpos`` sees the key at ``kpos`` (broadcast) within ``span``
    (``AttnLayer.span``: W > 0 the last W positions, -C the query's own chunk of C)."""
    if span > 0:
        return (qpos - kpos) < span
    return kpos >= qpos // -span * -span


def absorbed_query(
    q_nope: torch.Tensor, q_rope: torch.Tensor, w_kc: torch.Tensor, rows
) -> torch.Tensor:
    """[len(rows), H, R + r]: those rows' queries with the key up-projection folded in."""
    return torch.cat([torch.einsum("bhn,hnr->bhr", q_nope[rows], w_kc), q_rope[rows]], dim=-1)


def rule_topk(score: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` positions of the highest scores, the lowest position first among equal ones,
    returned ascending: the indexer's defined rule (``torch.topk`` leaves ties open)."""
    order = torch.sort(score, descending=True, stable=True).indices[:k]
    return torch.sort(order).values


def selected_mask(selection, rows: torch.Tensor, width: int) -> torch.Tensor:
    """[len(rows), width] True at the positions ``selection`` (positions, counts) lists for each
    row."""
    positions, counts = selection
    pos = positions[rows].long()
    valid = torch.arange(pos.shape[1])[None, :] < counts[rows].long()[:, None]
    m = torch.zeros((len(rows), width + 1), dtype=torch.bool)
    m.scatter_(1, torch.where(valid, pos, width), True)  # invalid entries land in the extra column
    return m[:, :width]
