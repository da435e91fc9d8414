"""Kimi Delta Attention (the linear-attention layers of Kimi-Linear), in torch.

The Gated DeltaNet's delta rule (``layers/gated_deltanet.py``) with a decay per key channel
instead of one per head: per head h (as many key as value heads, ``head_dim`` each), with
``beta = sigmoid(b_proj(x))`` and ``g = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias)``, a
vector of ``dk`` log-decays::

    S_t = diag(exp(g_t)) S_{t-1}                            (S: [dk, dv])
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T
    o_t = S_t^T q_t

q, k and v come apart (``q_proj``, ``k_proj``, ``v_proj``) through the same depthwise causal
convolution and SiLU (stored as ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``), q and k
L2-normalised, q scaled by dk^-0.5. The output is normalised per head (RMS over dv, the weight
multiplied in float32) and gated by ``sigmoid(g_b(g_a(x)))`` before ``o_proj``. The state is the
Gated DeltaNet's (``conv`` and ``recurrent`` in a ``StatePool`` slot), so the prefix cache's
snapshots, PD and TP treat it alike; under TP each rank holds whole heads (their rows of q, k, v,
``f_b_proj``, ``g_b_proj``, ``b_proj``, ``dt_bias`` and ``A_log``; ``f_a_proj`` and ``g_a_proj``
whole).

With pdserve's CPU kernels, prefill and decode run the Gated DeltaNet's kernels
(``gated_delta_scan``, ``gated_delta_decode_step``) given a decay per key channel ([.., H, dk]
instead of [.., H]). The torch code they replace, and which runs elsewhere: prefill in blocks of
``CHUNK`` positions aligned to absolute positions as the Gated DeltaNet does, the decays between
two positions of a block kept per channel ([H, L, L, dk]: the channels' decays do not factor out
of the block's products); a decode step the one-step update. HF's reference is
``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention``.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.forward_batch import ForwardBatch
from pdserve.layers import state_snapshots as snapshots
from pdserve.layers.gated_deltanet import STATE_KIND
from pdserve.layers.mamba2 import causal_conv, cpu_kernel_runs, extend_window, step_window

CHUNK = 16  # positions per prefill block: the per-channel decays are [H, L, L, dk]
SOFTPLUS_LINEAR_ABOVE = 20.0  # HF's softplus returns its input above this


class KimiGatedNorm(nn.Module):
    """``rmsnorm_per_head(x) * weight * sigmoid(gate)``, all in float32, rounded once to ``x``'s
    dtype (HF's ``KimiLinearRMSNormGated``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaRule:
    """The KDA forward over a Gated DeltaNet's parts (mixed in before ``GatedDeltaNet``): its
    ``dims``, ``conv1d``, ``_qkv``, ``out_proj`` and state, with the projections ``q_proj``,
    ``k_proj``, ``v_proj``, ``b_proj``, ``f_a_proj`` / ``f_b_proj``, ``g_a_proj`` / ``g_b_proj``,
    ``dt_bias`` per channel, ``A_log`` per head and a ``KimiGatedNorm`` as ``norm``."""

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        d, t = self.dims, h.shape[0]
        pool, index, _ = fb.state(self.kv_layer, STATE_KIND)
        conv_state, rec_state = pool.state("conv", index), pool.state("recurrent", index)
        qkv = torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], dim=-1)
        beta = torch.sigmoid(self.b_proj(h)).float()  # [T, H]
        g = self.f_b_proj(self.f_a_proj(h)).float() + self.dt_bias.float()
        softplus = torch.where(
            g > SOFTPLUS_LINEAR_ABOVE, g, torch.log(1.0 + torch.exp(g))
        )  # HF's form, not log1p
        rate = torch.exp(self.A_log.float())[:, None]  # [H, 1]
        g = -rate * softplus.view(t, d.key_heads, d.key_dim)  # [T, H, dk]
        out = torch.empty((t, d.value_heads, d.value_dim), dtype=h.dtype, device=h.device)

        def extend(rows: slice, position: int, slot: int) -> None:
            out[rows] = self._kda_extend(
                qkv[rows], g[rows], beta[rows], position, conv_state, rec_state, slot
            )

        def step(rows: torch.Tensor, slots: torch.Tensor) -> None:
            out[rows] = self._kda_step(qkv[rows], g[rows], beta[rows], conv_state, rec_state, slots)

        snapshots.run(fb, self.kv_layer, STATE_KIND, extend, step)
        gate = self.g_b_proj(self.g_a_proj(h)).view(t, d.value_heads, d.value_dim)
        o = self.norm(out, gate)
        return self.out_proj(o.reshape(t, d.values))

    def _kda_extend(self, qkv, g, beta, prefix, conv_state, rec_state, slot) -> torch.Tensor:
        """``n`` new tokens of one request after ``prefix`` tokens: o [n, H, dv] (model dtype);
        the request's state slot updated."""
        d, n = self.dims, qkv.shape[0]
        if cpu_kernel_runs(self.ops, qkv, conv_state):  # the recurrence token by token
            if not prefix:
                conv_state[slot].zero_()
                rec_state[slot].zero_()
            o = torch.empty((n, d.value_heads, d.value_dim), dtype=torch.float32)
            states = (conv_state, rec_state, slot, self.conv1d.weight, d.key_heads)
            self.ops.gated_delta_scan(o, qkv, g.contiguous(), beta.contiguous(), *states)
            return o.to(qkv.dtype)
        window = extend_window(conv_state, slot, qkv, prefix)  # [C, K - 1 + n]
        q, k, v = self._qkv(causal_conv(self.conv1d, window[None], n)[0])
        q, k, v, g = (x.transpose(0, 1) for x in (q, k, v, g))  # heads first
        beta = beta.t()
        s = rec_state[slot] if prefix else torch.zeros_like(rec_state[slot])  # [H, dk, dv]
        o = torch.empty_like(v)
        lo = 0
        while lo < n:  # blocks aligned to absolute positions
            hi = min(n, lo + CHUNK - (prefix + lo) % CHUNK)
            o[:, lo:hi], s = _kda_block(
                q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], s
            )
            lo = hi
        rec_state[slot] = s
        return o.transpose(0, 1).to(qkv.dtype)

    def _kda_step(self, qkv, g, beta, conv_state, rec_state, slots) -> torch.Tensor:
        """One new token of each of several requests: o [B, H, dv] (model dtype)."""
        if cpu_kernel_runs(self.ops, qkv, conv_state):
            d = self.dims
            out = torch.empty((qkv.shape[0], d.value_heads, d.value_dim), dtype=qkv.dtype)
            self.ops.gated_delta_decode_step(
                out, qkv, g.contiguous(), beta, conv_state, rec_state, slots, self.conv1d.weight,
                d.key_heads,
            )  # fmt: skip
            return out
        window = step_window(conv_state, slots, qkv)
        q, k, v = self._qkv(causal_conv(self.conv1d, window, 1)[:, 0])  # [B, H, ..]
        s = rec_state[slots] * torch.exp(g)[..., None]  # [B, H, dk, dv]: rows decay apart
        delta = (v - torch.einsum("bhkv,bhk->bhv", s, k)) * beta[..., None]
        s = s + k[..., None] * delta[..., None, :]
        rec_state[slots] = s
        return torch.einsum("bhkv,bhk->bhv", s, q).to(qkv.dtype)


def _kda_block(q, k, v, g, beta, s) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule with per-channel decays over one block of L positions from state ``s``
    [H, dk, dv]: q, k and g [H, L, dk], v [H, L, dv], beta [H, L], float32. Returns (o [H, L,
    dv], the state after the block). As ``gated_deltanet._delta_block`` with the decay between
    positions i >= j, ``exp(cum_i - cum_j)``, a vector over the channels inside each product."""
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
