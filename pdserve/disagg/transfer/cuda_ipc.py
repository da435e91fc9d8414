"""CUDA path of the ``local`` backend: decode's buffers in device memory shared by CUDA IPC.

Decode allocates each buffer as a torch CUDA tensor and exports its storage's IPC handle
(``_share_cuda_``, the mechanism ``torch.multiprocessing`` uses, but carried as plain fields
in ``Register`` instead of a pickle). Prefill opens the handle (``_new_shared_cuda``) and copies
with ``cudaMemcpyAsync(kind=cudaMemcpyDefault)`` on its own stream, one call per descriptor.

Caveats: both processes must see the GPU under the same index (same CUDA_VISIBLE_DEVICES
mapping); the exporting tensor must stay alive while any peer has it open (the KV pool holds it).
This path has not been exercised in CI (no GPU there); the CPU path in ``local.py`` has.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
import torch

from pdserve.disagg.transfer.base import TransferError

_CUDA_MEMCPY_DEFAULT = 4
_lib = None
_lib_lock = threading.Lock()
_streams: dict[int, "torch.cuda.Stream"] = {}


def allocate(nbytes: int, device: torch.device) -> tuple[torch.Tensor, dict[str, Any]]:
    tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    (dev, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
        tensor.untyped_storage()._share_cuda_()
    )
    share = {
        "device": int(dev),
        "handle": bytes(handle),
        "storage_size": int(size),
        "storage_offset": int(offset),
        "ref_counter_handle": bytes(ref_handle),
        "ref_counter_offset": int(ref_offset),
        "event_handle": bytes(event_handle) if event_handle else b"",
        "event_sync_required": bool(event_sync),
    }
    return tensor, share


def open_shared(share: dict[str, Any]) -> torch.Tensor:
    """A uint8 tensor over the peer's exported storage (its ``data_ptr()`` is the local base)."""
    storage = torch.UntypedStorage._new_shared_cuda(
        share["device"],
        share["handle"],
        share["storage_size"],
        share["storage_offset"],
        share["ref_counter_handle"],
        share["ref_counter_offset"],
        share["event_handle"] or None,
        share["event_sync_required"],
    )
    t = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", share["device"]))
    t.set_(storage, 0, (share["storage_size"],), (1,))
    return t


def _cudart():
    global _lib
    with _lib_lock:
        if _lib is None:
            names = ["libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0", "libcudart.so"]
            try:
                import os

                import nvidia.cuda_runtime as rt  # pip CUDA wheels ship libcudart here

                names += [os.path.join(list(rt.__path__)[0], "lib", n) for n in names]
            except ImportError:
                pass
            for name in names:
                try:
                    lib = ctypes.CDLL(name)
                    break
                except OSError:
                    continue
            else:
                raise TransferError("local backend (CUDA): libcudart not found")
            lib.cudaMemcpyAsync.argtypes = [
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_void_p,
            ]
            lib.cudaMemcpyAsync.restype = ctypes.c_int
            _lib = lib
        return _lib


def copy_batch(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray, device: str) -> None:
    """Copy every (src, dst, len) and wait for completion; raises ``TransferError``."""
    lib = _cudart()
    dev = torch.device(device) if str(device).startswith("cuda") else torch.device("cuda", 0)
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    with torch.cuda.device(idx):
        stream = _streams.get(idx)
        if stream is None:
            stream = _streams.setdefault(idx, torch.cuda.Stream(idx))
        handle = stream.cuda_stream
        for d, s, n in zip(dst.tolist(), src.tolist(), lengths.tolist()):
            rc = lib.cudaMemcpyAsync(d, s, n, _CUDA_MEMCPY_DEFAULT, handle)
            if rc != 0:
                raise TransferError(
                    f"cudaMemcpyAsync({d:#x} <- {s:#x}, {n}) failed with CUDA error {rc}"
                )
        stream.synchronize()
