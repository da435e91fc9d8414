"""pdserve's C++ CPU kernels against float64 references, on their AVX-512 and portable paths.

The kernels must build here (scripts/install.sh installs g++ and ninja): a test that cannot load
them fails with the reason instead of skipping.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from pdserve import kernels
from pdserve.layers.linear import pack_vnni16
from pdserve.layers.rotary import apply_rotary
from tests.helpers.spans import first_visible_key

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ops():
    mod = kernels.load()
    assert mod is not None, f"CPU kernels did not build: {kernels.unavailable_reason()}"
    return mod


def attention_reference(q, kc, vc, table, lens, scale, window):
    """float64 softmax attention of each row's query over its pages."""
    B, H, D = q.shape
    kvh, page = kc.shape[1], kc.shape[2]
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        start = first_visible_key(n - 1, window)
        pos = torch.arange(start, n)
        pages = table[b][pos // page].long()
        k = kc[pages, :, pos % page].double()  # [n, kv_heads, D]
        v = vc[pages, :, pos % page].double()
        for h in range(H):
            g = h // (H // kvh)
            p = torch.softmax((k[:, g] @ q[b, h].double()) * scale, 0)
            out[b, h] = p @ v[:, g]
    return out


CASES = [  # (group, head_dim, page_size, kv dtype, q dtype, window: W > 0 a window, -C a chunk)
    (1, 64, 1, torch.float32, torch.float32, 0),
    (3, 64, 16, torch.float32, torch.float32, 0),
    (4, 128, 32, torch.float32, torch.float32, 0),
    (3, 64, 16, torch.bfloat16, torch.float32, 0),
    (4, 128, 16, torch.bfloat16, torch.bfloat16, 0),
    (1, 128, 32, torch.bfloat16, torch.bfloat16, 0),
    (3, 64, 16, torch.float32, torch.float32, 100),
    (4, 128, 1, torch.bfloat16, torch.bfloat16, 37),
    (2, 80, 16, torch.float32, torch.float32, 0),
    (2, 16, 4, torch.float32, torch.float32, 5),
    # attention chunks (window -C): a query sees its own chunk of C positions
    (3, 64, 16, torch.float32, torch.float32, -64),
    (4, 128, 1, torch.bfloat16, torch.bfloat16, -37),
    (2, 16, 4, torch.float32, torch.float32, -5),
]


@pytest.mark.parametrize("group,head_dim,page,kv_dtype,q_dtype,window", CASES)
def test_paged_decode_attention_matches_float64(
    ops, isa, group, head_dim, page, kv_dtype, q_dtype, window
):
    gen = torch.Generator().manual_seed(group * 1000 + head_dim + page)
    kv_heads = 2
    lens = torch.tensor([1, 2, 15, 16, 17, 300, 1001, 2000], dtype=torch.int32)
    B = len(lens)
    used = (lens + page - 1) // page  # pages each request reads
    max_pages, num_pages = int(used.max()), int(used.sum()) + 3
    kc = torch.randn(num_pages, kv_heads, page, head_dim, generator=gen).to(kv_dtype)
    vc = torch.randn(num_pages, kv_heads, page, head_dim, generator=gen).to(kv_dtype)
    kc[0], vc[0] = float("nan"), float("nan")
    # every request's pages scattered over the pool; the table's entries past a request's pages
    # name page 0, all NaN, which a kernel reading past its pages would bring into its output
    table = torch.zeros(B, max_pages, dtype=torch.int32)
    scatter = (torch.randperm(num_pages - 1, generator=gen) + 1).to(torch.int32)
    for b, n in enumerate(used.tolist()):
        table[b, :n], scatter = scatter[:n], scatter[n:]
    q = torch.randn(B, kv_heads * group, head_dim, generator=gen).to(q_dtype)
    out = torch.full_like(q, float("nan"))
    scale = 1 / math.sqrt(head_dim)
    ops.paged_decode_attention(out, q, kc, vc, table, lens, scale, window)
    ref = attention_reference(q, kc, vc, table, lens, scale, window)
    # float32 output: accumulation error only; bf16 output: one rounding of values below ~4
    tol = 2e-6 if q_dtype == torch.float32 else 2**-8 * 4
    err = (out.double() - ref).abs().max().item()
    assert err < tol, f"max abs error {err}"


def test_paged_decode_attention_strided_rows_and_bad_input(ops):
    # q as a view into a fused qkv output (row stride larger than heads * head_dim)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, 5 * 64, generator=gen)
    q = qkv[:, : 3 * 64].view(3, 3, 64)
    kc = torch.randn(8, 1, 4, 64, generator=gen)
    vc = torch.randn(8, 1, 4, 64, generator=gen)
    table = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    lens = torch.tensor([8, 5, 1], dtype=torch.int32)
    out = torch.empty(3, 3, 64)
    ops.paged_decode_attention(out, q, kc, vc, table, lens, 0.125, 0)
    torch.testing.assert_close(
        out.double(), attention_reference(q, kc, vc, table, lens, 0.125, 0), atol=2e-6, rtol=0
    )
    with pytest.raises(RuntimeError, match="int32"):
        ops.paged_decode_attention(out, q, kc, vc, table.long(), lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        ops.paged_decode_attention(
            torch.empty(3, 3, 64),
            q,
            kc.expand(8, 2, 4, 64).contiguous(),
            vc.expand(8, 2, 4, 64).contiguous(),
            table,
            lens,
            0.125,
            0,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 576, 100])
def test_rms_norm_with_and_without_residual(ops, isa, dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=gen).to(dtype)
    res = torch.randn(7, hidden, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)

    def ref(v):  # HF's LlamaRMSNorm: statistics in fp32, cast back, then the weight
        vf = v.float()
        return w * (vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)

    out = torch.empty_like(x)
    ops.rms_norm(out, x, None, w, 1e-6)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=2**-7)
    torch.testing.assert_close(out, ref(x), **tol)
    summed = x + res  # HF adds in the activation dtype
    r = res.clone()
    ops.rms_norm(out, x, r, w, 1e-6)
    assert torch.equal(r, summed)
    torch.testing.assert_close(out, ref(summed), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rotary_embedding_matches_hf_formula(ops, isa, dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    T = 9
    qkv = torch.randn(T, (4 + 2 * 2) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : 4 * head_dim].view(T, 4, head_dim)
    k = qkv[:, 4 * head_dim : 6 * head_dim].view(T, 2, head_dim)
    freqs = torch.outer(
        torch.arange(T, dtype=torch.float32) * 37,
        1 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim),
    )
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    want_q = apply_rotary(q, cos.to(dtype), sin.to(dtype))
    want_k = apply_rotary(k, cos.to(dtype), sin.to(dtype))
    v_before = qkv[:, 6 * head_dim :].clone()
    ops.rotary_embedding(q, k, cos, sin)
    # the same products and sums as HF's eager code, each rounded to the dtype: bit-identical
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, 6 * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(ops, isa, dtype):
    gen = torch.Generator().manual_seed(1)
    gu = (3 * torch.randn(5, 2 * 1537, generator=gen)).to(dtype)
    out = torch.empty(5, 1537, dtype=dtype)
    ops.silu_and_mul(out, gu)
    gate, up = gu.chunk(2, dim=-1)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=2**-7)
    torch.testing.assert_close(out, F.silu(gate) * up, **tol)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 21, 100])
