"""Rows of a speculative tree (``ForwardBatch.trees``) on the torch and cpu backends: each token
attends to the sequence and the slots its mask names, at the positions the mask gives, on a
sliding-window layer and a full one (with attention sinks), beside a prefill and a decode row,
over scattered pages; checked against a dense float64 reference. Two kinds of tree row: a verify
row (its own tokens: the row's token and its drafts) and a draft head's level (earlier levels'
slots in its prefix, some of them visible)."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.kv_pool import KVPool
from pdserve.engine.speculative.tree import accept, depths, lineage, tree_mask
from pdserve.forward_batch import ForwardBatch, GroupTable
from pdserve.layers.attention.base import AttnLayer
from tests.unit.test_attention_sinks import backend_of, ops  # noqa: F401 (a fixture)

torch.set_num_threads(1)

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 4, 2, 64, 6


def reference(q, k, v, q_pos, k_pos, visible, scale, window, sinks):
    """float64 attention of ``q`` [Lq, H, D] at ``q_pos`` over keys ``k``/``v`` [Lk, KVH, D] at
    ``k_pos``, where ``visible`` [Lq, Lk]; within ``window`` by position; ``sinks`` [H]."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    w = torch.einsum("qhd,khd->hqk", q, k) * scale
    seen = visible.clone()
    if window:
        seen &= (q_pos[:, None] - k_pos[None, :]) < window
    w = w.masked_fill(~seen[None], float("-inf"))
    w = torch.cat([w, sinks.double().view(-1, 1, 1).expand(-1, q.shape[0], 1)], -1)
    probs = torch.softmax(w, -1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


def run(name: str, ops, page: int, scratch: int = 0) -> float:
    """One forward: a decode row, a verify tree row, a prefill, a head level's tree row; returns
    the largest error against the reference over both layers. ``scratch``: pages the pool sets
    aside for the cpu backend's one-query rows of tree tokens (0: their masks on SDPA)."""
    backend, dtype = backend_of(name, ops)
    gen = torch.Generator().manual_seed(page)
    pool = KVPool(2, 160, page, KV_HEADS, HEAD_DIM, dtype, "cpu")
    free = list(range(1, 160))
    random.Random(page).shuffle(free)
    pool.scratch = tuple(free.pop() for _ in range(scratch))
    # a verify row: the row's token (0) and 7 drafts of depths 1, 1, 2, 2, 2, 3, 3
    parents = [0, 0, 1, 1, 2, 3, 5]
    verify_at = [0] + depths(parents)
    # a head's third level: 3 tokens at one position; the two levels before it wrote 3 slots
    # each, the first level's slot 1 and the second's slot 4 are these tokens' ancestors
    level_sees = [[1, 4, 6], [1, 4, 7], [0, 3, 8]]
    rows = [  # (prefix, new tokens, tree: (base, sees, key positions) or None)
        (23, 1, None),
        (
            17,
            8,
            (17, [lineage(parents, j) for j in range(8)], [17 + d for d in verify_at]),
        ),
        (0, 12, None),
        (30 + 6, 3, (30, level_sees, [30 + s // 3 for s in range(9)])),
    ]
    pages, out_pages, out_offsets, trees, positions = [], [], [], {}, []
    for i, (prefix, n, tree) in enumerate(rows):
        mine = [free.pop() for _ in range(-(-(prefix + n) // page))]
        pages.append(mine)
        out_pages += [mine[p // page] for p in range(prefix, prefix + n)]
        out_offsets += [p % page for p in range(prefix, prefix + n)]
        if tree is None:
            positions += range(prefix, prefix + n)
        else:
            base, sees, key_positions = tree
            trees[i] = tree_mask(base, sees, key_positions)
            positions += key_positions[prefix - base :]
    table = torch.zeros(len(rows), max(map(len, pages)), dtype=torch.long)
    for i, mine in enumerate(pages):
        table[i, : len(mine)] = torch.tensor(mine)
    total = sum(n for _, n, _ in rows)
    layers = [
        AttnLayer(0, HEAD_DIM**-0.5, WINDOW, has_sinks=True),
        AttnLayer(1, HEAD_DIM**-0.5, None, has_sinks=True),
    ]
    err = 0.0
    for li, layer in enumerate(layers):
        # the prefixes' K/V, written into the pool as earlier forwards would have
        history = []
        for (prefix, n, _), mine in zip(rows, pages):
            k = torch.randn(prefix, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
            v = torch.randn(prefix, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
            for p in range(prefix):
                pool.buffer[li, 0, mine[p // page], :, p % page] = k[p]
                pool.buffer[li, 1, mine[p // page], :, p % page] = v[p]
            history.append((k, v))
        fb = ForwardBatch(
            input_ids=torch.zeros(total, dtype=torch.long),
            positions=torch.tensor(positions),
            prefix_lens=[r[0] for r in rows],
            extend_lens=[r[1] for r in rows],
            groups=[GroupTable(pool, table, torch.tensor(out_pages))],
            layer_group=[0, 0],
            layer_slot=[0, 1],
            out_offsets=torch.tensor(out_offsets),
            logits_idx=torch.arange(total),
            attn_backend=backend,
            trees=trees,
        )
        backend.init_forward(fb)
        q = torch.randn(total, HEADS, HEAD_DIM, generator=gen).to(dtype)
        k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        sinks = torch.randn(HEADS, generator=gen)
        out = backend.forward(layer, q, k, v, fb, sinks=sinks.to(dtype))
        for i, ((prefix, n, tree), start) in enumerate(zip(rows, fb.extend_starts)):
            kk = torch.cat([history[i][0], k[start : start + n]])
            vv = torch.cat([history[i][1], v[start : start + n]])
            q_pos = fb.positions[start : start + n]
            if tree is None:
                k_pos = torch.arange(prefix + n)
                visible = k_pos[None, :] <= q_pos[:, None]
            else:
                base, sees, key_positions = tree
                k_pos = torch.tensor(list(range(base)) + key_positions)
                visible = torch.zeros(n, prefix + n, dtype=torch.bool)
                visible[:, :base] = True
                for t, slots in enumerate(sees):
                    visible[t, [base + s for s in slots]] = True
            ref = reference(
                q[start : start + n],
                kk,
                vv,
                q_pos,
                k_pos,
                visible,
                layer.scale,
                layer.sliding_window,
                sinks.to(dtype),
            )
            err = max(err, (out[start : start + n].double() - ref).abs().max().item())
    return err


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("name", ["torch", "cpu-float32", "cpu-float32-scratch"])
def test_tree_rows_attend_to_their_ancestors(ops, name, page):
    scratch = 11 if name.endswith("scratch") else 0  # a few turns of tree tokens
    assert run(name.removesuffix("-scratch"), ops, page, scratch) < 2e-5


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("scratch", [0, 40])
def test_tree_rows_beside_the_flash_kernel(ops, flash_isa, page, scratch):
    assert run("cpu-bf16", ops, page, scratch) < 2e-2


def test_accept_walks_the_tree():
    # row 0 the row's token; drafts 1..5 with parents 0, 0, 1, 2, 4 (tokens 7, 8, 9, 9, 5)
    drafts, parents = [7, 8, 9, 9, 5], [0, 0, 1, 2, 4]
    # the draw at the row's token is 8 (the second child), at row 2 it is 9 (row 4), at row 4 3
    tokens, path = accept(drafts, [8, 0, 9, 0, 3, 0], parents)
    assert (tokens, path) == ([8, 9, 3], [2, 4])
    tokens, path = accept(drafts, [8, 0, 9, 0, 5, 1], parents)
    assert (tokens, path) == ([8, 9, 5, 1], [2, 4, 5])
    assert accept(drafts, [6, 0, 0, 0, 0, 0], parents) == ([6], [])
    # a chain is the tree whose parents are the rows before
    chain = accept([4, 5, 6], [4, 5, 1, 0])
    assert chain == accept([4, 5, 6], [4, 5, 1, 0], [0, 1, 2]) == ([4, 5, 1], [1, 2])
