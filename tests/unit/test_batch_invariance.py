"""The kernels of ``--enable-deterministic-inference``: a row's result is the same bits whatever
else is in the call (other rows, the chunk its request's rows come in, a cached prefix, the thread
count), on the AVX-512 and the portable paths; and ``linear_f32`` against float64."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve import kernels
from pdserve.layers.linear import PackedBF16, PackedF32, PackedW8A8, pack_panels

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ops():
    mod = kernels.load()
    assert mod is not None, f"CPU kernels did not build: {kernels.unavailable_reason()}"
    return mod


@pytest.mark.parametrize("rows,n,k", [(1, 64, 64), (5, 100, 37), (33, 257, 128), (64, 64, 1000)])
def test_linear_f32_matches_float64(ops, isa, rows, n, k):
    gen = torch.Generator().manual_seed(rows * n + k)
    w, b, x = (
        torch.randn(n, k, generator=gen),
        torch.randn(n, generator=gen),
        torch.randn(rows, k, generator=gen),
    )
    out = torch.full((rows, n), float("nan"))
    ops.linear_f32(out, x, pack_panels(w, 1), b)
    ref = x.double() @ w.double().T + b.double()
    err = (out.double() - ref).abs().max().item()
    assert err < 1e-5 * math.sqrt(k), f"max abs error {err}"


def test_linear_f32_gives_the_same_bits_on_every_path(ops):
    """One k-ordered FMA chain per output, whatever the tier: scalar (std::fma), AVX2 / NEON and
    AVX-512 tiles agree to the bit."""
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(200, 300, generator=gen), torch.randn(7, 300, generator=gen)
    packed, outs = pack_panels(w, 1), {}
    before = ops.isa_tier()
    for isa in ops.available_isas():
        ops.set_isa(isa)
        out = torch.empty(7, 200)
        ops.linear_f32(out, x, packed, None)
        outs[isa] = out
    ops.set_isa(before)
    assert all(torch.equal(outs["scalar"], out) for out in outs.values()), list(outs)


def test_linear_f32_rejects_bad_shapes(ops):
    with pytest.raises(RuntimeError, match="linear_f32: shapes"):
        ops.linear_f32(
            torch.empty(2, 64), torch.empty(2, 10), pack_panels(torch.empty(64, 11), 1), None
        )
    with pytest.raises(RuntimeError, match="float32"):
        ops.linear_f32(
            torch.empty(2, 64),
            torch.empty(2, 10).bfloat16(),
            pack_panels(torch.empty(64, 10), 1),
            None,
        )


def _matmuls(ops, gen):
    w = torch.randn(192, 160, generator=gen) * 0.05
    b = torch.randn(192, generator=gen)
    return {
        "float32": (PackedF32(w, b, ops), torch.float32),
        "bf16": (PackedBF16(w, b.bfloat16(), ops, batch_invariant=True), torch.bfloat16),
        "bf16-logits": (PackedBF16(w, None, ops, float32_out=True), torch.bfloat16),
        "w8a8": (PackedW8A8(w, b, ops), torch.bfloat16),
    }


@pytest.mark.parametrize("kind", ["float32", "bf16", "bf16-logits", "w8a8"])
def test_matmul_rows_do_not_depend_on_the_batch(ops, isa, kind):
    gen = torch.Generator().manual_seed(11)
    mm, dtype = _matmuls(ops, gen)[kind]
    x = torch.randn(64, 160, generator=gen).to(dtype)
    alone = torch.cat([mm(x[i : i + 1]) for i in range(64)])
    for m in (2, 3, 4, 5, 8, 9, 17, 31, 64):
        for start in (0, 64 - m):
            assert torch.equal(mm(x[start : start + m]), alone[start : start + m]), (
                f"{m} rows from {start}"
            )
    torch.set_num_threads(2)
    try:
        assert torch.equal(mm(x), alone)
    finally:
        torch.set_num_threads(1)


def test_bf16_matmul_without_the_flag_is_what_the_default_runs(ops):
    # the default path hands more than GEMV_MAX_ROWS rows to oneDNN where it takes oneDNN's bf16
    # (kernels.onednn_bf16), else pdserve's kernel at every row count; the batch-invariant one never
    # calls oneDNN
    w = torch.randn(64, 64)
    assert (PackedBF16(w, None, ops).onednn is not None) == kernels.onednn_bf16()[0]
    assert PackedBF16(w, None, ops, onednn=False).onednn is None
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():  # oneDNN can prepack bf16 on this CPU
        assert PackedBF16(w, None, ops, onednn=True).onednn is not None
        assert PackedBF16(w, None, ops, onednn=True, batch_invariant=True).onednn is None


def _pool(gen, length, kv_heads, head_dim, page):
    pages = -(-length // page)
    kc = torch.randn(pages + 2, kv_heads, page, head_dim, generator=gen).bfloat16()
    vc = torch.randn(pages + 2, kv_heads, page, head_dim, generator=gen).bfloat16()
    table = (torch.randperm(pages + 1, generator=gen)[:pages] + 1).to(torch.int32)[None, :]
    return kc, vc, table


@pytest.mark.parametrize("window", [0, 50])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_flash_attention_rows_do_not_depend_on_chunks_or_neighbours(
    ops, flash_isa, window, with_sinks
):
    """One request's rows computed as a whole prefill, as chunks after a cached prefix, one at a
    time as decode, and beside another request: the same bits."""
    gen = torch.Generator().manual_seed(window + with_sinks)
    L, kvh, G, D, page = 150, 2, 3, 64, 16
    kc, vc, table = _pool(gen, L, kvh, D, page)
    q = torch.randn(L, kvh * G, D, generator=gen).bfloat16()
    sinks = torch.randn(kvh * G, generator=gen) if with_sinks else None
    scale = 1 / math.sqrt(D)

    def run(rows, lens, starts, tables, qq):
        out = torch.empty_like(qq)
        ops.paged_attention_bf16(
            out,
            qq,
            kc,
            vc,
            tables,
            torch.tensor(lens, dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32),
            scale,
            window,
            sinks,
        )
        return out

    whole = run(None, [L], [0, L], table, q)
    for cut in ((0, 5, 150), (0, 37, 64, 100, 150), (0, 1, 2, 149, 150)):
        for a, b in zip(cut, cut[1:]):
            part = run(None, [b], [0, b - a], table, q[a:b].contiguous())
            assert torch.equal(part, whole[a:b]), f"rows {a}..{b}"
    for i in (0, 15, 16, 63, 64, 65, 149):
        assert torch.equal(
            run(None, [i + 1], [0, 1], table, q[i : i + 1].contiguous()), whole[i : i + 1]
        ), f"decode row {i}"
    # beside another request (its own pages, further in the pool's table)
    other_q = torch.randn(20, kvh * G, D, generator=gen).bfloat16()
    both = torch.cat([other_q, q[100:]])
    tables = torch.cat([table, table])
    out = run(None, [20, L], [0, 20, 20 + L - 100], tables, both.contiguous())
    assert torch.equal(out[20:], whole[100:])


def test_decode_kernel_as_row_attention_matches_itself_in_any_batch(ops, isa):
    """The float32 deterministic path runs every row (prefill rows too) as its own decode query."""
    gen = torch.Generator().manual_seed(5)
    L, kvh, G, D, page = 90, 2, 2, 32, 8
    kc, vc, table = _pool(gen, L, kvh, D, page)
    kc, vc = kc.float(), vc.float()
    q = torch.randn(L, kvh * G, D, generator=gen)
    lens = torch.arange(1, L + 1, dtype=torch.int32)
    tables = table.expand(L, -1).contiguous()
    whole = torch.empty_like(q)
    ops.paged_decode_attention(whole, q, kc, vc, tables, lens, 0.2, 30)
    for i in (0, 17, 89):
        one = torch.empty(1, kvh * G, D)
        ops.paged_decode_attention(
            one,
            q[i : i + 1].contiguous(),
            kc,
            vc,
            tables[i : i + 1].contiguous(),
            lens[i : i + 1],
            0.2,
            30,
        )
        assert torch.equal(one, whole[i : i + 1])
