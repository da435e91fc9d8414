"""Block-sparse key selection (MiniMax M3's lightning indexer), as the torch backends compute it.

Keys are grouped in blocks of ``block_size`` by absolute position (block b holds positions
``b * block_size .. (b + 1) * block_size - 1``, whatever the chunking). For each new token and
each indexer head (one per KV head) a block scores the best of its keys the token may see
(``q . key``, float32, no scale; keys past the token count as -inf); the ``local`` blocks ending at
the token's own block are kept whatever their score, then the best blocks until ``topk`` are kept
(the lower block first among equal scores; blocks wholly past the token never). The token's query
heads of that KV head attend to the kept blocks' keys, causally.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.layers.attention.base import KeyMask

if TYPE_CHECKING:
    from pdserve.forward_batch import ForwardBatch

# float32 scores of at most this many (query, head, key) triples at a time
_SCORE_BLOCK = 1 << 24


class BlockSelection(KeyMask):
    """``kept`` [T, heads, blocks] bool: the blocks each new token sees per KV head."""

    def __init__(self, kept: torch.Tensor, block_size: int):
        self.kept, self.block_size = kept, block_size

    def heads(self, start: int, end: int) -> "BlockSelection":
        """The selection of KV heads [start, end) (a tensor-parallel rank's)."""
        return BlockSelection(self.kept[:, start:end], self.block_size)

    def rows(self, tokens: torch.Tensor, width: int) -> torch.Tensor:
        blocks = torch.arange(width, device=self.kept.device) // self.block_size
        # keys past every sequence of the batch fall in no block: the backend's mask hides them
        blocks = blocks.clamp(max=self.kept.shape[-1] - 1)
        return self.kept[tokens.to(self.kept.device)][:, :, blocks]


def block_scores(q: torch.Tensor, keys: torch.Tensor, qpos: torch.Tensor, block_size: int):
    """[n, H, blocks]: per query (``q`` [n, H, D] at positions ``qpos`` [n]) and head, the best
    score of each block of ``keys`` [S, D] (positions 0 .. S - 1), -inf where the block has no key
    at or before the query."""
    n, heads, _ = q.shape
    s = keys.shape[0]
    blocks = -(-s // block_size)
    scores = torch.einsum("thd,sd->ths", q.float(), keys.float())
    later = torch.arange(s, device=q.device)[None, None, :] > qpos[:, None, None]
    scores = scores.masked_fill(later, float("-inf"))
    pad = blocks * block_size - s
    if pad:
        scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    return scores.view(n, heads, blocks, block_size).amax(dim=-1)


def keep_blocks(scores: torch.Tensor, qpos: torch.Tensor, block_size: int, topk: int, local: int):
    """[n, H, blocks] bool from ``block_scores``: the ``local`` blocks ending at each query's own,
    then the best until ``topk`` (the lower block first among equal scores)."""
    n, heads, blocks = scores.shape
    scores = scores.clone()
    own = qpos // block_size
    for back in range(local):
        at = (own - back).clamp(min=0)[:, None, None].expand(n, heads, 1)
        scores.scatter_(-1, at, float("inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk]
    kept = torch.zeros_like(scores, dtype=torch.bool)
    kept.scatter_(-1, order, scores.gather(-1, order) > float("-inf"))
    return kept


def select_paged(
    fb: "ForwardBatch",
    group: int,
    cache: torch.Tensor,
    q: torch.Tensor,
    block_size: int,
    topk: int,
    local: int,
) -> BlockSelection:
    """The selection of every new token of ``fb`` from its request's index keys in ``cache``
    [pages, page_size, D] (cache group ``group``, the new tokens' keys already stored)."""
    # trees are refused at start-up for models with an indexer cache (engine/speculative/eagle.py)
    assert not fb.trees, "block-sparse attention attends causally: no speculative trees"
    dim, page = cache.shape[-1], cache.shape[1]
    table, heads = fb.groups[group].page_table, q.shape[1]
    longest = max(fb.seq_lens, default=0)
    kept = torch.zeros(
        (q.shape[0], heads, max(1, -(-longest // block_size))), dtype=torch.bool, device=q.device
    )
    for i, (start, ext) in enumerate(zip(fb.extend_starts, fb.extend_lens)):
        if not ext:
            continue
        prefix = fb.prefix_lens[i]
        seq = prefix + ext
        keys = cache[table[i, : -(-seq // page)]].reshape(-1, dim)[:seq]  # [seq, D]
        qpos = torch.arange(prefix, seq, device=q.device)
        rows = max(1, _SCORE_BLOCK // (heads * seq))
        for a in range(0, ext, rows):
            b = min(ext, a + rows)
            scores = block_scores(q[start + a : start + b], keys, qpos[a:b], block_size)
            chosen = keep_blocks(scores, qpos[a:b], block_size, topk, local)
            kept[start + a : start + b, :, : chosen.shape[-1]] = chosen
    return BlockSelection(kept, block_size)
