"""Gated DeltaNet mixer (the linear-attention layers of Qwen3-Next), in torch.

Per token: ``in_proj_qkvz`` gives, for each of the G key heads in turn, its query and key (dk
each), and the values and gates z of its r = Hv / G value heads (r * dv each); ``in_proj_ba``
gives, per key head, its value heads' ``b`` then ``a``. The queries, keys and values (in that
order: all queries, all keys, all values) go through a depthwise causal convolution of K taps
(no bias) and SiLU. Then, per value head h with ``beta = sigmoid(b)``,
``g = -exp(A_log) * softplus(a + dt_bias)``, and q and k L2-normalised (q also scaled by
dk^-0.5), each value head reading its key head's q and k (Kimi Delta Attention,
``layers/kimi_delta.py``: g a vector over the dk key channels, each row of S decaying by its
own)::

    S_t = exp(g_t) S_{t-1}                                  (S: [dk, dv])
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T            (the delta rule)
    o_t = S_t^T q_t

``o`` is normalised per head (RMS over dv), scaled, gated by ``silu(z)`` and ``out_proj`` maps it
back. A request's state lives in its slot of the layer's ``StatePool``: ``conv``, the last K - 1
inputs of the convolution ([conv_dim, K - 1] in the model's dtype, segments q | k | v) and
``recurrent``, S of every value head ([Hv, dk, dv], float32).

Prefill runs the chunked form (blocks of ``chunk_size`` positions aligned to absolute positions,
so chunked prefill cuts them where one long forward would): inside a block the delta rule's
updates are one unit-triangular solve and masked matrix products, across blocks a recurrence.
A single new token after a prefix (a decode step) takes the one-step update, batched over the
requests. Both follow HF's ``torch_chunk_gated_delta_rule`` and
``torch_recurrent_gated_delta_rule``.
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
from pdserve.layers.mamba2 import (
    DepthwiseConv,
    causal_conv,
    copy_share,
    cpu_kernel_runs,
    extend_window,
    step_window,
)

STATE_KIND = RecurrentState.kind


@dataclass(frozen=True)
class GatedDeltaNetDims:
    hidden: int
    key_heads: int  # G
    value_heads: int  # Hv
    key_dim: int  # dk
    value_dim: int  # dv
    conv_kernel: int  # K
    eps: float
    chunk_size: int = 64

    @property
    def per_key(self) -> int:  # r: value heads per key head
        return self.value_heads // self.key_heads

    @property
    def keys(self) -> int:  # channels of all queries (and of all keys)
        return self.key_heads * self.key_dim

    @property
    def values(self) -> int:
        return self.value_heads * self.value_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.keys + self.values

    def state_spec(self, conv_dtype: str, ranks: int = 1) -> RecurrentState:
        """The state of one request of a layer of these sizes (one rank's of ``ranks``)."""
        return RecurrentState(
            parts=("conv", "recurrent"),
            shapes=(
                (self.conv_dim, self.conv_kernel - 1),
                (self.value_heads, self.key_dim, self.value_dim),
            ),
            dtypes=(conv_dtype, "float32"),
            segments=((self.keys, self.keys, self.values), ()),
            ranks=ranks,
        )

    def shard(self, ranks: int) -> "GatedDeltaNetDims":
        """One rank's sizes when ``ranks`` ranks split the key heads (each with its value heads)."""
        if self.value_heads % self.key_heads:
            raise ValueError(
                f"linear_num_value_heads: {self.value_heads} is not a multiple of "
                f"linear_num_key_heads {self.key_heads}"
            )
        if self.key_heads % ranks:
            raise ValueError(
                f"tp_size: {ranks} ranks cannot split a Gated DeltaNet layer's {self.key_heads} "
                f"key heads evenly"
            )
        return replace(
            self, key_heads=self.key_heads // ranks, value_heads=self.value_heads // ranks
        )


class GatedHeadRMSNorm(nn.Module):
    """``rmsnorm_per_head(x) * weight * silu(z)``: RMS over each head's dv channels in float32,
    rounded to ``x``'s dtype before the weight, the gate applied in float32 (HF's
    ``Qwen3NextRMSNormGated``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h.to(dtype) * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer; ``kv_layer`` is its index among this stage's layers. Under tensor
    parallelism (``tp``) each rank holds whole key heads with their value heads: its rows of the
    two input projections, its channels of the convolution (of each of q, k and v), its heads'
    ``A_log`` and ``dt_bias``, its columns of ``out_proj`` (summed over the ranks). It reads its
    HF weights itself (``checkpoint_names`` / ``load_checkpoint``)."""

    def __init__(self, dims: GatedDeltaNetDims, kv_layer: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.whole, self.tp, self.kv_layer = dims, tp, kv_layer
        self.dims = d = dims.shard(tp.size)
        self.make_input_projections(d)
        self.conv1d = DepthwiseConv(d.conv_dim, d.conv_kernel, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(d.value_heads))
        self.A_log = nn.Parameter(torch.empty(d.value_heads))
        self.norm = GatedHeadRMSNorm(d.value_dim, d.eps)
        self.out_proj = RowParallelLinear(d.values, d.hidden, bias=False, tp=tp)
        self.ops: Optional[ModuleType] = None  # pdserve's CPU kernels: the decode step's kernel
        # beta = sigmoid(b) * beta_scale: 2 lets the delta rule's eigenvalues go negative
        # (OLMo-Hybrid's ``linear_allow_neg_eigval``)
        self.beta_scale = 1.0

    def state_spec(self, conv_dtype: str) -> RecurrentState:
        return self.dims.state_spec(conv_dtype, self.tp.size)

    # ---- weights -----------------------------------------------------------------------------
    def checkpoint_names(self) -> list[str]:
        return [n for n, p in self.named_parameters()]

    def load_checkpoint(self, name: str, src: Any) -> None:
        params = dict(self.named_parameters())
        if name not in params:
            raise ValueError(f"unexpected Gated DeltaNet weight {name!r}")
        target, name = name, name.replace(".weight_scale_inv", ".weight")  # FP8 scales: as weights
        t = self.rank_part(name, src)
        copy_share(params[target], t, target)

    def rank_part(self, name: str, src: Any) -> torch.Tensor:
        """This rank's part of the layer's checkpoint tensor ``name``."""
        d, r = self.dims, self.tp.rank
        t = self.input_projection_part(name, src)
        if t is not None:
            return t
        if name == "conv1d.weight":  # channels q | k | v of every head: this rank's of each
            return self.qkv_part(src)
        if name in ("dt_bias", "A_log"):
            return src[r * d.value_heads : (r + 1) * d.value_heads]
        if name == "norm.weight":  # one head's: shared by every head
            return src[:]
        return src[:, r * d.values : (r + 1) * d.values]  # out_proj: its value heads' columns

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        d = self.dims
        pool, index, _ = fb.state(self.kv_layer, STATE_KIND)
        conv_state, rec_state = pool.state("conv", index), pool.state("recurrent", index)
        t = h.shape[0]
        qkv, z, beta, g = self.inputs(h)
        out = torch.empty((t, d.value_heads, d.value_dim), dtype=h.dtype, device=h.device)

        def extend(rows: slice, position: int, slot: int) -> None:
            out[rows] = self._extend(
                qkv[rows], g[rows], beta[rows], position, conv_state, rec_state, slot
            )

        def step(rows: torch.Tensor, slots: torch.Tensor) -> None:
            out[rows] = self._step(qkv[rows], g[rows], beta[rows], conv_state, rec_state, slots)

        snapshots.run(fb, self.kv_layer, STATE_KIND, extend, step)
        o = self.norm(out, z.reshape(t, d.value_heads, d.value_dim))
        return self.out_proj(o.reshape(t, d.values))

    def inputs(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(qkv [T, conv_dim] as the convolution takes it, the output gate [T, values], beta
        [T, Hv] and g, the log of the decay: [T, Hv], or [T, Hv, dk] for a decay per key channel;
        beta and g float32)."""
        qkv, z, b, a = self.project(h)
        beta = (torch.sigmoid(b) * self.beta_scale).float()  # the product in b's dtype
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        return qkv, z, beta, g

    # ---- the input projections (Qwen3-Next's layout; ``SplitGatedDeltaNet`` has Qwen3.5's) ----
    def make_input_projections(self, d: GatedDeltaNetDims) -> None:
        self.in_proj_qkvz = Linear(d.hidden, 2 * d.keys + 2 * d.values, bias=False)
        self.in_proj_ba = Linear(d.hidden, 2 * d.value_heads, bias=False)

    def input_projection_part(self, name: str, src: Any) -> Optional[torch.Tensor]:
        """This rank's rows of an input projection's weight (``name``); None for other names."""
        w, d, r = self.whole, self.dims, self.tp.rank
        if name == "in_proj_qkvz.weight":  # rows grouped by key head: take this rank's groups
            per = 2 * w.key_dim + 2 * w.per_key * w.value_dim
        elif name == "in_proj_ba.weight":
            per = 2 * w.per_key
        else:
            return None
        return src[r * d.key_heads * per : (r + 1) * d.key_heads * per]

    def qkv_part(self, src: Any) -> torch.Tensor:
        """This rank's rows of a tensor over the channels q | k | v of every head."""
        w, d, r = self.whole, self.dims, self.tp.rank
        return torch.cat(
            [
                src[r * d.keys : (r + 1) * d.keys],
                src[w.keys + r * d.keys : w.keys + (r + 1) * d.keys],
                src[2 * w.keys + r * d.values : 2 * w.keys + (r + 1) * d.values],
            ]
        )

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(qkv [T, conv_dim] as the convolution takes it, z [T, values], b and a [T, Hv])."""
        d, t = self.dims, h.shape[0]
        qkvz = self.in_proj_qkvz(h).view(t, d.key_heads, -1)
        vz = d.per_key * d.value_dim
        q, k, v, z = qkvz.split([d.key_dim, d.key_dim, vz, vz], dim=-1)
        ba = self.in_proj_ba(h).view(t, d.key_heads, 2 * d.per_key)
        b, a = ba[..., : d.per_key].reshape(t, -1), ba[..., d.per_key :].reshape(t, -1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return qkv, z, b, a

    # ---- the pieces --------------------------------------------------------------------------
    def _qkv(self, conv_out: torch.Tensor):
        """q and k [.., Hv, dk] (each value head its key head's; L2-normalised, q scaled) and v
        [.., Hv, dv], float32, from the convolved channels [.., conv_dim]."""
        d = self.dims
        lead = conv_out.shape[:-1]
        q, k, v = conv_out.float().split([d.keys, d.keys, d.values], dim=-1)
        q = q.reshape(*lead, d.key_heads, d.key_dim).repeat_interleave(d.per_key, dim=-2)
        k = k.reshape(*lead, d.key_heads, d.key_dim).repeat_interleave(d.per_key, dim=-2)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * d.key_dim**-0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        return q, k, v.reshape(*lead, d.value_heads, d.value_dim)

    def _extend(self, qkv, g, beta, prefix, conv_state, rec_state, slot) -> torch.Tensor:
        """``n`` new tokens of one request after ``prefix`` tokens, from its state (zeros for an
        empty prefix), which it updates. Returns o [n, Hv, dv] in the model's dtype. With
        pdserve's CPU kernels, one kernel convolves, normalises and runs the delta rule token by
        token instead of in blocks (faster on CPU at every length measured)."""
        d, n = self.dims, qkv.shape[0]
        if cpu_kernel_runs(self.ops, qkv, conv_state):
            if not prefix:
                conv_state[slot].zero_()
                rec_state[slot].zero_()
            o = torch.empty((n, d.value_heads, d.value_dim), dtype=torch.float32)
            states = (conv_state, rec_state, slot, self.conv1d.weight, d.key_heads)
            self.ops.gated_delta_scan(o, qkv, g.contiguous(), beta.contiguous(), *states)
            return o.to(qkv.dtype)
        window = extend_window(conv_state, slot, qkv, prefix)  # [C, K - 1 + n]
        q, k, v = self._qkv(causal_conv(self.conv1d, window[None], n)[0])
        # heads first: [Hv, n, ..]
        q, k, v, g = (x.transpose(0, 1) for x in (q, k, v, g))
        beta = beta.t()
        s = rec_state[slot] if prefix else torch.zeros_like(rec_state[slot])  # [Hv, dk, dv]
        o = torch.empty_like(v)
        block = _delta_block if g.dim() == 2 else _channel_delta_block
        lo = 0
        while lo < n:  # blocks aligned to absolute positions
            hi = min(n, lo + d.chunk_size - (prefix + lo) % d.chunk_size)
            o[:, lo:hi], s = block(
                q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], s
            )
            lo = hi
        rec_state[slot] = s
        return o.transpose(0, 1).to(qkv.dtype)

    def _step(self, qkv, g, beta, conv_state, rec_state, slots) -> torch.Tensor:
        """One new token of each of several requests (decode): o [B, Hv, dv], model dtype. With
        pdserve's CPU kernels, one kernel updates the states in place at ``slots`` (the torch code
        below is its reference)."""
        if cpu_kernel_runs(self.ops, qkv, conv_state):
            d = self.dims
            out = torch.empty((qkv.shape[0], d.value_heads, d.value_dim), dtype=qkv.dtype)
            self.ops.gated_delta_decode_step(
                out, qkv, g, beta, conv_state, rec_state, slots, self.conv1d.weight, d.key_heads
            )
            return out
        window = step_window(conv_state, slots, qkv)
        q, k, v = self._qkv(causal_conv(self.conv1d, window, 1)[:, 0])  # [B, Hv, ..]
        decay = torch.exp(g)  # per head [B, Hv] (or per key channel [B, Hv, dk]: S's rows)
        s = rec_state[slots] * (decay[..., None] if g.dim() == 3 else decay[..., None, None])
        delta = (v - torch.einsum("bhkv,bhk->bhv", s, k)) * beta[..., None]
        s = s + k[..., None] * delta[..., None, :]
        rec_state[slots] = s
        return torch.einsum("bhkv,bhk->bhv", s, q).to(qkv.dtype)


def _delta_block(q, k, v, g, beta, s) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one block of L positions from state ``s`` [H, dk, dv]: q and k
    [H, L, dk], v [H, L, dv], g and beta [H, L], all float32. Returns (o [H, L, dv], the state
    after the block). The L updates in WY form: with A the strictly lower part of
    ``(beta k) k^T`` weighted by the decays between positions, (I + A) u = beta v and
    (I + A) w = beta k exp(cum g) give the corrections u - w S the state takes."""
    L = q.shape[1]
    cum = torch.cumsum(g, dim=1)  # [H, L]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp((cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, -torch.inf))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = (k_beta @ k.transpose(1, 2)) * decay  # its diagonal is taken as 1 below
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * torch.exp(cum)[..., None], upper=False, unitriangular=True
    )
    v_new = u - w @ s  # [H, L, dv]
    attn = (q @ k.transpose(1, 2)) * decay  # [H, L, L]
    o = (q * torch.exp(cum)[..., None]) @ s + attn @ v_new
    last = cum[:, -1:]  # [H, 1]
    s = (
        s * torch.exp(last)[..., None]
        + (k * torch.exp(last - cum)[..., None]).transpose(1, 2) @ v_new
    )
    return o, s


def _channel_delta_block(q, k, v, g, beta, s) -> tuple[torch.Tensor, torch.Tensor]:
    """``_delta_block`` with a decay per key channel (Kimi Delta Attention's): g [H, L, dk]. The
    decay between positions i >= j, ``exp(cum_i - cum_j)``, is then a vector over the channels
    inside each product ([H, L, L, dk]: the channels' decays do not factor out of the block's
    products), so blocks of such a layer are kept short (``kimi_delta.CHUNK``)."""
    L = q.shape[1]
    cum = torch.cumsum(g, dim=1)  # [H, L, dk]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    diff = (cum[:, :, None, :] - cum[:, None, :, :]).masked_fill(~causal[..., None], -torch.inf)
    decay = torch.exp(diff)  # [H, L, L, dk]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = torch.einsum("hic,hjc,hijc->hij", k_beta, k, decay)  # diagonal taken as 1
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * torch.exp(cum), upper=False, unitriangular=True
    )
    v_new = u - w @ s  # [H, L, dv]
    attn = torch.einsum("hic,hjc,hijc->hij", q, k, decay)
    o = (q * torch.exp(cum)) @ s + attn @ v_new
    last = cum[:, -1:, :]  # [H, 1, dk]
    s = s * torch.exp(last).transpose(1, 2) + (k * torch.exp(last - cum)).transpose(1, 2) @ v_new
    return o, s
