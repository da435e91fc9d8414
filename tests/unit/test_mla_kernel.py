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
        lat = torch.stack([cache[table[b, p // page], p % page] for p in range(n)]).double()  # [n, R + r]
        c, k_rope = lat[:, :rank], lat[:, rank:]
        k = torch.cat([torch.einsum("sr,hnr->hsn", c, w_kc.double()), k_rope.expand(w_kc.shape[0], -1, -1)], -1)
        v = torch.einsum("sr,hvr->hsv", c, w_vc.double())
        q = torch.cat([q_nope[b].double(), q_rope[b].double()], -1)  # [H, N + r]
        p = torch.softmax(torch.einsum("hd,hsd->hs", q, k) * scale, -1)
        out.append(torch.einsum("hs,hsv->hv", p, v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("heads, rank, rope, nope, v", [(4, 32, 8, 16, 16), (20, 64, 16, 24, 32),
                                                        (16, 512, 64, 128, 128)])
def test_absorbed_kernel_matches_the_decompressed_form(ops, isa, dtype, page, heads, rank, rope, nope, v):
    gen = torch.Generator().manual_seed(heads * 100 + page)
    lens = torch.tensor([1, 2, 15, 16, 17, 70], dtype=torch.int32)
    B, pages = len(lens), 80 // page + 1
    cache = (torch.randn(B * pages + 1, page, rank + rope, generator=gen) * 0.5).to(dtype)
    table = torch.randperm(B * pages, generator=gen).add(1).view(B, pages).to(torch.int32)
    w_kc = torch.randn(heads, nope, rank, generator=gen) / rank ** 0.5
    w_vc = torch.randn(heads, v, rank, generator=gen) / rank ** 0.5
    q_nope, q_rope = torch.randn(B, heads, nope, generator=gen), torch.randn(B, heads, rope, generator=gen)
    scale = (nope + rope) ** -0.5
    # absorbed: the key up-projection folded into the query, the value one after
    q = torch.cat([torch.einsum("bhn,hnr->bhr", q_nope, w_kc), q_rope], -1).to(dtype)
    o = torch.empty(B, heads, rank, dtype=dtype)
    ops.mla_decode_attention(o, q, cache, table, lens, scale, rank)
    got = torch.einsum("bhr,hvr->bhv", o.double(), w_vc.double())
    want = decompressed(q_nope.to(dtype).float(), q_rope.to(dtype).float(), cache, table, lens, w_kc, w_vc, scale)
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
                ops.mla_decode_attention(alone, q[b:b + 1], cache, table[b:b + 1], lens[b:b + 1], 0.07, 512)
                assert torch.equal(alone[0], o[b]), (tier, b)
    finally:
        ops.set_isa(top)
    first = next(iter(results.values()))
    assert all(torch.equal(r, first) for r in results.values()), sorted(results)


def test_bad_input_is_refused(ops):
    cache = torch.zeros(4, 2, 24)
    table, lens = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="q has 20 dims, the cache's rows 24"):
        ops.mla_decode_attention(torch.empty(1, 2, 16), torch.zeros(1, 2, 20), cache, table, lens, 1.0, 16)
    with pytest.raises(RuntimeError, match="need 1 <= v_dim"):
        ops.mla_decode_attention(torch.empty(1, 2, 30), torch.zeros(1, 2, 24), cache, table, lens, 1.0, 30)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.mla_decode_attention(torch.empty(1, 2, 8), torch.zeros(1, 2, 24), cache, table, lens, 1.0, 16)
