"""The weight format layer (``pdserve/quantization``): which ``quantization_config`` is read and
what is refused naming its field; FP8 block scales seen in the weight's coordinates as the
tensor-parallel loader slices them, split columns refused on a block boundary only; the
dequantized weight of a loaded FP8 layer bit-identical to transformers' dequantizer, ragged
(ceil-grid) shapes, subnormals and ue8m0 scales included."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from pdserve.layers.linear import Linear
from pdserve.quantization.fp8_block import BlockScaleView, Fp8Block
from pdserve.quantization.fp8_matmul import Fp8BlockLinear
from pdserve.quantization.registry import weight_format


class Cfg:
    def __init__(self, quant):
        self.quantization_config = quant


FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}


def test_unquantized_configs_have_no_format():
    assert weight_format(Cfg(None)) is None
    assert weight_format(object()) is None


@pytest.mark.parametrize(
    "method",
    ["awq", "gptq", "bitsandbytes", "fbgemm_fp8", "modelopt", "x"],
)
def test_methods_not_built_are_refused_naming_the_field(method):
    with pytest.raises(ValueError, match=f"quantization_config.quant_method: '{method}'.*fp8"):
        weight_format(Cfg({"quant_method": method}))


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"fmt": "e5m2"}, "quantization_config.fmt: 'e5m2'"),
        ({"activation_scheme": "static"}, "quantization_config.activation_scheme: 'static'"),
        ({"weight_block_size": None}, "quantization_config.weight_block_size: None"),
        ({"weight_block_size": [128]}, "quantization_config.weight_block_size: \\[128\\]"),
        ({"weight_block_size": [128, 0]}, "quantization_config.weight_block_size"),
        ({"scale_fmt": "e4m3"}, "quantization_config.scale_fmt: 'e4m3'"),
    ],
)
def test_fp8_fields_not_served_are_refused(edit, message):
    with pytest.raises(ValueError, match=message):
        weight_format(Cfg({**FP8, "weight_block_size": [128, 128], **edit}))


def test_fp8_spec():
    fmt = weight_format(
        Cfg(
            {
                **FP8,
                "weight_block_size": [128, 64],
                "scale_fmt": "ue8m0",
                "modules_to_not_convert": ["lm_head", "model.layers.*.mlp.gate"],
            }
        )
    )
    assert isinstance(fmt, Fp8Block) and fmt.block == (128, 64) and fmt.scale_fmt == "ue8m0"
    assert fmt.describe() == "fp8 e4m3, 128x64 blocks, ue8m0 scales"
    assert fmt.ignores("lm_head") and fmt.ignores("model.layers.3.mlp.gate")
    assert not fmt.ignores("model.layers.3.mlp.gate_proj")
    assert not fmt.ignores("model.layers.3.self_attn.q_proj")


def test_block_scales_in_the_weights_coordinates():
    torch.manual_seed(0)
    n, k, block = 70, 100, (32, 32)
    scale = torch.rand(3, 4)
    full = scale.repeat_interleave(32, 0)[:n]  # [n, 4]: each row its blocks' scales
    view = BlockScaleView(scale, [n, k], block, "x.weight_scale_inv")
    assert view.get_shape() == [n, k]
    assert torch.equal(view[:], full)
    assert torch.equal(view[5:40], full[5:40])  # rows of two blocks, from inside the first
    assert torch.equal(view[64:70], full[64:70])  # the partial last block
    assert torch.equal(view[:, 32:64], full[:, 1:2])
    assert torch.equal(view[:, 64:100], full[:, 2:4])  # ends at the ragged edge
    assert torch.equal(view[10:20, 0:64], full[10:20, 0:2])
    with pytest.raises(ValueError, match="columns 16:48 of 100 split a 32-wide scale block"):
        view[:, 16:48]
    with pytest.raises(ValueError, match="x.weight_scale_inv"):
        view[:, 0:50]


def fp8_layer(n: int, k: int, block: tuple[int, int], scale: torch.Tensor, q: torch.Tensor):
    """A ``Linear`` given FP8 storage by the format, loaded as the loader does (through the
    view), with its matmul."""
    fmt = Fp8Block(block, None, ())
    layer = Linear(k, n, bias=False)
    fmt._swap(layer)
    layer.weight.data.copy_(q)
    layer.weight_scale_inv.data.copy_(BlockScaleView(scale, [n, k], block, "w")[:])
    return Fp8BlockLinear(layer.weight, layer.weight_scale_inv, None, block[1])


def random_fp8(n: int, k: int) -> torch.Tensor:
    """Every e4m3 byte but NaN, subnormals and -0 included, in random order."""
    bits = torch.randint(0, 256, (n, k), dtype=torch.int32)
    bits = torch.where((bits & 0x7F) == 0x7F, bits - 1, bits)  # 0x7F / 0xFF are NaN
    return bits.to(torch.uint8).view(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    "n,k,block", [(70, 100, (32, 32)), (64, 64, (128, 128)), (48, 96, (16, 48))]
)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_dequantized_weight_equals_transformers(n, k, block, ue8m0):
    torch.manual_seed(n + k)
    q = random_fp8(n, k)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1])) * 1e-2 + 1e-6
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    impl = fp8_layer(n, k, block, scale, q)
    ref = _dequantize_fp8_weight(q, scale, list(block), torch.float32)
    got = impl.dequantized()
    assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), ref.view(torch.int32))
    x = torch.randn(5, k)
    assert torch.allclose(impl(x), x @ ref.T, rtol=1e-5, atol=1e-6)


def test_e8m0_scales_stored_as_such():
    """V3.2-style releases store ``weight_scale_inv`` as F8_E8M0: read as the power of two."""
    exps = torch.tensor([[120, 127], [130, 100]], dtype=torch.uint8)
    stored = exps.view(torch.float8_e8m0fnu)
    view = BlockScaleView(stored, [40, 64], (32, 32), "w")
    expect = torch.exp2(exps.float() - 127).repeat_interleave(32, 0)[:40]
    assert torch.equal(view[:], expect)


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_layer_on_the_kernels(bias):
    """After ``use_kernels``: the checkpoint's layout dropped, the same weight dequantized back;
    up to 64 bf16 rows (and float32 at any count) ``linear_fp8``, near the float64 product and
    batch invariant; beyond it panels dequantized for the BLAS GEMM, the PyTorch path's values."""
    from pdserve import kernels

    ops = kernels.load()
    assert ops is not None, kernels.unavailable_reason()
    torch.manual_seed(11)
    n, k, block = 300, 256, (128, 128)
    q = random_fp8(n, k)
    scale = torch.rand(3, 2) * 1e-2 + 1e-6
    impl = fp8_layer(n, k, block, scale, q)
    want_w = impl.dequantized()
    impl.bias = torch.randn(n) if bias else None
    impl.use_kernels(ops, onednn=True)
    assert impl.weight is None and impl.packed.shape == (5, k, 64)
    assert torch.equal(impl.dequantized(), want_w)
    for rows, dtype in (
        (1, torch.bfloat16),
        (64, torch.bfloat16),
        (65, torch.bfloat16),
        (300, torch.bfloat16),
        (300, torch.float32),
    ):
        x = torch.randn(rows, k).to(dtype)
        out = impl(x)
        assert out.dtype == dtype and out.shape == (rows, n)
        b = impl.bias.to(dtype) if bias else None
        if rows <= 64 or dtype == torch.float32:
            # the kernel: float32 weights and sums; each row alone gives its bits
            ref = x.double() @ want_w.double().T + (b.double() if bias else 0)
            err = ((out.double() - ref).abs() / (ref.abs() + 1)).max().item()
            assert err < (1e-5 if dtype == torch.float32 else 2**-8), (rows, dtype, err)
            assert torch.equal(impl(x[-1:])[0], out[-1])
        else:  # the weight rounded to bf16, as the PyTorch path multiplies it
            ref = torch.nn.functional.linear(x, want_w.to(dtype), b)
            torch.testing.assert_close(out, ref, rtol=2**-7, atol=1e-2)


