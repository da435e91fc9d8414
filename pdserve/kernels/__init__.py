"""pdserve's CPU kernels: a small C++ extension built with ``torch.utils.cpp_extension``.

Paged decode attention, RMSNorm (+ residual), RoPE, SiLU-mul, a bf16 GEMV for small batches and
the decoder stack of a bf16 model for decode steps (``csrc/``). The build is compiled for the baseline ISA of the host compiler: functions that use
AVX-512 name their ISA extensions in a ``target`` attribute and run only where the CPU has them
(checked at run time), so one build serves every x86-64 host and never uses ``-march=native``.

It is built on first use (or ahead of time by ``python -m pdserve.kernels``) into
``<cache>/kernels/<torch version>-<python>-<source hash>``; a process that finds it built just
loads it. If there is no compiler, the build fails, or ``PDSERVE_DISABLE_CPU_KERNELS=1``,
``load()`` returns None after one log line and callers use their PyTorch code instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Optional

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = ("bindings.cpp", "paged_attention.cpp", "elementwise.cpp", "gemv.cpp", "decode_model.cpp", "flash_attention.cpp", "int8_gemm.cpp", "gemm_f32.cpp", "moe.cpp")
HEADERS = ("common.h",)
# no FMA contraction: the kernels round where HF rounds (an explicit fmadd is the only fused op)
CFLAGS = ("-O3", "-std=c++17", "-fno-math-errno", "-ffp-contract=off")

_lock = threading.Lock()
_loaded = False
_module: Optional[ModuleType] = None
_why_not: Optional[str] = None


def source_hash() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((SOURCE_DIR / name).read_bytes())
    h.update(" ".join(CFLAGS).encode())
    return h.hexdigest()[:12]


def build_dir() -> Path:
    import torch

    from pdserve.envs import cache_dir

    tag = f"torch{torch.__version__.replace('+', '_')}-py{sys.version_info[0]}{sys.version_info[1]}-{source_hash()}"
    return Path(cache_dir()) / "kernels" / tag


def _build(verbose: bool) -> ModuleType:
    from torch.utils.cpp_extension import load as cpp_load

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    # Our own lock, released by the OS if its holder dies: torch's lock file (``lock`` in the
    # build directory) would make every later build wait forever after a killed one.
    with open(out / ".pdserve-build.lock", "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        stale = out / "lock"
        if stale.exists():
            stale.unlink()
        return cpp_load(
            name=f"pdserve_cpu_kernels_{source_hash()}",
            sources=[str(SOURCE_DIR / s) for s in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_include_paths=[str(SOURCE_DIR)],
            build_directory=str(out),
            verbose=verbose,
        )


def load(verbose: bool = False) -> Optional[ModuleType]:
    """The extension module, or None when it is disabled or cannot be built (logged once)."""
    global _loaded, _module, _why_not
    with _lock:
        if _loaded:
            return _module
        _loaded = True
        from pdserve.envs import cpu_kernels_disabled

        if cpu_kernels_disabled():
            _why_not = "disabled by PDSERVE_DISABLE_CPU_KERNELS"
            logger.info("CPU kernels %s: using the PyTorch code paths", _why_not)
            return None
        try:
            _module = _build(verbose)
        except Exception as e:  # no compiler, no ninja, a failed build: serve without the kernels
            _why_not = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            logger.warning("CPU kernels could not be built (%s); using the slower PyTorch code paths. "
                           "Install a C++ compiler (e.g. Debian's g++) and ninja to enable them.", _why_not)
            return None
        logger.info("CPU kernels loaded (ISA %s) from %s", _module.isa(), build_dir())
        return _module


def unavailable_reason() -> Optional[str]:
    """Why ``load()`` returned None (after it did), else None."""
    return _why_not


def _reset_for_tests() -> None:
    global _loaded, _module, _why_not
    with _lock:
        _loaded, _module, _why_not = False, None, None


def main() -> int:
    """``python -m pdserve.kernels``: build (or find) the kernels and say which ISA they use."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mod = load(verbose="-v" in sys.argv)
    if mod is None:
        print(f"pdserve CPU kernels: not available ({_why_not})")
        return 1
    print(f"pdserve CPU kernels: ready in {build_dir()} (ISA {mod.isa()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
