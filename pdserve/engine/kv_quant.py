"""Quantized KV cache (``--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2``; ``fp8`` is e4m3, as vLLM
and SGLang accept it).

- ``int8``: symmetric, one scale per (token, KV head): ``x ~= q * scale``, ``scale = amax / 127``
  over the head's ``head_dim`` values. The scales are float32: 4 bytes beside ``head_dim`` bytes
  of values (3% of a page at head_dim 128, 6% at 64), read as they are by the kernels (no
  conversion in the inner loop), and exact for any amax (float16 would flush the scale of a
  head whose values are all below ~1e-5 to a subnormal or to zero).
- ``fp8_e4m3`` / ``fp8_e5m2``: one byte per value, ``x ~= fp8(x / s) * s`` with one scale per
  layer for K and one for V (``k_scale`` / ``v_scale``: the checkpoint's, as vLLM and SGLang
  load them, else 1.0). Values beyond the format's range are clamped (vLLM saturates too).

The pool keeps the values as ``int8`` (int8) or ``uint8`` (the fp8 bit patterns: CPU torch has
no ``index_copy_`` for float8 tensors); the per-token scales are a region of their own, so
whatever moves or sends a page (the prefix cache, a speculative tree's moves, the PD transfer)
moves or sends its scales with it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch

ALIASES = {"fp8": "fp8_e4m3"}
# the torch dtype of each quantized format's values (what they dequantize from)
FORMATS = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
QUANTIZED_KV_DTYPES = tuple(FORMATS) + tuple(ALIASES)
# cache kinds whose pool quantizes (the rest refuse a quantized --kv-cache-dtype at start-up)
QUANTIZABLE_KINDS = ("full_attention", "sliding_window", "chunked_attention")
INT8_MAX = 127.0


@dataclass(frozen=True)
class KVQuant:
    """One quantized KV format; ``name`` is the flag's value (aliases resolved)."""

    name: str

    @property
    def per_token(self) -> bool:
        """Whether each (token, head) has its own scale (int8), else one per layer (fp8)."""
        return self.name == "int8"

    @property
    def storage(self) -> torch.dtype:
        """The dtype of the pool's buffer."""
        return torch.int8 if self.per_token else torch.uint8

    @property
    def values(self) -> torch.dtype:
        return FORMATS[self.name]

    @property
    def max(self) -> float:
        return INT8_MAX if self.per_token else float(torch.finfo(self.values).max)

    def quantize(
        self, x: torch.Tensor, tensor_scale: float = 1.0
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``x`` [N, D] -> (values [N, D] in ``storage``, scales [N] float32 or None)."""
        xf = x.float()
        if self.per_token:
            scale = xf.abs().amax(dim=-1) / INT8_MAX
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.round(xf / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
            return q, scale
        q = (xf / tensor_scale).clamp_(-self.max, self.max).to(self.values)
        return q.view(torch.uint8), None

    def dequantize(
        self,
        q: torch.Tensor,
        scale: Optional[torch.Tensor],
        tensor_scale: float,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """``q`` [..., D] (``storage``) and ``scale`` [...] (int8) -> [..., D] in ``dtype``."""
        if self.per_token:
            return (q.float() * scale.unsqueeze(-1)).to(dtype)
        return (q.view(self.values).float() * tensor_scale).to(dtype)


def kv_quant_for(kv_cache_dtype: str) -> Optional[KVQuant]:
    """The format of a ``--kv-cache-dtype`` value, or None for a float cache."""
    name = ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    return KVQuant(name) if name in FORMATS else None


def check_quantizable(quant: Optional[KVQuant], kinds, model: str) -> None:
    """Refuse a quantized cache for a model with caches this engine keeps only in float."""
    if quant is None:
        return
    bad = sorted(set(kinds) - set(QUANTIZABLE_KINDS))
    if bad:
        raise ValueError(
            f"kv_cache_dtype: {quant.name!r} is not supported for {model}: its cache kind(s) "
            f"{bad} are kept in float only (quantized KV: {list(QUANTIZABLE_KINDS)}); "
            "use --kv-cache-dtype auto"
        )


@dataclass
class LayerScales:
    """What dequantizes one layer's K and V: the per-token scales ([num_pages, kv_heads,
    page_size] float32 each, int8) or the per-layer scales (fp8)."""

    quant: KVQuant
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    k_tensor: float = 1.0
    v_tensor: float = 1.0

    def store(self, kc: torch.Tensor, vc: torch.Tensor, rows: torch.Tensor, k, v) -> None:
        """Quantize new tokens' ``k``/``v`` ([T, kv_heads, D]) into rows ``rows`` ([T * kv_heads])
        of the caches' [rows, D] views (and of the scales' [rows] views)."""
        dim = kc.shape[-1]
        for cache, scales, tensor, x in (
            (kc, self.k, self.k_tensor, k),
            (vc, self.v, self.v_tensor, v),
        ):
            q, s = self.quant.quantize(x.reshape(-1, dim), tensor)
            cache.view(-1, dim).index_copy_(0, rows, q)
            if s is not None:
                scales.view(-1).index_copy_(0, rows, s)

    def rows(self, cache: torch.Tensor, which: str, idx: torch.Tensor, dtype) -> torch.Tensor:
        """Rows ``idx`` (any shape) of ``cache``'s [rows, D] view, dequantized: [*idx, D]."""
        dim = cache.shape[-1]
        scales, tensor = (self.k, self.k_tensor) if which == "k" else (self.v, self.v_tensor)
        s = None if scales is None else scales.view(-1)[idx]
        return self.quant.dequantize(cache.view(-1, dim)[idx], s, tensor, dtype)

    def pages(self, cache: torch.Tensor, which: str, pages: torch.Tensor, dtype) -> torch.Tensor:
        """Pages ``pages`` [n] of ``cache``, dequantized: [n, kv_heads, page_size, D]."""
        scales, tensor = (self.k, self.k_tensor) if which == "k" else (self.v, self.v_tensor)
        s = None if scales is None else scales[pages]
        return self.quant.dequantize(cache[pages], s, tensor, dtype)


