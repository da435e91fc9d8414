"""pdserve's kernels at 1 and 2 threads: what the OpenMP build gains from torch's thread count.

  python benchmarks/kernel_threads.py [--library path/to/pdserve_cpu_kernels_*.so] [--repeat 7]

- decode GEMV: linear_vnni, 1 row, 4096 -> 8192 (a 64 MiB bf16 weight read per call, more than
  the test host's 32 MiB L3);
- prefill linear: linear_vnni, 512 rows, 1024 -> 4096;
- flash attention: paged_attention_bf16, one 1,024-token causal prefill, 16 query / 8 KV heads,
  head dim 128, page 16.

Each figure is the minimum over ``--repeat`` timings of a few calls (the host may be shared).
``--library`` times another build of the kernels (e.g. an older one without ``-fopenmp``).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import time

import torch


def best(fn, repeat: int, calls: int) -> dict[int, float]:
    """Seconds per call at 1 and 2 threads, the minimum over ``repeat`` rounds (the thread counts
    alternate within a round, so both see the same load on a shared host)."""
    times: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(repeat):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            fn()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[threads].append((time.perf_counter() - t0) / calls)
    return {t: min(v) for t, v in times.items()}


def workloads(ops):
    from pdserve.layers.linear import pack_vnni16

    gen = torch.Generator().manual_seed(0)
    w_dec = pack_vnni16(torch.randn(8192, 4096, generator=gen))
    x_dec, out_dec = (
        torch.randn(1, 4096, generator=gen).bfloat16(),
        torch.empty(1, 8192, dtype=torch.bfloat16),
    )
    w_pre = pack_vnni16(torch.randn(4096, 1024, generator=gen))
    x_pre, out_pre = (
        torch.randn(512, 1024, generator=gen).bfloat16(),
        torch.empty(512, 4096, dtype=torch.bfloat16),
    )
    L, H, KVH, D, page = 1024, 16, 8, 128, 16
    kc = torch.randn(L // page + 1, KVH, page, D, generator=gen).bfloat16()
    vc = torch.randn(L // page + 1, KVH, page, D, generator=gen).bfloat16()
    table = torch.arange(1, L // page + 1, dtype=torch.int32)[None]
    q, attn = (
        torch.randn(L, H, D, generator=gen).bfloat16(),
        torch.empty(L, H, D, dtype=torch.bfloat16),
    )
    lens, starts = torch.tensor([L], dtype=torch.int32), torch.tensor([0, L], dtype=torch.int32)
    return {
        "decode GEMV 1x4096->8192": (lambda: ops.linear_vnni(out_dec, x_dec, w_dec, None), 20),
        "prefill linear_vnni 512x1024->4096": (
            lambda: ops.linear_vnni(out_pre, x_pre, w_pre, None),
            3,
        ),
        "flash attention 1024 tokens": (
            lambda: ops.paged_attention_bf16(
                attn, q, kc, vc, table, lens, starts, 1 / math.sqrt(D), 0
            ),
            2,
        ),
    }


def load(library: str | None):
    if library is None:
        from pdserve import kernels

        return kernels.load()
    name = library.rsplit("/", 1)[-1].split(".")[0]
    spec = importlib.util.spec_from_file_location(name, library)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--library", help="a built kernels module to time instead of pdserve's current build"
    )
    p.add_argument("--repeat", type=int, default=15)
    args = p.parse_args()
    ops = load(args.library)
    print(f"{'workload':38} {'1 thread ms':>12} {'2 threads ms':>13} {'speed-up':>9}")
    for name, (fn, calls) in workloads(ops).items():
        ms = {t: s * 1e3 for t, s in best(fn, args.repeat, calls).items()}
        print(f"{name:38} {ms[1]:12.3f} {ms[2]:13.3f} {ms[1] / ms[2]:8.2f}x")


if __name__ == "__main__":
    main()