@pytest.mark.parametrize(
    "n,k",
    # 200 x 576: panels of 64 outputs and a ragged one, k chunks of 256 and a ragged one (every
    # blocking of the kernels), at a fifteenth of a model-sized 3072 x 576
    [pytest.param(3072, 576, marks=pytest.mark.large_shape), (200, 576), (37, 19), (100, 64)],
)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_vnni_linear_matches_float64(ops, isa, rows, n, k, out_dtype):
    gen = torch.Generator().manual_seed(n + k + rows)
    x = torch.randn(rows, k, generator=gen)
    w = (0.1 * torch.randn(n, k, generator=gen)).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(out_dtype)
    out = torch.empty(rows, n, dtype=out_dtype)
    ops.linear_vnni(out, x, pack_vnni16(w), bias)
    # x is rounded to bf16 (as in any bf16 GEMM); products and sums are exact up to fp32
    # accumulation
    ref = x.to(torch.bfloat16).double() @ w.double().T + bias.double()
    err = ((out.double() - ref).abs() / (ref.abs() + 1)).max().item()
    assert err < (1e-5 if out_dtype == torch.float32 else 2**-8), err
    # each row is computed alone: the same bits whatever the batch
    single = torch.empty(1, n, dtype=out_dtype)
    ops.linear_vnni(single, x[-1:], pack_vnni16(w), bias)
    assert torch.equal(single[0], out[-1])
    with pytest.raises(RuntimeError, match="do not agree"):
        ops.linear_vnni(torch.empty(2, n), torch.randn(2, k + 2), pack_vnni16(w), None)


