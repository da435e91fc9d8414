"""Mamba2 mixer (the linear-attention layers of Bamba, Nemotron-H and Granite 4 hybrids), in torch.

Per token: ``in_proj`` gives ``z`` (the gate, I channels), ``xBC`` (the convolution's input: x of
I channels, then B and C of G groups of N each) and ``dt`` (one per head). ``xBC`` goes through a
depthwise causal convolution of K taps (with bias) and SiLU; then per head h of P channels,
with ``dt = softplus(dt + dt_bias)`` and ``A = -exp(A_log)``::

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T        (S: [P, N], B and C of the head's group)
    y_t = S_t C_t + D x_t

``y * silu(z)`` is normalised per group (RMS over I / G channels), scaled, and ``out_proj`` maps
it back. A request's state lives in its slot of the layer's ``StatePool``: ``conv``, the last
K - 1 inputs of the convolution ([conv_dim, K - 1], in the model's dtype, as HF keeps it), and
``ssm``, S of every head ([H, P, N], float32). A request whose prefix is empty starts from zeros;
a chunk continues from the state its previous chunk left.

Prefill runs the chunked form of the scan: blocks of ``chunk_size`` positions, aligned to absolute
positions (so chunked prefill cuts them where one long forward would), each solved as a masked
matrix product inside the block and a recurrence across blocks. A single new token after a prefix
(a decode step) takes the one-step update, batched over the requests, as HF's decode does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed import SINGLE, TPGroup
from pdserve.forward_batch import ForwardBatch
from pdserve.kv_spec import RecurrentState
from pdserve.layers import state_snapshots as snapshots
from pdserve.layers.linear import Linear, RowParallelLinear

STATE_KIND = RecurrentState.kind


@dataclass(frozen=True)
class Mamba2Dims:
    hidden: int
    heads: int  # H
    head_dim: int  # P
    groups: int  # G
    state: int  # N
    conv_kernel: int  # K
    chunk_size: int
    eps: float
    proj_bias: bool = False
    conv_bias: bool = True
    # the scan's bounds on dt (HF's ``time_step_limit``), applied where HF does: in prefill's
    # chunked scan, not in the decode step
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    # one rank's share (``shard``) of a layer with fewer groups than ranks: the ranks whose heads
    # read the one group this rank holds (each holds it whole, and a part of its heads)
    group_ranks: int = 1
    # how y meets the gate z (``NORMS``): Bamba's gated norm, or Falcon-H1's variants
    norm: str = "gate_norm"
    out_bias: Optional[bool] = None  # out_proj's bias (None: as ``proj_bias``)

    @property
    def inner(self) -> int:  # I
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.state

    def state_spec(self, conv_dtype: str, ranks: int = 1, whole_groups: int = 0) -> RecurrentState:
        """The state of one request of a layer of these sizes (one rank's of ``ranks``, of a layer
        of ``whole_groups`` groups: B and C's channels of the convolution are whole groups)."""
        g = whole_groups or self.groups
        return RecurrentState(
            parts=("conv", "ssm"),
            shapes=((self.conv_dim, self.conv_kernel - 1), (self.heads, self.head_dim, self.state)),
            dtypes=(conv_dtype, "float32"),
            segments=((self.inner, self.groups * self.state, self.groups * self.state), ()),
            pieces=((0, g, g), ()),
            ranks=ranks,
        )

    def shard(self, ranks: int) -> "Mamba2Dims":
        """One rank's sizes when ``ranks`` ranks split the heads evenly. The groups are split too
        when they divide; with fewer groups than ranks (Bamba-9B's and Granite 4.0-H's one group)
        each rank holds the group its heads read, as do the other ranks of that group."""
        if self.heads % ranks or (self.groups % ranks and ranks % self.groups):
            raise ValueError(
                f"tp_size: {ranks} ranks cannot split a Mamba2 layer's {self.heads} heads evenly "
                f"and give each rank whole groups of its {self.groups} (the ranks must divide the "
                "groups, or the groups the ranks)"
            )
        if self.groups % ranks == 0:
            return replace(self, heads=self.heads // ranks, groups=self.groups // ranks)
        return replace(self, heads=self.heads // ranks, groups=1, group_ranks=ranks // self.groups)


# How the scan's output y meets the gate z, per group of channels (RMS over the group):
# "gate_norm": weight * round(rms(y * silu(z))) (HF's ``RMSNormGated``: Bamba, Nemotron-H,
# Granite 4); "gate_norm_f32": round(weight * rms(y * silu(z))), the weight in float32, and
# "norm_gate_f32": round(weight * rms(y) * silu(z)) (Falcon-H1's ``mamba_norm_before_gate``);
# "gate": y * silu(z), no norm (Falcon-H1 without ``mamba_rms_norm``).
NORMS = ("gate_norm", "gate_norm_f32", "norm_gate_f32", "gate")


class SiluGate(nn.Module):
    """``y * silu(z)``, no norm (``NORMS``' "gate")."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (x.float() * F.silu(z.float())).to(x.dtype)


class GatedGroupRMSNorm(nn.Module):
    """``weight * rmsnorm_per_group(x * silu(z))`` over groups of ``dim / groups`` channels,
    computed in float32 and rounded to ``x``'s dtype before the weight, as HF's ``RMSNormGated``
    (``order`` "gate_norm"; Falcon-H1's two orders in ``NORMS``). ``group_ranks`` > 1: this rank's
    ``dim`` channels are its share of one group that many ranks of ``tp`` split (its group:
    ``tp.rank // group_ranks``); the squares are summed over them."""

    def __init__(
        self,
        dim: int,
        groups: int,
        eps: float,
        tp: TPGroup = SINGLE,
        group_ranks: int = 1,
        order: str = "gate_norm",
    ):
        super().__init__()
        if order not in NORMS[:3]:
            raise ValueError(f"order: {order!r}; expected one of {NORMS[:3]}")
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps = groups, eps
        self.tp, self.group_ranks = tp, group_ranks
        self.order = order

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() if self.order == "norm_gate_f32" else x.float() * F.silu(z.float())
        g = h.view(*h.shape[:-1], self.groups, -1)
        if self.group_ranks == 1:
            g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        else:  # one column per group of the layer, summed over the ranks
            sums = h.new_zeros((*h.shape[:-1], self.tp.size // self.group_ranks))
            mine = self.tp.rank // self.group_ranks
            sums[..., mine] = g.pow(2).sum((-2, -1))
            total = self.tp.all_reduce(sums)[..., mine, None, None]
            g = g * torch.rsqrt(total / (h.shape[-1] * self.group_ranks) + self.eps)
        if self.order == "gate_norm":
            return self.weight * g.view(h.shape).to(dtype)
        out = self.weight * g.view(h.shape)
        if self.order == "norm_gate_f32":
            out = out * F.silu(z.float())
        return out.to(dtype)


class DepthwiseConv(nn.Module):
    """The parameters of HF's ``nn.Conv1d(C, C, K, groups=C)``: ``weight`` [C, 1, K], ``bias``."""

    def __init__(self, channels: int, kernel: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None


def copy_share(param: torch.Tensor, t: torch.Tensor, name: str) -> None:
    """Copy this rank's share ``t`` of checkpoint tensor ``name`` into ``param``, refusing a shape
    that is not the parameter's (the state mixers read their weights themselves)."""
    if tuple(t.shape) != tuple(param.shape):
        raise ValueError(
            f"{name}: expected shape {tuple(param.shape)} for this rank, got {tuple(t.shape)}"
        )
    param.data.copy_(t)


def extend_window(state: torch.Tensor, slot: int, x: torch.Tensor, prefix: int) -> torch.Tensor:
    """The convolution's window over ``x`` [n, C], new inputs of one request after ``prefix``
    tokens: its previous K - 1 inputs (``state[slot]``, [C, K - 1]; zeros for an empty prefix),
    then x's, [C, K - 1 + n] in x's dtype; ``state[slot]`` takes the last K - 1."""
    prev = state[slot] if prefix else torch.zeros_like(state[slot])
    window = torch.cat([prev.to(x.dtype), x.t()], dim=1)
    state[slot] = window[:, window.shape[1] - state.shape[-1] :]
    return window


def step_window(state: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The windows [B, C, K] of one new input ``x`` [B, C] per request at ``slots`` (the state
    [num_slots, C, K - 1] takes the last K - 1 of each)."""
    window = torch.cat([state[slots].to(x.dtype), x[:, :, None]], dim=2)
    state[slots] = window[:, :, 1:]
    return window


def causal_conv(
    conv: DepthwiseConv, window: torch.Tensor, n: int, silu: bool = True
) -> torch.Tensor:
    """Causal depthwise convolution + SiLU (or none: ``silu`` False, LFM2's short convolution) of
    the last ``n`` positions of ``window``
    [B, C, K - 1 + n] (the previous inputs, then the new ones): [B, n, C]. The K taps are summed
    in float32 and rounded once to the weights' dtype, as a bf16 convolution does; ATen's bf16
    depthwise conv1d took 26 ms a call on an AVX2 CPU (a decode step of 28 Mamba2 layers: 0.8 s),
    these few multiply-adds take microseconds."""
    w = conv.weight
    k = w.shape[-1]
    taps = window.float().unfold(2, k, 1)[:, :, -n:]  # [B, C, n, K]
    out = (taps * w.float()[:, 0, None, :]).sum(-1)
    if conv.bias is not None:
        out = out + conv.bias.float()[:, None]
    out = out.to(w.dtype)
    return (F.silu(out) if silu else out).transpose(1, 2)


class Mamba2Mixer(nn.Module):
    """One Mamba2 layer; ``kv_layer`` is its index among this stage's layers (``ForwardBatch``).
    Under tensor parallelism (``tp``) each rank holds a share of the heads and of the groups
    (whole groups, so the gated norm stays local; with fewer groups than ranks, the one group its
    heads read, whose norm sums the squares over the ranks sharing it, as vLLM does for Bamba's
    one group): its rows of ``in_proj`` (of z, x, B, C and dt),
    its channels of the convolution, its columns of ``out_proj``, whose outputs are summed; its
    state is its channels' and heads' (``dims`` are the rank's sizes). It reads its HF weights
    itself (``checkpoint_names`` / ``load_checkpoint``)."""

    def __init__(self, dims: Mamba2Dims, kv_layer: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.whole, self.tp, self.kv_layer = dims, tp, kv_layer
        self.dims = d = dims.shard(tp.size)
        self.in_proj = Linear(d.hidden, d.inner + d.conv_dim + d.heads, bias=d.proj_bias)
        self.conv1d = DepthwiseConv(d.conv_dim, d.conv_kernel, d.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(d.heads))
        self.A_log = nn.Parameter(torch.empty(d.heads))
        self.D = nn.Parameter(torch.empty(d.heads))
        if d.norm == "gate":
            self.norm = SiluGate()
        else:
            self.norm = GatedGroupRMSNorm(d.inner, d.groups, d.eps, tp, d.group_ranks, d.norm)
        out_bias = d.proj_bias if d.out_bias is None else d.out_bias
        self.out_proj = RowParallelLinear(d.inner, d.hidden, bias=out_bias, tp=tp)
        # Falcon-H1's multipliers: of the layer's input, and per row of in_proj's output
        # (``set_multipliers``)
        self.in_scale = 1.0
        self.row_scales: tuple[tuple[int, float], ...] = ()  # (rows, multiplier) of z, x, B, C, dt
        self.proj_scale: Optional[torch.Tensor] = None
        self.ops: Optional[ModuleType] = None  # pdserve's CPU kernels: the decode step's kernel

    def state_spec(self, conv_dtype: str) -> RecurrentState:
        return self.dims.state_spec(conv_dtype, self.tp.size, self.whole.groups)

    def set_multipliers(self, inputs: float, rows: tuple[float, ...]) -> None:
        """Falcon-H1's ``ssm_in_multiplier`` (``inputs``) and ``ssm_multipliers`` (``rows``: one
        each for the rows of z, x, B, C and dt of in_proj's output)."""
        d = self.dims
        sizes = (d.inner, d.inner, d.groups * d.state, d.groups * d.state, d.heads)
        self.in_scale = float(inputs)
        if any(float(m) != 1.0 for m in rows):
            self.row_scales = tuple(zip(sizes, (float(m) for m in rows)))

    def _proj_scale(self, like: torch.Tensor) -> torch.Tensor:
        """The row multipliers as one vector of ``like``'s dtype and device (made at first use:
        the layer may be built on the meta device)."""
        if self.proj_scale is None or self.proj_scale.device != like.device:
            self.proj_scale = torch.cat(
                [torch.full((n,), m, device=like.device) for n, m in self.row_scales]
            )
        return self.proj_scale.to(like.dtype)

    # ---- weights -----------------------------------------------------------------------------
    def checkpoint_names(self) -> list[str]:
        return [n for n, p in self.named_parameters()]

    def _rows(self) -> list[tuple[int, int]]:
        """This rank's [start, end) of each block of the whole layer's ``in_proj`` rows: z, x,
        B, C, dt (the convolution's channels are x, B, C, less the I rows of z)."""
        w, d, r = self.whole, self.dims, self.tp.rank
        gn, dn = w.groups * w.state, d.groups * d.state
        heads = [(s + r * n, s + (r + 1) * n) for s, n in ((0, d.inner), (w.inner, d.inner))]
        g0 = r // d.group_ranks * dn  # the rank's groups' first row of B (and of C)
        groups = [(s + g0, s + g0 + dn) for s in (2 * w.inner, 2 * w.inner + gn)]
        dt = 2 * w.inner + 2 * gn + r * d.heads
        return [*heads, *groups, (dt, dt + d.heads)]

    def load_checkpoint(self, name: str, src: Any) -> None:
        params = dict(self.named_parameters())
        if name not in params:
            raise ValueError(f"unexpected Mamba2 weight {name!r}")
        z, x, b, c, dt = self._rows()
        r, heads = self.tp.rank, self.dims.heads
        if name.startswith("in_proj."):
            t = torch.cat([src[lo:hi] for lo, hi in (z, x, b, c, dt)])
        elif name.startswith("conv1d."):
            i = self.whole.inner
            t = torch.cat([src[lo - i : hi - i] for lo, hi in (x, b, c)])
        elif name in ("dt_bias", "A_log", "D"):
            t = src[r * heads : (r + 1) * heads]
        elif name == "norm.weight":
            t = src[r * self.dims.inner : (r + 1) * self.dims.inner]
        elif name == "out_proj.weight":
            t = src[:, r * self.dims.inner : (r + 1) * self.dims.inner]
        else:  # out_proj.bias: whole, added once after the sum
            t = src[:]
        copy_share(params[name], t, name)

    def forward(self, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        d = self.dims
        pool, index, _ = fb.state(self.kv_layer, STATE_KIND)
        conv_state, ssm_state = pool.state("conv", index), pool.state("ssm", index)
        proj = self.in_proj(h * self.in_scale if self.in_scale != 1.0 else h)
        if self.row_scales:
            proj = proj * self._proj_scale(proj)
        z, xbc, dt = proj.split([d.inner, d.conv_dim, d.heads], dim=-1)
        # the gated norm takes an extend's scan output in float32 and a decode step's in the
        # model's dtype, as HF's two paths do (the same in a float32 model)
        out = torch.empty((h.shape[0], d.inner), dtype=h.dtype, device=h.device)

        def extend(rows: slice, position: int, slot: int) -> None:
            y = self._extend(xbc[rows], dt[rows], position, conv_state, ssm_state, slot)
            out[rows] = self.norm(y, z[rows]).to(h.dtype)

        def step(rows: torch.Tensor, slots: torch.Tensor) -> None:
            y = self._step(xbc[rows], dt[rows], conv_state, ssm_state, slots)
            out[rows] = self.norm(y, z[rows])

        snapshots.run(fb, self.kv_layer, STATE_KIND, extend, step)
        return self.out_proj(out)

    # ---- the pieces --------------------------------------------------------------------------
    def _split(self, xbc: torch.Tensor):
        """x [.., H, P], B and C [.., H, N] (each head its group's) from the convolved channels."""
        d = self.dims
        x, b, c = xbc.split([d.inner, d.groups * d.state, d.groups * d.state], dim=-1)
        per = d.heads // d.groups
        lead = xbc.shape[:-1]
        b = b.reshape(*lead, d.groups, 1, d.state).expand(*lead, d.groups, per, d.state)
        c = c.reshape(*lead, d.groups, 1, d.state).expand(*lead, d.groups, per, d.state)
        return (
            x.reshape(*lead, d.heads, d.head_dim),
            b.reshape(*lead, d.heads, d.state),
            c.reshape(*lead, d.heads, d.state),
        )

    def _extend(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        prefix: int,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        slot: int,
    ) -> torch.Tensor:
        """``n`` new tokens of one request after ``prefix`` tokens: the chunked scan from its
        state (zeros for an empty prefix), which it updates. Returns y [n, I] in float32. With
        pdserve's CPU kernels, one kernel convolves and runs the recurrence itself, token by
        token (faster on CPU than the blocks at every length measured: docs/benchmarks.md)."""
        d, n = self.dims, xbc.shape[0]
        if cpu_kernel_runs(self.ops, xbc, conv_state):
            if not prefix:
                conv_state[slot].zero_()
                ssm_state[slot].zero_()
            y = torch.empty((n, d.inner), dtype=torch.float32)
            weights = (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D)
            self.ops.mamba2_scan(
                y, xbc, dt, conv_state, ssm_state, slot, *weights, d.groups, *d.dt_limit
            )
            return y
        window = extend_window(conv_state, slot, xbc, prefix)  # [C, K - 1 + n]
        x, b, c = self._split(causal_conv(self.conv1d, window[None], n)[0])
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype))
        dt = torch.clamp(dt, *d.dt_limit).float()  # [n, H]
        a = -torch.exp(self.A_log.float())
        s = ssm_state[slot] if prefix else torch.zeros_like(ssm_state[slot])  # [H, P, N]
        x32, b32, c32 = x.float(), b.float(), c.float()
        y = torch.empty((n, d.heads, d.head_dim), dtype=torch.float32, device=xbc.device)
        lo = 0
        while lo < n:  # blocks aligned to absolute positions
            hi = min(n, lo + d.chunk_size - (prefix + lo) % d.chunk_size)
            y[lo:hi], s = _scan_block(x32[lo:hi], dt[lo:hi], a, b32[lo:hi], c32[lo:hi], s)
            lo = hi
        ssm_state[slot] = s
        y = y + self.D.float()[:, None] * x32
        return y.reshape(n, d.inner)

    def _step(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """One new token of each of several requests (decode): [B, I] in the model's dtype. With
        pdserve's CPU kernels, one kernel updates the states in place at ``slots`` (rounding where
        the torch code below, its reference, rounds)."""
        d = self.dims
        if cpu_kernel_runs(self.ops, xbc, conv_state):
            out = torch.empty((xbc.shape[0], d.inner), dtype=xbc.dtype)
            weights = (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D)
            self.ops.mamba2_decode_step(
                out, xbc, dt, conv_state, ssm_state, slots, *weights, d.groups
            )
            return out
        window = step_window(conv_state, slots, xbc)
        x, b, c = self._split(causal_conv(self.conv1d, window, 1)[:, 0])  # [B, H, P], [B, H, N]
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype))[:, :, None]  # [B, H, 1], model dtype
        decay = torch.exp(dt.float() * -torch.exp(self.A_log.float())[:, None])  # [B, H, 1]
        s = ssm_state[slots] * decay[..., None] + ((dt * b)[:, :, None, :] * x[..., None])
        ssm_state[slots] = s
        y = torch.einsum("bhpn,bhn->bhp", s.to(c.dtype), c)
        y = y + x * self.D.to(x.dtype)[:, None]
        return y.reshape(y.shape[0], d.inner).to(xbc.dtype)


def cpu_kernel_runs(ops: Optional[ModuleType], x: torch.Tensor, conv_state: torch.Tensor) -> bool:
    """Whether a decode step or a prefill scan on ``x`` (the new tokens' convolution input) runs in
    pdserve's CPU kernels (``ops``: None without them): on CPU, float32 or bf16, the convolution
    window in x's dtype."""
    return (
        ops is not None
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and conv_state.dtype == x.dtype
    )


def _scan_block(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    s: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over one block of L positions from state ``s`` [H, P, N]: x [L, H, P], dt [L, H],
    a [H], b and c [L, H, N], all float32. Returns (y [L, H, P] without the D term, the state
    after the block)."""
    log_decay = torch.cumsum(dt * a, dim=0)  # [L, H]: log of the decay from the block start
    L = x.shape[0]
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    # decay from position j to position i (j <= i): exp(cum_i - cum_j)
    rel = (log_decay[:, None, :] - log_decay[None, :, :]).masked_fill(
        ~causal[..., None], -torch.inf
    )
    weights = torch.einsum("ihn,jhn->ijh", c, b) * torch.exp(rel)  # [L, L, H]
    xdt = x * dt[..., None]  # [L, H, P]
    y = torch.einsum("ijh,jhp->ihp", weights, xdt)
    y = y + torch.einsum("ihn,hpn->ihp", c, s) * torch.exp(log_decay)[..., None]
    to_end = torch.exp(log_decay[-1:] - log_decay)  # [L, H]
    s = s * torch.exp(log_decay[-1])[:, None, None] + torch.einsum(
        "jh,jhn,jhp->hpn", to_end, b, xdt
    )
    return y, s
