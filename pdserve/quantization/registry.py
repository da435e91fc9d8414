"""``quantization_config.quant_method`` -> weight format, imported only when chosen; every other
method refused at load, naming the field and the value."""

from __future__ import annotations

import importlib
from typing import Any, Optional

from pdserve.quantization.base import WeightFormat

_FORMATS = {
    "fp8": ("pdserve.quantization.fp8_block", "Fp8Block"),
    "compressed-tensors": ("pdserve.quantization.compressed_tensors", "CompressedTensors"),
    "mxfp4": ("pdserve.quantization.mxfp4", "Mxfp4"),
}
# methods seen in published checkpoints that no format here reads yet: what each is
_NOT_BUILT = {
    "awq": "AWQ int4",
    "gptq": "GPTQ int4",
    "bitsandbytes": "bitsandbytes",
    "fbgemm_fp8": "fbgemm FP8 per channel",
    "modelopt": "ModelOpt (NVFP4, FP8)",
    "nvfp4": "NVFP4",
    "gguf": "GGUF",
    "torchao": "torchao",
    "hqq": "HQQ",
    "eetq": "EETQ",
    "quanto": "Quanto",
    "bitnet": "BitNet",
}


def supported_methods() -> list[str]:
    return sorted(_FORMATS)


def quant_config(hf_config) -> Optional[dict[str, Any]]:
    """The config's ``quantization_config`` as a dict (None for a checkpoint not quantized)."""
    quant = getattr(hf_config, "quantization_config", None)
    if quant is None:
        return None
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else dict(vars(quant))
    return quant


def weight_format(hf_config) -> Optional[WeightFormat]:
    """The checkpoint's weight format, or None for unquantized weights; ``ValueError`` naming
    ``quantization_config.quant_method`` (or the field a format cannot serve) otherwise."""
    quant = quant_config(hf_config)
    if quant is None:
        return None
    method = quant.get("quant_method")
    if method in _FORMATS:
        module, name = _FORMATS[method]
        return getattr(importlib.import_module(module), name).from_config(quant)
    what = f" ({_NOT_BUILT[method]})" if method in _NOT_BUILT else ""
    raise ValueError(
        f"quantization_config.quant_method: {method!r}{what} is not supported; supported: "
        f"{', '.join(supported_methods())}"
    )
