"""compressed-tensors checkpoints (``quant_method: "compressed-tensors"``, as llm-compressor writes
them: RedHatAI's and Neural Magic's "-FP8-dynamic" releases, GLM-4.5/4.6-FP8). Read today: the
``float-quantized`` format with FP8 e4m3 weights and one scale per output channel
(``weights: {type: float, num_bits: 8, strategy: channel, symmetric: true}``), each quantized
linear storing ``weight`` F8_E4M3 [N, K] and ``weight_scale`` [N, 1] (``weight = q * scale``).

They are served as FP8 weights with 16-bit activations (W8A16) on the FP8 block machinery of
``fp8_block.py`` (a block of one row by the whole row; ``weight_scale`` read as its
``weight_scale_inv``): the checkpoint's bytes in place, the same kernels at every ISA tier.
Dynamic per-token FP8 activations (``input_activations: {dynamic: true}``), which the checkpoint
asks of GPUs with FP8 matmuls, are not applied: the result is the decompressed model's
(compressed-tensors' own decompressor), closer to the unquantized model than an FP8 x FP8
product. Static activation scales, other formats (``int-quantized``, ``pack-quantized``,
``naive-quantized``), group or block strategies and anything but 8-bit float weights are refused
naming the field."""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

from torch import nn

from pdserve.quantization.fp8_block import SCALE, Fp8Block

CT_SCALE = "weight_scale"  # the checkpoint's name; loaded as fp8_block's SCALE


class CompressedTensors(Fp8Block):
    method = "compressed-tensors"

    @classmethod
    def from_config(cls, quant: dict[str, Any]) -> "CompressedTensors":
        fmt = quant.get("format")
        if fmt != "float-quantized":
            raise ValueError(
                f"quantization_config.format: {fmt!r} is not supported for compressed-tensors; "
                "supported: float-quantized (FP8 weights per channel)"
            )
        groups = quant.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            raise ValueError("quantization_config.config_groups: expected one or more groups")
        for key, group in groups.items():
            where = f"quantization_config.config_groups.{key}"
            weights = (group or {}).get("weights") or {}
            wanted = {
                "type": "float",
                "num_bits": 8,
                "strategy": "channel",
                "symmetric": True,
            }
            for field, value in wanted.items():
                if weights.get(field, value) != value:
                    raise ValueError(
                        f"{where}.weights.{field}: {weights.get(field)!r} is not supported; "
                        f"supported: {value!r}"
                    )
            if weights.get("dynamic"):
                raise ValueError(f"{where}.weights.dynamic: true is not supported")
            acts = group.get("input_activations")
            if acts and not acts.get("dynamic", False):
                raise ValueError(
                    f"{where}.input_activations.dynamic: false (static activation scales) is not "
                    "supported; supported: dynamic or none"
                )
            targets = group.get("targets") or ["Linear"]
            if list(targets) != ["Linear"]:
                raise ValueError(
                    f"{where}.targets: {targets!r} is not supported; supported: ['Linear']"
                )
        return cls((1, None), None, quant.get("ignore") or ())

    def describe(self) -> str:
        return "compressed-tensors fp8 e4m3, a scale per output channel"

    def ignores(self, module: str) -> bool:
        """compressed-tensors' ignore list: module names, or ``re:`` regular expressions."""
        for p in self.ignore:
            if p.startswith("re:") and re.match(p[3:], module):
                return True
        return super().ignores(module)

    @staticmethod
    def _as_fp8_block(name: str) -> str:
        return name[: -len(CT_SCALE)] + SCALE if name.endswith("." + CT_SCALE) else name

    def _renamed(self, tensors: dict[str, tuple[str, list[int]]]) -> dict:
        return {self._as_fp8_block(n): v for n, v in tensors.items()}

    def prepare(self, model: nn.Module, tensors: dict[str, tuple[str, list[int]]]) -> None:
        super().prepare(model, self._renamed(tensors))

    def wrap(
        self, weights: Iterable[tuple[str, Any]], tensors: dict[str, tuple[str, list[int]]]
    ) -> Iterator[tuple[str, Any]]:
        renamed = ((self._as_fp8_block(n), src) for n, src in weights)
        return super().wrap(renamed, self._renamed(tensors))
