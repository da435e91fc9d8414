"""Quantized weights as published against bf16 weights at every instruction-set tier of this host,
one thread: FP8 block-scaled (``pdserve/quantization/fp8_block.py``) on one Llama-3.2-1B-shaped
layer's matmuls (q/k/v fused 2048 -> 3072, o 2048 -> 2048, gate/up fused 2048 -> 16384, down 8192
-> 2048), MXFP4 (``--format mxfp4``, ``quantization/mxfp4.py``) on 8 GPT-OSS-20B-shaped experts
(gate/up 2880 -> 5760, down 2880 -> 2880; a decode step reads 4 of them a layer), or int4 with a
float scale per 32 (``--format int4``, compressed-tensors' pack-quantized) on 8 Kimi-K2-shaped
experts (gate/up 7168 -> 4096, down 2048 -> 7168), and the same with int8 activations per row
(``--format w4a8``, ``linear_int4_w4a8``; int4 and w4a8 weights in one buffer of 2 MiB pages, as
an MoE layer's experts are served):

    python benchmarks/quantized_weights.py [--format fp8|mxfp4|int4|w4a8] [--tiers avx2,...]
        [--rows 1,8,64,512] [--json OUT]

Each tier runs in its own process with ``PDSERVE_CPU_ISA=<tier>`` and oneDNN, MKL and ATen capped
at the same tier (as ``benchmarks/isa_tiers.py`` does), so a column is what a host of that tier
runs. Per tier, best of 5:

- ``read GB/s``: a float32 sum over 512 MB (what memory speed is here);
- ``fp8 GEMV GB/s`` (``mxfp4 ...``) / ``bf16 GEMV GB/s``: the weights read per second at one row,
  over the packed bytes each reads (FP8: one byte per weight plus its row scales; MXFP4: half a
  byte plus a scale byte per 32; int4: half a byte plus a float32 scale per 32; bf16: two);
- ``ms fp8`` / ``ms bf16`` at each row count: the matmuls as served (FP8: ``linear_fp8`` up to 64
  rows, dequantized panels and oneDNN's bf16 GEMM above where pdserve takes oneDNN; MXFP4 / int4:
  ``linear_mxfp4`` / ``linear_int4`` at every row count; bf16: ``PackedBF16``), and their ratio;
- ``GFLOP/s`` at the largest row count: ``linear_fp8`` / ``linear_mxfp4`` alone (what
  batch-invariant serving and hosts without oneDNN's bf16 run) against pdserve's bf16 kernel
  ``linear_vnni``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from isa_tiers import lscpu, run_worker  # noqa: E402

WORKER = r"""
import json, os, sys, time, torch
torch.set_num_threads(1)
from pdserve import kernels
from pdserve.hostmem import huge_copies
from pdserve.layers.linear import PackedBF16, pack_vnni16
from pdserve.quantization.fp8_matmul import Fp8BlockLinear
from pdserve.quantization.int4_matmul import Int4GroupLinear
from pdserve.quantization.mxfp4_matmul import Mxfp4Linear

ops = kernels.load()
onednn = kernels.onednn_bf16()[0]
FORMAT = os.environ["Q_FORMAT"]
ROWS = [int(r) for r in os.environ["FP8_ROWS"].split(",")]

def best(fn, n=5):
    fn()
    t = float("inf")
    for _ in range(n):
        t0 = time.perf_counter(); fn(); t = min(t, time.perf_counter() - t0)
    return t

