"""The linear-attention mixers' CPU kernels at every instruction-set tier this CPU has.

Decode steps against their torch code (``Mamba2Mixer._step``, ``GatedDeltaNet._step``, also with
Kimi Delta Attention's decay per key channel): the
outputs of several steps in a row and the states they leave in the pool, float32 to 2e-6 of the
largest value and bf16 within a few bf16 ulps (the kernels round where torch rounds; only float32
sums differ in order), slots in the pool out of order, the slots of other requests left as they
were.

Prefill scans (``_extend``) against the recurrence in float64 and against the chunked torch code,
the same bits however the tokens are cut into calls.

The kernels must build here (scripts/install.sh installs g++ and ninja): a test that cannot load
them fails with the reason instead of skipping.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve import kernels
from pdserve.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetDims
from pdserve.layers.mamba2 import Mamba2Dims, Mamba2Mixer, causal_conv

torch.set_num_threads(1)

NUM_SLOTS = 5
STEPS = 4
SLOTS = {1: [2], 3: [2, 0, 3]}  # per batch size: each request's slot, out of order


@pytest.fixture(scope="module")
def ops():
    mod = kernels.load()
    assert mod is not None, f"CPU kernels did not build: {kernels.unavailable_reason()}"
    return mod


def mamba2(heads, head_dim, groups, state, dtype, seed) -> Mamba2Mixer:
    torch.manual_seed(seed)
    dims = Mamba2Dims(
        hidden=32, heads=heads, head_dim=head_dim, groups=groups, state=state,
        conv_kernel=4, chunk_size=8, eps=1e-5,
    )  # fmt: skip
    m = Mamba2Mixer(dims, kv_layer=0)
    with torch.no_grad():
        m.conv1d.weight.normal_(0, 0.5)
        m.conv1d.bias.normal_(0, 0.2)
        m.dt_bias.normal_(0, 1)
        m.A_log.copy_(torch.empty(heads).uniform_(0, 2.5))
        m.D.normal_(0, 1)
    return m.to(dtype)


def gated_deltanet(key_heads, value_heads, key_dim, value_dim, dtype, seed) -> GatedDeltaNet:
    torch.manual_seed(seed)
    dims = GatedDeltaNetDims(
        hidden=32, key_heads=key_heads, value_heads=value_heads, key_dim=key_dim,
        value_dim=value_dim, conv_kernel=4, eps=1e-6,
    )  # fmt: skip
    m = GatedDeltaNet(dims, kv_layer=0)
    with torch.no_grad():
        m.conv1d.weight.normal_(0, 0.5)
    return m.to(dtype)


def kimi_delta(heads, dim, dtype, seed):
    """A Kimi Delta Attention layer: the Gated DeltaNet's state, a decay per key channel."""
    from pdserve.models.kimi_linear import KimiDeltaAttention

    torch.manual_seed(seed)
    dims = GatedDeltaNetDims(
        hidden=32, key_heads=heads, value_heads=heads, key_dim=dim, value_dim=dim,
        conv_kernel=4, eps=1e-6,
    )  # fmt: skip
    m = KimiDeltaAttention(dims, kv_layer=0)
    with torch.no_grad():
        m.conv1d.weight.normal_(0, 0.5)
    return m.to(dtype)


def spacing(ref: torch.Tensor) -> torch.Tensor:
    """The bf16 spacing at |ref| (float32)."""
    return torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2**-100))) - 7)


