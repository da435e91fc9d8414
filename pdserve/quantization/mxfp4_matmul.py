"""The matmuls of MXFP4 weights (``mxfp4.py`` loads them): e2m1 codes, two per byte (the even k in
the low nibble), and one E8M0 scale byte ``e`` per 32 values of a row, the value being
``E2M1[code] * 2^(e - 127)``.

``Mxfp4Linear``: with pdserve's CPU kernels, ``linear_mxfp4`` (``kernels/csrc/fp8_linear.h``) on
the codes repacked once into 64-output panels of half the FP8 kernel's bytes, each code looked up
as its value in registers and run through the FP8 kernels' sums (every tier, AMX included, batch
invariant); the scales stay bytes. With ``int8_activations`` (``--mxfp4-int8-activations``,
opt-in) ``linear_mxfp4_w4a8`` instead: each row of x quantized to int8 as ``w8a8_int8`` does, the
codes (twice an e2m1 value is an integer) times those int8 values summed exactly in integer dot
products, a float32 scale ``2^(e - 127) / 2`` per group (the codes in ``int4_matmul.pack_w4a8``'s
quads). Without the kernels, a panel of output rows at a time is dequantized (exact in float32)
and multiplied in the activations' dtype. ``Mxfp4Experts``: an MoE layer's experts, each expert's
two matmuls an ``Mxfp4Linear`` over its slice."""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.quantization.experts import QuantizedExperts
from pdserve.quantization.fp8_matmul import AMX_MIN_ROWS, KERNEL_PANEL
from pdserve.quantization.matmul import CODES_MXFP4_A8, Panels, QuantizedLinear

GROUP = 32  # values per scale
# the e2m1 value of each code (sign in bit 3)
E2M1 = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)
# the largest scale byte the kernels represent (2^(e - 127) times 256 a finite float32)
MAX_SCALE_BYTE = 246


def codes(blocks: torch.Tensor) -> torch.Tensor:
    """Packed bytes [..., K/2] -> the codes [..., K] (low nibble first)."""
    b = blocks.to(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Weight [N, K/2] packed bytes and scale bytes [N, K/32] -> float32 [N, K], exactly (as
    transformers' MXFP4 dequantizer: ``ldexp(E2M1[code], e - 127)``)."""
    c = codes(blocks)
    n, k = c.shape
    values = E2M1.index_select(0, c.reshape(-1).to(torch.int64)).view(n, k // GROUP, GROUP)
    exp = scales.to(torch.int32) - 127
    return torch.ldexp(values, exp[..., None].to(torch.float32)).view(n, k)


def pack_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Row-major packed bytes [N, K/2] (two 4-bit codes a byte, the even k low) -> the 4-bit
    kernels' panels [ceil(N/64), K, 32] (byte j of a line: the code of output j low, of output
    j + 32 high), padded with zero codes."""
    pad = -blocks.shape[0] % KERNEL_PANEL
    c = F.pad(codes(blocks), (0, 0, 0, pad)).view(-1, KERNEL_PANEL, blocks.shape[1] * 2)
    line = c.permute(0, 2, 1)  # [NP, K, 64] codes in output order
    return (line[..., :32] | (line[..., 32:] << 4)).contiguous()


def pack_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major packed bytes [N, K/2] and scale bytes [N, K/32] -> ``linear_mxfp4``'s panels
    (``pack_codes``) and scales [ceil(N/64), K/32, 64] (uint8, output order), padded with zero
    codes and scales."""
    pad = -blocks.shape[0] % KERNEL_PANEL
    s = F.pad(scales.to(torch.uint8), (0, 0, 0, pad)).view(-1, KERNEL_PANEL, scales.shape[1])
    return pack_codes(blocks), s.permute(0, 2, 1).contiguous()


def unpack_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_mxfp4``'s inverse: the packed bytes [N, K/2] and scale bytes [N, K/32]."""
    line = torch.cat((packed & 0xF, packed >> 4), dim=-1)  # [NP, K, 64] in output order
    c = line.permute(0, 2, 1).reshape(-1, packed.shape[1])[:n]
    blocks = c[:, 0::2] | (c[:, 1::2] << 4)
    return blocks.contiguous(), scale.permute(0, 2, 1).reshape(-1, scale.shape[1])[:n].contiguous()


class Mxfp4Linear(QuantizedLinear):
    """``y = x w^T + b`` for an MXFP4 weight: ``blocks`` [N, K/2] packed bytes, ``scales`` [N,
    K/32] bytes (one expert's slice of its layer's parameters). After ``use_kernels``:
    ``linear_mxfp4`` on a packed copy (the arguments are no longer read)."""

    def __init__(
        self,
        blocks: torch.Tensor,
        scales: torch.Tensor,
        bias: Optional[torch.Tensor],
        int8_activations: bool = False,
    ):
        super().__init__(bias)
        self.out_features, self.in_features = blocks.shape[0], blocks.shape[1] * 2
        self.blocks, self.scales = blocks, scales
        self.int8_activations = int8_activations
        self.amx_min_rows = -1
        self.packed: Optional[torch.Tensor] = None
        self.packed_scale: Optional[torch.Tensor] = None

    def use_kernels(self, ops: ModuleType, batch_invariant: bool = False):
        if self.ops is None:
            if self.int8_activations:  # int4_matmul imports this module: imported here
                from pdserve.quantization.int4_matmul import pack_w4a8

                # 2^(e - 127) / 2: the codes' integers are twice the e2m1 values (exact)
                e = self.scales.to(torch.int32) - 128
                halves = torch.ldexp(torch.ones(e.shape), e.to(torch.float32))
                self.packed, self.packed_scale = pack_w4a8(self.blocks, halves)
            else:
                self.packed, self.packed_scale = pack_mxfp4(self.blocks, self.scales)
            self.ops, self.blocks, self.scales = ops, None, None
        self.amx_min_rows = -1 if batch_invariant else AMX_MIN_ROWS

    def dequantized(self, start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """Rows ``start:end`` of the weight in float32."""
        blocks, scales = self.blocks, self.scales
        if self.packed is not None:
            if self.int8_activations:
                raise RuntimeError("Mxfp4Linear: the weight is held in int8-activation quads only")
            blocks, scales = unpack_mxfp4(self.packed, self.packed_scale, self.out_features)
        return dequantize(blocks[start:end], scales[start:end])

    def panels(self) -> Optional[Panels]:
        if self.packed is None:
            return None
        codes = CODES_MXFP4_A8 if self.int8_activations else 1
        return Panels(codes, self.packed, self.packed_scale, GROUP, self.amx_min_rows)

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        out = x2.new_empty((x2.shape[0], self.out_features))
        bias = self._bias_in(x2.dtype)
        if self.int8_activations:
            self.ops.linear_mxfp4_w4a8(out, x2, self.packed, self.packed_scale, bias)
            return out
        self.ops.linear_mxfp4(out, x2, self.packed, self.packed_scale, bias, self.amx_min_rows)
        return out

    @property
    def nbytes(self) -> int:
        if self.packed is not None:
            return (
                self.packed.numel() + self.packed_scale.numel() * self.packed_scale.element_size()
            )
        return self.blocks.numel() + self.scales.numel()


class Mxfp4Experts(QuantizedExperts):
    """An MoE layer's experts on MXFP4 weights: each expert's two matmuls an ``Mxfp4Linear`` over
    its slice of ``w13`` / ``w2`` (packed bytes) and ``w13_scale`` / ``w2_scale``."""

    def __init__(self, experts: nn.Module, int8_activations: bool = False):
        super().__init__(experts, lambda w, s, b: Mxfp4Linear(w, s, b, int8_activations))
