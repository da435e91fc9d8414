"""``pdserve bench-transfer``: KV transfer bandwidth through pdserve vs the raw library vs memcpy.

    pdserve bench-transfer --size 1GiB --page-sizes 16KiB,256KiB,4MiB \\
        --backends local,mooncake,nixl --json t.json

Per backend and page size, this process plays prefill and a spawned one decode, each with a real
``KVPool`` (one layer, K and V, one item per page; decode's from the backend's allocator); decode's
pages are a random permutation, so every page is a descriptor. Each repeat runs, in turn:
- ``ours``: one room through ``KVManager`` / ``KVSender`` / ``KVReceiver``, timed on prefill from
  ``send()`` of every page to the transfer worker marking it Success (writes, metadata row,
  status message to decode);
  decode then checks that every page arrived where it belongs;
- ``raw`` (mooncake, nixl): the same descriptors through the library on the same engine/agent
  (Mooncake ``batch_transfer_sync_write`` per 512 descriptors, the engine's default queue limit;
  NIXL one ``WRITE`` polled in a tight loop), argument lists built before the clock starts;
- ``memcpy``: ``ctypes.memmove`` of the same descriptors into a second buffer of this process;
  ``bulk``: one torch copy of the whole size.
The best of ``--repeats`` counts (shared machines are noisy); ``--json`` keeps every sample.
``--request`` also times one 2048-token request of the demo model (30 layers, 3 KV heads, head
dim 64, bf16, page size 16: 47 MB in 7680 page items).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import time
from typing import Any, Optional

import numpy as np
import torch

from pdserve.bench.geometry import Geometry, fmt_size, parse_size
from pdserve.config import ServerArgs
from pdserve.disagg.bootstrap import BootstrapServer
from pdserve.disagg.descriptors import region_descriptors
from pdserve.disagg.kv_args import KVArgs
from pdserve.disagg.manager import KVManager, buffer_allocator, get_kv_class
from pdserve.disagg.metadata import MetadataBuffers
from pdserve.disagg.poll import KVPoll
from pdserve.disagg.transfer import get_backend
from pdserve.engine.kv_pool import KVPool

MOONCAKE_RAW_CALL = 512
POLL_S = 1e-3  # how often both sides poll their room, as a scheduler iteration would
DEMO_REQUEST = dict(layers=30, heads=3, head_dim=64, page_size=16, pages=128)  # 2048 tokens


# ---- the decode process ------------------------------------------------------------------


def _server_args(backend: str, geo: Geometry, mode: str, port: int):
    return ServerArgs(
        model_path="bench-transfer",
        device="cpu",
        page_size=geo.page_size,
        disaggregation_mode=mode,
        disaggregation_transfer_backend=backend,
        disaggregation_bootstrap_port=port,
        chunked_prefill_size=max(2048, geo.page_size),
        disaggregation_waiting_timeout=120.0,
        disaggregation_bootstrap_timeout=120.0,
    )


def _items(pool) -> Any:
    return pool._raw.view(
        pool.num_layers, 2, pool.num_pages, -1
    )  # [layers, K|V, pages, item bytes]


def decode_main(backend: str, geo: Geometry, port: int, out, cmds) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s decode %(name)s: %(message)s")
    alloc = buffer_allocator(backend, "decode")
    pool = KVPool(
        geo.layers,
        geo.pool_pages,
        geo.page_size,
        geo.heads,
        geo.head_dim,
        torch.bfloat16,
        "cpu",
        alloc,
    )
    meta = MetadataBuffers(8, allocator=alloc)
    kv_args = KVArgs.from_buffers(pool, meta, model_fingerprint="bench")
    mgr = KVManager(
        kv_args,
        "decode",
        _server_args(backend, geo, "decode", port),
        backend,
        bootstrap_host="127.0.0.1",
    )
    Receiver = get_kv_class(backend, "receiver")
    dst, expected = torch.tensor(geo.dst_pages()), torch.tensor(geo.src_pages())

    def arrived() -> bool:  # every destination item starts with the number of its source page
        return bool(
            (_items(pool)[:, :, dst, :8].contiguous().view(torch.int64)[..., 0] == expected).all()
        )

    out.put(("ready", None))
    try:
        while (cmd := cmds.get())[0] != "stop":
            if cmd[0] == "check":
                out.put(("checked", arrived()))
                continue
            _items(pool)[:, :, dst, :8] = 0  # clear the markers before a run
            if cmd[0] == "clear":  # a raw run follows
                out.put(("cleared", None))
            else:  # ("room", room): one room through the receiver
                rv = Receiver(mgr, f"127.0.0.1:{port}", cmd[1])
                rv.init()
                deadline = time.monotonic() + 120
                while rv.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
                    time.sleep(0.001)
                rv.send_metadata([geo.dst_pages()], 0)
                while (
                    rv.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline
                ):
                    time.sleep(POLL_S)
                out.put(("done", (cmd[1], int(rv.poll()), rv.failure_reason(), arrived())))
                rv.clear()
    finally:
        mgr.close()


# ---- this process: prefill, raw calls, memcpy ----------------------------------------------


class PrefillSide:
    def __init__(self, backend: str, geo: Geometry):
        self.backend, self.geo = backend, geo
        self.server = BootstrapServer("127.0.0.1", 0, expected_ranks=1)
        self.port = self.server.port
        self.pool = KVPool(
            geo.layers,
            geo.pool_pages,
            geo.page_size,
            geo.heads,
            geo.head_dim,
            torch.bfloat16,
            "cpu",
        )
        # each item's first 8 bytes: its page number, which decode checks at its destination
        _items(self.pool)[..., :8] = (
            torch.arange(geo.pool_pages)
            .view(1, 1, -1, 1)
            .expand(geo.layers, 2, -1, 1)
            .contiguous()
            .view(torch.uint8)
            .view(geo.layers, 2, geo.pool_pages, 8)
        )
        self.meta = MetadataBuffers(8)
        self.kv_args = KVArgs.from_buffers(self.pool, self.meta, model_fingerprint="bench")
        self.mgr = KVManager(
            self.kv_args,
            "prefill",
            _server_args(backend, geo, "prefill", self.port),
            backend,
            bootstrap_host="127.0.0.1",
        )
        self.Sender = get_kv_class(backend, "sender")
        ctx = mp.get_context("spawn")
        self.out, self.cmds = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=decode_main, args=(backend, geo, self.port, self.out, self.cmds), daemon=True
        )
        self.proc.start()
        self._expect("ready")
        self.room = 1000
        self._copy: Any = None
        # the clock stops when the transfer worker marks the room Success, not when this thread's
        # next poll sees it, so polling here can be lazy and steals no CPU from the transfer
        self._success_at: dict[int, float] = {}
        update = self.mgr.update_status

        def update_status(room: int, state: KVPoll, *args: Any, **kwargs: Any) -> Any:
            if state == KVPoll.Success:
                self._success_at.setdefault(room, time.perf_counter())
            return update(room, state, *args, **kwargs)

        self.mgr.update_status = update_status

    def _expect(self, kind: str, timeout: float = 180) -> Any:
        try:  # decode answers each command with one message, in order
            got, value = self.out.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(
                f"decode process: no {kind!r} in {timeout}s (alive: {self.proc.is_alive()})"
            ) from None
        assert got == kind, (got, kind)
        return value

    def ours(self) -> float:
        """Seconds from ``send()`` to Success on prefill, one room of every page."""

        self.room += 1
        self.cmds.put(("room", self.room))
        s = self.Sender(self.mgr, f"127.0.0.1:{self.port}", self.room)
        deadline = time.monotonic() + 120
        while s.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
            time.sleep(0.0005)
        s.init([self.geo.pages], 0)
        self.meta.set_row(0, self.room, 1)
        t0 = time.perf_counter()
        s.send([self.geo.src_pages()], last_chunk=True)
        while s.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        elapsed = self._success_at.pop(self.room, time.perf_counter()) - t0
        state, reason = s.poll(), s.failure_reason()
        s.clear()
        _, dstate, dreason, pages_ok = self._expect("done")
        if state != KVPoll.Success or dstate != KVPoll.Success or not pages_ok:
            raise RuntimeError(
                f"{self.backend}: transfer failed: "
                f"{reason or dreason or 'pages missing or misplaced at decode'}"
            )
        return elapsed

    def _descriptors(self, dst_ptrs: list[int]):
        """This pool's ``src_pages`` into ``dst_pages`` of the regions at ``dst_ptrs``, region by
        region."""
        regions = self.kv_args.regions
        return region_descriptors(
            [r.ptr for r in regions],
            dst_ptrs,
            [r.item_bytes for r in regions],
            self.geo.src_pages(),
            self.geo.dst_pages(),
        )

    def raw(self) -> Optional[float]:
        """Seconds for the same descriptors through the library directly (None: no library)."""
        # decode's buffers as this session sees them (a window of them on backends that fence late
        # writes)
        (sess,) = self.mgr.role.sessions.values()
        src, dst, lens = self._descriptors([r.ptr for r in sess.dst_regions])
        b = self.mgr.backend
        self.cmds.put(("clear",))
        self._expect("cleared")
        if self.backend == "mooncake":
            (session,) = b._sessions.values()
            calls = [
                (
                    src[i : i + MOONCAKE_RAW_CALL].tolist(),
                    dst[i : i + MOONCAKE_RAW_CALL].tolist(),
                    lens[i : i + MOONCAKE_RAW_CALL].tolist(),
                )
                for i in range(0, len(src), MOONCAKE_RAW_CALL)
            ]
            t0 = time.perf_counter()
            for s_, d_, n_ in calls:
                rc = b.engine.batch_transfer_sync_write(session, s_, d_, n_)
                if rc != 0:
                    raise RuntimeError(f"mooncake raw batch_transfer_sync_write returned {rc}")
            elapsed = time.perf_counter() - t0
        elif self.backend == "nixl":
            ((remote, mem, dev),) = b._remote.values()
            agent = b.agent
            local = np.stack([src, lens, np.zeros_like(src)], axis=1).astype(np.uint64)
            far = np.stack([dst, lens, np.full_like(dst, dev)], axis=1).astype(np.uint64)
            t0 = time.perf_counter()
            xfer = agent.initialize_xfer(
                "WRITE", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(far, mem), remote
            )
            state = agent.transfer(xfer)
            while state == "PROC":
                state = agent.check_xfer_state(xfer)
            elapsed = time.perf_counter() - t0
            agent.release_xfer_handle(xfer)
            if state != "DONE":
                raise RuntimeError(f"nixl raw transfer ended in state {state}")
        else:
            return None
        self.cmds.put(("check",))
        if not self._expect("checked"):
            raise RuntimeError(f"{self.backend}: raw transfer did not land")
        return elapsed

    def memcpy(self) -> tuple[float, float]:
        """Seconds for ``memcpy`` (ctypes.memmove of the same descriptors from this pool into a
        second buffer of this process) and ``bulk`` (one torch copy of the whole size)."""
        raw = self.pool._raw
        if self._copy is None:
            self._copy = torch.zeros_like(raw)  # touched now, not in the timed copy
        region = self.geo.pool_pages * self.geo.item_bytes
        src, dst, lens = self._descriptors(
            [self._copy.data_ptr() + i * region for i in range(len(self.kv_args.regions))]
        )
        memmove = ctypes.memmove
        t0 = time.perf_counter()
        for d, s_, n in zip(dst.tolist(), src.tolist(), lens.tolist()):
            memmove(d, s_, n)
        t1 = time.perf_counter()
        self._copy[: self.geo.total_bytes].copy_(raw[: self.geo.total_bytes])
        return t1 - t0, time.perf_counter() - t1

    def close(self) -> None:
        self._copy = None
        self.cmds.put(("stop",))
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.mgr.close()
        self.server.shutdown()


def available(backends: list[str]) -> tuple[list[str], dict[str, str]]:
    skipped = {}
    for name in backends:
        try:
            get_backend(name)
        except ValueError as e:
            skipped[name] = str(e)
    return [b for b in backends if b not in skipped], skipped


def run_backend(backend: str, geo: Geometry, repeats: int) -> dict[str, list[float]]:
    """Samples (seconds) of ours, raw, memcpy and bulk, interleaved repeat by repeat, so that the
    load of a shared machine hits every contender alike."""
    side = PrefillSide(backend, geo)
    try:
        side.ours()  # warm-up: connections, first touch of decode's pages
        samples: dict[str, list[float]] = {"ours": [], "raw": [], "memcpy": [], "bulk": []}
        for _ in range(repeats):
            got = {
                "ours": side.ours(),
                "raw": side.raw(),
                **dict(zip(("memcpy", "bulk"), side.memcpy())),
            }
            for k, v in got.items():
                samples[k] += [v] if v is not None else []
        return samples
    finally:
        side.close()


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next(
            (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu
        )
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "loadavg": os.getloadavg(),
    }


def _gbps(nbytes: int, seconds: list[float]) -> Optional[float]:
    return nbytes / min(seconds) / 1e9 if seconds else None


def _fmt(x: Optional[float], spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def summarize(geo: Geometry, samples: dict[str, list[float]]) -> dict[str, Any]:
    n = geo.total_bytes
    row = {
        "bytes": n,
        "descriptors": geo.layers * 2 * geo.pages,
        "samples_s": samples,
        **{f"{k}_gbps": _gbps(n, samples[k]) for k in ("ours", "raw", "memcpy", "bulk")},
        "ours_median_gbps": n / statistics.median(samples["ours"]) / 1e9,
    }
    row["ours_over_raw"] = row["ours_gbps"] / row["raw_gbps"] if row["raw_gbps"] else None
    row["ours_over_memcpy"] = row["ours_gbps"] / row["memcpy_gbps"]
    return row


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench-transfer", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--size",
        type=parse_size,
        default=parse_size("1GiB"),
        help="bytes per transfer (default 1GiB)",
    )
    p.add_argument(
        "--page-sizes", default="16KiB,256KiB,4MiB", help="comma-separated bytes per page and K|V"
    )
    p.add_argument(
        "--backends", default="local,mooncake,nixl", help="comma-separated transfer backends"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs per measurement (the best counts)"
    )
    p.add_argument(
        "--request",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time one 2048-token demo-model request (47 MB) per backend",
    )
    p.add_argument("--json", metavar="FILE", help="write every sample and the summary here")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    try:
        page_sizes = [parse_size(s) for s in args.page_sizes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    backends, skipped = available([b.strip() for b in args.backends.split(",") if b.strip()])
    for name, why in skipped.items():
        print(f"skipping {name}: {why}", file=sys.stderr)

    torch.set_num_threads(1)
    result: dict[str, Any] = {
        "command": " ".join(["pdserve bench-transfer", *argv]),
        "machine": machine(),
        "size": args.size,
        "repeats": args.repeats,
        "skipped": skipped,
        "rows": [],
        "request": [],
    }
    print(
        f"# {fmt_size(args.size)} per transfer, best of {args.repeats}; "
        f"{result['machine']['nproc']} CPUs, {result['machine']['cpu']}, load average "
        f"{result['machine']['loadavg'][0]:.1f}"
    )
    print(
        f"{'page':>8} {'backend':>9} {'ours GB/s':>10} {'raw GB/s':>9} {'memcpy':>7} {'bulk':>6} "
        f"{'ours/raw':>9} {'ours/memcpy':>12}"
    )
    for page_bytes in page_sizes:
        geo = Geometry.for_page_bytes(args.size, page_bytes)
        for backend in backends:
            samples = run_backend(backend, geo, args.repeats)
            row = {"page_bytes": page_bytes, "backend": backend, **summarize(geo, samples)}
            result["rows"].append(row)
            print(
                f"{fmt_size(page_bytes):>8} {backend:>9} {_fmt(row['ours_gbps']):>10} "
                f"{_fmt(row['raw_gbps']):>9} {_fmt(row['memcpy_gbps']):>7} "
                f"{_fmt(row['bulk_gbps']):>6} {_fmt(row['ours_over_raw']):>9} "
                f"{_fmt(row['ours_over_memcpy']):>12}",
                flush=True,
            )
    if args.request:
        geo = Geometry(**DEMO_REQUEST, seed=1)
        print(
            f"\n# one 2048-token demo-model request: {geo.total_bytes / 1e6:.1f} MB, "
            f"{geo.layers * 2 * geo.pages} descriptors (decode pages scattered)"
        )
        print(f"{'backend':>9} {'ours ms':>8} {'raw ms':>7} {'memcpy ms':>10}")
        for backend in backends:
            row = {"backend": backend, **summarize(geo, run_backend(backend, geo, args.repeats))}
            ms = {k: min(v) * 1e3 if v else None for k, v in row["samples_s"].items()}
            row.update(ours_ms=ms["ours"], raw_ms=ms["raw"], memcpy_ms=ms["memcpy"])
            result["request"].append(row)
            print(
                f"{backend:>9} {ms['ours']:>8.1f} {_fmt(ms['raw'], '.1f'):>7} "
                f"{ms['memcpy']:>10.1f}",
                flush=True,
            )
    result["loadavg_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
