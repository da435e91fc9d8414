"""The matmul of int8 weights with one scale per output channel and int8 activations quantized per
token on the fly (W8A8: compressed-tensors' ``int-quantized`` checkpoints, loaded by
``compressed_tensors.py``).

``Int8ChannelLinear``: with pdserve's CPU kernels, ``PackedW8A8`` (``layers/linear.py``: the
kernels of ``--quantization w8a8_int8``, every ISA tier, exact int32 sums, so batch invariant) on
the checkpoint's own int8 weight and scales. Without them the same scheme in PyTorch: each row of
x scaled by max|x| / 127 and rounded, the int8 product summed in float64 (exact), then scaled."""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 values as float32, per-row scale [M, 1]): the kernels' rule, in float32:
    scale = max|x| / 127, q = round(x * (1 / scale))."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True) / 127.0
    q = torch.round(xf * torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale)))
    return q.clamp(-127, 127), scale


class Int8ChannelLinear:
    """``y = (xq wq^T) * x_scale * w_scale + b`` for an int8 ``weight`` [N, K] and its channel
    ``scale`` [N, 1] (a layer's parameters, or one expert's slice). After ``use_kernels``:
    ``PackedW8A8`` on a packed copy (the arguments are no longer read)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]):
        self.out_features, self.in_features = weight.shape
        self.weight, self.scale, self.bias = weight, scale, bias
        self.packed = None

    def use_kernels(self, ops: ModuleType, onednn: bool = False, batch_invariant: bool = False):
        """Multiply with the int8 kernels from now on (every row count: their sums are exact)."""
        from pdserve.layers.linear import PackedW8A8

        if self.packed is None:
            self.packed = PackedW8A8.from_int8(self.weight, self.scale, self.bias, ops)
            self.weight, self.scale = None, None

    def panels(self) -> None:
        """None: its kernels are the int8 ones, not the panel kernels (``matmul.Panels``)."""
        return None

    def dequantized(self) -> torch.Tensor:
        """The weight in float32, ``q * scale`` (compressed-tensors' decompression)."""
        return self.weight.float() * self.scale.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = self.out_features
        x2 = x.reshape(-1, x.shape[-1])
        if self.packed is not None and x.dtype in (torch.float32, torch.bfloat16):
            return self.packed(x2.contiguous()).view(x.shape[:-1] + (n,))
        q, xs = quantize_rows(x2)
        acc = q.double() @ self.weight.double().T
        out = (acc * xs.double() * self.scale.double().T).float()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).view(x.shape[:-1] + (n,))

    @property
    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.nbytes
        return self.weight.numel() + self.scale.numel() * 4
