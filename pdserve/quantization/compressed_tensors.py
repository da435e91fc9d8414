"""compressed-tensors checkpoints (``quant_method: "compressed-tensors"``, as llm-compressor writes
them: RedHatAI's and Neural Magic's "-FP8-dynamic" and "-W8A8" releases, GLM-4.5/4.6-FP8). Read
today: the ``int-quantized`` format (``CompressedInt8``: int8 weights per channel, int8
activations per token, on the int8 kernels), and the ``float-quantized`` format with FP8 e4m3
weights and one scale per output channel
(``weights: {type: float, num_bits: 8, strategy: channel, symmetric: true}``), each quantized
linear storing ``weight`` F8_E4M3 [N, K] and ``weight_scale`` [N, 1] (``weight = q * scale``).

They are served as FP8 weights with 16-bit activations (W8A16) on the FP8 block machinery of
``fp8_block.py`` (a block of one row by the whole row; ``weight_scale`` read as its
``weight_scale_inv``): the checkpoint's bytes in place, the same kernels at every ISA tier.
Dynamic per-token FP8 activations (``input_activations: {dynamic: true}``), which the checkpoint
asks of GPUs with FP8 matmuls, are not applied: the result is the decompressed model's
(compressed-tensors' own decompressor), closer to the unquantized model than an FP8 x FP8
product. Static activation scales, other formats (``pack-quantized``, ``naive-quantized``), group
or block strategies, asymmetric weights and other bit widths are refused naming the field."""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from pdserve.quantization.experts import QuantizedExperts
from pdserve.quantization.fp8_block import SCALE, Fp8Block, row_col_slices
from pdserve.quantization.int4_matmul import Int4GroupLinear
from pdserve.quantization.int8_matmul import Int8ChannelLinear
from pdserve.quantization.mxfp4_matmul import codes

CT_SCALE = "weight_scale"  # the checkpoint's name; loaded as fp8_block's SCALE
# quantization_config.format -> the weights' quantization args it is read with
WEIGHTS = {
    "float-quantized": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True},
    "int-quantized": {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True},
    "pack-quantized": {"type": "int", "num_bits": 4, "strategy": "group", "symmetric": True},
}
INT8_TOKENS = {
    "type": "int",
    "num_bits": 8,
    "strategy": "token",
    "symmetric": True,
    "dynamic": True,
}


def _check_args(where: str, args: dict, wanted: dict) -> None:
    for field, value in wanted.items():
        if args.get(field, value) != value:
            raise ValueError(
                f"{where}.{field}: {args.get(field)!r} is not supported; supported: {value!r}"
            )


class CompressedTensors(Fp8Block):
    method = "compressed-tensors"

    @classmethod
    def from_config(cls, quant: dict[str, Any]) -> "CompressedTensors":
        fmt = quant.get("format")
        if fmt not in WEIGHTS:
            raise ValueError(
                f"quantization_config.format: {fmt!r} is not supported for compressed-tensors; "
                "supported: float-quantized (FP8 weights per channel), int-quantized (int8 "
                "weights per channel, int8 activations per token)"
            )
        groups = quant.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            raise ValueError("quantization_config.config_groups: expected one or more groups")
        for key, group in groups.items():
            where = f"quantization_config.config_groups.{key}"
            _check_args(f"{where}.weights", (group or {}).get("weights") or {}, WEIGHTS[fmt])
            if (group or {}).get("weights", {}).get("dynamic"):
                raise ValueError(f"{where}.weights.dynamic: true is not supported")
            acts = group.get("input_activations")
            if fmt == "pack-quantized":
                size = group["weights"].get("group_size")
                if not isinstance(size, int) or size <= 0 or size % 8:
                    raise ValueError(
                        f"{where}.weights.group_size: {size!r}; expected a positive multiple of 8"
                    )
                if acts:  # W4A8: int8 per token, dynamic, as --int4-int8-activations runs it
                    _check_args(f"{where}.input_activations", acts, INT8_TOKENS)
                if len({bool(g.get("input_activations")) for g in groups.values()}) > 1:
                    raise ValueError(
                        "quantization_config.config_groups: some groups quantize activations "
                        "and others not; one activation scheme for every int4 layer is supported"
                    )
                sizes = {g["weights"]["group_size"] for g in groups.values()}
                if len(sizes) > 1:
                    raise ValueError(
                        f"quantization_config.config_groups: group sizes {sorted(sizes)}; one "
                        "group size for every layer is supported"
                    )
            elif fmt == "int-quantized":
                if not acts:
                    raise ValueError(
                        f"{where}.input_activations: none (int8 weights with 16-bit activations) "
                        "is not supported; supported: int8 per token, dynamic"
                    )
                _check_args(f"{where}.input_activations", acts, INT8_TOKENS)
            elif acts and not acts.get("dynamic", False):
                raise ValueError(
                    f"{where}.input_activations.dynamic: false (static activation scales) is not "
                    "supported; supported: dynamic or none"
                )
            targets = group.get("targets") or ["Linear"]
            if list(targets) != ["Linear"]:
                raise ValueError(
                    f"{where}.targets: {targets!r} is not supported; supported: ['Linear']"
                )
        ignore = quant.get("ignore") or ()
        if fmt == "pack-quantized":
            first = next(iter(groups.values()))
            fmt4 = CompressedInt4((1, first["weights"]["group_size"]), None, ignore)
            fmt4.int8_activations = bool(first.get("input_activations"))
            return fmt4
        target = CompressedInt8 if fmt == "int-quantized" else cls
        return target((1, None), None, ignore)

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


