"""pdserve's CPU kernels: a small C++ extension of torch (``csrc/``), built by ``build.py``.

Paged decode attention, flash attention, RMSNorm (+ residual), RoPE, SiLU-mul, bf16 / float32 /
int8 matmuls, fused MoE experts, the decode step and the prefill scan of the linear-attention
mixers (Mamba2, Gated DeltaNet) and the decoder stack of a bf16 model for decode steps
(``csrc/``). The build is compiled for the baseline ISA of the host compiler: functions that use
an extension (AVX2, AVX-512, AMX; Arm's dot products, BF16, I8MM) name it in a ``target``
attribute and run only where the CPU has it (checked at run time, ``csrc/isa.h``), so one build
serves every host of an architecture and never uses ``-march=native``. Every kernel has a path
for each tier: AVX-512 (and AMX) code of its own, one 8-lane source for AVX2 and NEON
(``csrc/vec8.h``), and portable scalar code. ``PDSERVE_CPU_ISA`` (or ``ops.set_isa``) caps the tier.
It is compiled with OpenMP, as torch is, so ``at::parallel_for`` runs on torch's intra-op threads.

It is built on first use (or ahead of time by ``python -m pdserve.kernels``) into
``<cache>/kernels/torch<version>-py<version>-<source key>-<compiler key>``, logging why and its
progress; a finished build is loaded from its file without running ninja. If there is no
compiler, the build fails, or ``PDSERVE_DISABLE_CPU_KERNELS=1``, ``load()`` returns None after
one log line and callers use their PyTorch code instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from pathlib import Path
from types import ModuleType
from typing import Optional

from pdserve.kernels import build

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    "bindings.cpp",
    "isa.cpp",
    "elementwise_vec8.cpp",
    "gemm_vec8.cpp",
    "int8_vec8.cpp",
    "fp8_vec8.cpp",
    "attention_vec8.cpp",
    "moe_vec8.cpp",
    "linear_attention_vec8.cpp",
    "paged_attention.cpp",
    "kv_quant.cpp",
    "mla_attention.cpp",
    "elementwise.cpp",
    "gemv.cpp",
    "decode_model.cpp",
    "flash_attention.cpp",
    "int8_gemm.cpp",
    "fp8_linear.cpp",
    "int4_w4a8.cpp",
    "gemm_f32.cpp",
    "moe.cpp",
    "moe_panels.cpp",
    "linear_attention.cpp",
    "linear_attention_scan.cpp",
    "linear_attention_avx512.cpp",
    "amx.cpp",
    "amx_gemm.cpp",
    "amx_fp8.cpp",
    "amx_attention.cpp",
    "amx_selfcheck.cpp",
)
# no FMA contraction: the kernels round where HF rounds (an explicit fmadd is the only fused op)
CFLAGS = ("-O3", "-std=c++17", "-fno-math-errno", "-ffp-contract=off")
# at::parallel_for is inline (ATen/ParallelOpenMP.h): without -fopenmp it runs on the calling
# thread only. The module then uses torch's libgomp (already loaded, same soname).
OPENMP_FLAGS = ("-fopenmp",)

_lock = threading.Lock()
_loaded = False
_module: Optional[ModuleType] = None
_why_not: Optional[str] = None


def extension() -> build.Extension:
    import torch

    omp = OPENMP_FLAGS if torch.backends.openmp.is_available() else ()
    return build.Extension("pdserve_cpu_kernels", SOURCE_DIR, SOURCES, CFLAGS + omp, omp)


def source_hash() -> str:
    """The key over sources, headers, flags, torch and Python (not the compiler, not paths)."""
    return extension().source_key()


def kernel_build() -> build.Build:
    from pdserve.envs import cache_dir

    return build.locate(extension(), Path(cache_dir()) / "kernels")


def build_dir() -> Path:
    return kernel_build().directory


def load(rebuild: bool = False) -> Optional[ModuleType]:
    """The extension module, or None when it is disabled or cannot be built (logged once).
    ``rebuild``: compile it again even if a finished build exists."""
    global _loaded, _module, _why_not
    with _lock:
        if _loaded and not rebuild:
            return _module
        _loaded = True
        from pdserve.envs import cpu_kernels_disabled

        if cpu_kernels_disabled():
            _why_not = "disabled by PDSERVE_DISABLE_CPU_KERNELS"
            logger.info("CPU kernels %s: using the PyTorch code paths", _why_not)
            return None
        try:
            b = _built(rebuild)
        except Exception as e:  # no compiler, no ninja, a failed build: serve without the kernels
            _why_not = (
                f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            )
            hint = (
                " Install a C++ compiler (e.g. Debian's g++) and ninja to enable them."
                if isinstance(e, build.MissingTool)
                else ""
            )
            logger.warning(
                "CPU kernels could not be built (%s); using the slower PyTorch code paths.%s",
                _why_not,
                hint,
            )
            return None
        try:
            _module = build.import_module(b)
        except Exception as e:
            _why_not = f"{type(e).__name__} loading {b.library}: {e}"
            logger.warning(
                "CPU kernels could not be loaded (%s); using the slower PyTorch code paths. "
                "`python -m pdserve.kernels --rebuild` builds them again.",
                _why_not,
            )
            return None
        from pdserve.envs import cpu_isa

        forced = cpu_isa()
        if forced:
            try:
                _module.set_isa(forced)
            except ValueError as e:
                raise ValueError(f"PDSERVE_CPU_ISA: {e}") from None
        logger.info(
            "CPU kernels loaded (ISA %s%s; CPU: %s; tiers here: %s) from %s",
            _module.isa(),
            ", forced by PDSERVE_CPU_ISA" if forced else "",
            " ".join(_module.cpu_features()) or "baseline",
            ", ".join(_module.available_isas()),
            b.directory,
        )
        return _module


def _built(rebuild: bool) -> build.Build:
    try:
        b = kernel_build()
        build.ensure_built(b, rebuild=rebuild)
    except build.SourcesChanged as e:  # edited while this process started: once more, anew
        logger.warning("CPU kernels: %s; building for the sources as they are now", e)
        b = kernel_build()
        build.ensure_built(b, rebuild=rebuild)
    return b


# What oneDNN, MKL and ATen are capped at for each tier, so that a process run at a lower tier
# than its host's runs the libraries' code of such a host too (their variables are read once, at
# first use: the cap must be set before torch runs anything).
_LIBRARY_CAPS = {
    "scalar": {
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "ATEN_CPU_CAPABILITY": "default",
    },
    "avx2": {
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
    },
    "avx2_vnni": {
        "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
    },
    "avx512": {
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        "ATEN_CPU_CAPABILITY": "avx512",
    },
    "avx512_bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "ATEN_CPU_CAPABILITY": "avx512"},
}
# tiers without the instructions oneDNN's bf16 matmuls need (avx512bw/vl/dq, or avx_ne_convert)
_NO_ONEDNN_BF16 = ("scalar", "avx2", "avx2_vnni", "neon", "neon_dotprod")
# AVX-512 without bf16 dot products: oneDNN runs bf16 there by converting, and took 2.9x the time
# of pdserve's kernel (AVX-512 FMA tiles) at 2,048 rows (benchmarks/isa_tiers.py,
# docs/benchmarks.md)
_SLOW_ONEDNN_BF16 = ("avx512",)


def cap_library_isas(tier: Optional[str]) -> None:
    """Cap oneDNN, MKL and ATen at ``tier`` (where the environment does not already say), for this
    process and its children; nothing for None or a tier they have no cap for."""
    for name, value in _LIBRARY_CAPS.get(tier or "", {}).items():
        os.environ.setdefault(name, value)


def onednn_bf16() -> tuple[bool, str]:
    """Whether bf16 matmuls above the GEMV's rows go to oneDNN here, and why not: oneDNN must be
    able to run bf16 (torch's check, and the tier: PDSERVE_CPU_ISA or the kernels' own), and, where
    pdserve's kernels are loaded, not be the slower of the two (AVX-512 without avx512_bf16)."""
    import torch

    from pdserve.envs import cpu_isa

    if not torch.backends.mkldnn.is_available():
        return False, "oneDNN is not available in this torch build"
    ops = load()
    tier = ops.isa_tier() if ops is not None else cpu_isa()
    forced = f"PDSERVE_CPU_ISA={tier}" if cpu_isa() else f"this CPU (tier {tier})"
    if tier in _NO_ONEDNN_BF16:
        return False, f"{forced} is below what oneDNN's bf16 matmuls need (avx512bw/vl/dq)"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return (
            False,
            "oneDNN's bf16 matmuls need avx512bw, avx512vl and avx512dq (or avx_ne_convert), "
            "which this CPU lacks",
        )
    if tier in _SLOW_ONEDNN_BF16:
        return False, (
            f"{forced} has AVX-512 without bf16 dot products (avx512_bf16): oneDNN converts there "
            "and is slower than pdserve's kernels"
        )
    return True, ""


def unavailable_reason() -> Optional[str]:
    """Why ``load()`` returned None (after it did), else None."""
    return _why_not


def _reset_for_tests() -> None:
    global _loaded, _module, _why_not
    with _lock:
        _loaded, _module, _why_not = False, None, None


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m pdserve.kernels``: build (or find) the kernels and say which ISA they use."""
    p = argparse.ArgumentParser(prog="python -m pdserve.kernels", description=main.__doc__)
    p.add_argument(
        "--rebuild", action="store_true", help="compile again even if a finished build exists"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="also log the compiler's output")
    args = p.parse_args(argv)
    from pdserve.log import setup_logging

    setup_logging("kernels", "debug" if args.verbose else "info")
    mod = load(rebuild=args.rebuild)
    if mod is None:
        print(f"pdserve CPU kernels: not available ({_why_not})")
        return 1
    print(
        f"pdserve CPU kernels: ready in {build_dir()} (ISA {mod.isa()}; tiers here: "
        f"{', '.join(mod.available_isas())})"
    )
    return 0
