"""``ForwardBatch``: what one model forward needs, built by the engine from a list of requests.

Tokens of all requests are flattened into one sequence of ``T`` tokens; request ``i`` owns the
slice ``extend_starts[i] : extend_starts[i] + extend_lens[i]`` of it.

The cache is described per cache group (``kv_spec.CacheGroup``): each group has its own pool and
its own page ids, so each has its own page table and write locations (``GroupTable``). Entries
of a page table that a group no longer keeps (pages that slid out of a window) are 0, the
padding page; a backend never reads them because its mask excludes those positions. A layer
finds its group through ``layer_group`` and its slot in that group's pool through ``layer_slot``;
a layer that keeps several caches (a latent and an indexer key) finds each in ``layer_caches``.

This module is the contract between the engine and ``models``/``layers``; it imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


@dataclass
class GroupTable:
    """One cache group's view of the batch."""

    pool: Any  # engine.kv_pool.KVPool of this group
    page_table: (
        torch.Tensor
    )  # [B, max_pages] int64 page of each of a request's logical pages (0: none)
    out_pages: torch.Tensor  # [T] page of each new token's KV in this group
    # False: a per-request group (a recurrent state); ``page_table[:, 0]`` is each request's slot
    paged: bool = True
    _int32: Optional[tuple[torch.Tensor, torch.Tensor]] = field(default=None, repr=False)


@dataclass
class TreeMask:
    """A row whose tokens see only some of the row's own earlier keys: a speculative tree, whose
    tokens attend to their ancestors and themselves (``engine/speculative/``). Keys before slot
    ``base`` (the sequence) are all visible; ``visible`` [ext, prefix + ext - base] says which of
    the keys from ``base`` on each of the row's tokens sees, ``key_positions`` [prefix + ext -
    base] gives those keys' positions (a tree's slots are sequential, its positions are depths;
    windows compare positions)."""

    base: int
    visible: torch.Tensor
    key_positions: torch.Tensor


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    prefix_lens: list[int]  # per request: tokens already in the KV pool before this forward
    extend_lens: list[int]  # per request: tokens computed in this forward
    groups: list[GroupTable]  # per cache group
    layer_group: list[int]  # per layer of this stage (its index from the stage's first layer)
    layer_slot: list[int]  # ... the layer's index in its group's pool
    out_offsets: torch.Tensor  # [T] offset of each new token inside its page (every group alike)
    logits_idx: torch.Tensor  # [N] rows of the flattened tokens whose logits are needed
    attn_backend: Any  # layers.attention.base.AttentionBackend
    dp: Any = None  # DP attention: the engine.dp_attention.DPGather around the MLP
    parts: Optional[tuple] = None  # pipeline parallel: the lists it was made of (to split it)
    # per layer: {cache kind: (group, slot)} of every cache it keeps (a layer may keep several)
    layer_caches: Optional[list[dict]] = None
    anchor: int = 0  # the first paged group (kv_spec.anchor_group)
    page_size: int = (
        0  # tokens per page (where a state snapshot is taken: layers/state_snapshots.py)
    )
    # per request: the length of its whole sequence so far (prompt and output), the one its KV
    # is computed for (LongRoPE picks its tables by it); None: each request's ``seq_lens``
    full_lens: Optional[list[int]] = None
    # an EAGLE head's second input: the target's hidden state of each token's position before
    # it ([T, hidden_size]; engine/speculative/eagle.py)
    spec_hidden: Optional[torch.Tensor] = None
    # rows whose tokens do not attend causally (a speculative tree): row index -> its mask; their
    # ``positions`` are not their slots (slots follow ``prefix_lens`` as ever)
    trees: Optional[dict[int, TreeMask]] = None
    # called with a layer's (global) index once its forward has written that layer's caches
    # (a PD prefill sends them while the later layers compute)
    layer_done: Optional[Callable[[int], None]] = None
    # sparse attention whose later layers reuse an earlier layer's choice of keys (GLM-5's
    # "shared" indexer layers): the last indexer's selection in this forward, (positions, counts)
    index_selection: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    # per request: the slot of the LoRA adapter it runs under (-1: the base model); None: none
    adapters: Optional[list[int]] = None
    # image tokens of this forward: (their rows among the T tokens [N], their embeddings
    # [N, hidden]) that replace the token embeddings there (a vision-language model)
    image_embeds: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    # multimodal RoPE: each token's (time, height, width) positions [3, T] when some token's
    # differ (an image's); None: ``positions`` on every axis
    rope_positions: Optional[torch.Tensor] = None

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

    def table(self, layer: int) -> GroupTable:
        """The group table of stage layer ``layer``."""
        return self.groups[self.layer_group[layer]]

    def state(self, layer: int, kind: str) -> tuple[Any, int, torch.Tensor]:
        """Stage layer ``layer``'s per-request cache of ``kind`` (a recurrent state): (its pool,
        the layer's index in that pool, each request's slot [B])."""
        group, index = self._cache(layer, kind)
        g = self.groups[group]
        return g.pool, index, g.page_table[:, 0]

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of stage layer ``layer``: [num_pages, kv_heads, page_size, head_dim] each."""
        pool = self.groups[self.layer_group[layer]].pool
        slot = self.layer_slot[layer]
        return pool.k_cache(slot), pool.v_cache(slot)

    def kv_scales(self, layer: int):
        """What dequantizes stage layer ``layer``'s K and V (``kv_quant.LayerScales``), or None
        when its pool keeps floats."""
        pool = self.groups[self.layer_group[layer]].pool
        scales = getattr(pool, "layer_scales", None)
        return None if scales is None else scales(self.layer_slot[layer])

    def cache_group(self, layer: int, kind: str) -> int:
        """The group holding stage layer ``layer``'s cache of ``kind``."""
        if self.layer_caches is None:
            return self.layer_group[layer]
        return self.layer_caches[layer][kind][0]

    def latent(self, layer: int) -> torch.Tensor:
        """The latent cache of stage layer ``layer`` (latent attention): [num_pages, page_size,
        dim]."""
        group, slot = self._cache(layer, "latent_attention")
        return self.groups[group].pool.latent_cache(slot)

    def index_keys(self, layer: int) -> torch.Tensor:
        """The sparse-attention indexer's key cache of stage layer ``layer``: [num_pages, page_size,
        dim]."""
        group, slot = self._cache(layer, "index_keys")
        return self.groups[group].pool.index_cache(slot)

    def snapshots(self, layer: int, kind: str) -> Optional[torch.Tensor]:
        """Each request's snapshot slot [B] of stage layer ``layer``'s per-request cache of
        ``kind`` (0: none), or None when no request keeps one (the prefix cache is off)."""
        table = self.groups[self._cache(layer, kind)[0]].page_table
        return table[:, 1] if table.shape[1] > 1 else None

    def _cache(self, layer: int, kind: str) -> tuple[int, int]:
        if self.layer_caches is None:
            return self.layer_group[layer], self.layer_slot[layer]
        return self.layer_caches[layer][kind]

    def int32_tables(self, group: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(page_table [B, max_pages], seq_lens [B]) of one group (default: the anchor) as int32,
        what the CPU kernels take; built once per group."""
        g = self.groups[self.anchor if group is None else group]
        if g._int32 is None:
            g._int32 = (
                g.page_table.to(torch.int32),
                torch.tensor(self.seq_lens, dtype=torch.int32, device=g.page_table.device),
            )
        return g._int32

    @property
    def is_decode_only(self) -> bool:
        return all(e == 1 for e in self.extend_lens)

    def is_tree(self, row: int) -> bool:
        return self.trees is not None and row in self.trees
