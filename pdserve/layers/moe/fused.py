"""One MoE layer's local experts prepacked for pdserve's fused CPU kernel
(``kernels/csrc/moe.cpp``).

The kernel runs the whole expert MLP of a layer in one call: (token, slot) pairs grouped by
expert, the gate/up matmul with the activation applied in registers, the down matmul, and the
weighted sum over a token's slots into a float32 output, in bf16 (``vdpbf16ps``) or w8a8_int8
(``vpdpbusd``; the scheme of ``PackedW8A8``). Results are the same whatever the thread count.

Packing (once, at load, by the extension: a strided torch copy of 4-byte lanes runs at well under
1 GB/s): every expert's ``w13`` is reordered so that each 64-output panel holds 32 gate rows and
the matching 32 up rows (each half zero padded to a multiple of 32), then both matrices are laid
out in the panels of ``pack_panels`` (k pairs for bf16, k quads for int8), all experts in one
2 MiB-page buffer per matrix. Biases, int8 column sums and scales are float32 / int32 vectors in
the same panel order.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from pdserve.hostmem import huge_empty
from pdserve.layers.linear import PANEL

ACTIVATIONS = ("silu", "swiglu_oai")
QUANTIZATIONS = (None, "w8a8_int8")
HALF = PANEL // 2  # gate (and up) rows per panel of w13


def _panel_rows(n: int, inter: Optional[int] = None) -> torch.Tensor:
    """The source row of each packed output row (-1: zero padding), [ceil(n/64) * 64] int32. For
    w13 (``inter`` given): per 32-row block, its gate rows then the matching up rows, each half
    padded to I32 = ceil(I / 32) * 32."""
    if inter is None:
        rows = torch.arange(-(-n // PANEL) * PANEL)
        return torch.where(rows < n, rows, -1).to(torch.int32)
    j = torch.arange(-(-inter // HALF) * HALF)
    gate, up = torch.where(j < inter, j, -1), torch.where(j < inter, j + inter, -1)
    return torch.stack([gate.view(-1, HALF), up.view(-1, HALF)], 1).reshape(-1).to(torch.int32)


def _in_panel_order(v: torch.Tensor, rows: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """[E, N] per-output values -> [E, len(rows)] in packed row order, ``fill`` where rows is -1."""
    picked = v[:, rows.clamp(min=0).long()]
    return torch.where(rows >= 0, picked, torch.full_like(picked, fill)).contiguous()


def _pack_experts(
    ops: ModuleType, w: torch.Tensor, rows: torch.Tensor, k_group: int
) -> torch.Tensor:
    """[E, N, K] -> [E, len(rows)/64, ceil(K/kg), 4, 16, kg] in 2 MiB pages: element
    [e, np, ks, j, i, g] is w[e, rows[64 np + 16 j + i], kg ks + g] (zero where rows is -1 or past
    K)."""
    E, _, k = w.shape
    shape = (E, rows.numel() // PANEL, -(-k // k_group), 4, 16, k_group)
    out = huge_empty(int(torch.Size(shape).numel()) * w.element_size()).view(w.dtype).view(shape)
    ops.moe_pack_experts(out, w.contiguous(), rows)
    return out


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel symmetric int8 (``PackedW8A8``'s rule) of [E, N, K], expert by expert:
    (int8 [E, N, K], float32 scale [E, N])."""
    wq = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(w.shape[:2])
    for e in range(w.shape[0]):
        we = w[e].float()
        scale[e] = we.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        wq[e] = torch.round(we / scale[e][:, None]).clamp(-127, 127).to(torch.int8)
    return wq, scale


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

    def __init__(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        b13: Optional[torch.Tensor] = None,
        b2: Optional[torch.Tensor] = None,
        activation: str = "silu",
        alpha: float = 1.702,
        limit: float = 7.0,
        ops: Optional[ModuleType] = None,
        quantization: Optional[str] = None,
    ):
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"activation: {activation!r} is not supported; supported: {ACTIVATIONS}"
            )
        if quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization: {quantization!r} is not supported; supported: {QUANTIZATIONS}"
            )
        if (
            w13.dim() != 3
            or w2.dim() != 3
            or w13.shape[1] % 2
            or w2.shape[0] != w13.shape[0]
            or w2.shape[1] != w13.shape[2]
            or 2 * w2.shape[2] != w13.shape[1]
        ):
            raise ValueError(
                f"w13 must be [E, 2*I, H] and w2 [E, H, I], got w13 {tuple(w13.shape)}, "
                f"w2 {tuple(w2.shape)}"
            )
        if ops is None:
            from pdserve import kernels

            ops = kernels.load()
            if ops is None:
                raise RuntimeError(
                    f"PackedExperts needs pdserve's CPU kernels: {kernels.unavailable_reason()}"
                )
        self.ops = ops
        self.num_experts, self.hidden, self.intermediate = w2.shape
        self.activation, self.alpha, self.limit = activation, float(alpha), float(limit)
        self.quantization = quantization
        rows13, rows2 = (
            _panel_rows(2 * self.intermediate, self.intermediate),
            _panel_rows(self.hidden),
        )
        self.w13_colsum = self.w13_scale = self.w2_colsum = self.w2_scale = None
        if quantization is None:
            self.w13 = _pack_experts(ops, w13.detach().to(torch.bfloat16), rows13, 2)
            self.w2 = _pack_experts(ops, w2.detach().to(torch.bfloat16), rows2, 2)
        else:
            self.w13, self.w13_colsum, self.w13_scale = self._pack_int8(ops, w13.detach(), rows13)
            self.w2, self.w2_colsum, self.w2_scale = self._pack_int8(ops, w2.detach(), rows2)
        # biases in bf16 like the weights, held as float32 in panel order
        self.b13 = (
            None
            if b13 is None
            else _in_panel_order(b13.detach().to(torch.bfloat16).float(), rows13)
        )
        self.b2 = (
            None if b2 is None else _in_panel_order(b2.detach().to(torch.bfloat16).float(), rows2)
        )

    @staticmethod
    def _pack_int8(ops: ModuleType, w: torch.Tensor, rows: torch.Tensor):
        """int8 panels of every expert, their column sums and scales ([E, N/64 * 64])."""
        wq, scale = _quantize(w)
        colsum = _in_panel_order(wq.sum(dim=2, dtype=torch.int32), rows)
        return _pack_experts(ops, wq, rows, 4), colsum, _in_panel_order(scale, rows, 1.0)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.empty((x.shape[0], self.hidden), dtype=torch.float32)
        x = x.contiguous()
        ids = ids.to(torch.int32).contiguous()
        weights = weights.to(torch.float32).contiguous()
        if self.quantization is None:
            self.ops.moe_experts_bf16(
                out,
                x,
                ids,
                weights,
                self.w13,
                self.w2,
                self.b13,
                self.b2,
                self.activation,
                self.alpha,
                self.limit,
            )
        else:
            self.ops.moe_experts_w8a8(
                out,
                x,
                ids,
                weights,
                self.w13,
                self.w13_colsum,
                self.w13_scale,
                self.w2,
                self.w2_colsum,
                self.w2_scale,
                self.b13,
                self.b2,
                self.activation,
                self.alpha,
                self.limit,
            )
        return out

    @property
    def nbytes(self) -> int:
        tensors = (
            self.w13,
            self.w2,
            self.b13,
            self.b2,
            self.w13_colsum,
            self.w13_scale,
            self.w2_colsum,
            self.w2_scale,
        )
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
