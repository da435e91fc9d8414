"""The fused MoE kernel (``kernels/csrc/moe.cpp`` through ``layers/moe/fused.py``) against a plain
torch loop over (slot, expert) that rounds where the kernel's contract says it rounds, on the
AVX-512 and the portable code, in bf16 and w8a8_int8.

Tolerance: the reference sums in float64, the kernel in float32 in its own order, so an
intermediate (gate/up, a, y) that lies within float32 noise of a bf16 rounding boundary can round
one bf16 step (2^-8 relative) the other way. That is rare (about 1 output in 1,000 here) and moves
an output by about one bf16 step of its size, while a fault (a missed slot, a wrong panel, bias or
activation) moves many outputs by far more. So: at least 95 % of the float32 outputs are
bit-identical, max |kernel - reference| <= 4e-3 (one bf16 step) of max |reference|, the mean
error <= 1e-4 of it. The int8 reference repeats the kernel's quantization in float, so the same
bounds hold; its own error against the bf16 result is checked separately (under 5 %).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve import kernels
from pdserve.layers.moe.fused import PackedExperts

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ops():
    mod = kernels.load()
    if mod is None:
        pytest.skip(f"pdserve's CPU kernels are not available: {kernels.unavailable_reason()}")
    return mod


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def act_ref(
    gu: torch.Tensor, inter: int, activation: str, alpha: float, limit: float
) -> torch.Tensor:
    """float32 activation of bf16 values, rounded to bf16 once."""
    gate, up = gu[:, :inter], gu[:, inter:]
    if activation == "silu":
        return bf16(F.silu(gate) * up)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return bf16((up + 1) * (gate * torch.sigmoid(gate * alpha)))


def quant_rows(v: torch.Tensor) -> torch.Tensor:
    """Per-row symmetric int8 as the kernel does it, dequantized: scale = max|v| / 127,
    q = round(v * (1 / scale))."""
    scale = v.abs().amax(1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(v * (1 / scale)).clamp(-127, 127) * scale


def quant_channels(w: torch.Tensor) -> torch.Tensor:
    """Per output channel symmetric int8 of a weight (PackedW8A8's rule), dequantized."""
    scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(w / scale).clamp(-127, 127) * scale


def reference(
    x, w13, w2, b13, b2, ids, weights, activation, alpha=1.702, limit=7.0, int8=False
) -> torch.Tensor:
    """out[t] += weights[t, k] * y over slots k in order, per expert e = ids[t, k] >= 0."""
    T, K = ids.shape
    inter = w2.shape[2]
    out = torch.zeros(T, x.shape[1])
    for k in range(K):
        for e in range(w13.shape[0]):
            rows = (ids[:, k] == e).nonzero().flatten()
            if rows.numel() == 0:
                continue
            xe, wa, wb = x[rows].float(), w13[e].float(), w2[e].float()
            if int8:
                xe, wa, wb = quant_rows(xe), quant_channels(wa), quant_channels(wb)
            gu = xe.double() @ wa.double().T + (0 if b13 is None else b13[e].double())
            a = act_ref(bf16(gu), inter, activation, alpha, limit)
            if int8:
                a = quant_rows(a)
            y = bf16(a.double() @ wb.double().T + (0 if b2 is None else b2[e].double()))
            out[rows] += y * weights[rows, k][:, None]
    return out


def make_layer(E: int, H: int, inter: int, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * inter, H, generator=gen) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, inter, generator=gen) / inter**0.5).to(torch.bfloat16)
    b13 = (0.5 * torch.randn(E, 2 * inter, generator=gen)).to(torch.bfloat16) if bias else None
    b2 = (0.5 * torch.randn(E, H, generator=gen)).to(torch.bfloat16) if bias else None
    return w13, w2, b13, b2


