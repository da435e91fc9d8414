"""FP8 block-scaled weights (``pdserve/quantization/fp8_block.py``) against bf16 weights, one
thread, on one Llama-3.2-1B-shaped layer's matmuls (q/k/v fused 2048 -> 3072, o 2048 -> 2048,
gate/up fused 2048 -> 16384, down 8192 -> 2048):

    python benchmarks/fp8_weights.py [--rows 1,8,64,512] [--repeat 5]

Per row count, the median time of the layer's four matmuls: FP8 (the checkpoint's bytes, each
256-row panel dequantized exactly and multiplied by ``F.linear`` in bf16) and bf16
(``PackedBF16``: pdserve's GEMV up to 64 rows, oneDNN above, where it runs), and their ratio;
also the bytes each holds. Only the matmuls: no attention, no model."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F  # noqa: F401  (the FP8 path's matmul)

from pdserve import kernels
from pdserve.layers.linear import Linear, PackedBF16
from pdserve.quantization.fp8_block import BlockScaleView, Fp8Block, Fp8BlockLinear

SHAPES = [("qkv", 2048, 3072), ("o", 2048, 2048), ("gate_up", 2048, 16384), ("down", 8192, 2048)]
BLOCK = (128, 128)


def fp8_layer(k: int, n: int) -> Fp8BlockLinear:
    w = torch.randn(n, k) * 0.02
    rows, cols = -(-n // BLOCK[0]), -(-k // BLOCK[1])
    blocks = w.view(rows, BLOCK[0], cols, BLOCK[1])
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k)
    layer = Linear(k, n, bias=False)
    Fp8Block(BLOCK, None, ())._swap(layer)
    layer.weight.data.copy_(q)
    layer.weight_scale_inv.data.copy_(BlockScaleView(scale, [n, k], BLOCK, "w")[:])
    return Fp8BlockLinear(layer.weight, layer.weight_scale_inv, None, BLOCK[1])


def timed(fn, x, repeat: int) -> float:
    fn(x)
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(x)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="1,8,64,512")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    ops = kernels.load()
    print(f"kernels: ISA {ops.isa() if ops else 'none'}; one thread")
    layers = []
    for name, k, n in SHAPES:
        fp8 = fp8_layer(k, n)
        bf16 = PackedBF16(fp8.dequantized().to(torch.bfloat16), None, ops)
        layers.append((name, k, fp8, bf16))
    held8 = sum(f.nbytes for _, _, f, _ in layers)
    held16 = sum(b.nbytes for _, _, _, b in layers)
    print(f"bytes held: fp8 {held8 / 2**20:.1f} MiB, bf16 {held16 / 2**20:.1f} MiB")
    print("| rows | fp8 ms | bf16 ms | fp8 / bf16 |\n|---|---|---|---|")
    for rows in [int(r) for r in args.rows.split(",")]:
        t8 = t16 = 0.0
        for _, k, fp8, bf16 in layers:
            x = torch.randn(rows, k).to(torch.bfloat16)
            t8 += timed(fp8, x, args.repeat)
            t16 += timed(bf16, x, args.repeat)
        print(f"| {rows} | {t8 * 1e3:.2f} | {t16 * 1e3:.2f} | {t8 / t16:.2f} |")


if __name__ == "__main__":
    main()