class CompressedInt8(CompressedTensors):
    """compressed-tensors' ``int-quantized`` W8A8 (RedHatAI's and Neural Magic's "-W8A8" /
    "-quantized.w8a8" releases): ``weight`` I8 [N, K] with ``weight_scale`` [N, 1], activations
    quantized to int8 per token at run time, on the int8 kernels of ``--quantization w8a8_int8``
    with the checkpoint's own weights and scales (``int8_matmul.py``)."""

    stored_dtype = "I8"
    storage = torch.int8
    kind = "int8"

    def describe(self) -> str:
        return "compressed-tensors int8 weights per channel, int8 activations per token"

    def _values(self, q: torch.Tensor) -> torch.Tensor:
        return q.float()

    def _linear(self, weight: torch.Tensor, scale: torch.Tensor, bias) -> Any:
        return Int8ChannelLinear(weight, scale, bias)

    def _experts(self, module: nn.Module) -> Any:
        return QuantizedExperts(module, Int8ChannelLinear)


class CompressedInt4(CompressedTensors):
    """compressed-tensors' ``pack-quantized`` int4 W4A16 (Kimi K2-Thinking's routed experts,
    RedHatAI's "-quantized.w4a16" releases): ``weight_packed`` I32 [N, K/8] (eight codes ``q + 8``
    a word, the first in the low bits), ``weight_scale`` [N, K/group] and ``weight_shape``; read
    as the bytes of those words (two codes a byte) with a scale per row and group, on the 4-bit
    kernels (``int4_matmul.py``). Activations stay 16-bit, unless the checkpoint's scheme (W4A8,
    int8 per token, dynamic) or ``--int4-int8-activations`` quantizes them: then
    ``linear_int4_w4a8``'s integer dot products."""

    stored_dtype = "I4"  # the packed words, seen in the weight's coordinates
    storage = torch.uint8
    kind = "int4"
    int8_activation_flag = "int4_int8_activations"
    # int8 activations per token: a W4A8 checkpoint's scheme, or --int4-int8-activations
    int8_activations = False

    def check_flags(self, args: Any) -> None:
        super().check_flags(args)
        # a W4A8 checkpoint's own scheme, or the flag's
        self.int8_activations |= bool(getattr(args, "int4_int8_activations", False))

    def describe(self) -> str:
        acts = "int8 activations per token (W4A8)" if self.int8_activations else "W4A16"
        return f"compressed-tensors int4 weights, a scale per {self.block[1]} ({acts})"

    def _stored_columns(self, k: int) -> int:
        return k // 2

    def _values(self, q: torch.Tensor) -> torch.Tensor:
        return codes(q).float() - 8.0

    def _linear(self, weight: torch.Tensor, scale: torch.Tensor, bias) -> Any:
        return Int4GroupLinear(weight, scale, bias, self.block[1], self.int8_activations)

    def _experts(self, module: nn.Module) -> Any:
        group, int8 = self.block[1], self.int8_activations
        return QuantizedExperts(module, lambda w, s, b: Int4GroupLinear(w, s, b, group, int8))

    @staticmethod
    def _as_weight(name: str) -> str:
        return name[: -len("_packed")] if name.endswith(".weight_packed") else name

    def _renamed(self, tensors: dict[str, tuple[str, list[int]]]) -> dict:
        out = {}
        for name, (dtype, shape) in super()._renamed(tensors).items():
            if name.endswith(".weight_shape"):
                continue
            if name.endswith(".weight_packed"):
                if dtype != "I32" or len(shape) != 2:
                    raise ValueError(
                        f"weight {name!r}: {dtype} {list(shape)}; expected I32 [N, K/8]"
                    )
                dtype, shape = self.stored_dtype, [shape[0], shape[1] * 8]
            out[self._as_weight(name)] = (dtype, shape)
        return out

    def wrap(
        self, weights: Iterable[tuple[str, Any]], tensors: dict[str, tuple[str, list[int]]]
    ) -> Iterator[tuple[str, Any]]:
        def packed(pairs):
            for name, src in pairs:
                if name.endswith(".weight_shape"):
                    continue
                if name.endswith(".weight_packed"):
                    src = PackedInt4View(src, name)
                yield self._as_weight(name), src

        return super().wrap(packed(weights), tensors)


class PackedInt4View:
    """A ``weight_packed`` I32 [N, K/8] seen as the weight [N, K] it holds, as the loader slices
    weights: rows ``a:b`` and columns ``c:d`` (whole words: multiples of 8) give the bytes of
    those words, [b - a, (d - c) / 2] uint8."""

    def __init__(self, src: Any, name: str):
        self.src, self.name = src, name
        shape = src.shape if isinstance(src, torch.Tensor) else src.get_shape()
        self.shape = [int(shape[0]), int(shape[1]) * 8]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        (a, b), (c, d) = row_col_slices(index, self.shape, self.name)
        if c % 8 or d % 8:
            raise ValueError(
                f"weight {self.name!r}: columns {c}:{d} split an int32 word of 8 int4 values; a "
                "tensor-parallel split of the input dimension must fall on whole words"
            )
        words = self.src[a:b, c // 8 : d // 8]
        return words.contiguous().view(torch.uint8)
