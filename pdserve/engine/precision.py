"""Which dtypes an engine computes in and keeps its KV cache in.

``--dtype auto`` keeps the checkpoint's dtype, with one decision made on CPU for a bf16 (or fp16)
checkpoint: compute in bf16 with prepacked weights, or upcast to float32. Which is faster depends
on the host, not on a CPU flag: on one of this project's hosts (AMD, avx512_bf16) prepacked bf16
ran at 0.3-0.6x the time of fp32, on another (Intel, no AMX) plain bf16 ran at 2x. So the
decision is a measurement: the model's own layer shapes, at batch 1 and at a decode batch, timed
once in each dtype at start-up (tens of ms). A float32 checkpoint stays float32 (it is what the
HF-exact promise is made in); ``--dtype float32|bfloat16`` forces.

``--kv-cache-dtype auto`` follows the compute dtype; ``int8`` / ``fp8_e4m3`` / ``fp8_e5m2``
(``fp8``) quantize it (``kv_quant.py``).
"""

from __future__ import annotations

import logging
import time
from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# rows timed: batch-1 decode, a mid-size decode batch, a prefill chunk
PROBE_ROWS = (1, 32, 256)
PROBE_REPEATS = 3


def _layer_shapes(hf_config) -> list[tuple[int, int]]:
    """(out, in) of the matmuls of one decoder layer."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return [
        ((heads + 2 * kv_heads) * head_dim, hidden),
        (hidden, heads * head_dim),
        (2 * inter, hidden),
        (hidden, inter),
    ]


def _best_time(fn, repeats: int = PROBE_REPEATS) -> float:
    fn()  # first call: packing caches, page faults
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_linear_times(
    hf_config, ops: Optional[ModuleType], onednn: bool = True
) -> dict[str, float]:
    """Seconds for one pass over a decoder layer's matmuls at each of ``PROBE_ROWS``, summed, in
    float32 (``F.linear``) and in prepacked bf16 (what ``PackedBF16`` runs: oneDNN and pdserve's
    GEMV, or, with ``onednn`` False, pdserve's kernel at every row count)."""
    from pdserve.layers.linear import PackedBF16

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in _layer_shapes(hf_config)]
    packed = [PackedBF16(w, None, ops, onednn=onednn) for w in weights]
    out = {"float32": 0.0, "bfloat16": 0.0}
    for rows in PROBE_ROWS:
        xs = {k: torch.randn(rows, k, generator=gen) for k in {w.shape[1] for w in weights}}
        xs_bf16 = {k: x.to(torch.bfloat16) for k, x in xs.items()}
        out["float32"] += _best_time(lambda: [F.linear(xs[w.shape[1]], w) for w in weights])
        out["bfloat16"] += _best_time(lambda: [p(xs_bf16[p.in_features]) for p in packed])
    return out


def choose_compute_dtype(
    dtype: str, device: str, hf_config, ops: Optional[ModuleType]
) -> tuple[torch.dtype, str]:
    """(compute dtype, why) for ``--dtype`` on ``device``."""
    from pdserve.models.loader import resolve_dtype

    if dtype != "auto":
        return resolve_dtype(hf_config, dtype), f"--dtype {dtype}"
    ckpt = resolve_dtype(hf_config, "auto")
    if device != "cpu" or ckpt == torch.float32:
        return ckpt, f"the checkpoint's dtype ({str(ckpt).replace('torch.', '')})"
    from pdserve.kernels import onednn_bf16

    onednn, why_not = onednn_bf16()
    if not onednn:
        logger.info(
            "bf16 matmuls: not on oneDNN (%s)%s",
            why_not,
            "" if ops is None else "; pdserve's kernels probed",
        )
        if ops is None:
            return (
                torch.float32,
                f"{why_not}, and pdserve's CPU kernels are not available: "
                "bf16 matmuls would be slow",
            )
    try:
        times = measure_linear_times(hf_config, ops, onednn)
    except Exception as e:  # an instruction the library lacks here, or any failure: not available
        logger.warning(
            "the bf16 matmul probe failed (%s: %s); computing in float32", type(e).__name__, e
        )
        return (
            torch.float32,
            f"the bf16 matmul probe failed ({type(e).__name__}: {str(e).splitlines()[0]})",
        )
    ratio = times["bfloat16"] / times["float32"]
    detail = (
        f"layer matmuls at {'/'.join(map(str, PROBE_ROWS))} rows took "
        f"{times['bfloat16'] * 1e3:.1f} ms in prepacked bf16 "
        f"({'oneDNN + GEMV' if onednn else 'pdserve kernels'}) "
        f"vs {times['float32'] * 1e3:.1f} ms in float32 ({ratio:.2f}x)"
    )
    if ratio < 1.0:
        return torch.bfloat16, f"measured: {detail}"
    return (
        torch.float32,
        f"measured: {detail}; upcasting the {str(ckpt).replace('torch.', '')} checkpoint",
    )


def choose_kv_cache_dtype(kv_cache_dtype: str, compute: torch.dtype) -> torch.dtype:
    """The dtype of the KV pool's buffer (a quantized format's storage: ``kv_quant.py``)."""
    from pdserve.engine.kv_quant import kv_quant_for

    if kv_cache_dtype == "auto":
        return compute
    quant = kv_quant_for(kv_cache_dtype)
    if quant is not None:
        return quant.storage
    return getattr(torch, kv_cache_dtype)
