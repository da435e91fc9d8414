"""What the matmuls of quantized weights share (``fp8_matmul.py``, ``mxfp4_matmul.py``): the
kernel's call on 2-D rows once ``use_kernels`` gave them pdserve's kernels, otherwise panels of
output rows dequantized and multiplied in the activations' dtype; the bias kept per dtype."""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import ModuleType
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

PANEL_ROWS = 256  # output rows dequantized at once by the PyTorch matmul
NO_ROW_LIMIT = 1 << 62
CODES_W4A8 = 3  # int4 codes with int8 activations (linear_int4_w4a8's quads)
CODES_MXFP4_A8 = 4  # MXFP4 codes with int8 activations (linear_mxfp4_w4a8, the same quads)


class Panels(NamedTuple):
    """A matmul's weight as the panel kernels (``kernels/csrc/fp8_linear.h``) read it:
    ``codes`` 0 FP8, 1 MXFP4, 2 int4, 3 int4 with int8 activations (``int4_w4a8.cpp``'s quads),
    4 MXFP4 with int8 activations (the same quads);
    ``max_rows``: bf16 calls of more rows go elsewhere."""

    codes: int
    packed: torch.Tensor
    scale: torch.Tensor
    block_k: int
    amx_min_rows: int
    max_rows: int = NO_ROW_LIMIT


class QuantizedLinear(ABC):
    """``y = x w^T + b``; subclasses give ``dequantized(start, end)`` (rows of the weight in
    float32) and ``_kernel(x2)`` (the kernel on [M, K] rows, float32 or bf16)."""

    out_features: int

    def __init__(self, bias: Optional[torch.Tensor]):
        self.bias = bias
        self.ops: Optional[ModuleType] = None
        self._bias: dict[torch.dtype, torch.Tensor] = {}

    @abstractmethod
    def dequantized(self, start: int = 0, end: Optional[int] = None) -> torch.Tensor: ...

    @abstractmethod
    def _kernel(self, x: torch.Tensor) -> torch.Tensor: ...

    def panels(self) -> Optional[Panels]:
        """The packed weight once ``use_kernels`` gave the panel kernels (None before, or for a
        format of other kernels)."""
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = self.out_features
        if self.ops is not None and x.dtype in (torch.float32, torch.bfloat16):
            x2 = x.reshape(-1, x.shape[-1])
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            return self._kernel(x2).view(x.shape[:-1] + (n,))
        out = x.new_empty(x.shape[:-1] + (n,))
        for start in range(0, n, PANEL_ROWS):
            end = min(n, start + PANEL_ROWS)
            bias = None if self.bias is None else self.bias[start:end].to(x.dtype)
            out[..., start:end] = F.linear(x, self.dequantized(start, end).to(x.dtype), bias)
        return out

    def _bias_in(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
        if self.bias is None:
            return None
        if dtype not in self._bias:
            self._bias[dtype] = self.bias.detach().to(dtype).contiguous()
        return self._bias[dtype]