def ulps(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got - ref| in units of the bf16 spacing at |ref|."""
    return (got.float() - ref.float()).abs() / spacing(ref.float())


def assert_close(got, ref, dtype, what):
    if dtype == torch.float32:
        scale = ref.abs().max().item()
        err = (got - ref).abs().max().item()
        assert err <= 2e-6 * scale, f"{what}: max abs error {err} at scale {scale}"
        return
    # bf16: a float32 sum in another order may round to the neighbouring bf16 value (measured: 0 to
    # 4 in 10,000 values, by one spacing)
    off = ulps(got, ref)
    assert (off > 0).float().mean().item() < 0.01, f"{what}: {(off > 0).sum()} of {off.numel()}"
    assert off.max().item() <= 4, f"{what}: {off.max().item()} ulps"


class CountingOps:
    """``ops`` that count the kernel calls made through them."""

    def __init__(self, ops):
        self.ops, self.calls = ops, 0

    def __getattr__(self, name):
        fn = getattr(self.ops, name)

        def call(*args):
            self.calls += 1
            return fn(*args)

        return call


def run_steps(mixer, ops, inputs, states, slots):
    """The outputs of the steps (``inputs``: one argument tuple per step) run with ``ops`` (None:
    torch), from copies of ``states``; and those copies afterwards."""
    states = [s.clone() for s in states]
    mixer.ops = None if ops is None else CountingOps(ops)
    outs = [mixer._step(*step, *states, slots).clone() for step in inputs]
    assert ops is None or mixer.ops.calls == len(inputs), "the kernel did not run every step"
    return outs, states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("heads,head_dim,groups,state", [(4, 16, 2, 24), (6, 40, 1, 101)])
def test_mamba2_step_matches_torch(ops, isa, dtype, batch, heads, head_dim, groups, state):
    m = mamba2(heads, head_dim, groups, state, dtype, seed=batch + state)
    d = m.dims
    gen = torch.Generator().manual_seed(7)
    conv = torch.randn(NUM_SLOTS, d.conv_dim, d.conv_kernel - 1, generator=gen).to(dtype)
    ssm = torch.randn(NUM_SLOTS, d.heads, d.head_dim, d.state, generator=gen)
    inputs = [
        (
            torch.randn(batch, d.conv_dim, generator=gen).to(dtype),
            (torch.randn(batch, d.heads, generator=gen) * 2).to(dtype),
        )
        for _ in range(STEPS)
    ]
    slots = torch.tensor(SLOTS[batch])
    with torch.no_grad():
        ref, ref_state = run_steps(m, None, inputs, (conv, ssm), slots)
        got, got_state = run_steps(m, ops, inputs, (conv, ssm), slots)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == dtype and a.shape == (batch, d.inner)
        assert_close(a, b, dtype, f"y of step {i}")
    assert torch.equal(got_state[0], ref_state[0]), "the convolution windows"
    assert_close(got_state[1], ref_state[1], torch.float32, "the SSM state")
    others = [s for s in range(NUM_SLOTS) if s not in SLOTS[batch]]
    assert torch.equal(got_state[1][others], ssm[others])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(
    "key_heads,value_heads,key_dim,value_dim", [(2, 4, 16, 24), (1, 3, 20, 70)]
)
def test_gated_delta_step_matches_torch(
    ops, isa, dtype, batch, key_heads, value_heads, key_dim, value_dim
):
    m = gated_deltanet(key_heads, value_heads, key_dim, value_dim, dtype, seed=batch + key_dim)
    d = m.dims
    gen = torch.Generator().manual_seed(11)
    conv = torch.randn(NUM_SLOTS, d.conv_dim, d.conv_kernel - 1, generator=gen).to(dtype)
    rec = torch.randn(NUM_SLOTS, d.value_heads, d.key_dim, d.value_dim, generator=gen) * 0.3
    inputs = [
        (
            torch.randn(batch, d.conv_dim, generator=gen).to(dtype),
            -torch.rand(batch, d.value_heads, generator=gen) * 2,  # g: the log of the decay
            torch.rand(batch, d.value_heads, generator=gen),  # beta
        )
        for _ in range(STEPS)
    ]
    slots = torch.tensor(SLOTS[batch])
    with torch.no_grad():
        ref, ref_state = run_steps(m, None, inputs, (conv, rec), slots)
        got, got_state = run_steps(m, ops, inputs, (conv, rec), slots)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == dtype and a.shape == (batch, d.value_heads, d.value_dim)
        assert_close(a, b, dtype, f"o of step {i}")
    assert torch.equal(got_state[0], ref_state[0]), "the convolution windows"
    assert_close(got_state[1], ref_state[1], torch.float32, "the recurrent state")
    others = [s for s in range(NUM_SLOTS) if s not in SLOTS[batch]]
    assert torch.equal(got_state[1][others], rec[others])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("heads,dim", [(4, 16), (2, 40)])
def test_kimi_delta_step_matches_torch(ops, isa, dtype, batch, heads, dim):
    """The decode step with a decay per key channel (g [B, H, dk]): each row of the state decays
    by its own channel's."""
    m = kimi_delta(heads, dim, dtype, seed=batch + dim)
    d = m.dims
    gen = torch.Generator().manual_seed(13)
    conv = torch.randn(NUM_SLOTS, d.conv_dim, d.conv_kernel - 1, generator=gen).to(dtype)
    rec = torch.randn(NUM_SLOTS, heads, dim, dim, generator=gen) * 0.3
    inputs = [
        (
            torch.randn(batch, d.conv_dim, generator=gen).to(dtype),
            -torch.rand(batch, heads, dim, generator=gen) * 2,  # g per channel
            torch.rand(batch, heads, generator=gen),
        )
        for _ in range(STEPS)
    ]
    slots = torch.tensor(SLOTS[batch])
    with torch.no_grad():
        ref, ref_state = run_steps(m, None, inputs, (conv, rec), slots)
        got, got_state = run_steps(m, ops, inputs, (conv, rec), slots)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == dtype and a.shape == (batch, heads, dim)
        assert_close(a, b, dtype, f"o of step {i}")
    assert torch.equal(got_state[0], ref_state[0]), "the convolution windows"
    assert_close(got_state[1], ref_state[1], torch.float32, "the recurrent state")
    others = [s for s in range(NUM_SLOTS) if s not in SLOTS[batch]]
    assert torch.equal(got_state[1][others], rec[others])


def test_kernels_give_the_same_bits_on_one_and_two_threads(ops):
    """Each output is computed by one task ((request, head) of a step, a head or a block of its
    columns in a scan): 2 threads give the bits of 1, for 3 requests' steps or 3 tokens' scan."""
    m, g = mamba2(4, 16, 2, 24, torch.bfloat16, 0), gated_deltanet(2, 4, 16, 24, torch.bfloat16, 0)
    gen = torch.Generator().manual_seed(3)
    cases = [
        (m, (torch.randn(3, m.dims.conv_dim, generator=gen).to(torch.bfloat16),
             torch.randn(3, 4, generator=gen).to(torch.bfloat16)),
         (torch.randn(NUM_SLOTS, m.dims.conv_dim, 3).to(torch.bfloat16),
          torch.randn(NUM_SLOTS, 4, 16, 24))),
        (g, (torch.randn(3, g.dims.conv_dim, generator=gen).to(torch.bfloat16),
             -torch.rand(3, 4, generator=gen), torch.rand(3, 4, generator=gen)),
         (torch.randn(NUM_SLOTS, g.dims.conv_dim, 3).to(torch.bfloat16),
          torch.randn(NUM_SLOTS, 4, 16, 24))),
    ]  # fmt: skip
    before = torch.get_num_threads()
    try:
        for mixer, step, states in cases:
            results = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                with torch.no_grad():
                    outs, after = run_steps(mixer, ops, [step], states, torch.tensor([2, 0, 3]))
                scan, scanned = extend(mixer, ops, step, 5, states, 2)
                results.append((outs[0], *after, scan, *scanned))
            for a, b in zip(*results):
                assert torch.equal(a, b)
    finally:
        torch.set_num_threads(before)


def test_bad_arguments_are_refused(ops):
    m = mamba2(4, 16, 2, 24, torch.float32, 0)
    d = m.dims
    conv = torch.zeros(NUM_SLOTS, d.conv_dim, 3)
    ssm = torch.zeros(NUM_SLOTS, 4, 16, 24)
    xbc, dt = torch.randn(2, d.conv_dim), torch.randn(2, 4)
    out = torch.empty(2, d.inner)
    w = (m.conv1d.weight, m.conv1d.bias, m.dt_bias, m.A_log, m.D)

    def step(slots, conv=conv, ssm=ssm, groups=2):
        ops.mamba2_decode_step(out, xbc, dt, conv, ssm, slots, *w, groups)

    with pytest.raises(RuntimeError, match="the same slot"):
        step(torch.tensor([1, 1]))
    with pytest.raises(RuntimeError, match=r"slot 5 is not in the pool's \[0, 5\)"):
        step(torch.tensor([0, 5]))
    with pytest.raises(RuntimeError, match="must have the input's dtype"):
        step(torch.tensor([0, 1]), conv=conv.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32"):
        step(torch.tensor([0, 1]), ssm=ssm.double())
    with pytest.raises(RuntimeError, match="are not x | B | C"):
        step(torch.tensor([0, 1]), groups=1)
    assert torch.equal(conv, torch.zeros_like(conv)) and torch.equal(ssm, torch.zeros_like(ssm))
    g = gated_deltanet(2, 4, 16, 24, torch.float32, 0)
    with pytest.raises(RuntimeError, match="g and beta must be float32"):
        ops.gated_delta_decode_step(
            torch.empty(2, 4, 24),
            torch.randn(2, g.dims.conv_dim),
            torch.randn(2, 4).double(),
            torch.rand(2, 4),
            torch.zeros(NUM_SLOTS, g.dims.conv_dim, 3),
            torch.zeros(NUM_SLOTS, 4, 16, 24),
            torch.tensor([0, 1]),
            g.conv1d.weight,
            2,
        )


# ---- prefill scans -------------------------------------------------------------------------------
def conv_out(mixer, x, prefix, conv, slot):
    """The torch convolution of ``_extend`` (its output [n, C] in the model's dtype)."""
    prev = conv[slot] if prefix else torch.zeros_like(conv[slot])
    window = torch.cat([prev.to(x.dtype), x.t()], dim=1)
    return causal_conv(mixer.conv1d, window[None], x.shape[0])[0]


def mamba2_float64(m, xbc, dt, prefix, conv, ssm, slot):
    """y [n, I] of the recurrence token by token in float64 (from ``_extend``'s convolution and
    dt)."""
    x, b, c = (t.double() for t in m._split(conv_out(m, xbc, prefix, conv, slot)))
    dt = torch.clamp(F.softplus(dt + m.dt_bias.to(dt.dtype)), *m.dims.dt_limit).double()
    a = -torch.exp(m.A_log.double())
    s = ssm[slot].double() if prefix else torch.zeros_like(ssm[slot], dtype=torch.float64)
    ys = []
    for t in range(xbc.shape[0]):
        upd = (dt[t, :, None] * x[t])[..., None] * b[t][:, None, :]
        s = s * torch.exp(dt[t] * a)[:, None, None] + upd
        ys.append(torch.einsum("hpn,hn->hp", s, c[t]) + m.D.double()[:, None] * x[t])
    return torch.stack(ys).reshape(xbc.shape[0], -1)


def delta_float64(m, qkv, g, beta, prefix, conv, rec, slot):
    """o [n, Hv, dv] of the delta rule token by token in float64 (from ``_extend``'s q, k, v)."""
    q, k, v = (t.double() for t in m._qkv(conv_out(m, qkv, prefix, conv, slot)))
    s = rec[slot].double() if prefix else torch.zeros_like(rec[slot], dtype=torch.float64)
    os = []
    for t in range(qkv.shape[0]):
        decay = torch.exp(g[t].double())  # [Hv], or [Hv, dk]: a decay per key channel
        s = s * (decay[:, :, None] if decay.dim() == 2 else decay[:, None, None])
        delta = (v[t] - torch.einsum("hkv,hk->hv", s, k[t])) * beta[t].double()[:, None]
        s = s + k[t][..., None] * delta[:, None, :]
        os.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(os)


def extend(mixer, ops, inputs, prefix, states, slot, cuts=()):
    """``_extend`` over the tokens of ``inputs`` (cut into calls at ``cuts``) with ``ops`` (None:
    torch), from copies of ``states``: (the outputs, float32, and the states after)."""
    states = [s.clone() for s in states]
    mixer.ops = None if ops is None else CountingOps(ops)
    n = inputs[0].shape[0]
    bounds = [0, *cuts, n]
    with torch.no_grad():
        outs = [
            mixer._extend(*(t[lo:hi] for t in inputs), prefix + lo, *states, slot).float()
            for lo, hi in zip(bounds, bounds[1:])
        ]
    assert ops is None or mixer.ops.calls == len(bounds) - 1, "the kernel did not run"
    return torch.cat(outs), states


def relative(got, ref) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix", [0, 9])
@pytest.mark.parametrize("n", [1, 5, 37])
def test_mamba2_scan_matches_the_recurrence(ops, isa, dtype, prefix, n):
    m = mamba2(6, 40, 2, 21, dtype, seed=n)
    d = m.dims
    gen = torch.Generator().manual_seed(n + prefix)
    conv = torch.randn(NUM_SLOTS, d.conv_dim, d.conv_kernel - 1, generator=gen).to(dtype)
    ssm = torch.randn(NUM_SLOTS, d.heads, d.head_dim, d.state, generator=gen)
    xbc = torch.randn(n, d.conv_dim, generator=gen).to(dtype)
    dt = torch.randn(n, d.heads, generator=gen).to(dtype)
    got, got_states = extend(m, ops, (xbc, dt), prefix, (conv, ssm), 3)
    ref, ref_states = extend(m, None, (xbc, dt), prefix, (conv, ssm), 3)
    exact = mamba2_float64(m, xbc, dt, prefix, conv, ssm, 3)
    assert relative(got, exact) < 2e-6, relative(got, exact)
    assert relative(ref, exact) < 1e-5  # the chunked torch code, for scale
    assert torch.equal(got_states[0], ref_states[0]), "the convolution window"
    assert relative(got_states[1], ref_states[1].double()) < 2e-5
    others = [s for s in range(NUM_SLOTS) if s != 3]
    assert torch.equal(got_states[1][others], ssm[others])
    cut, cut_states = extend(m, ops, (xbc, dt), prefix, (conv, ssm), 3, cuts=(n // 3, n // 2))
    assert torch.equal(cut, got) and all(map(torch.equal, cut_states, got_states))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix", [0, 9])
@pytest.mark.parametrize("n", [1, 5, 37])
@pytest.mark.parametrize("per_channel", [False, True], ids=["gated_deltanet", "kimi_delta"])
def test_delta_scan_matches_the_recurrence(ops, isa, dtype, prefix, n, per_channel):
    """The prefill scan, with a decay per value head (Gated DeltaNet) or per key channel (Kimi
    Delta Attention), against the recurrence in float64 and the torch code's blocks (of 64 or 16:
    37 tokens cross them)."""
    if per_channel:
        m = kimi_delta(3, 24, dtype, seed=n)
    else:
        m = gated_deltanet(2, 4, 20, 70, dtype, seed=n)
    d = m.dims
    gen = torch.Generator().manual_seed(n + prefix)
    conv = torch.randn(NUM_SLOTS, d.conv_dim, d.conv_kernel - 1, generator=gen).to(dtype)
    rec = torch.randn(NUM_SLOTS, d.value_heads, d.key_dim, d.value_dim, generator=gen) * 0.3
    qkv = torch.randn(n, d.conv_dim, generator=gen).to(dtype)
    decays = (n, d.value_heads, d.key_dim) if per_channel else (n, d.value_heads)
    g = -torch.rand(decays, generator=gen) * 2
    beta = torch.rand(n, d.value_heads, generator=gen)
    got, got_states = extend(m, ops, (qkv, g, beta), prefix, (conv, rec), 3)
    ref, ref_states = extend(m, None, (qkv, g, beta), prefix, (conv, rec), 3)
    exact = delta_float64(m, qkv, g, beta, prefix, conv, rec, 3)
    if dtype == torch.float32:
        assert relative(ref, exact) < 1e-5  # the torch blocks
        assert relative(got, exact) < 2e-6, relative(got, exact)
    else:  # one rounding of the float32 output (whose own error may cross a rounding boundary)
        off = (got.double() - exact).abs() / (spacing(exact.float()) + 2e-6 * exact.abs().max())
        assert off.max().item() <= 1
    assert torch.equal(got_states[0], ref_states[0]), "the convolution window"
    assert relative(got_states[1], ref_states[1].double()) < 2e-5
    others = [s for s in range(NUM_SLOTS) if s != 3]
    assert torch.equal(got_states[1][others], rec[others])
    cut, cut_states = extend(m, ops, (qkv, g, beta), prefix, (conv, rec), 3, cuts=(n // 3, n // 2))
    assert torch.equal(cut, got) and all(map(torch.equal, cut_states, got_states))


def short_conv(channels: int, kernel: int, bias: bool, dtype, seed: int):
    """LFM2's short-convolution mixer with random weights (its convolution is what the kernels
    compute)."""
    from pdserve.layers.short_conv import ShortConvMixer

    gen = torch.Generator().manual_seed(seed)
    m = ShortConvMixer(channels, kernel, bias, kv_layer=0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return m.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("channels,kernel,bias", [(40, 3, False), (70, 4, True)])
def test_short_conv_step_is_the_torch_convolution(ops, isa, dtype, batch, channels, kernel, bias):
    """LFM2's short convolution of a decode step: the torch code's bits (``causal_conv`` without
    SiLU over ``step_window``), its windows updated the same way, at every tier."""
    from pdserve.layers.mamba2 import step_window

    m = short_conv(channels, kernel, bias, dtype, seed=batch)
    gen = torch.Generator().manual_seed(7)
    states = (torch.randn(5, channels, kernel - 1, generator=gen)).to(dtype)
    slots = torch.tensor([4, 0, 2][:batch])
    want_states = states.clone()
    for step in range(3):
        bx = torch.randn(batch, channels, generator=gen).to(dtype)
        window = step_window(want_states, slots, bx)
        want = causal_conv(m.conv, window, 1, silu=False)[:, 0]
        got = torch.empty_like(bx)
        ops.short_conv_decode_step(got, bx, states, slots, m.conv.weight, m.conv.bias)
        assert torch.equal(got, want), (step, (got.float() - want.float()).abs().max())
        assert torch.equal(states, want_states)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix", [0, 9])
@pytest.mark.parametrize("n", [1, 5, 37])
def test_short_conv_scan_is_the_torch_convolution(ops, isa, dtype, prefix, n):
    """A chunk of n new inputs after ``prefix`` (zeros before an empty prefix, as the mixer clears
    its slot): ``causal_conv`` over ``extend_window``'s bits and window."""
    from pdserve.layers.mamba2 import extend_window

    m = short_conv(70, 3, True, dtype, seed=n)
    gen = torch.Generator().manual_seed(prefix)
    states = torch.randn(3, 70, 2, generator=gen).to(dtype)
    want_states = states.clone()
    bx = torch.randn(n, 70, generator=gen).to(dtype)
    window = extend_window(want_states, 1, bx, prefix)
    want = causal_conv(m.conv, window[None], n, silu=False)[0]
    if not prefix:
        states[1].zero_()
    got = torch.empty_like(bx)
    ops.short_conv_scan(got, bx, states, 1, m.conv.weight, m.conv.bias)
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    assert torch.equal(states, want_states)


def test_short_conv_refuses_bad_arguments(ops):
    m = short_conv(40, 3, False, torch.float32, seed=0)
    states = torch.zeros(4, 40, 2)
    bx = torch.randn(2, 40)
    w = m.conv.weight
    with pytest.raises(RuntimeError, match="same slot"):
        ops.short_conv_decode_step(torch.empty(2, 40), bx, states, torch.tensor([1, 1]), w, None)
    with pytest.raises(RuntimeError, match="not in the pool"):
        ops.short_conv_decode_step(torch.empty(2, 40), bx, states, torch.tensor([0, 4]), w, None)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.short_conv_decode_step(
            torch.empty(2, 40).bfloat16(), bx, states, torch.tensor([0, 1]), w, None
        )
    with pytest.raises(RuntimeError, match="out must be"):
        ops.short_conv_scan(torch.empty(3, 40), bx, states, 0, w, None)
    with pytest.raises(RuntimeError, match="slot 9"):
        ops.short_conv_scan(torch.empty(2, 40), bx, states, 9, w, None)
