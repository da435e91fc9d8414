"""The matmul of symmetric int4 weights with a float scale per output channel and group of k
(compressed-tensors' ``pack-quantized`` W4A16: Kimi K2-Thinking's routed experts, RedHatAI's
"-quantized.w4a16" releases; loaded by ``compressed_tensors.py``): codes ``q + 8`` two a byte,
the even k in the low nibble, as the checkpoint's int32 words hold them.

``Int4GroupLinear``: with pdserve's CPU kernels, ``linear_int4`` (``kernels/csrc/fp8_linear.h``:
the FP8 kernels' sums on 4-bit panels, each code looked up as its value; every tier, AMX included,
batch invariant) on the codes repacked once; without them, panels of output rows dequantized
(``(code - 8) * scale``, one rounding: compressed-tensors' decompression) and multiplied in the
activations' dtype."""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F

from pdserve.quantization.fp8_matmul import AMX_MIN_ROWS, KERNEL_PANEL, pack_scales
from pdserve.quantization.matmul import CODES_W4A8, Panels, QuantizedLinear
from pdserve.quantization.mxfp4_matmul import codes, pack_codes


def dequantize(packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """Bytes [N, K/2] and scales [N, ceil(K/group)] -> float32 [N, K]: ``(code - 8) * scale``."""
    q = codes(packed).to(torch.float32) - 8.0
    k = q.shape[1]
    return q * scale.float().repeat_interleave(group, dim=1)[:, :k]


def pack_w4a8(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes [N, K/2] (two codes a byte, the even k low) and scales [N, KB] -> the quads
    [ceil(N/64), ceil(K/4), 128] of ``linear_int4_w4a8`` (``kernels/csrc/int4_w4a8.cpp``: byte
    4 l + i of a quad's first 64 holds output l's code of k = 4 kq + i low and output 32 + l's
    high; of the second 64, outputs 16 + l and 48 + l) and plain float32 scales
    [ceil(N/64), KB, 64] in output order."""
    c = codes(weight)
    n, k = c.shape
    c = F.pad(c, (0, -k % 4, 0, -n % KERNEL_PANEL), value=8)  # padding codes meet x's zeros
    quads = c.view(-1, 4, 16, c.shape[1] // 4, 4).permute(
        0, 3, 1, 2, 4
    )  # [NP, KQ, 4 blocks, 16, 4]
    first = quads[:, :, 0] | (quads[:, :, 2] << 4)
    second = quads[:, :, 1] | (quads[:, :, 3] << 4)
    packed = torch.cat((first.flatten(2), second.flatten(2)), dim=2).contiguous()
    s = F.pad(scale.to(torch.float32), (0, 0, 0, -n % KERNEL_PANEL))
    return packed, s.view(-1, KERNEL_PANEL, scale.shape[1]).permute(0, 2, 1).contiguous()


class Int4GroupLinear(QuantizedLinear):
    """``y = x w^T + b`` for int4 ``weight`` bytes [N, K/2] and ``scale`` [N, ceil(K/group)] (a
    layer's parameters, or one expert's slice). After ``use_kernels``: ``linear_int4`` on a packed
    copy (the arguments are no longer read)."""

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        bias: Optional[torch.Tensor],
        group: int,
        int8_activations: bool = False,
    ):
        super().__init__(bias)
        self.out_features, self.in_features = weight.shape[0], weight.shape[1] * 2
        self.weight, self.scale, self.group = weight, scale, group
        # W4A8 (--int4-int8-activations): linear_int4_w4a8, x quantized per row to int8
        self.int8_activations = int8_activations
        self.amx_min_rows = -1
        self.packed: Optional[torch.Tensor] = None
        self.packed_scale: Optional[torch.Tensor] = None

    def use_kernels(self, ops: ModuleType, onednn: bool = False, batch_invariant: bool = False):
        if self.ops is None:
            if self.int8_activations:
                self.packed, self.packed_scale = pack_w4a8(self.weight, self.scale)
            else:
                self.packed = pack_codes(self.weight)
                self.packed_scale = pack_scales(self.scale)
            self.ops, self.weight, self.scale = ops, None, None
        self.amx_min_rows = -1 if batch_invariant else AMX_MIN_ROWS

    def dequantized(self, start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        if self.packed is not None:
            raise RuntimeError("Int4GroupLinear: the weight is held packed for the kernels only")
        return dequantize(self.weight[start:end], self.scale[start:end], self.group)

    def panels(self) -> Optional[Panels]:
        if self.packed is None:
            return None
        codes = CODES_W4A8 if self.int8_activations else 2
        return Panels(codes, self.packed, self.packed_scale, self.group, self.amx_min_rows)

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        out = x2.new_empty((x2.shape[0], self.out_features))
        if self.int8_activations:
            bias = self._bias_in(x2.dtype)
            self.ops.linear_int4_w4a8(out, x2, self.packed, self.packed_scale, bias, self.group)
            return out
        self.ops.linear_int4(
            out,
            x2,
            self.packed,
            self.packed_scale,
            self._bias_in(x2.dtype),
            self.group,
            self.amx_min_rows,
        )
        return out

    @property
    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.numel() + self.packed_scale.numel() * 4
        return self.weight.numel() + self.scale.numel() * self.scale.element_size()
