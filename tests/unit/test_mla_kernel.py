"""The latent attention decode kernel (``mla_decode_attention``, absorbed form) against the
decompressed form in float64 (per-head keys and values built from the latents, as HF computes
MLA), over page sizes, ragged lengths, head counts that do and do not fill its 16-head tasks,
DeepSeek-V3's 576/512 dims, float32 and bf16; and the same bits on every tier, from any batch."""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ops():
    mod = kernels.load()
    assert mod is not None, f"CPU kernels did not build: {kernels.unavailable_reason()}"
    return mod


def decompressed(q_nope, q_rope, cache, table, lens, w_kc, w_vc, scale):
    """[B, H, V] in float64: each head's keys [w_kc c | k_rope] and values w_vc c, then softmax."""
    page, rank = cache.shape[1], w_kc.shape[2]
    out = []
    for b in range(q_nope.shape[0]):
        n = int(lens[b])
        lat = torch.stack(
            [cache[table[b, p // page], p % page] for p in range(n)]
        ).double()  # [n, R + r]
        c, k_rope = lat[:, :rank], lat[:, rank:]
        k = torch.cat(
            [torch.einsum("sr,hnr->hsn", c, w_kc.double()), k_rope.expand(w_kc.shape[0], -1, -1)],
            -1,
        )
        v = torch.einsum("sr,hvr->hsv", c, w_vc.double())
        q = torch.cat([q_nope[b].double(), q_rope[b].double()], -1)  # [H, N + r]
        p = torch.softmax(torch.einsum("hd,hsd->hs", q, k) * scale, -1)
        out.append(torch.einsum("hs,hsv->hv", p, v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize(
    "heads, rank, rope, nope, v",
    [
        (4, 32, 8, 16, 16),
        (20, 64, 16, 24, 32),
        (16, 96, 24, 32, 40),
        pytest.param(16, 512, 64, 128, 128, marks=pytest.mark.large_shape),
    ],
)
def test_absorbed_kernel_matches_the_decompressed_form(
    ops, isa, dtype, page, heads, rank, rope, nope, v
):
    gen = torch.Generator().manual_seed(heads * 100 + page)
    lens = torch.tensor([1, 2, 15, 16, 17, 70], dtype=torch.int32)
    B, pages = len(lens), 80 // page + 1
    cache = (torch.randn(B * pages + 1, page, rank + rope, generator=gen) * 0.5).to(dtype)
    table = torch.randperm(B * pages, generator=gen).add(1).view(B, pages).to(torch.int32)
    w_kc = torch.randn(heads, nope, rank, generator=gen) / rank**0.5
    w_vc = torch.randn(heads, v, rank, generator=gen) / rank**0.5
    q_nope, q_rope = (
        torch.randn(B, heads, nope, generator=gen),
        torch.randn(B, heads, rope, generator=gen),
    )
    scale = (nope + rope) ** -0.5
    # absorbed: the key up-projection folded into the query, the value one after
    q = torch.cat([torch.einsum("bhn,hnr->bhr", q_nope, w_kc), q_rope], -1).to(dtype)
    o = torch.empty(B, heads, rank, dtype=dtype)
    ops.mla_decode_attention(o, q, cache, table, lens, scale, rank)
    got = torch.einsum("bhr,hvr->bhv", o.double(), w_vc.double())
    want = decompressed(
        q_nope.to(dtype).float(), q_rope.to(dtype).float(), cache, table, lens, w_kc, w_vc, scale
    )
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    assert (got - want).abs().max().item() < tol * max(1.0, want.abs().max().item())


def test_same_bits_on_every_tier_and_from_any_batch(ops):
    gen = torch.Generator().manual_seed(7)
    lens = torch.tensor([3, 40, 1, 33], dtype=torch.int32)
    cache = torch.randn(40, 16, 576, generator=gen).to(torch.bfloat16)
    table = torch.randperm(39, generator=gen)[:12].add(1).view(4, 3).to(torch.int32)
    q = torch.randn(4, 20, 576, generator=gen).to(torch.bfloat16)
    results = {}
    top = ops.isa_tier()
    try:
        for tier in ops.available_isas():
            ops.set_isa(tier)
            o = torch.empty(4, 20, 512, dtype=torch.bfloat16)
            ops.mla_decode_attention(o, q, cache, table, lens, 0.07, 512)
            results[tier] = o
            for b in range(4):  # one row alone gives that row's bits
                alone = torch.empty(1, 20, 512, dtype=torch.bfloat16)
                ops.mla_decode_attention(
                    alone, q[b : b + 1], cache, table[b : b + 1], lens[b : b + 1], 0.07, 512
                )
                assert torch.equal(alone[0], o[b]), (tier, b)
    finally:
        ops.set_isa(top)
    first = next(iter(results.values()))
    assert all(torch.equal(r, first) for r in results.values()), sorted(results)


def test_bad_input_is_refused(ops):
    cache = torch.zeros(4, 2, 24)
    table, lens = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="q has 20 dims, the cache's rows 24"):
        ops.mla_decode_attention(
            torch.empty(1, 2, 16), torch.zeros(1, 2, 20), cache, table, lens, 1.0, 16
        )
    with pytest.raises(RuntimeError, match="need 1 <= v_dim"):
        ops.mla_decode_attention(
            torch.empty(1, 2, 30), torch.zeros(1, 2, 24), cache, table, lens, 1.0, 30
        )
    with pytest.raises(RuntimeError, match="out must be"):
        ops.mla_decode_attention(
            torch.empty(1, 2, 8), torch.zeros(1, 2, 24), cache, table, lens, 1.0, 16
        )


def test_sparse_positions_select_the_keys(ops):
    """With ``positions`` a row attends to its listed keys only; listing every key is the dense
    result, bit for bit."""
    gen = torch.Generator().manual_seed(11)
    cache = torch.randn(20, 4, 40, generator=gen)
    table = torch.arange(1, 17, dtype=torch.int32).view(2, 8)
    q = torch.randn(2, 3, 40, generator=gen)
    dense_lens = torch.tensor([30, 19], dtype=torch.int32)
    dense = torch.empty(2, 3, 32)
    ops.mla_decode_attention(dense, q, cache, table, dense_lens, 0.3, 32)
    every = torch.stack([torch.arange(32, dtype=torch.int32)] * 2)
    again = torch.empty(2, 3, 32)
    ops.mla_decode_attention(again, q, cache, table, dense_lens, 0.3, 32, every)
    assert torch.equal(again, dense)
    picked = torch.tensor([[0, 5, 29, 0], [3, 4, 17, 18]], dtype=torch.int32)
    counts = torch.tensor([3, 4], dtype=torch.int32)
    sparse = torch.empty(2, 3, 32)
    ops.mla_decode_attention(sparse, q, cache, table, counts, 0.3, 32, picked)
    for b in range(2):  # the same as a dense call over a cache holding only those keys
        rows = torch.stack(
            [cache[table[b, p // 4], p % 4] for p in picked[b, : counts[b]].tolist()]
        )
        p = torch.softmax(q[b].double() @ rows.double().T * 0.3, -1)
        torch.testing.assert_close(sparse[b].double(), p @ rows[:, :32].double(), rtol=0, atol=1e-6)


def indexer_reference(q, w, keys, n, topk, scale):
    """The rule in float64: score_t = sum_h w_h relu(scale q_h . k_t); highest first, lowest
    position among equals; ascending."""
    s = (w.double()[:, None] * torch.relu(q.double() @ keys[:n].double().T * scale)).sum(0)
    order = torch.sort(s, descending=True, stable=True).indices[:topk]
    return torch.sort(order).values.tolist()


def test_indexer_topk_follows_the_rule_with_ties(ops, isa):
    gen = torch.Generator().manual_seed(5)
    page, dim, heads = 4, 24, 5
    cache = torch.randn(30, page, dim, generator=gen)
    cache[3, 1] = -cache[
        3, 1
    ].abs()  # some keys every head scores <= 0: exact-zero ties after the ReLU
    table = torch.arange(1, 29, dtype=torch.int32).view(2, 14)
    keys = [
        torch.stack([cache[table[b, t // page], t % page] for t in range(56)]) for b in range(2)
    ]
    q = torch.randn(
        6, heads, dim, generator=gen
    ).abs()  # positive queries: keys of negative entries score 0
    w = torch.rand(6, heads, generator=gen)
    req = [0, 0, 0, 1, 1, 1]
    lens = torch.tensor([1, 9, 13, 5, 40, 56], dtype=torch.int32)
    out = torch.full((6, 8), -1, dtype=torch.int32)
    count = torch.empty(6, dtype=torch.int32)
    ops.indexer_topk(out, count, q, w, cache, table[req].contiguous(), lens, dim**-0.5)
    for i in range(6):
        want = indexer_reference(q[i], w[i], keys[req[i]], int(lens[i]), 8, dim**-0.5)
        assert count[i] == len(want) and out[i, : count[i]].tolist() == want, i
    # a key that scores exactly zero loses to any positive one, and ties go to the lowest position
    zero = torch.zeros(1, heads, dim)
    ops.indexer_topk(out[:1], count[:1], zero, w[:1], cache, table[:1].contiguous(), lens[4:5], 1.0)
    assert out[0, : count[0]].tolist() == list(range(8))


def test_indexer_bad_input_is_refused(ops):
    with pytest.raises(RuntimeError, match="q must be a contiguous float32"):
        ops.indexer_topk(
            torch.empty(1, 2, dtype=torch.int32),
            torch.empty(1, dtype=torch.int32),
            torch.zeros(1, 2, 8, dtype=torch.bfloat16),
            torch.zeros(1, 2),
            torch.zeros(2, 4, 8),
            torch.zeros(1, 2, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            1.0,
        )
