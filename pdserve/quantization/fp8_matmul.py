"""The matmuls of FP8 e4m3 weights with block scales (``fp8_block.py`` loads them).

The matmul (``Fp8BlockLinear``): with pdserve's CPU kernels (handed over by ``use_kernels``,
which ``ModelRunner`` calls after loading), ``linear_fp8`` (``kernels/csrc/fp8_linear.h``) on the
bytes repacked once into 64-output panels, widened to float32 in registers at every ISA tier, each
block's partial sum scaled once, batch invariant; the checkpoint's layout is then dropped, so the
bytes are held once. Without the kernels, a panel of output rows at a time is dequantized into
float32 (each byte's exact value from a table, then ``q * scale``: one rounding, as transformers'
dequantizer computes it) and multiplied in the activations' dtype. MoE experts stored one weight
per expert (``Fp8Experts``) run the same matmul on each expert's slice."""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.quantization.experts import QuantizedExperts
from pdserve.quantization.matmul import NO_ROW_LIMIT, PANEL_ROWS, Panels, QuantizedLinear

_E4M3_TABLES: dict[torch.device, torch.Tensor] = {}


def _widen(q: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 -> float32, exactly: a 256-entry table of every byte's value, looked up with
    ``index_select`` (on one CPU thread 4x faster than PyTorch's elementwise conversion)."""
    table = _E4M3_TABLES.get(q.device)
    if table is None:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
        table = _E4M3_TABLES[q.device] = codes.to(torch.float32).to(q.device)
    codes = q.contiguous().view(torch.uint8).reshape(-1).to(torch.int32)
    return table.index_select(0, codes).view(q.shape)


# the byte order inside a packed line (kernels/csrc/fp8_linear.h): byte p holds output OUT_OF[p]
OUT_OF = torch.tensor(
    [(32 if p & 8 else 0) + 8 * (p >> 4) + (p & 7) for p in range(64)], dtype=torch.long
)
KERNEL_PANEL = 64
# bf16 calls of more rows than this dequantize panels for oneDNN's bf16 GEMM where it runs with
# AVX512-BF16 and pdserve's AMX kernels do not: above about 100 rows that is the faster there
# (docs/benchmarks.md, "FP8 block weights")
KERNEL_MAX_ROWS = 64
# on AMX hosts, bf16 calls from this many rows take the tiles (below, building the B tiles costs
# more than the vector kernel's whole call); batch-invariant serving keeps one kernel for all
AMX_MIN_ROWS = 4


def pack_fp8(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 ``weight`` [N, K] and row scales [N, KB] -> ``linear_fp8``'s panels [ceil(N/64), K, 64]
    (uint8, the line order of ``OUT_OF``) and scales [ceil(N/64), KB, 64] (float32, times 256),
    zero padded."""
    n, k = weight.shape
    pad = -n % KERNEL_PANEL
    w = F.pad(weight.view(torch.uint8), (0, 0, 0, pad)).view(-1, KERNEL_PANEL, k)
    packed = w[:, OUT_OF, :].permute(0, 2, 1).contiguous()
    return packed, pack_scales(scale)


def pack_scales(scale: torch.Tensor) -> torch.Tensor:
    """Row scales [N, KB] -> the kernels' [ceil(N/64), KB, 64] (float32, times 256, output
    order), zero padded."""
    pad = -scale.shape[0] % KERNEL_PANEL
    s = F.pad(scale.to(torch.float32), (0, 0, 0, pad)).view(-1, KERNEL_PANEL, scale.shape[1])
    return (s.permute(0, 2, 1) * 256.0).contiguous()


def unpack_fp8(
    packed: torch.Tensor, scale: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_fp8``'s inverse: the FP8 weight [N, K] and its row scales [N, KB]."""
    w = torch.empty_like(packed)
    w[:, :, OUT_OF] = packed
    weight = w.permute(0, 2, 1).reshape(-1, packed.shape[1])[:n]
    rows = (scale / 256.0).permute(0, 2, 1).reshape(-1, scale.shape[1])[:n]
    return weight.contiguous().view(torch.float8_e4m3fn), rows.contiguous()


class Fp8BlockLinear(QuantizedLinear):
    """``y = x (q * s)^T + b`` for FP8 ``weight`` [N, K] and row scales ``scale`` [N,
    ceil(K/bk)] (a layer's parameters, or one expert's slice of them). After ``use_kernels``:
    ``linear_fp8`` on a packed copy (the arguments are no longer read: the caller drops them).
    Before: ``PANEL_ROWS`` output rows at a time are dequantized into float32 (one rounding) and
    multiplied in ``x``'s dtype."""

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        bias: Optional[torch.Tensor],
        block_k: Optional[int],
    ):
        super().__init__(bias)
        self.out_features, self.in_features = weight.shape
        # None: one scale per output channel, a block of the whole row
        self.weight, self.scale = weight, scale
        self.block_k = block_k or self.in_features
        self.onednn = False
        self.amx_min_rows = -1
        self.packed: Optional[torch.Tensor] = None
        self.packed_scale: Optional[torch.Tensor] = None

    def use_kernels(self, ops: ModuleType, onednn: bool = False, batch_invariant: bool = False):
        """Multiply with ``ops.linear_fp8`` from now on, on the weight packed for it; ``onednn``:
        bf16 calls of more than ``KERNEL_MAX_ROWS`` rows dequantize panels (``ops.fp8_dequantize``)
        for oneDNN's bf16 GEMM instead; ``batch_invariant``: the same kernel at every row count."""
        if self.ops is None:
            self.packed, self.packed_scale = pack_fp8(self.weight, self.scale)
            self.ops, self.weight, self.scale = ops, None, None
        self.onednn = onednn and not batch_invariant
        self.amx_min_rows = -1 if batch_invariant else AMX_MIN_ROWS

    def dequantized(self, start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """Rows ``start:end`` of the weight in float32."""
        weight, scale = self.weight, self.scale
        if self.packed is not None:
            weight, scale = unpack_fp8(self.packed, self.packed_scale, self.out_features)
        w = _widen(weight[start:end])
        s = scale[start:end]
        rows, k = w.shape
        full, rem = divmod(k, self.block_k)
        w[:, : full * self.block_k].view(rows, full, self.block_k).mul_(s[:, :full, None])
        if rem:
            w[:, full * self.block_k :].mul_(s[:, full:])
        return w

    def panels(self) -> Optional[Panels]:
        if self.packed is None:
            return None
        rows = KERNEL_MAX_ROWS if self.onednn else NO_ROW_LIMIT
        return Panels(0, self.packed, self.packed_scale, self.block_k, self.amx_min_rows, rows)

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        if self.onednn and x2.dtype == torch.bfloat16 and x2.shape[0] > KERNEL_MAX_ROWS:
            return self._dequantized_matmul(x2)
        out = x2.new_empty((x2.shape[0], self.out_features))
        self.ops.linear_fp8(
            out,
            x2,
            self.packed,
            self.packed_scale,
            self._bias_in(x2.dtype),
            self.block_k,
            self.amx_min_rows,
        )
        return out

    def _dequantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``PANEL_ROWS`` outputs at a time dequantized in ``x``'s dtype (k-major, as the packed
        panels are: ``x @ w^T`` reads it without a copy), then the BLAS GEMM."""
        n, k = self.out_features, self.in_features
        out = x.new_empty((x.shape[0], n))
        panels = PANEL_ROWS // KERNEL_PANEL
        wt = x.new_empty((k, PANEL_ROWS))
        bias = self._bias_in(x.dtype)
        for start in range(0, n, PANEL_ROWS):
            end = min(n, start + PANEL_ROWS)
            p0 = start // KERNEL_PANEL
            part = wt[:, : end - start]
            self.ops.fp8_dequantize(
                part,
                self.packed[p0 : p0 + panels],
                self.packed_scale[p0 : p0 + panels],
                self.block_k,
            )
            if bias is None:
                out[:, start:end] = x @ part
            else:
                out[:, start:end] = torch.addmm(bias[start:end], x, part)
        return out

    @property
    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.numel() + self.packed_scale.numel() * 4
        return self.weight.numel() * self.weight.element_size() + self.scale.numel() * 4


class Fp8Experts(QuantizedExperts):
    """An MoE layer's experts on FP8 block weights: each expert's two matmuls an
    ``Fp8BlockLinear`` over its slice of ``w13`` / ``w2``."""

    def __init__(self, experts: nn.Module, block_k: Optional[int]):
        super().__init__(experts, lambda w, s, b: Fp8BlockLinear(w, s, b, block_k))