def test_mxfp4_spec():
    fmt = weight_format(Cfg({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}))
    assert fmt.method == "mxfp4" and fmt.batch_invariant and fmt.ignores("lm_head")
    with pytest.raises(ValueError, match="quantization_config.dequantize: true"):
        weight_format(Cfg({"quant_method": "mxfp4", "dequantize": True}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_reference_dequantizer_is_transformers(dtype):
    """Every code in every nibble, scale bytes 0 (2^-127) to 254: transformers' MXFP4
    dequantizer bit for bit (exact in float32; bf16 rounds nothing but below its subnormals)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from pdserve.quantization.mxfp4_matmul import dequantize

    gen = torch.Generator().manual_seed(0)
    n, k = 255, 64
    blocks = torch.randint(0, 256, (n, k // 2), dtype=torch.int32, generator=gen).to(torch.uint8)
    blocks[0, :16] = torch.arange(256, dtype=torch.int32)[:16].to(torch.uint8) * 17
    scales = torch.arange(n * 2, dtype=torch.int32).remainder(255).view(n, 2).to(torch.uint8)
    want = convert_moe_packed_tensors(
        blocks.view(1, n, k // 32, 16), scales.view(1, n, k // 32), dtype=dtype
    )[0].T
    assert torch.equal(dequantize(blocks, scales).to(dtype), want)
