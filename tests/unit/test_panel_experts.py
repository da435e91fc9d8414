"""A layer's quantized experts (FP8 blocks, MXFP4, int4) in one C++ call (``ops.PanelExperts``,
``kernels/csrc/moe_panels.cpp``) against the Python loop over the same matmuls, at every tier
this host runs."""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.layers.moe.experts import Experts
from pdserve.quantization.experts import QuantizedExperts
from pdserve.quantization.fp8_matmul import Fp8BlockLinear
from pdserve.quantization.int4_matmul import Int4GroupLinear
from pdserve.quantization.mxfp4_matmul import Mxfp4Linear

torch.set_num_threads(1)

# hidden and intermediate sizes not multiples of the 64-output panels (MXFP4's k: of 32)
H, E = 96, 5
INTER = {"fp8": 80, "mxfp4": 96, "int4": 80}


@pytest.fixture(scope="module")
def ops():
    mod = kernels.load()
    assert mod is not None, f"CPU kernels did not build: {kernels.unavailable_reason()}"
    return mod


def quantized(fmt: str, activation: str, bias: bool, seed: int = 0) -> QuantizedExperts:
    """E experts of random codes and scales in ``fmt``'s stored layout."""
    gen = torch.Generator().manual_seed(seed)
    inter = INTER[fmt]
    experts = Experts(H, (0, inter), list(range(E)), activation=activation, bias=bias)
    if bias:
        experts.b13.data = torch.randn(E, 2 * inter, generator=gen)
        experts.b2.data = torch.randn(E, H, generator=gen)

    def stored(n: int, k: int):
        if fmt == "fp8":
            w = torch.randn(E, n, k, generator=gen).to(torch.float8_e4m3fn)
            return w, torch.rand(E, n, -(-k // 64), generator=gen) * 0.05 + 0.01
        codes = torch.randint(0, 256, (E, n, k // 2), generator=gen, dtype=torch.int32)
        if fmt == "mxfp4":
            scales = torch.randint(118, 124, (E, n, k // 32), generator=gen, dtype=torch.int32)
            return codes.to(torch.uint8), scales.to(torch.uint8)
        return codes.to(torch.uint8), torch.rand(E, n, -(-k // 32), generator=gen) * 0.02 + 1e-3

    for name, (n, k) in (("w13", (2 * inter, H)), ("w2", (H, inter))):
        for attr, t in zip((name, f"{name}_scale"), stored(n, k)):
            setattr(experts, attr, torch.nn.Parameter(t, requires_grad=False))
    make = {
        "fp8": lambda w, s, b: Fp8BlockLinear(w, s, b, 64),
        "mxfp4": Mxfp4Linear,
        "int4": lambda w, s, b: Int4GroupLinear(w, s, b, 32),
    }[fmt]
    return QuantizedExperts(experts, make)


def routing(tokens: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
    ids[0, 0] = -1  # a slot whose expert is on another rank
    if tokens > 2:
        ids[2] = -1  # a token with no expert here
    weights = torch.rand(tokens, k, generator=gen)
    return ids, weights


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "int4"])
@pytest.mark.parametrize(
    "activation,bias,dtype",
    [
        ("silu", False, torch.float32),
        ("silu", False, torch.bfloat16),
        ("swiglu_oai", True, torch.float32),
        ("swiglu_oai", True, torch.bfloat16),
    ],
)
def test_panel_experts_are_the_loop_and_batch_invariant(ops, isa, fmt, activation, bias, dtype):
    """The C++ call gives the Python loop's result over the same kernels (float32: to the
    activation's last bits; bf16: the activation rounded once instead of per operation), a token
    alone gives its bits in any batch, unrouted slots and tokens add nothing; near float64 over
    the dequantized weights."""
    impl = quantized(fmt, activation, bias)
    reference = [(w13.dequantized(), w2.dequantized()) for w13, w2 in impl.linears]
    impl.use_kernels(ops)
    assert impl.fused is not None and impl.fused.num_experts() == E
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, H, generator=gen).to(dtype)
    ids, weights = routing(7, 3, seed=2)
    fused = impl(x, ids, weights)
    loop = impl.experts._loop(x, ids, weights, torch.zeros(7, H), impl.linears)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(fused, loop, rtol=tol, atol=tol * loop.abs().max().item())
    assert bool((fused[2] == 0).all())
    for t in (0, 1, 6):
        assert torch.equal(impl(x[t : t + 1], ids[t : t + 1], weights[t : t + 1])[0], fused[t])
    # float64 over the dequantized weights and the module's own activation
    want = torch.zeros(7, H, dtype=torch.float64)
    e = impl.experts
    for t in range(7):
        for j in range(3):
            s = int(ids[t, j])
            if s < 0:
                continue
            w13, w2 = reference[s]
            gu = x[t].double() @ w13.double().T + (e.b13[s].double() if bias else 0)
            a = e.act(gu)
            want[t] += weights[t, j].double() * (
                a @ w2.double().T + (e.b2[s].double() if bias else 0)
            )
    err = ((fused.double() - want).abs().max() / (want.abs().max() + 1)).item()
    assert err < (1e-5 if dtype == torch.float32 else 3e-2), err


def test_panel_experts_refuse_bad_arguments(ops):
    impl = quantized("int4", "silu", False)
    impl.use_kernels(ops)
    x = torch.randn(2, H)
    with pytest.raises(RuntimeError, match="local experts"):
        impl.fused.forward(
            torch.empty(2, H), x, torch.full((2, 2), E, dtype=torch.int32), torch.ones(2, 2)
        )
    with pytest.raises(RuntimeError, match="x must be"):
        impl.fused.forward(
            torch.empty(2, H),
            torch.randn(2, H + 1),
            torch.zeros(2, 2, dtype=torch.int32),
            torch.ones(2, 2),
        )


def test_other_activations_keep_the_loop(ops):
    """An activation the C++ call lacks (Gemma 4's gelu_tanh) stays on the Python loop."""
    impl = quantized("int4", "gelu_tanh", False)
    impl.use_kernels(ops)
    assert impl.fused is None
    x = torch.randn(3, H)
    ids, weights = routing(3, 2, seed=3)
    assert impl(x, ids, weights).abs().sum() > 0
