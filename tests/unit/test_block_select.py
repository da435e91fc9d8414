"""The block-sparse selection rule (``layers/attention/block_select.py``) on hand-made scores, and
MiniMax M3's refusals of configurations it does not serve."""

from __future__ import annotations

import types

import pytest
import torch

from pdserve.layers.attention.block_select import BlockSelection, block_scores, keep_blocks
from pdserve.models.minimax_m3 import check_config

INF = float("inf")


def kept(scores, qpos, topk, local, block_size=4):
    s = torch.tensor([[scores]], dtype=torch.float32)  # [1 query, 1 head, blocks]
    out = keep_blocks(s, torch.tensor([qpos]), block_size, topk, local)
    return out[0, 0].nonzero().flatten().tolist()


def test_local_blocks_then_the_best_with_ties_to_the_lower_block():
    # query at position 21: block 5; blocks 5 and 4 are local whatever they score
    assert kept([1.0, 3.0, 3.0, 2.0, -5.0, -9.0], 21, topk=3, local=2) == [1, 4, 5]
    assert kept([1.0, 3.0, 3.0, 2.0, -5.0, -9.0], 21, topk=4, local=2) == [1, 2, 4, 5]
    assert kept([1.0, 3.0, 3.0, 2.0, -5.0, -9.0], 21, topk=3, local=0) == [1, 2, 3]


def test_blocks_past_the_query_are_never_kept():
    # query at position 9 (block 2): blocks 3.. hold no key it sees, however many may be kept
    assert kept([0.5, 0.1, 0.2, -INF, -INF], 9, topk=4, local=1) == [0, 1, 2]
    # near the start the local blocks clamp at block 0 (kept once)
    assert kept([0.5, -INF, -INF], 1, topk=2, local=2) == [0]


def test_a_block_scores_its_best_key_the_query_sees():
    keys = torch.tensor([[1.0], [4.0], [2.0], [9.0], [3.0], [8.0]])  # positions 0..5
    q = torch.tensor([[[1.0]], [[1.0]]])  # two queries, one head, one dim
    s = block_scores(q, keys, torch.tensor([4, 5]), block_size=4)
    # blocks [0..3] and [4..5]: position 4 does not see key 5
    assert s[:, 0].tolist() == [[9.0, 3.0], [9.0, 8.0]]


def test_the_mask_covers_each_kept_block_and_each_head_apart():
    kept_blocks = torch.tensor([[[True, False, True], [False, True, True]]])  # 1 token, 2 heads
    sel = BlockSelection(kept_blocks, block_size=2)
    rows = sel.rows(torch.tensor([0]), 7)
    assert rows[0].int().tolist() == [[1, 1, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]]
    assert sel.heads(1, 2).rows(torch.tensor([0]), 4)[0].int().tolist() == [[0, 0, 1, 1]]


def m3_config(**fields):
    base = dict(
        num_hidden_layers=2,
        layer_types=["minimax_m3_sparse", "full_attention"],
        mlp_layer_types=["dense", "sparse"],
        num_key_value_heads=2,
        index_n_heads=2,
        index_block_size=4,
        index_topk_blocks=4,
        index_local_blocks=1,
        quantization_config=None,
    )
    return types.SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(index_n_heads=4), "index_n_heads: 4; the indexer chooses blocks per KV head"),
        (dict(index_local_blocks=5), r"index_local_blocks: 5 must be in \[0, index_topk_blocks"),
        (dict(layer_types=["sliding_attention"] * 2), r"layer_types: \['sliding_attention'\]"),
        (dict(mlp_layer_types=["dense"]), "mlp_layer_types: 1 entries for 2 layers"),
        (dict(quantization_config={"quant_method": "fp8"}), "quantization_config: 'fp8'"),
    ],
)
def test_configurations_it_does_not_serve_are_refused_by_name(fields, message):
    check_config(m3_config())  # the base one is served
    with pytest.raises(ValueError, match=message):
        check_config(m3_config(**fields))
