"""Quantized KV cache (int8 with per-token scales, fp8 e4m3 / e5m2 with per-layer scales): the
quantization, the pool's scale regions and moves, and the paged decode kernel reading quantized
pages at every instruction-set tier against float64 attention over the dequantized K/V."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve import kernels
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.kv_quant import KVQuant, check_quantizable, kv_quant_for
from pdserve.layers.attention.cpu_backend import kernel_caches
from tests.unit.test_cpu_kernels import attention_reference

torch.set_num_threads(1)
FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]


@pytest.fixture(scope="module")
def ops():
    mod = kernels.load()
    assert mod is not None, f"CPU kernels did not build: {kernels.unavailable_reason()}"
    return mod


def quantized_pages(fmt: str, num_pages: int, kv_heads: int, page: int, dim: int, gen, scale=1.0):
    """A layer's K (or V) as a pool of ``fmt`` keeps it: (values, per-row scales or None, the
    dequantized float64 pages)."""
    x = torch.randn(num_pages * kv_heads * page, dim, generator=gen) * 2
    quant = KVQuant(fmt)
    q, s = quant.quantize(x, scale)
    deq = quant.dequantize(q, s, scale, torch.float64)
    shape = (num_pages, kv_heads, page, dim)
    return q.view(shape), (None if s is None else s.view(shape[:3])), deq.view(shape)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_round_trip_error_is_within_the_format(fmt):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=gen) * 3
    quant = KVQuant(fmt)
    q, s = quant.quantize(x, 0.5)
    back = quant.dequantize(q, s, 0.5, torch.float32)
    if fmt == "int8":  # half a step of each row's scale
        assert s.dtype == torch.float32 and s.shape == (64,)
        assert ((back - x).abs() <= s[:, None] * 0.5 + 1e-6).all()
    else:  # the format's relative rounding (3 or 2 mantissa bits)
        rel = 2.0 ** -(4 if fmt == "fp8_e4m3" else 3)
        assert s is None and q.dtype == torch.uint8
        assert ((back - x).abs() <= x.abs() * rel + 0.5 * 2.0**-9).all()
    assert kv_quant_for("fp8") == KVQuant("fp8_e4m3") and kv_quant_for("bfloat16") is None


def test_zero_rows_and_out_of_range_values():
    q, s = KVQuant("int8").quantize(torch.zeros(2, 8))
    assert (q == 0).all() and (s == 0).all()
    big = torch.tensor([[1e6, -1e6, 3.0]])
    q8, _ = KVQuant("fp8_e4m3").quantize(big)
    assert q8.view(torch.float8_e4m3fn).float().tolist() == [[448.0, -448.0, 3.0]]


@pytest.mark.parametrize("page", [1, 16])
def test_int8_pool_writes_moves_and_registers_its_scales(page):
    pool = KVPool(2, 9, page, 2, 16, torch.bfloat16, "cpu", quant=KVQuant("int8"))
    assert pool.buffer.dtype == torch.int8 and pool.scales.shape == (2, 2, 9, 2, page)
    assert pool.dtype_name == "int8"
    # the scales live in the pool's one allocation, after the values
    assert pool.nbytes == pool.buffer.numel() + pool.scales.numel() * 4
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    pages, offs = torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0])
    pool.write(1, pages, offs, k, v)
    scales = pool.layer_scales(1)
    got = scales.pages(pool.k_cache(1), "k", pages, torch.float32)[:, :, 0]
    assert (got - k).abs().max() <= k.abs().max() / 127
    pool.move((torch.tensor([1]), torch.tensor([0])), (torch.tensor([5]), torch.tensor([0])))
    assert torch.equal(pool.buffer[:, :, 5, :, 0], pool.buffer[:, :, 1, :, 0])
    assert torch.equal(pool.scales[:, :, 5, :, 0], pool.scales[:, :, 1, :, 0])
    regions = pool.regions(pool.as_group())
    parts = sorted({r.part for r in regions})
    assert parts == ["k", "k_scale", "v", "v_scale"]
    scale_region = next(r for r in regions if r.part == "k_scale" and r.layer == 1)
    assert scale_region.item_bytes == 2 * page * 4 and scale_region.split == "heads"
    assert scale_region.ptr == pool.scales[1, 0].data_ptr()


def test_fp8_pool_is_one_byte_per_value_without_scale_regions():
    pool = KVPool(2, 5, 4, 2, 16, torch.bfloat16, "cpu", quant=KVQuant("fp8_e5m2"))
    assert pool.buffer.dtype == torch.uint8 and pool.scales is None
    assert pool.nbytes == 2 * 2 * 5 * 2 * 4 * 16
    assert {r.part for r in pool.regions(pool.as_group())} == {"k", "v"}
    assert pool.dtype_name == "fp8_e5m2"


def test_latent_caches_are_refused_naming_the_model_and_flag():
    with pytest.raises(ValueError, match=r"kv_cache_dtype: 'int8' is not supported for DeepseekV3"):
        check_quantizable(KVQuant("int8"), {"latent_attention"}, "DeepseekV3ForCausalLM")
    check_quantizable(KVQuant("int8"), {"full_attention", "sliding_window"}, "LlamaForCausalLM")


CASES = [  # (format, group, head_dim, page size, q dtype, window)
    ("int8", 1, 64, 1, torch.float32, 0),
    ("int8", 4, 128, 16, torch.bfloat16, 0),
    ("int8", 3, 80, 16, torch.float32, 37),
    ("fp8_e4m3", 4, 64, 16, torch.float32, 0),
    ("fp8_e4m3", 2, 128, 1, torch.bfloat16, 0),
    ("fp8_e5m2", 4, 64, 16, torch.float32, 0),
    ("fp8_e5m2", 1, 40, 1, torch.float32, 5),
]


@pytest.mark.parametrize("fmt,group,head_dim,page,q_dtype,window", CASES)
def test_quantized_paged_decode_matches_float64(
    ops, isa, fmt, group, head_dim, page, q_dtype, window
):
    gen = torch.Generator().manual_seed(group * 100 + head_dim + page)
    kv_heads = 2
    lens = torch.tensor([1, 15, 17, 300, 1001], dtype=torch.int32)
    B = len(lens)
    max_pages = (int(lens.max()) + page - 1) // page
    num_pages = B * max_pages + 3
    tensor_scale = (0.5, 2.0) if fmt != "int8" else (1.0, 1.0)
    kq, ks, kd = quantized_pages(fmt, num_pages, kv_heads, page, head_dim, gen, tensor_scale[0])
    vq, vs, vd = quantized_pages(fmt, num_pages, kv_heads, page, head_dim, gen, tensor_scale[1])
    table = (
        (torch.randperm(num_pages - 1, generator=gen)[: B * max_pages] + 1)
        .view(B, max_pages)
        .to(torch.int32)
    )
    q = torch.randn(B, kv_heads * group, head_dim, generator=gen).to(q_dtype)
    out = torch.full_like(q, float("nan"))
    scale = 1 / math.sqrt(head_dim)
    from pdserve.engine.kv_quant import LayerScales

    layer = LayerScales(KVQuant(fmt), ks, vs, *tensor_scale)
    kc, vc, kw = kernel_caches(kq, vq, layer)
    ops.paged_decode_attention(out, q, kc, vc, table, lens, scale, window, None, **kw)
    ref = attention_reference(q, kd, vd, table, lens, scale, window)
    tol = 2e-5 if q_dtype == torch.float32 else 2**-8 * 4
    err = (out.double() - ref).abs().max().item()
    assert err < tol, f"max abs error {err}"


def test_quantized_decode_refuses_missing_or_stray_scales(ops):
    kq = torch.zeros(3, 1, 4, 16, dtype=torch.int8)
    q, out = torch.zeros(1, 1, 16), torch.zeros(1, 1, 16)
    table, lens = torch.ones(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="k_scales and v_scales go with an int8 cache"):
        ops.paged_decode_attention(out, q, kq, kq, table, lens, 1.0, 0)
    f = torch.zeros(3, 1, 4, 16)
    with pytest.raises(RuntimeError, match="k_scale and v_scale go with an fp8 cache"):
        ops.paged_decode_attention(out, q, f, f, table, lens, 1.0, 0, k_scale=2.0)
    bad = torch.zeros(3, 1, 4)
    with pytest.raises(RuntimeError, match="float32 \\[pages, kv_heads, page_size\\]"):
        ops.paged_decode_attention(
            out, q, kq, kq, table, lens, 1.0, 0, k_scales=bad.double(), v_scales=bad
        )


FLASH_CASES = [  # (format, group, page size, window)
    ("int8", 4, 16, 0),
    ("int8", 2, 1, 70),
    ("fp8_e4m3", 4, 1, 0),
    ("fp8_e5m2", 2, 16, 70),
]


@pytest.mark.parametrize("fmt,group,page,window", FLASH_CASES)
def test_quantized_flash_attention_matches_float64(ops, flash_isa, fmt, group, page, window):
    """The extend/prefill kernel (decode rows, prefills, extends after a prefix) over quantized
    pages against float64 attention over the dequantized K/V."""
    from pdserve.engine.kv_quant import LayerScales
    from tests.unit.test_attention_sinks import eager_reference

    gen = torch.Generator().manual_seed(page * 10 + group + window)
    kv_heads, head_dim = 2, 64
    rows = [(1, 1), (1, 200), (5, 5), (40, 170), (130, 130), (17, 81)]  # (new tokens, length)
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    max_pages = (int(lens.max()) + page - 1) // page
    num_pages = len(rows) * max_pages + 3
    tensor_scale = (0.5, 2.0) if fmt != "int8" else (1.0, 1.0)
    kq, ks, kd = quantized_pages(fmt, num_pages, kv_heads, page, head_dim, gen, tensor_scale[0])
    vq, vs, vd = quantized_pages(fmt, num_pages, kv_heads, page, head_dim, gen, tensor_scale[1])
    table = (
        (torch.randperm(num_pages - 1, generator=gen)[: len(rows) * max_pages] + 1)
        .view(len(rows), max_pages)
        .to(torch.int32)
    )
    starts = torch.tensor([0] + [e for e, _ in rows]).cumsum(0).to(torch.int32)
    q = torch.randn(int(starts[-1]), kv_heads * group, head_dim, generator=gen).bfloat16()
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    kc, vc, kw = kernel_caches(kq, vq, LayerScales(KVQuant(fmt), ks, vs, *tensor_scale))
    ops.paged_attention_bf16(out, q, kc, vc, table, lens, starts, scale, window, None, **kw)
    for b, (ext, n) in enumerate(rows):
        pos = torch.arange(n)
        pages = table[b][pos // page].long()
        k, v = kd[pages, :, pos % page], vd[pages, :, pos % page]  # [n, kv_heads, D]
        a = int(starts[b])
        ref = eager_reference(q[a : a + ext], k, v, torch.arange(n - ext, n), scale, window, None)
        err = (out[a : a + ext].double() - ref).abs().max().item()
        # K and V rounded to bf16 for the products (AVX512-BF16), probabilities too, output bf16
        assert err < 3e-2, f"row {b} ({ext} of {n}): max abs error {err}"
