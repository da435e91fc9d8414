"""MXFP4 experts, as GPT-OSS publishes them: ``quantization_config = {"quant_method": "mxfp4",
"modules_to_not_convert": [...]}``; each MoE layer stores ``experts.gate_up_proj_blocks`` U8 [E,
2I, H/32, 16] and ``experts.down_proj_blocks`` U8 [E, H, I/32, 16] (two e2m1 codes a byte, the even
k in the low nibble; rows are outputs, gate and up interleaved as in the bf16 release) with
``*_scales`` U8 [E, rows, K/32] (E8M0: ``2^(e - 127)``); attention, router, embeddings and head
stay bf16.

What is held: the checkpoint's bytes, one expert's rows in the kernels' panel order after
``use_kernels`` (``mxfp4_matmul.py``), scales as bytes: 4.25 bits a weight, as on disk. The
intermediate dimension is split over tensor-parallel ranks only on whole 32-value groups (refused
otherwise, naming the dimension); experts spread over ranks whole (expert parallelism) as bf16
experts do. A scale byte past 246 (a weight of 2^120 or more, or E8M0's NaN 255) is refused at
load, naming the tensor."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from pdserve.quantization.base import WeightFormat
from pdserve.quantization.mxfp4_matmul import GROUP, MAX_SCALE_BYTE, Mxfp4Experts

PROJECTIONS = ("gate_up_proj", "down_proj")


class Mxfp4(WeightFormat):
    method = "mxfp4"
    batch_invariant = True  # with the kernels: the FP8 kernels' arithmetic (or exact integer sums)
    int8_activation_flag = "mxfp4_int8_activations"
    # each expert matmul's input quantized to int8 per token (--mxfp4-int8-activations)
    int8_activations = False

    def check_flags(self, args: Any) -> None:
        super().check_flags(args)
        self.int8_activations = bool(getattr(args, "mxfp4_int8_activations", False))

    @classmethod
    def from_config(cls, quant: dict[str, Any]) -> "Mxfp4":
        if quant.get("dequantize"):
            raise ValueError(
                "quantization_config.dequantize: true asks to serve the weights dequantized; serve "
                "the MXFP4 weights as they are (drop the field), or save a bf16 copy first"
            )
        return cls(quant.get("modules_to_not_convert") or ())

    def describe(self) -> str:
        acts = ", int8 activations per token" if self.int8_activations else ""
        return f"mxfp4 experts, e8m0 scales per 32{acts}"

    def prepare(self, model: nn.Module, tensors: dict[str, tuple[str, list[int]]]) -> None:
        from pdserve.layers.moe.experts import Experts
        from pdserve.models.weights import self_loading_modules

        own_name, holds = self.checkpoint_naming(model)
        owners = self_loading_modules(model)
        found: dict[str, set[str]] = {}
        for name, (dtype, shape) in sorted(tensors.items()):
            if not name.endswith("_blocks"):
                continue
            base = name[: -len("_blocks")]
            path, _, proj = base.rpartition(".")
            if self.ignores(path):
                raise ValueError(
                    f"weight {name!r} is MXFP4, but quantization_config.modules_to_not_convert "
                    "keeps its module in high precision"
                )
            if dtype != "U8" or len(shape) != 4 or shape[-1] != GROUP // 2:
                raise ValueError(
                    f"weight {name!r}: {dtype} {list(shape)}; MXFP4 blocks are U8 [experts, rows, "
                    f"groups, {GROUP // 2}]"
                )
            scale = base + "_scales"
            if scale not in tensors:
                raise ValueError(f"weight {name!r}: its scale tensor {scale!r} is missing")
            sdtype, sshape = tensors[scale]
            if sdtype != "U8" or list(sshape) != list(shape[:3]):
                raise ValueError(
                    f"weight {scale!r}: {sdtype} {list(sshape)}, expected U8 {list(shape[:3])} "
                    f"(one E8M0 byte per {GROUP} values of {name!r})"
                )
            own = own_name(name)
            if own is None or not holds(own):
                continue
            own_path = own.rpartition(".")[0]
            module = owners.get(own_path)
            if (
                not isinstance(module, Experts)
                or module.fmt != "gpt_oss"
                or proj not in PROJECTIONS
            ):
                raise ValueError(
                    f"weight {name!r}: MXFP4, but the model has no MoE experts that read it "
                    "(MXFP4 is read for GPT-OSS-layout experts: gate_up_proj and down_proj)"
                )
            found.setdefault(own_path, set()).add(proj)
        for path, projs in found.items():
            if projs != set(PROJECTIONS):
                missing = sorted(set(PROJECTIONS) - projs)
                raise ValueError(
                    f"{path}: {', '.join(p + '_blocks' for p in missing)} missing; an MoE layer's "
                    "experts must be MXFP4 in both projections or in none"
                )
            self._swap_experts(owners[path], path)

    @staticmethod
    def _swap_experts(experts: nn.Module, path: str) -> None:
        """Byte storage for the experts' ``w13`` / ``w2`` (two codes a byte) and their scales."""
        n = experts.intermediate
        if n % GROUP:
            raise ValueError(
                f"{path}: this rank's {n} intermediate columns (intermediate_size split over the "
                f"tensor-parallel ranks of an expert) are not whole {GROUP}-value MXFP4 groups; "
                "choose a tp_size (or moe_tp_size) that splits it into multiples of 32"
            )
        s, h = experts.num_slots, experts.hidden
        shapes = {"w13": (s, 2 * n, h), "w2": (s, h, n)}
        for name, (slots, rows, k) in shapes.items():
            w = torch.empty((slots, rows, k // 2), dtype=torch.uint8)
            setattr(experts, name, nn.Parameter(w, requires_grad=False))
            scale = torch.empty((slots, rows, k // GROUP), dtype=torch.uint8)
            experts.register_parameter(f"{name}_scale", nn.Parameter(scale, requires_grad=False))
        experts.weight_kind = "mxfp4"

    def wrap(
        self, weights: Iterable[tuple[str, Any]], tensors: dict[str, tuple[str, list[int]]]
    ) -> Iterator[tuple[str, Any]]:
        return iter(weights)

    def finish(self, model: nn.Module) -> int:
        total = 0
        for path, module in model.named_modules():
            if getattr(module, "weight_kind", None) != "mxfp4":
                continue
            for name, ckpt in (
                ("w13_scale", "gate_up_proj_scales"),
                ("w2_scale", "down_proj_scales"),
            ):
                top = int(getattr(module, name).max()) if getattr(module, name).numel() else 0
                if top > MAX_SCALE_BYTE:
                    what = "NaN" if top == 255 else f"2^{top - 127}"
                    raise ValueError(
                        f"weight {path}.{ckpt}: scale byte {top} ({what}) is out of the range "
                        f"served (E8M0 bytes up to {MAX_SCALE_BYTE}, 2^{MAX_SCALE_BYTE - 127})"
                    )
            module.impl = Mxfp4Experts(module, self.int8_activations)
            total += module.impl.nbytes
        return total

    def use_kernels(self, model: nn.Module, ops: ModuleType, batch_invariant: bool = False) -> int:
        total = 0
        for module in model.modules():
            impl = getattr(module, "impl", None)
            if not isinstance(impl, Mxfp4Experts):
                continue
            impl.use_kernels(ops, batch_invariant)
            # the checkpoint's layout is no longer read: 0-element stand-ins of its dtypes
            for name in ("w13", "w2", "w13_scale", "w2_scale"):
                old = getattr(module, name)
                setattr(module, name, nn.Parameter(old.new_empty(0), requires_grad=False))
            total += impl.nbytes
        return total
