"""One side of a KV transfer, driven over stdin/stdout (one JSON object a line), so a test can put
prefill and decode in different network namespaces with the real transfer backend between them.

``python -m tests.helpers.kv_window_peer decode BACKEND HOST NBYTES``: allocates NBYTES of pool
with the backend's allocator, registers it, opens a window for session ``s1`` and prints
``{"describe", "regions", "dst"}`` (``describe`` with bytes base64-encoded). Commands:
``fence`` (what decode does once the session's prefill is declared dead), ``reuse`` (another
request's KV takes the pages: fills the pool with its own pattern and prints its digest),
``check`` (prints the pool's digest and how many bytes of the writer's pattern are in the pool and
in the window's address range).

``... prefill BACKEND HOST NBYTES``: reads the decode's first line from stdin, connects, and on
``write`` starts one write of NBYTES bytes of pattern 0xAB into the window (in a thread) and
prints ``{"started"}``; ``wait`` prints ``{"done", "error"}`` once the write ended.
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import json
import sys
import threading

import numpy as np
import torch

from pdserve.disagg.transfer import get_backend

WRITER_BYTE = 0xAB
OTHER_BYTE = 0x5C


def _enc(d: dict) -> dict:
    return {
        k: {"b64": base64.b64encode(v).decode()} if isinstance(v, bytes) else v
        for k, v in d.items()
    }


def _dec(d: dict) -> dict:
    return {
        k: base64.b64decode(v["b64"]) if isinstance(v, dict) and "b64" in v else v
        for k, v in d.items()
    }


def _out(**kw) -> None:
    print(json.dumps(kw), flush=True)


def _make(backend: str, role: str, host: str):
    cls = get_backend(backend)
    return cls, (cls(role, host=host) if backend == "mooncake" else cls(role))


def decode(backend: str, host: str, nbytes: int) -> None:
    cls, be = _make(backend, "decode", host)
    pool = cls.buffer_allocator()(nbytes, torch.device("cpu"))
    be.register_regions([(pool.data_ptr(), nbytes)])
    win = be.open_window("s1")
    assert win is not None, "the backend offers no window for CPU buffers"
    _out(
        describe=_enc(be.describe()),
        regions=win.regions([(pool.data_ptr(), nbytes)]),
        dst=win.translate(pool.data_ptr()),
    )
    view = pool.numpy()
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "fence":
            _out(fenced=be.fence_window("s1"))
        elif cmd == "reuse":
            view[:] = OTHER_BYTE
            _out(digest=hashlib.sha256(view.tobytes()).hexdigest())
        elif cmd == "check":
            through = np.ctypeslib.as_array(
                (ctypes.c_uint8 * nbytes).from_address(win.translate(pool.data_ptr()))
            )
            _out(
                digest=hashlib.sha256(view.tobytes()).hexdigest(),
                writer_bytes_in_pool=int((view == WRITER_BYTE).sum()),
                writer_bytes_in_window=int((through == WRITER_BYTE).sum()),
            )
        elif cmd == "quit":
            break
    be.close()


def prefill(backend: str, host: str, nbytes: int) -> None:
    _, be = _make(backend, "prefill", host)
    src = np.full(nbytes, WRITER_BYTE, dtype=np.uint8)
    be.register_regions([(src.ctypes.data, nbytes)])
    peer = json.loads(sys.stdin.readline())
    be.connect("s1", _dec(peer["describe"]), [tuple(r) for r in peer["regions"]])
    result: dict = {}
    done = threading.Event()

    def write() -> None:
        try:  # one descriptor per 64 KiB, as a chunk of pages would be
            step = 1 << 16
            offs = np.arange(0, nbytes, step, dtype=np.int64)
            be.write(
                "s1", src.ctypes.data + offs, peer["dst"] + offs, np.minimum(step, nbytes - offs)
            ).wait(120)
        except Exception as e:
            result["error"] = f"{type(e).__name__}: {e}"
        done.set()

    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "write":
            threading.Thread(target=write, daemon=True).start()
            _out(started=True)
        elif cmd == "wait":
            done.wait(120)
            _out(done=done.is_set(), error=result.get("error", ""))
        elif cmd == "quit":
            break
    be.close()


if __name__ == "__main__":
    role, backend, host, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    (decode if role == "decode" else prefill)(backend, host, n)