def make_routing(T: int, K: int, E: int, seed: int, unused=(), drop: float = 0.2):
    """softmax top-k of random logits; experts in ``unused`` never chosen; a ``drop`` share of the
    slots marked -1 (expert on another rank)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=gen)
    logits[:, list(unused)] = -float("inf")
    weights, ids = torch.softmax(logits, -1).topk(K, dim=-1)
    ids = ids.to(torch.int32)
    ids[torch.rand(T, K, generator=gen) < drop] = -1
    return ids, weights


def assert_close_to(
    out: torch.Tensor, ref: torch.Tensor, max_rel: float = 4e-3, mean_rel: float = 1e-4
):
    scale = ref.abs().max().item()
    err = (out - ref).abs()
    assert (err == 0).float().mean().item() >= 0.95, (err == 0).float().mean().item()
    assert err.max().item() <= max_rel * scale, (err.max().item(), scale)
    assert err.mean().item() <= mean_rel * scale, (err.mean().item(), scale)


CASES = [  # T, K, E, H, I, activation, bias
    (1, 1, 4, 40, 24, "silu", False),
    (7, 2, 6, 40, 24, "swiglu_oai", True),
    (64, 8, 10, 136, 80, "silu", True),
    (300, 8, 10, 136, 80, "swiglu_oai", False),
    (300, 2, 6, 41, 23, "silu", True),
]


@pytest.mark.parametrize("quantization", [None, "w8a8_int8"])
@pytest.mark.parametrize("T,K,E,H,inter,activation,bias", CASES)
def test_fused_experts_match_the_reference(
    ops, isa, quantization, T, K, E, H, inter, activation, bias
):
    seed = T * 100 + K * 10 + E
    w13, w2, b13, b2 = make_layer(E, H, inter, bias, seed)
    ids, weights = make_routing(T, K, E, seed, unused=(1,))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 1)).to(torch.bfloat16)
    experts = PackedExperts(w13, w2, b13, b2, activation, ops=ops, quantization=quantization)
    out = experts(x, ids, weights)
    assert out.dtype == torch.float32 and out.shape == (T, H)
    int8 = quantization is not None
    ref = reference(x, w13, w2, b13, b2, ids, weights, activation, int8=int8)
    assert_close_to(out, ref)
    if int8:  # the scheme's own error against bf16: about 1 % of the output scale
        exact = reference(x, w13, w2, b13, b2, ids, weights, activation)
        assert (out - exact).abs().max().item() <= 0.05 * exact.abs().max().item()
    # tokens whose every slot is elsewhere get zeros; a token's result does not depend on the batch
    none_here = (ids < 0).all(1)
    assert torch.equal(out[none_here], torch.zeros_like(out[none_here]))
    last = experts(x[-1:], ids[-1:], weights[-1:])
    assert torch.equal(last[0], out[-1])


@pytest.mark.parametrize("quantization", [None, "w8a8_int8"])
def test_same_result_on_one_and_two_threads_and_float32_input(ops, quantization):
    w13, w2, b13, b2 = make_layer(12, 136, 80, True, 7)
    ids, weights = make_routing(300, 8, 12, 7, unused=(3, 5))
    x = torch.randn(300, 136, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    experts = PackedExperts(w13, w2, b13, b2, "silu", ops=ops, quantization=quantization)
    one = experts(x, ids, weights)
    torch.set_num_threads(2)
    try:
        two = experts(x, ids, weights)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(one, two)
    # float32 activations are rounded to bf16 first, as a bf16 matmul does
    assert torch.equal(experts(x.float(), ids, weights), one)


def test_bad_arguments_are_named(ops):
    w13, w2, _, _ = make_layer(4, 40, 24, False, 1)
    with pytest.raises(ValueError, match="activation"):
        PackedExperts(w13, w2, activation="gelu", ops=ops)
    with pytest.raises(ValueError, match="quantization"):
        PackedExperts(w13, w2, ops=ops, quantization="fp8")
    with pytest.raises(ValueError, match="w13"):
        PackedExperts(w13[:, :47], w2, ops=ops)
    experts = PackedExperts(w13, w2, ops=ops)
    x = torch.randn(2, 40).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="4 local experts"):
        experts(x, torch.tensor([[0], [4]], dtype=torch.int32), torch.ones(2, 1))
