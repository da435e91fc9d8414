"""``PDSERVE_*`` environment variables: the one place they are read (at start-up, never at import).

Each variable is the environment equivalent of a server flag; an explicit flag wins over the
environment, the environment wins over the built-in default.
"""

from __future__ import annotations

import functools
import os
from typing import Any

# env var -> ServerArgs field
ENV_TO_FIELD = {
    "PDSERVE_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "disaggregation_bootstrap_timeout",
    "PDSERVE_DISAGGREGATION_WAITING_TIMEOUT": "disaggregation_waiting_timeout",
    "PDSERVE_DISAGGREGATION_HEARTBEAT_INTERVAL": "disaggregation_heartbeat_interval",
    "PDSERVE_DISAGGREGATION_HEARTBEAT_MISSES": "disaggregation_heartbeat_misses",
    "PDSERVE_NUM_RESERVED_DECODE_TOKENS": "num_reserved_decode_tokens",
    "PDSERVE_DISAGGREGATION_PREALLOC_TIMEOUT": "disaggregation_prealloc_timeout",
    "PDSERVE_DISAGGREGATION_MAX_PREALLOC_QUEUE": "disaggregation_max_prealloc_queue",
    "PDSERVE_DISAGGREGATION_SECRET": "disaggregation_secret",
    "PDSERVE_API_KEY": "api_key",
    "PDSERVE_DISAGGREGATION_FAULT_PROB": "disaggregation_fault_prob",
    "PDSERVE_DISAGGREGATION_FAULT_MODE": "disaggregation_fault_mode",
    "PDSERVE_DISAGGREGATION_FAULT_DELAY": "disaggregation_fault_delay",
    "PDSERVE_DISAGGREGATION_FAULT_RANKS": "disaggregation_fault_ranks",
    "PDSERVE_TORCH_NUM_THREADS": "torch_num_threads",
    "PDSERVE_HICACHE_FILE_BACKEND_STORAGE_DIR": "hicache_file_backend_storage_dir",
    "PDSERVE_HICACHE_FILE_BACKEND_MAX_GB": "hicache_file_backend_max_gb",
}


def cache_dir() -> str:
    """Where prepared models and other artefacts live (``PDSERVE_CACHE`` or ~/.cache/pdserve)."""
    return os.environ.get("PDSERVE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "pdserve"
    )


def api_key() -> str | None:
    """``PDSERVE_API_KEY``: the router's ``--api-key`` when the flag is not given (servers read it
    through ``ENV_TO_FIELD``)."""
    return os.environ.get("PDSERVE_API_KEY") or None


def cpu_kernels_disabled() -> bool:
    """``PDSERVE_DISABLE_CPU_KERNELS=1``: do not build or use the C++ CPU kernels (PyTorch paths
    only)."""
    return os.environ.get("PDSERVE_DISABLE_CPU_KERNELS", "").strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
    )


def cpu_isa() -> str | None:
    """``PDSERVE_CPU_ISA``: cap pdserve's CPU kernels at an instruction-set tier (``scalar``,
    ``avx2``, ``avx2_vnni``, ``avx512``, ``avx512_bf16``, ``amx``; on Arm ``neon``,
    ``neon_dotprod``, ``neon_bf16``), so that one host runs the paths of hosts with less;
    ``pdserve``'s commands also cap oneDNN, MKL and ATen at it
    (``pdserve.kernels.cap_library_isas``)."""
    return os.environ.get("PDSERVE_CPU_ISA", "").strip().lower() or None


def rank_start_method() -> str:
    """``PDSERVE_RANK_START_METHOD``: ``fork`` (the default: a CPU server's several ranks on one
    node are forked from its front end once it imported torch and the engine) or ``spawn`` (each
    rank a fresh interpreter, as a one-rank server's and GPU ranks always are)."""
    method = os.environ.get("PDSERVE_RANK_START_METHOD", "").strip().lower() or "fork"
    if method not in ("fork", "spawn"):
        raise ValueError(f"PDSERVE_RANK_START_METHOD={method!r}: expected fork or spawn")
    return method


def take_parent_pid() -> int | None:
    """``PDSERVE_PARENT_PID``: the pid of the process this one must not outlive (``pdserve launch``
    sets it for its servers and router; ``lifetime.end_with_parent``). Removed from the
    environment once read, so this process's own children do not inherit it."""
    raw = os.environ.pop("PDSERVE_PARENT_PID", "").strip()
    return int(raw) if raw.isdigit() else None


def apply_env_defaults(kwargs: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Fill server arguments still at their built-in default (``defaults``: field -> default) from
    the environment."""
    for env, name in ENV_TO_FIELD.items():
        raw = os.environ.get(env)
        if raw is None or name not in defaults:
            continue
        if name in kwargs and kwargs[name] != defaults[name]:
            continue  # an explicit value wins
        default = defaults[name]
        kind = type(default) if default is not None else str
        if name == "torch_num_threads":
            kind = int
        try:
            kwargs[name] = kind(raw)
        except ValueError as e:
            raise ValueError(f"{env}: cannot parse {raw!r} as {kind.__name__}") from e


@functools.cache
def cuda_available() -> bool:
    """``torch.cuda.is_available()``, without importing torch when its build has no GPU support
    (a CPU wheel: its ``torch/version.py`` names no CUDA or HIP version). Importing torch costs
    about a CPU second, which the HTTP front end and the router otherwise never spend."""
    build = _torch_build()
    if build is not None and not (getattr(build, "cuda", None) or getattr(build, "hip", None)):
        return False
    import torch

    return torch.cuda.is_available()


def _torch_build():
    """torch's ``version.py`` run on its own (torch itself not imported), or None when it cannot
    be found or run."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "version.py")
    build = importlib.util.spec_from_file_location("pdserve_torch_build", path)
    try:
        module = importlib.util.module_from_spec(build)
        build.loader.exec_module(module)
    except Exception:  # missing or unexpected: ask torch itself
        return None
    return module
