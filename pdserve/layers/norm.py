"""RMSNorm as Llama, Gemma and GPT-OSS round it, optionally fused with the residual add that
precedes it in a pre-norm block."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``; the statistics are taken in float32 and the result is
    cast back to the input dtype before the weight multiplies it (bit-compatible with HF).

    With ``ops`` (pdserve's CPU kernels) it runs as one kernel, the residual add included, with
    the same rounding steps."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops: Optional[ModuleType] = None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: ``norm(x)``. With it: ``x + residual`` becomes the new residual
        stream and ``(norm(x + residual), x + residual)`` is returned (the kernel path updates
        ``residual`` in place)."""
        if self.ops is not None and residual is None and x.dim() > 2:  # per-head norms (Qwen3 q/k)
            rows = x.reshape(-1, x.shape[-1])
            out = torch.empty_like(rows)
            self.ops.rms_norm(out, rows, None, self.weight, self.eps)
            return out.view(x.shape)
        if self.ops is not None and x.dim() == 2 and x.stride(1) == 1:
            out = torch.empty_like(x)
            self.ops.rms_norm(out, x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class AddNorm(nn.Module):
    """A norm (``_norm``) that may take the residual add before it, in torch: with ``residual``,
    ``x + residual`` (in the activation dtype, as HF's decoder layers add) becomes the new stream
    and ``(norm(x + residual), x + residual)`` is returned."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(AddNorm):
    """Gemma's RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``, all in float32 and rounded to
    the input dtype once at the end (Llama rounds before the weight multiplies; HF Gemma after).
    The checkpoint stores the weight as an offset from 1 (HF initialises it to zeros). There is no
    kernel path: the CPU kernel rounds the Llama way."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GptOssRMSNorm(AddNorm):
    """GPT-OSS's RMSNorm: ``weight * x / sqrt(mean(x^2) + eps)`` with the weight's product taken in
    float32 and one rounding to the input dtype at the end (HF: ``(weight * x).to(dtype)``;
    Llama rounds before the weight multiplies). The weight may be held in any float dtype (HF
    keeps it in float32; a bf16 checkpoint's values are exact in either). No kernel path: the CPU
    kernel rounds the Llama way."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


class Gemma4RMSNorm(AddNorm):
    """Gemma 4's RMSNorm: ``x * (mean(x^2) + eps) ** -0.5 * weight`` in float32, rounded once to the
    input dtype (the weight as it is, not Gemma 2/3's offset from 1). ``scale=False``: no weight
    (the values' norm, the router's input norm). No kernel path."""

    def __init__(self, dim: int, eps: float = 1e-6, scale: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (xf if self.weight is None else xf * self.weight.float()).to(x.dtype)


class UnitRMSNorm(AddNorm):
    """RMSNorm without a weight: ``x * rsqrt(mean(x^2) + eps)`` in float32, rounded once to the
    input dtype (Llama 4's q/k norm). ``dim`` is taken for the norms' common signature."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole q or k projection (every head together: OLMo 2, OLMoE, MiniMax-M2)
    where a rank holds only its heads' part: the sum of squares is summed over the attention
    ranks ``tp`` and divided by ``tp.size`` times the local width, which is the projection's width
    when the heads are split and counts each replicated KV head as often as it is held. The
    weight is this rank's part. ``late_rounding``: the weight multiplies in float32 and the result
    is rounded once (OLMo 2); otherwise rounded first, as Llama does (OLMoE)."""

    def __init__(self, dim: int, eps: float, tp, late_rounding: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.tp = tp
        self.late_rounding = late_rounding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.tp.size == 1:
            variance = xf.pow(2).mean(-1, keepdim=True)
        else:
            squares = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True))
            variance = squares / (self.tp.size * x.shape[-1])
        xf = xf * torch.rsqrt(variance + self.eps)
        if self.late_rounding:
            return (self.weight.float() * xf).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class LayerNorm(AddNorm):
    """``nn.LayerNorm``: ``weight * (x - mean) / sqrt(var + eps) + bias`` as ATen computes it
    (StableLM, StarCoder 2). No kernel path."""

    eps_field = "layer_norm_eps"

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class HeadLayerNorms(nn.Module):
    """A LayerNorm without bias per head, each with its own weight (StableLM's q/k norms:
    ``norms.{h}.weight``), over this rank's heads ``heads`` [start, end) of x [T, heads, D]. It
    reads its HF weights itself, the other ranks' heads' passed over."""

    def __init__(self, heads: tuple[int, int], dim: int, eps: float):
        super().__init__()
        self.heads = heads
        self.weight = nn.Parameter(torch.ones(heads[1] - heads[0], dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in float32, rounded once, as ATen's LayerNorm rounds with its weight inside
        y = F.layer_norm(x.float(), x.shape[-1:], None, None, self.eps) * self.weight.float()
        return y.to(x.dtype)

    def checkpoint_names(self) -> list[str]:
        return [f"norms.{h}.weight" for h in range(*self.heads)]

    def load_checkpoint(self, name: str, src: Any) -> None:
        parts = name.split(".")
        if len(parts) != 3 or parts[0] != "norms" or not parts[1].isdigit():
            raise ValueError(f"unexpected per-head norm weight {name!r}")
        h = int(parts[1])
        if self.heads[0] <= h < self.heads[1]:  # another rank's head: that rank's to load
            self.weight.data[h - self.heads[0]].copy_(src[:])


class CohereLayerNorm(AddNorm):
    """Cohere's LayerNorm: ``weight * (x - mean) / sqrt(var + eps)`` with no bias, all in float32
    and rounded once to the input dtype. No kernel path."""

    eps_field = "layer_norm_eps"  # the config field of its epsilon (``models/llama.norm_eps``)

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        centred = xf - xf.mean(-1, keepdim=True)
        xf = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)
