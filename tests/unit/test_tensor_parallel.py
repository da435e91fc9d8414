"""Tensor-parallel parts that need no second process: head and vocabulary shards, sharded loading,
the prefill -> decode head map, and sliced transfer descriptors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pdserve.disagg import rank_map
from pdserve.disagg.descriptors import head_slice_descriptors
from pdserve.distributed import TPGroup, kv_heads_for_rank, shard_range
from pdserve.models.weights import TPShards
from tests.helpers.checkpoints import LLAMA_MQA_TIED, build_tiny_checkpoint


def test_shard_ranges():
    assert [shard_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="not divisible"):
        shard_range(6, 0, 4)
    # KV heads split when there are enough, replicated (the one the rank's query heads use) when not
    assert [kv_heads_for_rank(4, 8, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    assert [kv_heads_for_rank(2, 8, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_heads_for_rank(1, 4, r, 2) for r in range(2)] == [(0, 1), (0, 1)]
    with pytest.raises(ValueError, match="multiple"):
        kv_heads_for_rank(2, 6, 0, 3)


@pytest.mark.parametrize(
    "p_tp, d_tp, kv, heads",
    [
        (1, 1, 2, 4),
        (1, 2, 2, 4),
        (2, 1, 2, 4),
        (2, 2, 2, 4),
        (1, 2, 1, 4),
        (2, 1, 1, 4),
        (2, 4, 2, 8),
        (4, 2, 2, 8),
        (4, 1, 2, 8),
        (1, 4, 8, 8),
        (4, 4, 1, 8),
        (2, 4, 4, 8),
        (4, 2, 8, 8),
    ],
)
def test_every_decode_head_is_written_exactly_once(p_tp, d_tp, kv, heads):
    plan = rank_map.plan(p_tp, d_tp, kv, heads)
    for d in range(d_tp):
        d0, d1 = kv_heads_for_rank(kv, heads, d, d_tp)
        mine = [s for s in plan if s.decode_rank == d and not s.empty]
        covered = sorted(itertools.chain.from_iterable(range(*s.heads) for s in mine))
        assert covered == list(range(d0, d1)), (d, mine)
        assert sum(s.writes_metadata for s in mine) == 1  # one metadata writer per decode rank
        for s in mine:
            p0, p1 = kv_heads_for_rank(kv, heads, s.prefill_rank, p_tp)
            assert p0 <= s.heads[0] and s.heads[1] <= p1  # the prefill rank holds what it writes
            assert s.src_offset == s.heads[0] - p0 and s.dst_offset == s.heads[0] - d0
    if p_tp == d_tp:  # equal TP: rank to rank, whole pages
        assert all(s.prefill_rank == s.decode_rank and s.whole_pages for s in plan)
    for p in range(p_tp):
        assert rank_map.destinations_of(p_tp, d_tp, kv, heads, p) == sum(
            s.prefill_rank == p for s in plan
        )


# (prefill tp, decode tp, KV heads, query heads) -> prefill ranks whose heads are all read elsewhere
IDLE_PREFILL_RANKS = {
    (2, 1, 1, 4): [1],  # MQA: one replicated head, one source suffices
    (4, 2, 1, 4): [2, 3],
    (4, 1, 1, 4): [1, 2, 3],
    (4, 2, 2, 4): [1, 2],  # GQA, each head on 2 prefill ranks; decode ranks read different replicas
    (4, 1, 2, 4): [1, 3],
    (8, 2, 2, 8): [1, 2, 3, 4, 6, 7],
    (2, 1, 2, 4): [],  # decode needs both ranks' heads
    (4, 4, 1, 4): [],  # equal TP: rank to rank
}


@pytest.mark.parametrize("p_tp, d_tp, kv, heads", sorted(IDLE_PREFILL_RANKS))
def test_every_prefill_rank_concludes_every_room(p_tp, d_tp, kv, heads):
    """Each prefill rank has at least one destination per room, so its part of a room always
    ends; a rank decode reads nothing from gets exactly one empty slice (no heads, no metadata row),
    and every decode rank still reads each of its heads from exactly one writing rank."""
    plan = rank_map.plan(p_tp, d_tp, kv, heads)
    idle = sorted({s.prefill_rank for s in plan if s.empty})
    assert idle == IDLE_PREFILL_RANKS[(p_tp, d_tp, kv, heads)]
    for p in range(p_tp):
        mine = [s for s in plan if s.prefill_rank == p]
        assert rank_map.destinations_of(p_tp, d_tp, kv, heads, p) == len(mine) >= 1
        if p in idle:  # an empty slice only, into decode rank p % d_tp, which asks it for nothing
            assert (
                len(mine) == 1 and mine[0].decode_rank == p % d_tp and not mine[0].writes_metadata
            )
            assert rank_map.pair_for(p_tp, d_tp, kv, heads, p, p % d_tp).empty
            assert not mine[0].whole_pages
        else:
            assert not any(s.empty for s in mine)
    for d in range(d_tp):
        src = rank_map.sources(p_tp, d_tp, kv, heads, d)
        assert [s.prefill_rank for s in src] == sorted(s.prefill_rank for s in src)
        assert sum(s.writes_metadata for s in src) == 1 and not any(
            s.writes_metadata and s.empty for s in src
        )
        d0, d1 = kv_heads_for_rank(kv, heads, d, d_tp)
        assert sum(s.num_heads for s in src) == d1 - d0
    pairs = {(s.prefill_rank, s.decode_rank) for s in plan}
    for p, d in itertools.product(range(p_tp), range(d_tp)):
        if (p, d) not in pairs:  # no business together: registration between them is refused
            with pytest.raises(ValueError, match="expected exactly one"):
                rank_map.pair_for(p_tp, d_tp, kv, heads, p, d)


def test_replicated_heads_are_read_from_different_replicas():
    # 2 KV heads on 4 prefill ranks (each held twice), 2 decode ranks of 1 head each... and 1 of 2
    plan = rank_map.plan(4, 1, 2, 8)
    assert [(s.prefill_rank, s.heads) for s in plan if not s.empty] == [(0, (0, 1)), (2, (1, 2))]
    plan = rank_map.plan(4, 4, 2, 8)
    assert sorted({s.prefill_rank for s in plan}) == [0, 1, 2, 3]


def test_head_slice_descriptors_address_every_page():
    # 2 regions, src items of 3 heads x 32 bytes, dst items of 1 head; slice = head 2 of src
    src, dst, lens = head_slice_descriptors(
        [1000, 9000], [50000, 70000], 96, 32, [1, 5], [7, 8], 64, 0, 32
    )
    assert src.tolist() == [1000 + 96 + 64, 1000 + 5 * 96 + 64, 9000 + 96 + 64, 9000 + 5 * 96 + 64]
    assert dst.tolist() == [50000 + 7 * 32, 50000 + 8 * 32, 70000 + 7 * 32, 70000 + 8 * 32]
    assert (lens == 32).all() and lens.dtype == np.int64


@pytest.mark.parametrize("variant", ["llama", "mqa-tied"])
def test_two_shards_reassemble_the_model(variant):
    """Each rank loads only its slices; together they hold exactly the checkpoint."""
    from safetensors import safe_open

    from pdserve.models.loader import load_model

    path = build_tiny_checkpoint("llama", **(LLAMA_MQA_TIED if variant == "mqa-tied" else {}))
    ranks = [load_model(path, tp=TPGroup(rank=r, size=2))[0] for r in range(2)]
    with safe_open(f"{path}/model.safetensors", framework="pt") as st:
        full = {k: st.get_tensor(k) for k in st.keys()}
    cfg = ranks[0].config
    D = ranks[0].head_dim
    q = torch.cat([m.model.layers[0].self_attn.qkv_proj.weight[: m.num_heads * D] for m in ranks])
    assert torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"])
    o = torch.cat([m.model.layers[0].self_attn.o_proj.weight for m in ranks], dim=1)
    assert torch.equal(o, full["model.layers.0.self_attn.o_proj.weight"])
    emb = torch.cat([m.model.embed_tokens.weight for m in ranks])[: cfg.vocab_size]
    assert torch.equal(emb, full["model.embed_tokens.weight"])
    k_rows = [
        m.model.layers[0].self_attn.qkv_proj.weight[
            m.num_heads * D : (m.num_heads + m.num_kv_heads) * D
        ]
        for m in ranks
    ]
    if variant == "mqa-tied":  # one KV head, replicated on both ranks
        assert all(torch.equal(k, full["model.layers.0.self_attn.k_proj.weight"]) for k in k_rows)
        assert ranks[0].lm_head is None
    else:
        assert torch.equal(torch.cat(k_rows), full["model.layers.0.self_attn.k_proj.weight"])
    shards = TPShards.of(cfg, TPGroup(rank=1, size=2))
    assert shards.vocab == (cfg.vocab_size // 2, cfg.vocab_size)