@pytest.mark.parametrize("layout", ["contiguous", "column slice", "odd offset"])
def test_vnni_linear_reads_bf16_rows_in_place(ops, isa, layout):
    # bf16 rows of whole pairs are read where they are (any even row stride); other layouts are
    # copied first: the same bits either way
    gen = torch.Generator().manual_seed(7)
    n, k, rows = 130, 96, 6
    w = (0.1 * torch.randn(n, k, generator=gen)).to(torch.bfloat16)
    wide = torch.randn(rows, k + 4, generator=gen).to(torch.bfloat16)
    x = {
        "contiguous": wide[:, :k].contiguous(),
        "column slice": wide[:, :k],
        "odd offset": wide[:, 1 : k + 1],
    }[layout]
    out = torch.empty(rows, n)
    ops.linear_vnni(out, x, pack_vnni16(w), None)
    ref = torch.empty(rows, n)
    ops.linear_vnni(ref, x.float().contiguous(), pack_vnni16(w), None)  # float32 x: always copied
    assert torch.equal(out, ref)
    exact = x.double() @ w.double().T
    assert ((out.double() - exact).abs() / (exact.abs() + 1)).max().item() < 1e-5


def test_isa_tiers_can_be_forced(ops):
    tiers = ops.available_isas()
    before = ops.isa_tier()
    assert tiers[0] == "scalar" and ops.cpu_features() is not None and before in tiers
    try:
        for tier in tiers:
            ops.set_isa(tier)
            assert ops.isa_tier() == tier
            assert ops.isa() == (tier if tier != "amx" else "avx512_bf16") or ops.isa().startswith(
                "amx"
            )
            # every tier but scalar has SIMD code for the flash kernel and the int8 dot products
            assert ops.flash_supported(64) == (tier != "scalar") and ops.has_int8_dot() == (
                tier != "scalar"
            )
            # bf16 above the GEMV's rows goes to oneDNN only with bf16 dot products (or AMX)
            native = (
                tier in ("avx512_bf16", "amx", "neon_bf16")
                and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            )
            assert kernels.onednn_bf16()[0] == native, (tier, kernels.onednn_bf16())
        with pytest.raises(
            ValueError, match=r"ISA tier 'avx1024' is not available on this CPU \(available: scalar"
        ):
            ops.set_isa("avx1024")
    finally:
        ops.set_isa(before)
    assert ops.isa_tier() == before and ops.available_isas() == tiers


