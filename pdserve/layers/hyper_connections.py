"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual is ``hc_mult`` streams
[T, N, D]; before each block a projection of the normalised streams gives the collapse weights
(``pre``), the expansion weights (``post``) and a doubly stochastic mixing matrix (``comb``,
Sinkhorn-Knopp); after it the streams become ``post * out + comb^T streams`` (``mix``);
``HyperHead`` collapses them before the final norm. Float32 throughout, as HF computes them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def hyper_weights(config, fn, base, scale, streams: torch.Tensor):
    """The mHC weights of one block from the ``hc_mult`` streams [T, N, D]: (post [T, N], comb
    [T, N, N], the collapsed block input [T, D]); float32 throughout, as HF computes them."""
    n, eps = config.hc_mult, config.hc_eps
    flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), config.rms_norm_eps)
    mixed = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(config.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def mix(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
    """The streams after a block: ``post * out + comb^T streams`` (in the streams' dtype)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


class HyperHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        n = config.hc_mult
        self.n, self.eps, self.norm_eps = n, config.hc_eps, config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * config.hidden_size))
        self.hc_base = nn.Parameter(torch.empty(n))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
