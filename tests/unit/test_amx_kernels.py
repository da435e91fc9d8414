"""pdserve's AMX kernels (kernels/csrc/amx*.cpp) against float64 references.

On a CPU without AMX the AMX kernels run on emulated tiles (``set_amx_emulation``: the tile
instructions in plain C++, through the same dispatch and self-check), which needs avx512_bf16 for
the code around the tiles. The emulation's tile products are pinned to the SDM's pseudo-code
first; then each kernel is checked against float64 (layouts, tails, masks), for batch and thread
invariance, against the AVX-512 kernels and with AMX switched off. Tests of the real tiles skip
on CPUs without AMX.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from pdserve import kernels
from pdserve.layers.linear import PackedW8A8, pack_vnni16
from tests.helpers.spans import first_visible_key

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ops():
    mod = kernels.load()
    assert mod is not None, f"CPU kernels did not build: {kernels.unavailable_reason()}"
    return mod


@pytest.fixture
def emulated(ops):
    """The AMX kernels on emulated tiles; every switch restored afterwards."""
    try:
        ops.set_amx_emulation(True)
    except RuntimeError as e:
        pytest.skip(f"no AMX emulation on this CPU: {e}")
    yield ops
    ops.set_amx_emulation(False)
    ops.set_amx(True)
    ops.set_amx_fault_injection("")
    ops.set_amx_min_rows(1, 1)


@pytest.fixture
def hardware(ops):
    status = ops.amx_status()
    if status["self_check_hardware"].startswith("failed"):
        pytest.fail(f"the AMX kernels disagree with the AVX-512 kernels on this CPU: {status}")
    if status["backend"] != "hardware":
        why = (
            "this CPU has no AMX (amx_tile, amx_bf16, amx_int8)"
            if not status["cpu"]
            else f"AMX not usable: {status}"
        )
        pytest.skip(f"{why}: the AMX kernels are tested on emulated tiles only here")
    yield ops


def bf16_bits(x: float) -> torch.Tensor:
    return torch.tensor([x], dtype=torch.float32).to(torch.bfloat16)


# ---- the emulated tile products ----


def test_emulated_tile_products_follow_the_sdm(ops):
    gen = torch.Generator().manual_seed(0)
    for m, k, n in [(16, 16, 16), (3, 5, 7), (1, 1, 1)]:
        a = torch.randint(0, 256, (m, 4 * k), generator=gen, dtype=torch.uint8)
        s = torch.randint(-128, 128, (m, 4 * k), generator=gen, dtype=torch.int8)
        b = torch.randint(-128, 128, (k, 4 * n), generator=gen, dtype=torch.int8)
        c0 = torch.randint(-1000, 1000, (m, n), generator=gen, dtype=torch.int32)
        bq = b.long().view(k, n, 4).permute(0, 2, 1).reshape(4 * k, n)  # [k quads * 4, n]
        for op, x in (("usd", a), ("ssd", s)):
            c = c0.clone()
            ops.amx_tile_dp(op, c, x, b, False)
            assert torch.equal(c.long(), c0.long() + x.long() @ bq), op
        af = torch.randn(m, 2 * k, generator=gen).to(torch.bfloat16)
        bf = torch.randn(k, 2 * n, generator=gen).to(torch.bfloat16)
        cf = torch.randn(m, n, generator=gen)
        c = cf.clone()
        ops.amx_tile_dp("bf16", c, af, bf, False)
        bp = bf.double().view(k, n, 2).permute(0, 2, 1).reshape(2 * k, n)
        assert (c.double() - (cf.double() + af.double() @ bp)).abs().max().item() < 1e-5
    # each product is added on its own, rounded to fp32: 1 + 2^-24 + 2^-24 stays 1 (ties to even),
    # where one rounding of the pair's sum would give 1 + 2^-23
    c = torch.ones(1, 1)
    ops.amx_tile_dp(
        "bf16",
        c,
        torch.cat([bf16_bits(2.0**-24)] * 2).view(1, 2),
        torch.ones(1, 2, dtype=torch.bfloat16),
        False,
    )
    assert c.item() == 1.0
    # bf16 denormal inputs read as zero
    c = torch.zeros(1, 1)
    tiny = torch.tensor([1], dtype=torch.int16).view(torch.bfloat16)  # smallest denormal
    ops.amx_tile_dp(
        "bf16",
        c,
        torch.cat([tiny, bf16_bits(0.0)]).view(1, 2),
        torch.cat([bf16_bits(2.0**120)] * 2).view(1, 2),
        False,
    )
    assert c.item() == 0.0


def test_emulated_tiles_enforce_the_palette_limits(ops):
    with pytest.raises(RuntimeError, match="at most 16 x 64"):
        ops.amx_tile_dp(
            "usd",
            torch.zeros(17, 4, dtype=torch.int32),
            torch.zeros(17, 8, dtype=torch.uint8),
            torch.zeros(2, 16, dtype=torch.int8),
            False,
        )
    with pytest.raises(RuntimeError, match="do not agree"):
        ops.amx_tile_dp(
            "usd",
            torch.zeros(4, 4, dtype=torch.int32),
            torch.zeros(4, 8, dtype=torch.uint8),
            torch.zeros(3, 16, dtype=torch.int8),
            False,
        )
    with pytest.raises(RuntimeError, match="op must be"):
        ops.amx_tile_dp("fp8", torch.zeros(1, 1), torch.zeros(1, 2), torch.zeros(1, 2), False)


# ---- bf16 linear ----


def vnni_case(n: int, k: int, rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    w = (0.1 * torch.randn(n, k, generator=gen)).to(torch.bfloat16)
    return x, w, torch.randn(n, generator=gen)


def vnni(ops, x, packed, bias, n, dtype=torch.float32, **kw):
    out = torch.empty(x.shape[0], n, dtype=dtype)
    ops.linear_vnni(out, x, packed, None if bias is None else bias.to(dtype), **kw)
    return out


@pytest.mark.parametrize(
    "n,k,rows",
    [
        (3072, 576, 1),
        (3072, 576, 21),
        (37, 19, 1),
        (37, 19, 2),
        (37, 19, 3),
        (37, 19, 5),
        (37, 19, 21),
        (100, 64, 8),
        (100, 64, 17),
        (100, 64, 40),
    ],
)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_bf16_linear_on_emulated_tiles_matches_float64(emulated, n, k, rows, out_dtype):
    ops = emulated
    assert ops.isa() == "amx_bf16_emulated"
    x, w, bias = vnni_case(n, k, rows, n + k + rows)
    out = vnni(ops, x, pack_vnni16(w), bias, n, out_dtype)
    ref = x.to(torch.bfloat16).double() @ w.double().T + bias.to(out_dtype).double()
    err = ((out.double() - ref).abs() / (ref.abs() + 1)).max().item()
    assert err < (1e-5 if out_dtype == torch.float32 else 2**-8), err
    assert torch.equal(vnni(ops, x[-1:], pack_vnni16(w), bias, n, out_dtype)[0], out[-1])


def test_bf16_linear_rows_do_not_depend_on_the_batch_or_threads(emulated):
    ops = emulated
    x, w, bias = vnni_case(100, 200, 64, 1)
    packed = pack_vnni16(w)
    full = vnni(ops, x, packed, bias, 100)
    for m in range(1, 65):
        assert torch.equal(vnni(ops, x[:m], packed, bias, 100), full[:m]), m
    torch.set_num_threads(2)
    try:
        assert torch.equal(vnni(ops, x, packed, bias, 100), full)
    finally:
        torch.set_num_threads(1)


def test_emulated_tiles_are_what_runs(emulated):
    ops = emulated
    x, w, bias = vnni_case(37, 19, 3, 2)
    packed = pack_vnni16(w)
    good = vnni(ops, x, packed, bias, 37)
    assert ops.amx_status()["self_check_emulated"] == "passed"
    ops.set_amx_fault_injection(
        "bf16"
    )  # after the self-check: a wrong tile product reaches the output
    bad = vnni(ops, x, packed, bias, 37)
    assert (bad - good)[0, 0].item() == pytest.approx(1.0, abs=1e-3)
    assert torch.equal(bad[1:], good[1:])


def test_amx_min_rows_and_switching_amx_off(emulated):
    ops = emulated
    x, w, bias = vnni_case(100, 64, 12, 3)
    packed = pack_vnni16(w)
    on_tiles = vnni(ops, x, packed, bias, 100, amx_min_rows=1)
    ops.set_amx(False)
    avx512 = vnni(ops, x, packed, bias, 100)
    ops.set_amx_emulation(False)
    assert torch.equal(
        avx512, vnni(ops, x, packed, bias, 100)
    )  # off is the AVX-512 kernel, bit for bit
    ops.set_amx_emulation(True)
    ops.set_amx(True)
    assert ops.isa() == "amx_bf16_emulated"
    # calls below the threshold take the AVX-512 kernel, calls at or above it the tiles
    for m in (1, 7, 8, 12):
        got = vnni(ops, x[:m], packed, bias, 100, amx_min_rows=8)
        assert torch.equal(got, (on_tiles if m >= 8 else avx512)[:m]), m
    ops.set_amx_min_rows(8, 1)  # the process default of amx_min_rows
    assert torch.equal(vnni(ops, x[:7], packed, bias, 100), avx512[:7])
    assert ops.amx_status()["linear_min_rows"] == 8
    with pytest.raises(RuntimeError, match=">= 1"):
        ops.set_amx_min_rows(0, 1)


# ---- FP8 block weights ----


def fp8_case(n: int, k: int, rows: int, bk: int, seed: int):
    """Every e4m3 byte but NaN (subnormals and -0 too), block scales, bf16 x and a bias; the
    packed operands and the exact weight."""
    from pdserve.quantization.fp8_matmul import _widen, pack_fp8

    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (n, k), dtype=torch.int32, generator=gen)
    q = torch.where((bits & 0x7F) == 0x7F, bits - 1, bits).to(torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.rand(n, -(-k // bk), generator=gen) * 1e-2 + 1e-6
    packed, packed_scale = pack_fp8(q, scale)
    w = _widen(q) * scale.repeat_interleave(bk, 1)[:, :k]
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    return x, packed, packed_scale, w, torch.randn(n, generator=gen)


def fp8(ops, x, packed, scale, bias, n, bk, out_dtype=torch.float32, amx_min_rows=1):
    out = torch.empty(x.shape[0], n, dtype=out_dtype)
    ops.linear_fp8(out, x, packed, scale, bias.to(out_dtype), bk, amx_min_rows)
    return out


@pytest.mark.parametrize(
    "n,k,bk,rows", [(70, 100, 32, 1), (130, 300, 128, 5), (64, 256, 128, 17), (200, 96, 48, 40)]
)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_on_emulated_tiles_matches_float64(emulated, n, k, bk, rows, out_dtype):
    """The B tiles hold the e4m3 values exactly (subnormals too), blocks of any width (48: steps
    across a block's end), partial k steps and row blocks; rows independent of the batch."""
    ops = emulated
    x, packed, scale, w, bias = fp8_case(n, k, rows, bk, n + k + rows)
    out = fp8(ops, x, packed, scale, bias, n, bk, out_dtype)
    ref = x.double() @ w.double().T + bias.to(out_dtype).double()
    err = ((out.double() - ref).abs() / (ref.abs() + 1)).max().item()
    assert err < (1e-5 if out_dtype == torch.float32 else 2**-8), err
    for m in {1, rows // 2 + 1}:
        assert torch.equal(fp8(ops, x[:m], packed, scale, bias, n, bk, out_dtype), out[:m])
    # below amx_min_rows the vector kernel: other bits, the same values
    vec = fp8(ops, x, packed, scale, bias, n, bk, out_dtype, amx_min_rows=rows + 1)
    assert ((vec.double() - ref).abs() / (ref.abs() + 1)).max().item() < (
        1e-5 if out_dtype == torch.float32 else 2**-8
    )


def test_fp8_linear_on_hardware_tiles_equals_the_emulation(hardware):
    ops = hardware
    for n, k, bk, rows in [(130, 300, 128, 5), (200, 96, 48, 40)]:
        x, packed, scale, w, bias = fp8_case(n, k, rows, bk, 1)
        hw = fp8(ops, x, packed, scale, bias, n, bk)
        ref = x.double() @ w.double().T + bias.double()
        assert ((hw.double() - ref).abs() / (ref.abs() + 1)).max().item() < 1e-5
        ops.set_amx_emulation(True)
        try:
            emu = fp8(ops, x, packed, scale, bias, n, bk)
        finally:
            ops.set_amx_emulation(False)
        # the hardware may round a pair's sum otherwise in the last bit (amx.h): a few ulps
        assert ((hw - emu).abs() / (emu.abs() + 1)).max().item() < 1e-5


# ---- int8 linear ----


@pytest.mark.parametrize("rows", [1, 3, 8, 21])
@pytest.mark.parametrize("n,k", [(3072, 576), (37, 19), (100, 130)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_w8a8_linear_on_emulated_tiles_equals_vnni_and_its_quantization(
    emulated, rows, n, k, x_dtype
):
    ops = emulated
    gen = torch.Generator().manual_seed(n + k + rows)
    x = (2 * torch.randn(rows, k, generator=gen)).to(x_dtype)
    w = 0.1 * torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    lin = PackedW8A8(w, bias, ops)
    out = lin(x)
    # the quantization scheme in float64 (as test_cpu_kernels checks the VNNI kernel)
    x32 = x.float()
    xs32 = x32.abs().amax(1, keepdim=True) / 127
    xq = torch.round(x32 * (1 / xs32)).clamp(-127, 127).double()
    ws = w.abs().amax(1, keepdim=True) / 127
    wq = torch.round(w / ws).clamp(-127, 127).double()
    ref = (xq @ wq.T) * xs32.double() * ws.double().T + bias.to(x_dtype).double()
    err = ((out.double() - ref).abs() / (ref.abs() + 1)).max().item()
    assert err < (1e-5 if x_dtype == torch.float32 else 2**-8), err
    ops.set_amx(False)
    vnni_out = lin(x)
    if ops.has_int8_dot():  # exact integer sums, the same dequantization: the same bits
        assert torch.equal(out, vnni_out)


# ---- attention ----


def attention_batch(reqs, heads, kv_heads, dim, page, seed):
    """q, the pool, a scattered page table, lens and q_starts for requests (length, new tokens)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-n // page) for n, _ in reqs]
    pages = list(range(1, sum(need) + 1))
    rng.shuffle(pages)
    table = torch.zeros(len(reqs), max(need), dtype=torch.int32)
    for b, c in enumerate(need):
        table[b, :c] = torch.tensor([pages.pop() for _ in range(c)])
    kc = torch.randn(sum(need) + 1, kv_heads, page, dim, generator=gen).to(torch.bfloat16)
    vc = torch.randn(sum(need) + 1, kv_heads, page, dim, generator=gen).to(torch.bfloat16)
    q = torch.randn(sum(e for _, e in reqs), heads, dim, generator=gen).to(torch.bfloat16)
    lens = torch.tensor([n for n, _ in reqs], dtype=torch.int32)
    starts = torch.tensor(
        [0] + [sum(e for _, e in reqs[: i + 1]) for i in range(len(reqs))], dtype=torch.int32
    )
    return q, kc, vc, table, lens, starts


def attention_reference(q, kc, vc, table, lens, starts, scale, window, sinks):
    heads, kv_heads, page = q.shape[1], kc.shape[1], kc.shape[2]
    g = heads // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(lens)):
        n, s0, s1 = int(lens[b]), int(starts[b]), int(starts[b + 1])
        pos = torch.arange(n)
        rows = table[b][pos // page].long()
        k = kc[rows, :, pos % page].double().repeat_interleave(g, 1)  # [n, heads, D]
        v = vc[rows, :, pos % page].double().repeat_interleave(g, 1)
        for j, t in enumerate(range(s0, s1)):
            p = n - (s1 - s0) + j
            lo = first_visible_key(p, window)
            logits = torch.einsum("khd,hd->hk", k[lo : p + 1], q[t].double()) * scale
            if sinks is not None:
                logits = torch.cat([logits, sinks.double()[:, None]], 1)
            w = torch.softmax(logits, 1)[:, : p + 1 - lo]
            out[t] = torch.einsum("hk,khd->hd", w, v[lo : p + 1])
    return out


def attention(ops, q, kc, vc, table, lens, starts, scale, window, sinks, **kw):
    out = torch.zeros_like(q)
    ops.paged_attention_bf16(out, q, kc, vc, table, lens, starts, scale, window, sinks, **kw)
    return out


REQS = [(150, 150), (37, 1), (90, 21), (5, 5), (300, 1)]  # prefill, decode, extend after a prefix


@pytest.mark.parametrize(
    "group,dim,page,window,sinks",
    [
        (1, 64, 1, 0, False),
        (4, 128, 16, 0, False),
        (2, 80, 16, 37, True),
        (8, 64, 16, 0, True),
        (2, 256, 32, 100, False),
        (2, 16, 4, 5, False),
        (3, 96, 16, 64, True),
        (2, 80, 16, -37, True),  # attention chunks of 37 positions
        (3, 96, 1, -64, False),
    ],
)
def test_attention_on_emulated_tiles_matches_float64(emulated, group, dim, page, window, sinks):
    ops = emulated
    kv_heads = 2
    heads = group * kv_heads
    args = attention_batch(REQS, heads, kv_heads, dim, page, seed=dim + page + abs(window))
    sk = 2 * torch.randn(heads, generator=torch.Generator().manual_seed(1)) if sinks else None
    scale = dim**-0.5
    out = attention(ops, *args, scale, window, sk)
    ref = attention_reference(*args, scale, window, sk)
    assert (out.double() - ref).abs().max().item() < 2e-2
    ops.set_amx(False)
    avx512 = attention(ops, *args, scale, window, sk)
    assert (out.double() - avx512.double()).abs().max().item() < 2e-2
    ops.set_amx_emulation(False)
    ops.set_amx(True)
    again = attention(ops, *args, scale, window, sk)
    if ops.amx_status()["backend"] == "hardware":
        # AMX on without emulation runs the hardware tiles here: within the float64 bound (they
        # differ from the emulated attention in the last bits of a few rows on Sapphire Rapids)
        assert (again.double() - ref).abs().max().item() < 2e-2
    else:  # no tiles to run: AMX on without emulation is the AVX-512 kernel
        assert torch.equal(avx512, again)


@pytest.mark.parametrize("window", [0, 37])
def test_attention_rows_do_not_depend_on_the_other_rows_or_threads(emulated, window):
    ops = emulated
    heads, kv_heads, dim, page = 8, 2, 64, 16
    q, kc, vc, table, lens, starts = attention_batch(
        [(200, 200)], heads, kv_heads, dim, page, seed=5
    )
    scale = dim**-0.5
    full = attention(ops, q, kc, vc, table, lens, starts, scale, window, None)
    # the last `ext` positions alone (other query blocks), and next to another request
    for ext in (1, 7, 23, 90):
        rows = q[-ext:].contiguous()
        alone = attention(
            ops,
            rows,
            kc,
            vc,
            table,
            lens,
            torch.tensor([0, ext], dtype=torch.int32),
            scale,
            window,
            None,
        )
        assert torch.equal(alone, full[-ext:]), ext
        both = torch.cat([q[:3], rows])
        pair_table = torch.cat([table, table])
        pair = attention(
            ops,
            both,
            kc,
            vc,
            pair_table,
            torch.tensor([3, 200], dtype=torch.int32),
            torch.tensor([0, 3, 3 + ext], dtype=torch.int32),
            scale,
            window,
            None,
        )
        assert torch.equal(pair[3:], full[-ext:]), ext
    torch.set_num_threads(2)
    try:
        assert torch.equal(
            attention(ops, q, kc, vc, table, lens, starts, scale, window, None), full
        )
    finally:
        torch.set_num_threads(1)


def test_attention_amx_min_rows(emulated):
    ops = emulated
    q, kc, vc, table, lens, starts = attention_batch([(100, 100), (50, 1)], 4, 2, 64, 16, seed=6)
    tiles = attention(ops, q, kc, vc, table, lens, starts, 0.125, 0, None)
    ops.set_amx(False)
    avx512 = attention(ops, q, kc, vc, table, lens, starts, 0.125, 0, None)
    ops.set_amx(True)
    # tasks of 16 positions x 2 heads take the tiles; the decode row's task (2 rows) does not
    mixed = attention(ops, q, kc, vc, table, lens, starts, 0.125, 0, None, amx_min_rows=3)
    assert torch.equal(mixed[:100], tiles[:100]) and torch.equal(mixed[100:], avx512[100:])
    ops.amx_status()  # the self-check has run: a wrong tile product now reaches the output
    ops.set_amx_fault_injection("bf16")
    faulty = attention(ops, q, kc, vc, table, lens, starts, 0.125, 0, None, amx_min_rows=3)
    assert (faulty[:100].float() - tiles[:100].float()).abs().max() > 0.1
    assert torch.equal(faulty[100:], avx512[100:])


# ---- the self-check ----


def test_self_check_runs_first_and_isa_names_the_tiles(emulated):
    ops = emulated
    ops.reset_amx_self_check()
    assert ops.amx_status()["self_check_emulated"] != "not run"  # amx_status asks for the backend
    ops.reset_amx_self_check()
    assert ops.isa() == "amx_bf16_emulated"
    assert ops.amx_status()["self_check_emulated"] == "passed"


@pytest.mark.parametrize(
    "fault,found,not_found",
    [
        ("bf16", ["bf16 linear", "attention"], ["int8 linear"]),
        ("int8", ["int8 linear"], ["bf16 linear", "attention"]),
    ],
)
def test_a_failed_self_check_disables_amx(emulated, caplog, fault, found, not_found):
    ops = emulated
    x, w, bias = vnni_case(100, 64, 12, 3)
    packed = pack_vnni16(w)
    ops.set_amx(False)
    avx512 = vnni(ops, x, packed, bias, 100)
    ops.set_amx(True)
    ops.set_amx_fault_injection(fault)
    ops.reset_amx_self_check()
    try:
        with caplog.at_level(logging.INFO, logger="pdserve.kernels"):
            got = vnni(ops, x, packed, bias, 100)
        assert torch.equal(got, avx512)  # served by the AVX-512 kernel
        assert ops.isa() == "avx512_bf16"
        status = ops.amx_status()
        assert status["backend"] == "none" and status["self_check_emulated"].startswith("failed")
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "AMX disabled" in errors[0]
        for name in found:
            assert name in errors[0]
        for name in not_found:
            assert name not in errors[0]
    finally:
        ops.set_amx_fault_injection("")
        ops.reset_amx_self_check()
    assert ops.isa() == "amx_bf16_emulated"


# ---- the real tiles (CPUs with AMX) ----


def test_hardware_tile_products_match_the_emulation(hardware):
    ops = hardware
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (16, 64), generator=gen, dtype=torch.uint8)
    b = torch.randint(-128, 128, (16, 64), generator=gen, dtype=torch.int8)
    for op, x in (("usd", a), ("ssd", a.view(torch.int8))):
        hw, emu = torch.zeros(16, 16, dtype=torch.int32), torch.zeros(16, 16, dtype=torch.int32)
        ops.amx_tile_dp(op, hw, x, b, True)
        ops.amx_tile_dp(op, emu, x, b, False)
        assert torch.equal(hw, emu), op
    af, bf = (
        torch.randn(16, 32, generator=gen).to(torch.bfloat16),
        torch.randn(16, 32, generator=gen).to(torch.bfloat16),
    )
    hw, emu = torch.zeros(16, 16), torch.zeros(16, 16)
    ops.amx_tile_dp("bf16", hw, af, bf, True)
    ops.amx_tile_dp("bf16", emu, af, bf, False)
    assert (hw - emu).abs().max().item() <= 1e-5 * emu.abs().max().item()


def test_hardware_kernels_match_float64(hardware):
    ops = hardware
    assert ops.isa() == "amx_bf16" and ops.amx_status()["self_check_hardware"] == "passed"
    for n, k, rows in [(3072, 576, 1), (3072, 576, 21), (37, 19, 5), (100, 64, 40)]:
        x, w, bias = vnni_case(n, k, rows, n + k + rows)
        out = vnni(ops, x, pack_vnni16(w), bias, n)
        ref = x.to(torch.bfloat16).double() @ w.double().T + bias.double()
        assert ((out.double() - ref).abs() / (ref.abs() + 1)).max().item() < 1e-5
        for m in (1, rows // 2 + 1):
            assert torch.equal(vnni(ops, x[:m], pack_vnni16(w), bias, n), out[:m])
        lin = PackedW8A8(w.float(), bias, ops)
        tiles = lin(x)
        ops.set_amx(False)
        try:
            assert torch.equal(tiles, lin(x))
        finally:
            ops.set_amx(True)
    args = attention_batch(REQS, 8, 2, 128, 16, seed=7)
    sk = torch.randn(8, generator=torch.Generator().manual_seed(1))
    for window, sinks in ((0, None), (37, sk)):
        out = attention(ops, *args, 128**-0.5, window, sinks)
        assert (
            out.double() - attention_reference(*args, 128**-0.5, window, sinks)
        ).abs().max().item() < 2e-2


# ---- MXFP4 weights (the FP8 tiles, codes looked up as e4m3 bytes) ----


@pytest.mark.parametrize("n,k,rows", [(70, 96, 1), (130, 320, 5), (64, 256, 17), (200, 96, 40)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_linear_on_emulated_tiles_matches_float64(emulated, n, k, rows, out_dtype):
    from pdserve.quantization.mxfp4_matmul import dequantize, pack_mxfp4
    from tests.unit.test_cpu_kernels import mxfp4_case

    ops = emulated
    blocks, scales, x, bias = mxfp4_case(n, k, rows, n + k + rows, torch.bfloat16)
    packed, packed_scale = pack_mxfp4(blocks, scales)

    def run(x, amx_min_rows=1):
        out = torch.empty(x.shape[0], n, dtype=out_dtype)
        ops.linear_mxfp4(out, x, packed, packed_scale, bias.to(out_dtype), amx_min_rows)
        return out

    out = run(x)
    w = dequantize(blocks, scales).double()
    ref = x.double() @ w.T + bias.to(out_dtype).double()
    # relative to the sum of the terms' magnitudes (a row spans scales 2^-127 .. 2^119)
    size = x.double().abs() @ w.abs().T + bias.double().abs() + 1
    err = ((out.double() - ref).abs() / size).max().item()
    assert err < (1e-6 if out_dtype == torch.float32 else 2**-8), err
    for m in {1, rows // 2 + 1}:
        assert torch.equal(run(x[:m]), out[:m])


def test_mxfp4_linear_on_hardware_tiles_equals_the_emulation(hardware):
    from pdserve.quantization.mxfp4_matmul import dequantize, pack_mxfp4
    from tests.unit.test_cpu_kernels import mxfp4_case

    ops = hardware
    for n, k, rows in [(130, 320, 5), (200, 96, 40)]:
        blocks, scales, x, bias = mxfp4_case(n, k, rows, 1, torch.bfloat16)
        packed, packed_scale = pack_mxfp4(blocks, scales)
        outs = []
        for emulation in (False, True):
            ops.set_amx_emulation(emulation)
            try:
                out = torch.empty(rows, n)
                ops.linear_mxfp4(out, x, packed, packed_scale, bias, 1)
            finally:
                ops.set_amx_emulation(False)
            outs.append(out)
        hw, emu = outs
        w = dequantize(blocks, scales).double()
        size = x.double().abs() @ w.abs().T + bias.double().abs() + 1
        # the hardware may round a pair's sum otherwise in the last bit (amx.h): a few ulps
        assert ((hw - emu).double().abs() / size).max().item() < 1e-6
