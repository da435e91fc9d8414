"""Where ranks sit (TP x DP attention x PP), what each holds, how the pipeline cuts a batch, and
the refusals of unsupported combinations: the parts that need no second process."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from pdserve.config import ServerArgs
from pdserve.distributed import TPGroup, rank_coordinates
from pdserve.engine.pipeline import num_micro_batches, split
from pdserve.models.weights import TPShards, stage_layers


def test_rank_coordinates():
    # tp 4, 2 attention groups of 2 ranks
    assert [rank_coordinates(r, 4, 2) for r in range(4)] == [
        (0, 0, 0, 0),
        (0, 1, 0, 1),
        (0, 2, 1, 0),
        (0, 3, 1, 1),
    ]
    # dp == tp: one rank per group
    assert [rank_coordinates(r, 2, 2) for r in range(2)] == [(0, 0, 0, 0), (0, 1, 1, 0)]
    # 2 pipeline stages of one rank
    assert [rank_coordinates(r, 1, 1) for r in range(2)] == [(0, 0, 0, 0), (1, 0, 0, 0)]


def test_stage_layers():
    assert [stage_layers(4, p, 2) for p in range(2)] == [(0, 2), (2, 4)]
    assert [stage_layers(7, p, 3) for p in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert stage_layers(30, 0, 1) == (0, 30)
    with pytest.raises(ValueError, match="pp_size"):
        stage_layers(2, 0, 3)


def _config(**kw):
    base = dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return transformers.LlamaConfig(**{**base, **kw})


def test_dp_attention_shards_hold_every_head_and_half_the_mlp():
    cfg = _config()
    tp, attn = TPGroup(rank=1, size=2), TPGroup(rank=0, size=1)
    s = TPShards.of(cfg, tp, attn)
    assert (
        s.heads == (0, 4) and s.kv_heads == (0, 2) and s.vocab == (0, 1000)
    )  # the group's: all of them
    assert s.inter == (64, 128)  # the MLP: tensor-parallel over both ranks
    w = torch.arange(128 * 64, dtype=torch.float32).view(128, 64)
    assert torch.equal(s.shard("model.layers.0.mlp.gate_proj.weight", w), w[64:])
    assert torch.equal(s.shard("model.layers.0.mlp.down_proj.weight", w.t()), w.t()[:, 64:])
    q = torch.randn(64, 64)  # 4 heads x head dim 16
    assert torch.equal(s.shard("model.layers.0.self_attn.q_proj.weight", q), q)


def test_pipeline_stages_hold_their_layers():
    cfg = _config()
    first = TPShards.of(cfg, pp_rank=0, pp_size=2)
    last = TPShards.of(cfg, pp_rank=1, pp_size=2)
    assert first.layers == (0, 2) and last.layers == (2, 4)
    assert first.holds("model.layers.1.mlp.up_proj.weight") and not first.holds(
        "model.layers.2.mlp.up_proj.weight"
    )
    assert last.holds("model.layers.3.self_attn.o_proj.weight")
    assert first.holds("model.embed_tokens.weight") and last.holds(
        "model.embed_tokens.weight"
    )  # tied head
    assert not first.has_head and last.has_head
    untied = TPShards.of(_config(tie_word_embeddings=False), pp_rank=1, pp_size=2)
    assert not untied.holds("model.embed_tokens.weight") and untied.holds("lm_head.weight")


@pytest.mark.parametrize("seed", range(20))
def test_pipeline_split_covers_the_batch(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    prefix = [rng.randint(0, 50) for _ in range(n)]
    ext = [rng.choice([1, rng.randint(1, 300)]) for _ in range(n)]
    ids, pos, logits = [], [], []
    for p, e in zip(prefix, ext):
        start = len(ids)
        ids += [rng.randrange(1000) for _ in range(e)]
        pos += list(range(p, p + e))
        logits += sorted(rng.sample(range(start, start + e), rng.randint(0, min(e, 3))))
    pages = [[i] for i in range(n)]
    fulls = [p + e + rng.randint(0, 9) for p, e in zip(prefix, ext)]
    parts = (ids, pos, prefix, ext, pages, logits, fulls)
    k = num_micro_batches(len(ids), 2)
    mbs = split(parts, k)
    assert 1 <= len(mbs) <= k
    # the micro-batches' tokens, in order, are the batch's; each request's pieces continue each
    # other
    assert sum((mb[0][0] for mb in mbs), []) == ids and sum((mb[0][1] for mb in mbs), []) == pos
    for (m_ids, m_pos, m_pre, m_ext, m_pages, _, m_fulls), _ in mbs:
        assert sum(m_ext) == len(m_ids)
        # each piece keeps its request's sequence length
        assert m_fulls == [fulls[p[0]] for p in m_pages]
        starts = [0]
        for e in m_ext:
            starts.append(starts[-1] + e)
        for i, (p, e) in enumerate(zip(m_pre, m_ext)):
            assert m_pos[starts[i] : starts[i] + e] == list(
                range(p, p + e)
            )  # prefix = first position
    assert sum(([r + lo for r in mb[5]] for mb, lo in mbs), []) == logits


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(dp_size=2, tp_size=2), "dp_size"),  # without --enable-dp-attention
        (dict(dp_size=2, tp_size=3, enable_dp_attention=True), "dp_size"),
        (dict(dp_size=4, tp_size=2, enable_dp_attention=True), "dp_size"),
        (dict(pp_size=2, tp_size=2), "pp_size"),
        (dict(pp_size=2, disaggregation_mode="decode"), "pp_size"),
        (dict(pp_size=0), "pp_size"),
        (dict(disaggregation_fault_ranks="2", pp_size=2), "disaggregation_fault_ranks"),
    ],
)
def test_unsupported_parallel_layouts_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ServerArgs(model_path="/nonexistent", **kwargs)


def test_supported_layouts():
    assert (
        ServerArgs(model_path="/m", tp_size=4, dp_size=2, enable_dp_attention=True).world_size == 4
    )
    assert ServerArgs(model_path="/m", pp_size=2, disaggregation_mode="prefill").world_size == 2
    ServerArgs(model_path="/m", pp_size=2, disaggregation_fault_ranks="1")


def test_launch_passes_parallel_flags():
    from pdserve.server import cluster

    args, _ = cluster.parse_args(
        ["--prefill-pp-size", "2", "--decode-tp-size", "2", "--decode-dp-size", "2", "--dp-aware"]
    )
    assert cluster._parallel_flags(
        args.prefill_tp_size, args.prefill_dp_size, args.prefill_pp_size
    ) == ["--tp-size", "1", "--pp-size", "2"]
    assert cluster._parallel_flags(args.decode_tp_size, args.decode_dp_size) == [
        "--tp-size",
        "2",
        "--dp-size",
        "2",
        "--enable-dp-attention",
    ]
    assert args.dp_aware
    with pytest.raises(SystemExit):
        cluster.parse_args(["--decode-tp-size", "2", "--decode-dp-size", "3"])


def test_launch_passes_role_prefixed_server_flags():
    from pdserve.server import cluster

    common, roles = cluster.split_role_flags(
        [
            "--max-total-tokens",
            "4096",
            "--decode-ep-size",
            "2",
            "--decode-moe-a2a-backend=torch",
            "--prefill-enable-return-routed-experts",
            "--decode-moe-dense-tp-size",
            "1",
            "--decode-unknown",
            "x",
        ]
    )
    assert common == ["--max-total-tokens", "4096", "--decode-unknown", "x"]
    assert roles == {
        "prefill": ["--enable-return-routed-experts"],
        "decode": ["--ep-size", "2", "--moe-a2a-backend=torch", "--moe-dense-tp-size", "1"],
    }
    with pytest.raises(ValueError, match="--decode-ep-size: expected a value"):
        cluster.split_role_flags(["--decode-ep-size"])
