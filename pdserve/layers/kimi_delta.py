"""Kimi Delta Attention (the linear-attention layers of Kimi-Linear): the Gated DeltaNet
(``layers/gated_deltanet.py``) with a decay per key channel instead of one per head.

Per head h (as many key as value heads, ``head_dim`` each), with ``beta = sigmoid(b_proj(x))``
and ``g = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias)``, a vector of ``dk`` log-decays::

    S_t = diag(exp(g_t)) S_{t-1}                            (S: [dk, dv])
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T
    o_t = S_t^T q_t

q, k and v come apart (``q_proj``, ``k_proj``, ``v_proj``) through the same depthwise causal
convolution and SiLU (stored as ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``), q and k
L2-normalised, q scaled by dk^-0.5. The output is normalised per head (RMS over dv, the weight
multiplied in float32) and gated by ``sigmoid(g_b(g_a(x)))`` before ``o_proj``. The state is the
Gated DeltaNet's (``conv`` and ``recurrent`` in a ``StatePool`` slot), so the prefix cache's
snapshots, PD and TP treat it alike; under TP each rank holds whole heads.

What differs from the Gated DeltaNet is its inputs (``KimiDeltaGates.inputs``) and its norm
(``KimiGatedNorm``); the rest is the Gated DeltaNet's, given g as [T, H, dk]: pdserve's CPU
kernels (``gated_delta_scan``, ``gated_delta_decode_step``) take it so, and the torch code runs
blocks of ``CHUNK`` positions with the decays kept per channel. HF's reference is
``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention``.
"""

from __future__ import annotations

import torch
from torch import nn

CHUNK = 16  # positions per torch prefill block: the per-channel decays are [H, L, L, dk]
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


class KimiDeltaGates:
    """The inputs of a KDA layer (mixed in before ``GatedDeltaNet``): its ``dims``, the
    projections ``q_proj``, ``k_proj``, ``v_proj``, ``b_proj``, ``f_a_proj`` / ``f_b_proj``,
    ``g_a_proj`` / ``g_b_proj``, ``dt_bias`` per channel and ``A_log`` per head."""

    def inputs(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        d, t = self.dims, h.shape[0]
        qkv = torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], dim=-1)
        beta = torch.sigmoid(self.b_proj(h)).float()  # [T, H]
        g = self.f_b_proj(self.f_a_proj(h)).float() + self.dt_bias.float()
        softplus = torch.where(  # HF's form, not log1p
            g > SOFTPLUS_LINEAR_ABOVE, g, torch.log(1.0 + torch.exp(g))
        )
        rate = torch.exp(self.A_log.float())[:, None]  # [H, 1]
        g = -rate * softplus.view(t, d.key_heads, d.key_dim)  # [T, H, dk]
        gate = self.g_b_proj(self.g_a_proj(h))
        return qkv, gate, beta, g
