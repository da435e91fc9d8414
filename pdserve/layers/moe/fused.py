"""One MoE layer's local experts prepacked for pdserve's fused CPU kernel (``kernels/csrc/moe.cpp``).

The kernel runs the whole expert MLP of a layer in one call: (token, slot) pairs grouped by
expert, the gate/up matmul with the activation applied in registers, the down matmul, and the
weighted sum over a token's slots into a float32 output, in bf16 (``vdpbf16ps``) or w8a8_int8
(``vpdpbusd``; the scheme of ``PackedW8A8``). Results are the same whatever the thread count.

Packing (once, at load): every expert's ``w13`` is reordered so that each 64-output panel holds
32 gate rows and the matching 32 up rows (each half zero padded to a multiple of 32), then both
matrices are laid out in the panels of ``pack_panels`` (k pairs for bf16, k quads for int8), all
experts in one 2 MiB-page buffer per matrix. Biases, int8 column sums and scales are float32 /
int32 vectors in the same panel order.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F

from pdserve.hostmem import huge_empty
from pdserve.layers.linear import PANEL

ACTIVATIONS = ("silu", "swiglu_oai")
QUANTIZATIONS = (None, "w8a8_int8")
HALF = PANEL // 2  # gate (and up) rows per panel of w13


def _gate_up_panels(m: torch.Tensor, inter: int) -> torch.Tensor:
    """[2*I, ...] (gate rows then up rows) -> [2*I32, ...]: per 32-row block, its gate rows then its
    up rows, each half zero padded to I32 = ceil(I / 32) * 32."""
    pad = -inter % HALF
    rest = m.shape[1:]
    gate, up = (F.pad(h, (0, 0) * len(rest) + (0, pad)) for h in (m[:inter], m[inter:]))
    blocks = (inter + pad) // HALF
    return torch.stack([gate.reshape(blocks, HALF, *rest), up.reshape(blocks, HALF, *rest)], 1).reshape(-1, *rest)


def _panel_vector(v: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """[N] -> [ceil(N/64) * 64], padded with ``fill``."""
    return F.pad(v, (0, -v.shape[0] % PANEL), value=fill)


def _pack_experts(mats, k_group: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-expert [N, K] matrices -> one [E, ceil(N/64), ceil(K/kg), 4, 16, kg] tensor in 2 MiB
    pages: element [e, np, ks, j, i, g] is mats[e][64 np + 16 j + i, kg ks + g] (zero padded)."""
    mats = list(mats)
    n, k = mats[0].shape
    np_, ks = -(-n // PANEL), -(-k // k_group)
    shape = (len(mats), np_, ks, 4, 16, k_group)
    out = huge_empty(int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()).view(dtype).view(shape)
    for e, w in enumerate(mats):
        w = F.pad(w.to(dtype), (0, ks * k_group - k, 0, np_ * PANEL - n))
        out[e].copy_(w.view(np_, 4, 16, ks, k_group).permute(0, 3, 1, 2, 4))
    return out


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel symmetric int8 (``PackedW8A8``'s rule): (int8 [N, K], float32 scale [N])."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class PackedExperts:
    """One MoE layer's local experts prepacked for the fused CPU kernel.

    ``w13`` [E, 2*I, H] (rows [0, I) the gate projection, [I, 2I) the up projection), ``w2``
    [E, H, I], optional biases ``b13`` [E, 2*I] and ``b2`` [E, H]. Weights and biases are taken in
    bf16 (or quantized to int8 per expert and output channel with ``quantization="w8a8_int8"``).
    ``ops`` is the loaded extension (``pdserve.kernels.load()``; loaded here when None).

    ``self(x, ids, weights)``: x [T, H] bf16, ids [T, K] int32 local expert per (token, slot), -1
    where the expert is not on this rank, weights [T, K] float32; returns the float32 [T, H] sum
    over slots of ``weights[t, k] * expert(x[t])``. Per expert: ``gu = round(x w13^T + b13)``,
    ``a = round(act(gate, up))`` in float32, ``y = round(a w2^T + b2)``, all rounding to bf16."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, b13: Optional[torch.Tensor] = None,
                 b2: Optional[torch.Tensor] = None, activation: str = "silu", alpha: float = 1.702,
                 limit: float = 7.0, ops: Optional[ModuleType] = None, quantization: Optional[str] = None):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: {activation!r} is not supported; supported: {ACTIVATIONS}")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: {quantization!r} is not supported; supported: {QUANTIZATIONS}")
        if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] % 2 or w2.shape[0] != w13.shape[0] \
                or w2.shape[1] != w13.shape[2] or 2 * w2.shape[2] != w13.shape[1]:
            raise ValueError(f"w13 must be [E, 2*I, H] and w2 [E, H, I], got w13 {tuple(w13.shape)}, "
                             f"w2 {tuple(w2.shape)}")
        if ops is None:
            from pdserve import kernels

            ops = kernels.load()
            if ops is None:
                raise RuntimeError(f"PackedExperts needs pdserve's CPU kernels: {kernels.unavailable_reason()}")
        self.ops = ops
        self.num_experts, self.hidden, self.intermediate = w2.shape
        self.activation, self.alpha, self.limit = activation, float(alpha), float(limit)
        self.quantization = quantization
        E, inter = self.num_experts, self.intermediate
        w13_rows = (_gate_up_panels(w13[e].detach(), inter) for e in range(E))
        w2_rows = (w2[e].detach() for e in range(E))
        self.w13_colsum = self.w13_scale = self.w2_colsum = self.w2_scale = None
        if quantization is None:
            self.w13 = _pack_experts((w.to(torch.bfloat16) for w in w13_rows), 2, torch.bfloat16)
            self.w2 = _pack_experts((w.to(torch.bfloat16) for w in w2_rows), 2, torch.bfloat16)
        else:
            self.w13, self.w13_colsum, self.w13_scale = self._pack_int8(w13_rows)
            self.w2, self.w2_colsum, self.w2_scale = self._pack_int8(w2_rows)
        # biases in bf16 like the weights, held as float32 in panel order
        self.b13 = None if b13 is None else torch.stack(
            [_gate_up_panels(b13[e].detach().to(torch.bfloat16).float(), inter) for e in range(E)]).contiguous()
        self.b2 = None if b2 is None else torch.stack(
            [_panel_vector(b2[e].detach().to(torch.bfloat16).float()) for e in range(E)]).contiguous()

    @staticmethod
    def _pack_int8(mats) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int8 panels of every expert, their column sums and scales ([E, N/64 * 64])."""
        colsums, scales = [], []

        def quantized():
            for w in mats:
                wq, scale = _quantize(w)
                colsums.append(_panel_vector(wq.sum(dim=1, dtype=torch.int32)))
                scales.append(_panel_vector(scale, 1.0))
                yield wq

        packed = _pack_experts(quantized(), 4, torch.int8)
        return packed, torch.stack(colsums).contiguous(), torch.stack(scales).contiguous()

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.empty((x.shape[0], self.hidden), dtype=torch.float32)
        x = x.contiguous()
        ids = ids.to(torch.int32).contiguous()
        weights = weights.to(torch.float32).contiguous()
        if self.quantization is None:
            self.ops.moe_experts_bf16(out, x, ids, weights, self.w13, self.w2, self.b13, self.b2,
                                      self.activation, self.alpha, self.limit)
        else:
            self.ops.moe_experts_w8a8(out, x, ids, weights, self.w13, self.w13_colsum, self.w13_scale, self.w2,
                                      self.w2_colsum, self.w2_scale, self.b13, self.b2, self.activation,
                                      self.alpha, self.limit)
        return out

    @property
    def nbytes(self) -> int:
        tensors = (self.w13, self.w2, self.b13, self.b2, self.w13_colsum, self.w13_scale, self.w2_colsum, self.w2_scale)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