torch.manual_seed(0)
layers = []
if FORMAT == "fp8":
    for k, n in [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)]:  # qkv, o, gate_up, down
        w = torch.randn(n, k) * 0.02
        kb = -(-k // 128)
        blocks = torch.nn.functional.pad(w, (0, kb * 128 - k)).view(n // 128, 128, kb, 128)
        s = blocks.abs().amax(dim=(1, 3)) / 448.0
        q = (blocks / s[:, None, :, None]).view(n, kb * 128)[:, :k].to(torch.float8_e4m3fn)
        lin = Fp8BlockLinear(q, s.repeat_interleave(128, 0), None, 128)
        deq = lin.dequantized().to(torch.bfloat16)
        lin.use_kernels(ops, onednn)
        kernel = lambda o, x, f=lin: ops.linear_fp8(o, x, f.packed, f.packed_scale, None, 128)
        layers.append((k, n, lin, PackedBF16(deq, None, ops), pack_vnni16(deq), kernel))
elif FORMAT in ("int4", "w4a8"):
    w4a8 = FORMAT == "w4a8"
    for expert in range(8):
        for k, n in [(7168, 4096), (2048, 7168)]:
            blocks = torch.randint(0, 256, (n, k // 2), dtype=torch.int32).to(torch.uint8)
            lin = Int4GroupLinear(blocks, torch.rand(n, k // 32) * 1e-3 + 1e-4, None, 32, w4a8)
            deq = lin.dequantized().to(torch.bfloat16)
            lin.use_kernels(ops)
            if w4a8:
                kernel = lambda o, x, f=lin: ops.linear_int4_w4a8(
                    o, x, f.packed, f.packed_scale, None, 32
                )
            else:
                kernel = lambda o, x, f=lin: ops.linear_int4(
                    o, x, f.packed, f.packed_scale, None, 32
                )
            layers.append((k, n, lin, PackedBF16(deq, None, ops), pack_vnni16(deq), kernel))
    # in one buffer of 2 MiB pages, as an MoE layer's experts are served
    held = [layer[2] for layer in layers]
    for lin, copy in zip(held, huge_copies([lin.packed for lin in held])):
        lin.packed = copy
else:
    for expert in range(8):
        for k, n in [(2880, 5760), (2880, 2880)]:
            blocks = torch.randint(0, 256, (n, k // 2), dtype=torch.int32).to(torch.uint8)
            scales = torch.randint(118, 124, (n, k // 32), dtype=torch.int32).to(torch.uint8)
            lin = Mxfp4Linear(blocks, scales, None)
            deq = lin.dequantized().to(torch.bfloat16)
            lin.use_kernels(ops)
            kernel = lambda o, x, f=lin: ops.linear_mxfp4(o, x, f.packed, f.packed_scale, None)
            layers.append((k, n, lin, PackedBF16(deq, None, ops), pack_vnni16(deq), kernel))

out = {"isa": ops.isa(), "onednn_bf16": onednn}
big = torch.ones(128 << 20)
out["read GB/s"] = big.numel() * 4 / best(lambda: big.sum()) / 1e9
del big
x1 = [torch.randn(1, k).to(torch.bfloat16) for k, *_ in layers]
q_bytes = sum(f.nbytes for _, _, f, *_ in layers)
bf16_bytes = sum(n * k * 2 for k, n, *_ in layers)
tq = sum(best(lambda: f(x)) for (_, _, f, *_), x in zip(layers, x1))
t16 = sum(best(lambda: b(x)) for (_, _, _, b, *_), x in zip(layers, x1))
out[f"{FORMAT} GEMV GB/s"] = q_bytes / tq / 1e9
out["bf16 GEMV GB/s"] = bf16_bytes / t16 / 1e9
for rows in ROWS:
    xs = [torch.randn(rows, k).to(torch.bfloat16) for k, *_ in layers]
    a = sum(best(lambda: f(x), 3) for (_, _, f, *_), x in zip(layers, xs))
    b = sum(best(lambda: bb(x), 3) for (_, _, _, bb, *_), x in zip(layers, xs))
    out[f"ms {FORMAT} {rows}"] = a * 1e3
    out[f"ms bf16 {rows}"] = b * 1e3
    out[f"{FORMAT}/bf16 time {rows}"] = a / b
rows = ROWS[-1]
flops = sum(2 * rows * k * n for k, n, *_ in layers)
t_k = t_v = 0.0
for k, n, f, _, vnni, kernel in layers:
    x = torch.randn(rows, k).to(torch.bfloat16)
    o = torch.empty(rows, n, dtype=torch.bfloat16)
    t_k += best(lambda: kernel(o, x), 2)
    t_v += best(lambda: ops.linear_vnni(o, x, vnni, None), 2)
out[f"linear_{FORMAT} GFLOP/s {rows}"] = flops / t_k / 1e9
out[f"linear_vnni GFLOP/s {rows}"] = flops / t_v / 1e9
print(json.dumps(out))
"""


def run_tier(tier: str, rows: str, fmt: str) -> dict:
    return run_worker(tier, WORKER, {"FP8_ROWS": rows, "Q_FORMAT": fmt})


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tiers", default=None, help="comma-separated (default: every SIMD tier here)")
    ap.add_argument("--format", choices=("fp8", "mxfp4", "int4", "w4a8"), default="fp8")
    ap.add_argument("--rows", default="1,8,64,512")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from pdserve import kernels

    tiers = a.tiers.split(",") if a.tiers else kernels.load().available_isas()[1:]
    results = {t: run_tier(t, a.rows, a.format) for t in tiers}
    keys = list(next(iter(results.values())))
    print("| measurement | " + " | ".join(tiers) + " |")
    print("|---|" + "---|" * len(tiers))
    for k in keys:
        cells = [results[t].get(k, "") for t in tiers]
        fmt = [f"{v:.2f}" if isinstance(v, float) else str(v) for v in cells]
        print(f"| {k} | " + " | ".join(fmt) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": lscpu(), "tiers": results}, f, indent=2)


if __name__ == "__main__":
    main()
