"""Gemma 4's pieces: the norms and the rotary tables against HF's modules, the configuration record
of its per-layer shapes, the cache specs (no cache for the KV-shared layers, each kind's own KV
heads in the bytes per token, on one rank and on one of two), what it refuses by name, and how PD
moves pages of two kinds with different KV head counts between TP sizes: byte-exact where both
kinds split, refused at registration where one is replicated."""

from __future__ import annotations

import ctypes
import itertools
import types

import numpy as np
import pytest
import torch

hf = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")

from pdserve.disagg import rank_map  # noqa: E402
from pdserve.disagg.destinations import _region_mismatches  # noqa: E402
from pdserve.disagg.layout import chunk_descriptors  # noqa: E402
from pdserve.distributed import Parallel, kv_heads_for_rank  # noqa: E402
from pdserve.kv_region import Region  # noqa: E402
from pdserve.kv_spec import (  # noqa: E402
    FullAttention,
    SlidingWindow,
    group_layers,
    transfer_bytes_per_token,
)
from pdserve.layers.norm import Gemma4RMSNorm  # noqa: E402
from pdserve.layers.rotary import rope_parameters, rotary_embedding  # noqa: E402
from pdserve.models import hf_config  # noqa: E402
from pdserve.models.gemma4 import Gemma4ForCausalLM  # noqa: E402
from tests.helpers.checkpoints import tiny_config  # noqa: E402


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """The tiny ``gemma4`` configuration as pdserve reads it (the record, second reading)."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))

    def read(arch: str = "gemma4", **overrides):
        d = tmp_path / f"{arch}-{len(overrides)}"
        tiny_config(arch, **overrides).save_pretrained(d)
        hf_config.load_hf_config(str(d))
        return hf_config.load_hf_config(str(d))

    return read


def model(config, rank: int = 0, size: int = 1, **par) -> Gemma4ForCausalLM:
    tp = types.SimpleNamespace(rank=rank, size=size)
    with torch.device("meta"):
        return Gemma4ForCausalLM(config, par=Parallel(world=tp, tp=tp, attn=tp, **par))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [True, False])
def test_the_norm_equals_hf(dtype, scale):
    x = torch.randn(5, 3, 32).to(dtype)
    ref = hf.Gemma4RMSNorm(32, eps=1e-6, with_scale=scale)
    mine = Gemma4RMSNorm(32, eps=1e-6, scale=scale)
    if scale:
        w = torch.randn(32)
        ref.weight.data.copy_(w)
        mine.weight.data.copy_(w)
    assert torch.equal(mine(x), ref(x))


def test_the_rotary_tables_equal_hf():
    """The window layers' default RoPE over their head_dim, the full layers' proportional one
    (a quarter of the frequencies turned, the rest 0) over theirs."""
    config = tiny_config("gemma4")
    ref = hf.Gemma4TextRotaryEmbedding(config)
    x = torch.zeros(1)
    positions = torch.arange(300)[None]
    for kind in ("sliding_attention", "full_attention"):
        head_dim = config.per_layer_config[kind].head_dim
        params = rope_parameters({"rope_parameters": config.rope_parameters[kind]})
        mine = rotary_embedding(head_dim, params, 64)
        mine.reserve(300, torch.device("cpu"))
        cos, sin = ref(x, positions, kind)
        assert torch.equal(mine(positions[0])[0], cos[0]) and torch.equal(
            mine(positions[0])[1], sin[0]
        )
    assert params["rope_type"] == "proportional" and (mine.inv_freq == 0).sum() == 12


def test_the_record_keeps_each_layers_shape(recorded):
    config = recorded()
    shapes = [(c.head_dim, c.num_key_value_heads) for c in config.per_layer_config]
    assert shapes == [(16, 4), (32, 2)] * 3
    assert getattr(config, "head_dim", None) is None  # per layer only, as transformers has it


def test_shared_layers_keep_no_cache_and_each_kind_counts_its_own_heads(recorded):
    config = recorded()
    whole = model(config)
    specs = whole.kv_cache_specs()
    assert specs == [
        SlidingWindow(4, 16, 16),
        FullAttention(2, 32, total_kv_heads=2),
        SlidingWindow(4, 16, 16),
        FullAttention(2, 32, total_kv_heads=2),
        None,  # layer 4 reads layer 2's cache
        None,  # layer 5 reads layer 3's
    ]
    attn = whole.attention_layers()
    assert [(a.layer_id, a.stores_kv) for a in attn[4:]] == [(2, False), (3, False)]
    assert whole.total_kv_heads == 4
    # a long prompt moves the full layers' K and V: 2 layers x 2 x 2 heads x 32 x float32
    for rank in (whole, model(config, rank=1, size=2)):
        groups = group_layers(rank.kv_cache_specs())
        assert [g.layers for g in groups] == [(0, 2), (1, 3)]
        assert transfer_bytes_per_token(groups, rank.total_kv_heads, 4) == 2 * 2 * 2 * 32 * 4
    half = model(config, rank=1, size=2).kv_cache_specs()
    assert half[:2] == [SlidingWindow(2, 16, 16), FullAttention(1, 32, total_kv_heads=2)]
    assert FullAttention(1, 32, total_kv_heads=2).describe()["total_kv_heads"] == 2
    assert "total_kv_heads" not in FullAttention(1, 32).describe()  # other models': unchanged


def test_the_moe_form_runs_its_block_beside_every_mlp(recorded):
    m = model(recorded("gemma4_moe"))
    blocks = m.moe_blocks()
    assert [b.layer_id for b in blocks] == list(range(6))
    assert blocks[0].experts.activation == "gelu_tanh" and blocks[0].expert_norm is not None
    names = m.checkpoint_weight_names()
    for name in (
        "model.layers.0.router.proj.weight",
        "model.layers.0.router.per_expert_scale",
        "model.layers.0.experts.gate_up_proj",
        "model.layers.0.pre_feedforward_layernorm_2.weight",
        "model.layers.0.post_feedforward_layernorm_1.weight",
    ):
        assert name in names
    # keys are values on the full layers, and the shared layers compute no keys at all
    assert "model.layers.1.self_attn.v_proj.weight" not in names
    assert "model.layers.0.self_attn.v_proj.weight" in names
    assert not any(n.startswith("model.layers.5.self_attn.k_") for n in names)


def test_what_it_cannot_serve_is_refused_by_name(recorded):
    config = recorded()
    with pytest.raises(ValueError, match="pp_size: 2; a Gemma 4 model with per-layer inputs"):
        model(config, pp_size=2)
    for field, value, message in (
        ("quantization_config", {"quant_method": "fp8"}, "quantization_config: quantized"),
        ("use_bidirectional_attention", "all", "use_bidirectional_attention: 'all'"),
        ("num_kv_shared_layers", 6, "num_kv_shared_layers: 6 of 6 layers"),
        ("vocab_size_per_layer_input", 100, "vocab_size_per_layer_input: 100 rows"),
    ):
        setattr(config, field, value)
        with pytest.raises(ValueError, match=message):
            model(config)
        config = recorded()
    kinds = ["full_attention"] * 4 + ["sliding_attention", "full_attention"]  # no window to share
    with pytest.raises(ValueError, match=r"layer 4 \(sliding_attention\) would read the cache"):
        model(recorded(layer_types=kinds))


# ---- PD between TP sizes: two kinds of KV head counts ---------------------------------------

HEAD_BYTES, PAGES, Q_HEADS = 64, 4, 16  # a head's bytes of a page: page x dims x dtype


def move(heads: tuple[int, int], p_tp: int, d_tp: int) -> str:
    """Pages of two groups (their whole-model KV heads ``heads``) from every prefill rank into
    every decode rank, planned by the larger count as the model's ``total_kv_heads``: "exact"
    when every decode rank holds its heads' bytes of every page sent, "refused" when a
    registration check fails."""
    rng = np.random.default_rng(0)
    whole = [rng.integers(0, 256, (PAGES, h * HEAD_BYTES), dtype=np.uint8) for h in heads]

    def share(rank: int, tp: int) -> list[np.ndarray]:
        out = []
        for items, h in zip(whole, heads):
            a, b = kv_heads_for_rank(h, Q_HEADS, rank, tp)
            out.append(np.ascontiguousarray(items[:, a * HEAD_BYTES : b * HEAD_BYTES]))
        return out

    def regions(arrays: list[np.ndarray]) -> list[Region]:
        return [
            Region(ptr=a.ctypes.data, nbytes=a.nbytes, item_bytes=a.shape[1], group=g, layer=g)
            for g, a in enumerate(arrays)
        ]

    src = [share(p, p_tp) for p in range(p_tp)]
    dst = [[np.zeros_like(a) for a in share(d, d_tp)] for d in range(d_tp)]
    pages = [[0, 2], [0, 2]]
    for pair in rank_map.plan(p_tp, d_tp, max(heads), Q_HEADS):
        s, d = regions(src[pair.prefill_rank]), regions(dst[pair.decode_rank])
        if _region_mismatches(s, d, pair, p_tp, d_tp, pair.decode_rank):
            return "refused"
        descs = chunk_descriptors(s, d, pair, pages, pages, p_tp, d_tp)
        for a, b, n in zip(*(x.tolist() for x in descs)) if descs is not None else ():
            ctypes.memmove(b, a, n)
    ok = all(
        np.array_equal(dst[d][g][[0, 2]], share(d, d_tp)[g][[0, 2]])
        for d in range(d_tp)
        for g in range(2)
    )
    return "exact" if ok else "wrong"


def test_two_kinds_of_kv_heads_move_exactly_or_are_refused():
    """Where both kinds' heads split over both TP sizes (or the sizes are equal: whole pages) the
    bytes land exactly; where the smaller kind is replicated on one side only, decode's
    registration is refused. Never a wrong byte, at any pairing."""
    sizes = list(itertools.product((1, 2, 4), repeat=2))
    outcomes = {(h, p, d): move(h, p, d) for h in ((16, 4), (4, 2), (2, 1)) for p, d in sizes}
    assert "wrong" not in outcomes.values()
    for heads in ((16, 4), (4, 2)):  # the real 31B's counts, the tiny recipe's
        assert outcomes[heads, 1, 2] == outcomes[heads, 2, 1] == "exact"
        assert outcomes[heads, 1, 1] == outcomes[heads, 2, 2] == "exact"
    assert outcomes[(16, 4), 1, 4] == "exact"
    assert outcomes[(4, 2), 1, 4] == outcomes[(4, 2), 4, 2] == "refused"
    assert outcomes[(2, 1), 1, 2] == outcomes[(2, 1), 2, 1] == "refused"
