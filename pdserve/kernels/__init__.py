"""pdserve's CPU kernels: a small C++ extension of torch (``csrc/``), built by ``build.py``.

Paged decode attention, RMSNorm (+ residual), RoPE, SiLU-mul, a bf16 GEMV for small batches and
the decoder stack of a bf16 model for decode steps (``csrc/``). The build is compiled for the baseline ISA of the host compiler: functions that use
AVX-512 name their ISA extensions in a ``target`` attribute and run only where the CPU has them
(checked at run time), so one build serves every x86-64 host and never uses ``-march=native``.
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
import threading
from pathlib import Path
from types import ModuleType
from typing import Optional

from pdserve.kernels import build

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = ("bindings.cpp", "paged_attention.cpp", "elementwise.cpp", "gemv.cpp", "decode_model.cpp", "flash_attention.cpp", "int8_gemm.cpp", "gemm_f32.cpp", "moe.cpp", "amx.cpp", "amx_gemm.cpp", "amx_attention.cpp", "amx_selfcheck.cpp")
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
            _why_not = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            hint = (" Install a C++ compiler (e.g. Debian's g++) and ninja to enable them."
                    if isinstance(e, build.MissingTool) else "")
            logger.warning("CPU kernels could not be built (%s); using the slower PyTorch code paths.%s",
                           _why_not, hint)
            return None
        try:
            _module = build.import_module(b)
        except Exception as e:
            _why_not = f"{type(e).__name__} loading {b.library}: {e}"
            logger.warning("CPU kernels could not be loaded (%s); using the slower PyTorch code paths. "
                           "`python -m pdserve.kernels --rebuild` builds them again.", _why_not)
            return None
        logger.info("CPU kernels loaded (ISA %s) from %s", _module.isa(), b.directory)
        return _module


def _built(rebuild: bool) -> build.Build:
    try:
        b = kernel_build()
        build.ensure_built(b, rebuild=rebuild)
    except build.SourcesChanged as e:  # edited while this process started: once more, for the new sources
        logger.warning("CPU kernels: %s; building for the sources as they are now", e)
        b = kernel_build()
        build.ensure_built(b, rebuild=rebuild)
    return b


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
    p.add_argument("--rebuild", action="store_true", help="compile again even if a finished build exists")
    p.add_argument("-v", "--verbose", action="store_true", help="also log the compiler's output")
    args = p.parse_args(argv)
    from pdserve.log import setup_logging

    setup_logging("kernels", "debug" if args.verbose else "info")
    mod = load(rebuild=args.rebuild)
    if mod is None:
        print(f"pdserve CPU kernels: not available ({_why_not})")
        return 1
    print(f"pdserve CPU kernels: ready in {build_dir()} (ISA {mod.isa()})")
    return 0
