"""Mamba (version 1) mixer: the ``mamba`` layers of Jamba (``JambaForCausalLM``) and the layers of
Mamba and FalconMamba (``MambaForCausalLM``, ``FalconMambaForCausalLM``), in torch.

Per token: ``in_proj`` gives x and the gate z (I channels each); x goes through a depthwise causal
convolution of K taps and SiLU; ``x_proj`` maps it to a time step of R ranks and B and C (N each),
which Jamba normalises (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``; FalconMamba without
weights, Mamba not at all); ``dt_proj`` widens the time step to one per channel, and with ``dt =
softplus(dt + dt_bias)`` and ``A = -exp(A_log)`` ([I, N]: one decay per channel and state) every
channel i runs::

    S_t[i] = exp(dt_t[i] A[i]) S_{t-1}[i] + dt_t[i] x_t[i] B_t        (S: [I, N])
    y_t[i] = S_t[i] . C_t + D[i] x_t[i]

``y * silu(z)`` goes through ``out_proj``. A request's state, in its slot of the layer's
``StatePool``: ``conv``, the last K - 1 inputs of the convolution ([I, K - 1], in the model's
dtype), and ``ssm`` ([I, N], float32). The extend runs the recurrence token by token from the
request's state (zeros for an empty prefix), as HF's sequential scan does from zeros, so a chunk
continues exactly where the previous one stopped; a decode step takes the one-step update, batched
over the requests. Under tensor parallelism each rank holds a share of the channels: its rows of
x and z, of the convolution, ``dt_proj``, ``A_log`` and ``D``, its columns of ``x_proj`` (whose
outputs are summed before the norms) and of ``out_proj`` (summed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed import SINGLE, TPGroup
from pdserve.forward_batch import ForwardBatch
from pdserve.kv_spec import RecurrentState
from pdserve.layers import state_snapshots as snapshots
from pdserve.layers.linear import Linear, RowParallelLinear
from pdserve.layers.mamba2 import (
    DepthwiseConv,
    causal_conv,
    copy_share,
    extend_window,
    step_window,
)
from pdserve.layers.norm import RMSNorm, UnitRMSNorm

STATE_KIND = RecurrentState.kind
CHECKPOINT_NAMES = {"dt_bias": "dt_proj.bias"}  # ours -> the checkpoint's
OWN_NAMES = {v: k for k, v in CHECKPOINT_NAMES.items()}


@dataclass(frozen=True)
class Mamba1Dims:
    hidden: int
    inner: int  # I
    state: int  # N
    conv_kernel: int  # K
    dt_rank: int  # R
    eps: float
    proj_bias: bool = False
    conv_bias: bool = True
    # RMS norms on the time step, B and C: "weighted" (Jamba's), "weightless" (FalconMamba's),
    # "none" (Mamba's)
    bcdt_norms: str = "weighted"

    def shard(self, ranks: int) -> "Mamba1Dims":
        if self.inner % ranks:
            raise ValueError(
                f"tp_size: {ranks} ranks cannot split a Mamba layer's {self.inner} channels evenly"
            )
        return replace(self, inner=self.inner // ranks)

    def state_spec(self, conv_dtype: str, ranks: int = 1) -> RecurrentState:
        return RecurrentState(
            parts=("conv", "ssm"),
            shapes=((self.inner, self.conv_kernel - 1), (self.inner, self.state)),
            dtypes=(conv_dtype, "float32"),
            ranks=ranks,
        )


class Mamba1Mixer(nn.Module):
    """One Mamba layer; ``kv_layer`` is its index among this stage's layers. It reads its HF
    weights itself (``checkpoint_names`` / ``load_checkpoint``)."""

    def __init__(self, dims: Mamba1Dims, kv_layer: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.whole, self.tp, self.kv_layer = dims, tp, kv_layer
        self.dims = d = dims.shard(tp.size)
        self.in_proj = Linear(d.hidden, 2 * d.inner, bias=d.proj_bias)
        self.conv1d = DepthwiseConv(d.inner, d.conv_kernel, d.conv_bias)
        self.x_proj = RowParallelLinear(d.inner, d.dt_rank + 2 * d.state, bias=False, tp=tp)
        # the time step's bias joins inside the softplus (after the projection's rounding, as
        # HF's scan adds it); the checkpoint's ``dt_proj.bias``
        self.dt_proj = Linear(d.dt_rank, d.inner, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(d.inner))
        self.A_log = nn.Parameter(torch.empty(d.inner, d.state))
        self.D = nn.Parameter(torch.empty(d.inner))
        self.out_proj = RowParallelLinear(d.inner, d.hidden, bias=d.proj_bias, tp=tp)
        if d.bcdt_norms not in ("weighted", "weightless", "none"):
            raise ValueError(f"bcdt_norms: {d.bcdt_norms!r}; expected weighted, weightless or none")
        if d.bcdt_norms != "none":
            norm = RMSNorm if d.bcdt_norms == "weighted" else UnitRMSNorm
            self.dt_layernorm = norm(d.dt_rank, d.eps)
            self.b_layernorm = norm(d.state, d.eps)
            self.c_layernorm = norm(d.state, d.eps)

    def state_spec(self, conv_dtype: str) -> RecurrentState:
        return self.dims.state_spec(conv_dtype, self.tp.size)

    # ---- weights -----------------------------------------------------------------------------
    def checkpoint_names(self) -> list[str]:
        return [CHECKPOINT_NAMES.get(n, n) for n, _ in self.named_parameters()]

    def load_checkpoint(self, name: str, src: Any) -> None:
        params = dict(self.named_parameters())
        name = OWN_NAMES.get(name, name)
        if name not in params:
            raise ValueError(f"unexpected Mamba weight {name!r}")
        n, r, whole = self.dims.inner, self.tp.rank, self.whole.inner
        mine = slice(r * n, (r + 1) * n)
        if name.startswith("in_proj."):  # rows: x, then z
            t = torch.cat([src[r * n : (r + 1) * n], src[whole + r * n : whole + (r + 1) * n]])
        elif name.startswith(("conv1d.", "dt_proj.")) or name in ("dt_bias", "A_log", "D"):
            t = src[mine]
        elif name in ("x_proj.weight", "out_proj.weight"):
            t = src[:, mine]
        else:  # out_proj.bias (added once after the sum) and the norms: whole
            t = src[:]
        copy_share(params[name], t, name)

    # ---- compute -----------------------------------------------------------------------------
    def forward(self, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        pool, index, _ = fb.state(self.kv_layer, STATE_KIND)
        conv_state, ssm_state = pool.state("conv", index), pool.state("ssm", index)
        x, z = self.in_proj(h).chunk(2, dim=-1)
        out = torch.empty_like(x)

        def extend(rows: slice, position: int, slot: int) -> None:
            window = extend_window(conv_state, slot, x[rows], position)  # [I, K - 1 + n]
            xc = causal_conv(self.conv1d, window[None], rows.stop - rows.start)[0]  # [n, I]
            dt, b, c = self._selective(xc)
            if not position:
                ssm_state[slot].zero_()
            out[rows] = self._scan(xc, dt, b, c, z[rows], ssm_state, slot)

        def step(rows: torch.Tensor, slots: torch.Tensor) -> None:
            window = step_window(conv_state, slots, x[rows])
            xc = causal_conv(self.conv1d, window, 1)[:, 0]  # [B, I]
            dt, b, c = self._selective(xc)
            dt = F.softplus(dt + self.dt_bias.to(dt.dtype))
            a = -torch.exp(self.A_log.float())
            s = ssm_state[slots] * torch.exp(dt.float()[..., None] * a)
            s = s + (dt.float()[..., None] * b.float()[:, None, :]) * xc.float()[..., None]
            ssm_state[slots] = s
            y = torch.matmul(s.to(c.dtype), c[..., None])[..., 0]
            out[rows] = ((y + xc * self.D.to(xc.dtype)) * F.silu(z[rows])).to(out.dtype)

        snapshots.run(fb, self.kv_layer, STATE_KIND, extend, step)
        return self.out_proj(out)

    def _selective(self, xc: torch.Tensor):
        """The time step (one per channel, before its bias), B and C of convolved tokens."""
        d = self.dims
        dt, b, c = self.x_proj(xc.contiguous()).split([d.dt_rank, d.state, d.state], dim=-1)
        if d.bcdt_norms != "none":
            dt, b, c = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        return self.dt_proj(dt.contiguous()), b, c

    def _scan(self, x, dt, b, c, z, ssm_state, slot: int) -> torch.Tensor:
        """The recurrence over the n tokens of one request from its state in ``slot`` (updated):
        (y + D x) * silu(z), [n, I] in the model's dtype."""
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype))
        a = -torch.exp(self.A_log.float())
        decay = torch.exp(dt.float()[..., None] * a)  # [n, I, N]
        push = (dt.float()[..., None] * b.float()[:, None, :]) * x.float()[..., None]
        s = ssm_state[slot]
        ys = []
        for t in range(x.shape[0]):
            s = decay[t] * s + push[t]
            ys.append(torch.matmul(s.to(x.dtype), c[t, :, None])[:, 0])
        ssm_state[slot] = s
        y = torch.stack(ys)  # the model's dtype; the skip and the gate in float32, as HF's scan
        return ((y.float() + x.float() * self.D.float()) * F.silu(z)).to(x.dtype)
