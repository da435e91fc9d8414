"""The GEMV kernel (``linear_vnni``) against oneDNN's prepacked bf16 matmul at a few row counts, on
one decoder layer's matmul shapes: where ``GEMV_MAX_ROWS`` (pdserve/layers/linear.py) should be.

  taskset -c 1 python benchmarks/gemv_rows.py [--rows 8,16,32,64,128] [--shapes 1b|demo]
      [--threads 1]

Shapes (out, in) of qkv, o, gate_up and down: ``1b`` Llama-3.2-1B (hidden 2048, 32/8 heads of 64,
MLP 8192), ``demo`` SmolLM2-135M (hidden 576, 9/3 heads of 64, MLP 1536). Each is the best of 3
passes over the four matmuls, after one untimed pass.
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {
    "1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
    "demo": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
}


def best(fn, passes: int = 3) -> float:
    fn()
    t = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", default="8,16,32,64,128")
    p.add_argument("--shapes", default="1b", choices=SHAPES)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from pdserve import kernels
    from pdserve.layers.linear import PackedBF16

    ops = kernels.load()
    if ops is None:
        raise SystemExit(f"pdserve's CPU kernels are not available: {kernels.unavailable_reason()}")
    shapes = SHAPES[a.shapes]
    ws = [PackedBF16(torch.randn(n, k) * 0.02, None, ops) for n, k in shapes]
    print("| rows | GEMV ms | oneDNN ms | GEMV / oneDNN | GEMV GFLOP/s |")
    print("|---|---|---|---|---|")
    for m in (int(r) for r in a.rows.split(",")):
        xs = {k: torch.randn(m, k).bfloat16() for _, k in shapes}
        outs = {n: torch.empty(m, n, dtype=torch.bfloat16) for n, _ in shapes}
        g = best(
            lambda: [
                ops.linear_vnni(outs[w.out_features], xs[w.in_features], w.vnni, None) for w in ws
            ]
        )
        o = best(
            lambda: [
                torch.ops.mkldnn._linear_pointwise(
                    xs[w.in_features], w.onednn, None, "none", [], ""
                )
                for w in ws
            ]
        )
        flops = 2 * m * sum(n * k for n, k in shapes)
        print(
            f"| {m} | {g * 1e3:.2f} | {o * 1e3:.2f} | {g / o:.2f} | {flops / g / 1e9:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