def scale_regions(scales: torch.Tensor, group, final: str) -> list:
    """The transfer regions of an int8 pool's scales ``[layers, 2, pages, kv_heads, page_size]``
    (float32) as the pool of cache group ``group``: per layer ``k_scale`` and ``v_scale``, one
    item per page (``kv_heads * page_size * 4`` bytes), split by heads like the pages."""
    from pdserve.kv_region import Region

    num_pages, kv_heads, page_size = scales.shape[2:]
    item = kv_heads * page_size * 4
    return [
        Region(
            ptr=scales[i, kv].data_ptr(),
            nbytes=num_pages * item,
            item_bytes=item,
            group=group.id,
            layer=layer,
            part=part,
            final=final,
            split="heads",
        )
        for i, layer in enumerate(group.layers)
        for kv, part in ((0, "k_scale"), (1, "v_scale"))
    ]


# ---- per-layer scales of fp8 checkpoints ---------------------------------------------------------
# the names vLLM and SGLang load: "<attn>.k_scale" / "<attn>.v_scale" (under self_attn, its k/v
# projections, or its "attn" module), or one "kv_scale" for both (older checkpoints)
_SCALE_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:(?:k_proj|v_proj|attn)\.)?(k_scale|v_scale|kv_scale)$"
)


def checkpoint_kv_scales(model_path: str) -> dict[int, tuple[float, float]]:
    """Per layer (the checkpoint's numbering): (k_scale, v_scale) from the checkpoint's
    safetensors, for the layers that have them."""
    if not os.path.isdir(model_path):
        return {}
    from safetensors import safe_open

    found: dict[int, dict[str, float]] = {}
    for name in sorted(os.listdir(model_path)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(model_path, name)
        with open(path, "rb") as f:  # the header only: skip shards without scales cheaply
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        keys = [k for k in header if _SCALE_NAME.search(k)]
        if not keys:
            continue
        with safe_open(path, framework="pt") as f:
            for key in keys:
                layer, kind = _SCALE_NAME.search(key).groups()
                value = float(f.get_tensor(key).float().reshape(-1)[0])
                for part in ("k_scale", "v_scale") if kind == "kv_scale" else (kind,):
                    found.setdefault(int(layer), {})[part] = value
    return {
        layer: (d.get("k_scale", 1.0), d.get("v_scale", 1.0)) for layer, d in sorted(found.items())
    }