def test_pdserve_cpu_isa_caps_the_kernels_and_the_libraries():
    """A process started with PDSERVE_CPU_ISA runs the kernels (and oneDNN, MKL, ATen) at that tier,
    and does not take oneDNN's bf16 matmuls below AVX-512; an unknown tier is refused by name."""
    import subprocess
    import sys

    lowest_simd = (kernels.load().available_isas() + ["scalar"])[1]
    script = (
        "import os, torch; from pdserve import kernels; "
        "kernels.cap_library_isas(os.environ['PDSERVE_CPU_ISA']); ops = kernels.load(); "
        "print(ops.isa(), kernels.onednn_bf16()[0], os.environ.get('ONEDNN_MAX_CPU_ISA'))"
    )
    env = {**os.environ, "PDSERVE_CPU_ISA": lowest_simd}
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    isa, onednn, cap = out.stdout.split()
    assert (
        isa == lowest_simd
        and onednn == "False"
        and cap == {"avx2": "AVX2", "scalar": "SSE41"}.get(lowest_simd, cap)
    )
    env["PDSERVE_CPU_ISA"] = "avx1024"
    out = subprocess.run(
        [sys.executable, "-c", "from pdserve import kernels; kernels.load()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        out.returncode != 0 and "PDSERVE_CPU_ISA: ISA tier 'avx1024' is not available" in out.stderr
    )


def test_kernels_can_be_disabled(monkeypatch):
    monkeypatch.setenv("PDSERVE_DISABLE_CPU_KERNELS", "1")
    kernels._reset_for_tests()
    try:
        assert kernels.load() is None
        assert "PDSERVE_DISABLE_CPU_KERNELS" in kernels.unavailable_reason()
    finally:
        monkeypatch.delenv("PDSERVE_DISABLE_CPU_KERNELS")
        kernels._reset_for_tests()
    assert kernels.load() is not None


def test_build_is_keyed_by_torch_and_sources():
    d = kernels.build_dir()
    assert torch.__version__.replace("+", "_") in d.name and kernels.source_hash() in d.name
    assert "-march=native" not in " ".join(kernels.CFLAGS)


@pytest.mark.parametrize(
    "rows,n,k",
    [
        pytest.param(r, 3072, 576, marks=pytest.mark.large_shape) if n == 3072 else (r, n, k)
        for r in (1, 2, 3, 8, 21)
        for n, k in ((3072, 576), (200, 576), (37, 19))
    ]
    + [(300, 200, 130)],
)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_w8a8_linear_matches_its_quantization(ops, isa, rows, n, k, x_dtype):
    from pdserve.layers.linear import PackedW8A8

    gen = torch.Generator().manual_seed(n + k + rows)
    x = (2 * torch.randn(rows, k, generator=gen)).to(x_dtype)
    w = 0.1 * torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    lin = PackedW8A8(w, bias, ops)
    out = lin(x)
    assert out.dtype == x_dtype and out.shape == (rows, n)
    # the same scheme in float64: per-row activation scale, per-channel weight scale, exact int sums
    # the kernel's quantization rule, in float32 as it runs it: scale = max|x| / 127, q = round(x *
    # (1/scale))
    x32 = x.float()
    xs32 = x32.abs().amax(1, keepdim=True) / 127
    xq = torch.round(x32 * (1 / xs32)).clamp(-127, 127).double()
    xs, xf = xs32.double(), x.double()
    ws = w.abs().amax(1, keepdim=True) / 127  # the packing's rule, in float32
    wq = torch.round(w / ws).clamp(-127, 127).double()
    ref = (xq @ wq.T) * xs * ws.double().T + bias.to(x_dtype).double()
    err = ((out.double() - ref).abs() / (ref.abs() + 1)).max().item()
    assert err < (1e-5 if x_dtype == torch.float32 else 2**-8), err
    # against the unquantized product: the scheme's own error, about 1 % of the output scale
    exact = xf @ w.double().T + bias.to(x_dtype).double()
    assert ((out.double() - exact).abs().max() / exact.abs().max()).item() < 0.03
    one = lin(x[-1:])  # integer sums: a row's result does not depend on the batch
    assert torch.equal(one[0], out[-1])


def random_e4m3(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Every e4m3 byte but NaN (0x7f / 0xff), subnormals and -0 included."""
    bits = torch.randint(0, 256, (n, k), dtype=torch.int32, generator=gen)
    bits = torch.where((bits & 0x7F) == 0x7F, bits - 1, bits)
    return bits.to(torch.uint8).view(torch.float8_e4m3fn)


def fp8_exact_product(
    x: torch.Tensor, q: torch.Tensor, rows: torch.Tensor, bk: int
) -> torch.Tensor:
    """x (q * s)^T in float64 with each block's partial sum scaled once, as the kernel does (its
    float32 roundings aside)."""
    w = q.to(torch.float64)
    k = w.shape[1]
    out = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for b in range(rows.shape[1]):
        part = x.double()[:, b * bk : min(k, (b + 1) * bk)] @ w[:, b * bk : min(k, (b + 1) * bk)].T
        out += part * rows[:, b].double()
    return out


@pytest.mark.parametrize(
    "rows,n,k,bk",
    [(r, 70, 100, 32) for r in (1, 2, 3, 7, 8, 13, 40)] + [(1, 130, 300, 128), (5, 64, 256, 128)],
)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_the_portable_loop_and_batch_invariant(
    ops, isa, rows, n, k, bk, x_dtype, out_dtype
):
    """linear_fp8 at every tier gives the portable loop's bits (the same fused multiply-adds in the
    same order; bf16 x on AMX tiles: TDPBF16PS's order inside a block, tested in
    test_amx_kernels.py), near the float64 product; a row alone gives the bits it gives in any
    batch; every e4m3 value (subnormals too) is read exactly; ragged N, K, a partial last block."""
    from pdserve.quantization.fp8_matmul import pack_fp8

    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    q = random_e4m3(n, k, gen)
    scale = torch.rand(n, -(-k // bk), generator=gen) * 1e-2 + 1e-6
    x = torch.randn(rows, k, generator=gen).to(x_dtype)
    bias = torch.randn(n, generator=gen).to(out_dtype)
    packed, packed_scale = pack_fp8(q, scale)
    out = torch.empty(rows, n, dtype=out_dtype)
    ops.linear_fp8(out, x, packed, packed_scale, bias, bk, 1)
    before = ops.isa_tier()
    ops.set_isa("scalar")
    try:
        portable = torch.empty(rows, n, dtype=out_dtype)
        ops.linear_fp8(portable, x, packed, packed_scale, bias, bk)
    finally:
        ops.set_isa(before)
    tiles = ops.isa().startswith("amx") and x_dtype == torch.bfloat16
    assert tiles or torch.equal(
        out.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32),
        portable.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32),
    )
    ref = fp8_exact_product(x, q, scale, bk) + bias.double()
    err = ((out.double() - ref).abs() / (ref.abs() + 1)).max().item()
    assert err < (1e-5 if out_dtype == torch.float32 else 2**-8), err
    for m in {0, rows - 1}:
        one = torch.empty(1, n, dtype=out_dtype)
        ops.linear_fp8(one, x[m : m + 1], packed, packed_scale, bias, bk, 1)
        assert torch.equal(one[0], out[m])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_dequantize_is_transformers_rounding(ops, isa, out_dtype):
    """The packed panels back to value * scale in float32 (one rounding, as transformers'
    dequantizer), then to bf16, k-major (out[k][n]) into a column slice of a wider buffer: bit
    for bit, the columns past the weight untouched."""
    from pdserve.quantization.fp8_matmul import _widen, pack_fp8

    gen = torch.Generator().manual_seed(3)
    n, k, bk = 130, 300, 128
    q = random_e4m3(n, k, gen)
    scale = torch.rand(n, 3, generator=gen) * 1e-2 + 1e-6
    packed, packed_scale = pack_fp8(q, scale)
    buf = torch.full((k, 256), 7.0, dtype=out_dtype)
    ops.fp8_dequantize(buf[:, :n], packed, packed_scale, bk)
    want = (_widen(q) * scale.repeat_interleave(bk, 1)[:, :k]).to(out_dtype)
    assert torch.equal(buf[:, :n], want.T) and bool((buf[:, n:] == 7.0).all())
    with pytest.raises(RuntimeError, match="does not match"):
        ops.fp8_dequantize(torch.empty(k, n + 64), packed, packed_scale, bk)


def test_fp8_linear_refuses_mismatched_shapes(ops):
    from pdserve.quantization.fp8_matmul import pack_fp8

    q = torch.zeros(70, 100).to(torch.float8_e4m3fn)
    packed, scale = pack_fp8(q, torch.ones(70, 4))
    with pytest.raises(RuntimeError, match="do not agree"):
        ops.linear_fp8(torch.empty(2, 70), torch.randn(2, 101), packed, scale, None, 32)
    with pytest.raises(RuntimeError, match="scale must be"):
        ops.linear_fp8(torch.empty(2, 70), torch.randn(2, 100), packed, scale, None, 64)


# ---- MXFP4 weights ----


def mxfp4_case(n: int, k: int, rows: int, seed: int, x_dtype=torch.float32):
    """Every code (both zeros too) and scale bytes from 0 (2^-127) to 246 (the largest served),
    most near 127; the packed row-major bytes, the scale bytes, x and a bias."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 2), dtype=torch.int32, generator=gen).to(torch.uint8)
    scales = torch.randint(117, 135, (n, k // 32), dtype=torch.int32, generator=gen)
    scales.view(-1)[:2] = torch.tensor([0, 246])  # the range's ends, in the first row
    x = torch.randn(rows, k, generator=gen).to(x_dtype)
    return blocks, scales.to(torch.uint8), x, torch.randn(n, generator=gen)


@pytest.mark.parametrize("rows,n,k", [(r, 70, 96) for r in (1, 2, 3, 7, 13, 40)] + [(1, 130, 320)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_linear_is_the_portable_loop_and_batch_invariant(
    ops, isa, rows, n, k, x_dtype, out_dtype
):
    """linear_mxfp4 at every tier gives the portable loop's bits (the FP8 kernels on codes looked
    up as e4m3 bytes; bf16 x on AMX tiles: TDPBF16PS's order, test_amx_kernels.py), near the
    float64 product of the dequantized weight (transformers' bit for bit: test_weight_formats.py);
    a row alone gives its bits in any batch; ragged N."""
    from pdserve.quantization.mxfp4_matmul import dequantize, pack_mxfp4

    blocks, scales, x, bias = mxfp4_case(n, k, rows, rows * 1000 + n + k, x_dtype)
    bias = bias.to(out_dtype)
    packed, packed_scale = pack_mxfp4(blocks, scales)
    out = torch.empty(rows, n, dtype=out_dtype)
    ops.linear_mxfp4(out, x, packed, packed_scale, bias, 1)
    before = ops.isa_tier()
    ops.set_isa("scalar")
    try:
        portable = torch.empty(rows, n, dtype=out_dtype)
        ops.linear_mxfp4(portable, x, packed, packed_scale, bias)
    finally:
        ops.set_isa(before)
    tiles = ops.isa().startswith("amx") and x_dtype == torch.bfloat16
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    assert tiles or torch.equal(out.view(bits), portable.view(bits))
    w = dequantize(blocks, scales)
    ref = x.double() @ w.double().T + bias.double()
    # relative to the sum of the terms' magnitudes (a row spans scales 2^-127 .. 2^119)
    size = x.double().abs() @ w.double().abs().T + bias.double().abs() + 1
    err = ((out.double() - ref).abs() / size).max().item()
    assert err < (1e-6 if out_dtype == torch.float32 else 2**-8), err
    for m in {0, rows - 1}:
        one = torch.empty(1, n, dtype=out_dtype)
        ops.linear_mxfp4(one, x[m : m + 1], packed, packed_scale, bias, 1)
        assert torch.equal(one[0], out[m])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantize_is_the_reference(ops, isa, out_dtype):
    """The packed panels back to the weight, k-major into a column slice of a wider buffer: the
    reference dequantizer (transformers' bit for bit: test_weight_formats.py) exactly in float32,
    then rounded to bf16, the columns past it untouched; the packing undone exactly."""
    from pdserve.quantization.mxfp4_matmul import dequantize, pack_mxfp4, unpack_mxfp4

    n, k = 130, 320
    blocks, scales, _, _ = mxfp4_case(n, k, 1, 5)
    packed, packed_scale = pack_mxfp4(blocks, scales)
    back = unpack_mxfp4(packed, packed_scale, n)
    assert torch.equal(back[0], blocks) and torch.equal(back[1], scales)
    buf = torch.full((k, 256), 7.0, dtype=out_dtype)
    ops.mxfp4_dequantize(buf[:, :n], packed, packed_scale)
    want = dequantize(blocks, scales).T
    assert torch.equal(buf[:, :n], want.to(out_dtype)) and bool((buf[:, n:] == 7.0).all())


def test_mxfp4_linear_refuses_mismatched_shapes(ops):
    from pdserve.quantization.mxfp4_matmul import pack_mxfp4

    blocks, scales, _, _ = mxfp4_case(70, 96, 1, 0)
    packed, scale = pack_mxfp4(blocks, scales)
    with pytest.raises(RuntimeError, match="do not agree"):
        ops.linear_mxfp4(torch.empty(2, 70), torch.randn(2, 128), packed, scale, None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.linear_mxfp4(torch.empty(2, 70), torch.randn(2, 100), packed, scale, None)
    with pytest.raises(RuntimeError, match="scale must be"):
        ops.linear_mxfp4(torch.empty(2, 70), torch.randn(2, 96), packed, scale.float(), None)


@pytest.mark.parametrize("rows", [1, 3, 21])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_w8a8_linear_takes_a_checkpoints_int8_weights(ops, isa, rows, x_dtype):
    """A checkpoint's int8 weight and channel scales as they are (compressed-tensors' int8
    reaches -128): the same scheme in float64, exact int sums; a row alone gives its bits."""
    from pdserve.layers.linear import PackedW8A8

    gen = torch.Generator().manual_seed(rows)
    n, k = 70, 200
    wq = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int32).to(torch.int8)
    wq[0] = -128  # a row of the extreme value: vpmaddubsw's pairs must not saturate
    ws = torch.rand(n, generator=gen) * 1e-2 + 1e-4
    x = (2 * torch.randn(rows, k, generator=gen)).to(x_dtype)
    bias = torch.randn(n, generator=gen)
    lin = PackedW8A8.from_int8(wq, ws[:, None], bias, ops)
    out = lin(x)
    x32 = x.float()
    xs = x32.abs().amax(1, keepdim=True) / 127
    xq = torch.round(x32 * (1 / xs)).clamp(-127, 127).double()
    ref = (xq @ wq.double().T) * xs.double() * ws.double() + bias.to(x_dtype).double()
    err = ((out.double() - ref).abs() / (ref.abs() + 1)).max().item()
    assert err < (1e-5 if x_dtype == torch.float32 else 2**-8), err
    assert torch.equal(lin(x[-1:])[0], out[-1])


# ---- int4 weights (compressed-tensors' pack-quantized) ----


@pytest.mark.parametrize(
    "rows,n,k,group",
    [(1, 70, 96, 32), (2, 70, 96, 32), (3, 70, 96, 32), (7, 70, 96, 32), (40, 130, 256, 128)],
)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_is_the_portable_loop_and_batch_invariant(ops, isa, rows, n, k, group, x_dtype):
    """linear_int4 at every tier gives the portable loop's bits (the FP8 kernels' sums on codes
    looked up as q = code - 8; bf16 x on AMX tiles: their order), near the float64 product of
    the dequantized weight; a row alone gives its bits in any batch; every code; the
    dequantization kernel is the reference's bits."""
    from pdserve.quantization.int4_matmul import Int4GroupLinear

    gen = torch.Generator().manual_seed(rows + n + k)
    blocks = torch.randint(0, 256, (n, k // 2), dtype=torch.int32, generator=gen).to(torch.uint8)
    scale = torch.rand(n, -(-k // group), generator=gen) * 1e-2 + 1e-4
    x = torch.randn(rows, k, generator=gen).to(x_dtype)
    bias = torch.randn(n, generator=gen)
    lin = Int4GroupLinear(blocks, scale, bias, group)
    w = lin.dequantized()
    lin.use_kernels(ops, batch_invariant=False)
    out = lin(x)
    before = ops.isa_tier()
    ops.set_isa("scalar")
    try:
        portable = lin(x)
        deq = torch.empty(k, n)
        ops.int4_dequantize(deq, lin.packed, lin.packed_scale, group)
    finally:
        ops.set_isa(before)
    tiles = ops.isa().startswith("amx") and x_dtype == torch.bfloat16
    assert tiles or torch.equal(
        out.view(torch.int32 if x_dtype == torch.float32 else torch.int16),
        portable.view(torch.int32 if x_dtype == torch.float32 else torch.int16),
    )
    here = torch.empty(k, n)
    ops.int4_dequantize(here, lin.packed, lin.packed_scale, group)
    assert torch.equal(here, w.T) and torch.equal(deq, w.T)
    ref = x.double() @ w.double().T + bias.to(x_dtype).double()
    err = ((out.double() - ref).abs() / (ref.abs() + 1)).max().item()
    assert err < (1e-5 if x_dtype == torch.float32 else 2**-8), err
    assert torch.equal(lin(x[-1:])[0], out[-1])


@pytest.mark.parametrize("rows,n,k,group", [(1, 70, 96, 32), (3, 130, 256, 128), (6, 64, 100, 4)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_int4_w4a8_is_the_integer_sums_at_every_tier(ops, isa, rows, n, k, group, x_dtype):
    """linear_int4_w4a8 (int4 codes x per-row int8 activations): the portable loop's bits at every
    tier, a row alone its bits in any batch, near float64 over x quantized by w8a8's rule; k not
    a multiple of 4 (padded quads), ragged N."""
    from pdserve.quantization.int4_matmul import dequantize, pack_w4a8

    gen = torch.Generator().manual_seed(rows + n + k)
    blocks = torch.randint(0, 256, (n, -(-k // 2)), dtype=torch.int32, generator=gen).to(
        torch.uint8
    )
    kk = blocks.shape[1] * 2
    scale = torch.rand(n, -(-kk // group), generator=gen) * 1e-2 + 1e-4
    x = (3 * torch.randn(rows, kk, generator=gen)).to(x_dtype)
    bias = torch.randn(n, generator=gen).to(x_dtype)
    packed, packed_scale = pack_w4a8(blocks, scale)
    out = torch.empty(rows, n, dtype=x_dtype)
    ops.linear_int4_w4a8(out, x, packed, packed_scale, bias, group)
    before = ops.isa_tier()
    ops.set_isa("scalar")
    try:
        portable = torch.empty(rows, n, dtype=x_dtype)
        ops.linear_int4_w4a8(portable, x, packed, packed_scale, bias, group)
    finally:
        ops.set_isa(before)
    assert torch.equal(out, portable)
    one = torch.empty(1, n, dtype=x_dtype)
    ops.linear_int4_w4a8(one, x[-1:], packed, packed_scale, bias, group)
    assert torch.equal(one[0], out[-1])
    x32 = x.float()
    xs = x32.abs().amax(1, keepdim=True) / 127
    xq = torch.round(x32 * (1 / xs)).clamp(-127, 127)
    ref = (xq.double() * xs.double()) @ dequantize(blocks, scale, group).double().T
    ref = ref + bias.double()
    err = ((out.double() - ref).abs() / (ref.abs() + 1)).max().item()
    assert err < (1e-5 if x_dtype == torch.float32 else 2**-8), err


@pytest.mark.parametrize("rows,n,k", [(1, 70, 96), (5, 130, 256), (8, 64, 2880)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_w4a8_is_the_integer_sums_at_every_tier(ops, isa, rows, n, k, x_dtype):
    """linear_mxfp4_w4a8 (MXFP4's e2m1 codes x per-row int8 activations): the portable loop's bits
    at every tier, a row alone its bits in any batch, near float64 over the dequantized MXFP4
    weight (every code, scales from 2^-128) and x quantized by w8a8's rule."""
    from pdserve.quantization.mxfp4_matmul import Mxfp4Linear, dequantize

    gen = torch.Generator().manual_seed(rows + n + k)
    blocks = torch.randint(0, 256, (n, k // 2), dtype=torch.int32, generator=gen).to(torch.uint8)
    scales = torch.randint(118, 130, (n, k // 32), dtype=torch.int32, generator=gen)
    scales[0, 0], scales[-1, -1] = 0, 160  # 2^-128 (subnormal in float32), 2^33
    scales = scales.to(torch.uint8)
    x = (3 * torch.randn(rows, k, generator=gen)).to(x_dtype)
    bias = torch.randn(n, generator=gen).to(x_dtype)
    lin = Mxfp4Linear(blocks, scales, bias, int8_activations=True)
    ref_w = dequantize(blocks, scales)
    lin.use_kernels(ops)
    assert lin.panels().codes == 4
    out = lin(x)
    before = ops.isa_tier()
    ops.set_isa("scalar")
    try:
        portable = lin(x)
    finally:
        ops.set_isa(before)
    assert torch.equal(out, portable)
    assert torch.equal(lin(x[-1:])[0], out[-1])
    x32 = x.float()
    xs = x32.abs().amax(1, keepdim=True) / 127
    xq = torch.round(x32 * (1 / xs)).clamp(-127, 127)
    ref = (xq.double() * xs.double()) @ ref_w.double().T + bias.double()
    err = ((out.double() - ref).abs() / (ref.abs() + 1)).max().item()
    assert err < (1e-5 if x_dtype == torch.float32 else 2**-8), err
