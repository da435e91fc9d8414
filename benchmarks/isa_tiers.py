"""pdserve's CPU kernels at every instruction-set tier of this host, side by side, one thread.

  python benchmarks/isa_tiers.py [--tiers scalar,avx2,...] [--json out.json]

Each tier runs in its own process with ``PDSERVE_CPU_ISA=<tier>`` and oneDNN, MKL and ATen capped
at the same tier (``pdserve.kernels.cap_library_isas``): the AVX2 column is what an AVX2-only host
runs, the PyTorch paths beside it included. Per tier:

- batch-1 weight streaming: the demo model's matmul shapes (30 layers + LM head) and one
  Llama-3.2-1B-shaped layer through the bf16 GEMV, GB/s of weights read, against this process's
  read bandwidth (a float32 sum over 512 MB: what memory speed is here);
- bf16 matmuls of the demo model's layer shapes at 1, 8, 32 and 2,048 rows: pdserve's kernel
  (``linear_vnni``, what bf16 runs where oneDNN has no bf16) and, where the tier has it, oneDNN's
  prepacked bf16 (timed wherever it runs; pdserve takes it only where it has bf16 dot products);
  float32 at 2,048 rows: ``F.linear`` (MKL / oneDNN) and the batch-invariant
  ``linear_f32``; w8a8_int8 at 1 and 2,048 rows; GFLOP/s;
- attention: a decode batch (32 requests, 880-1,320-token contexts, 9 q / 3 KV heads, head dim 64)
  through the flash kernel (bf16 KV) and the paged decode kernel (float32 KV), and a 1,024-token
  causal prefill through the flash kernel, against gather + SDPA / SDPA at the same tier.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, random, time, torch, torch.nn.functional as F
torch.set_num_threads(1)
from pdserve import kernels
from pdserve.layers.linear import PackedBF16, PackedF32, PackedW8A8, pack_vnni16

ops = kernels.load()
# oneDNN's bf16 is timed wherever it runs at this tier (pdserve takes it only where it is faster)
onednn = (
    torch.ops.mkldnn._is_mkldnn_bf16_supported() and ops.isa_tier() not in kernels._NO_ONEDNN_BF16
)

def bench(fn, n=5):
    fn()
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter(); fn(); best = min(best, time.perf_counter() - t0)
    return best

out = {
    "isa": ops.isa(),
    "aten": torch.backends.cpu.get_cpu_capability(),
    "onednn_bf16_taken": kernels.onednn_bf16()[0],
}
big = torch.ones(128 << 20)
out["read_gb_s"] = big.numel() * 4 / bench(lambda: big.sum(), 5) / 1e9
del big

DEMO = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LLAMA1B = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]
for name, shapes, repeat in (
    ("demo", DEMO * 30 + [(49152, 576)], 1), ("llama1b_layer", LLAMA1B, 4)
):
    ws = [pack_vnni16(torch.randn(n, k)) for n, k in shapes]
    xs = {k: torch.randn(1, k).bfloat16() for _, k in shapes}
    os_ = {n: torch.empty(1, n, dtype=torch.bfloat16) for n, _ in shapes}
    def gemv():
        for _ in range(repeat):
            for (n, k), w in zip(shapes, ws):
                ops.linear_vnni(os_[n], xs[k], w, None)
    out[f"gemv_{name}_gb_s"] = repeat * sum(n * k * 2 for n, k in shapes) / bench(gemv, 5) / 1e9

gen = torch.Generator().manual_seed(0)
weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in DEMO]
for rows in (1, 8, 32, 2048):
    flops = sum(2 * rows * n * k for n, k in DEMO)
    kern = [PackedBF16(w, None, ops, onednn=False) for w in weights]
    xb = {k: torch.randn(rows, k, generator=gen).bfloat16() for _, k in DEMO}
    out[f"bf16_{rows}_kernel_gflop_s"] = (
        flops / bench(lambda: [p(xb[p.in_features]) for p in kern]) / 1e9
    )
    if onednn:
        dnn = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), rows) for w in weights]
        out[f"bf16_{rows}_onednn_gflop_s"] = flops / bench(
            lambda: [
                torch.ops.mkldnn._linear_pointwise(xb[w.shape[1]], w, None, "none", [], "")
                for w in dnn
            ]
        ) / 1e9
    if rows in (1, 2048):
        q = [PackedW8A8(w, None, ops) for w in weights]
        out[f"w8a8_{rows}_gop_s"] = flops / bench(lambda: [p(xb[p.in_features]) for p in q]) / 1e9
    if rows == 2048:
        xf = {k: x.float() for k, x in xb.items()}
        out["f32_2048_torch_gflop_s"] = (
            flops / bench(lambda: [F.linear(xf[w.shape[1]], w) for w in weights]) / 1e9
        )
        f32 = [PackedF32(w, None, ops) for w in weights]
        out["f32_2048_linear_f32_gflop_s"] = (
            flops / bench(lambda: [p(xf[p.in_features]) for p in f32]) / 1e9
        )

rng = random.Random(0)
B, H, KVH, D, PS = 32, 9, 3, 64, 16
lens = torch.tensor([rng.randint(880, 1320) for _ in range(B)], dtype=torch.int32)
max_pages = (int(lens.max()) + PS - 1) // PS
P = B * max_pages + 1
table = (torch.randperm(P - 1, generator=gen)[: B * max_pages] + 1).view(B, max_pages).int()
L = max_pages * PS
kpos = torch.arange(L)
gather = (
    (table.long()[:, kpos // PS][:, None, :] * KVH + torch.arange(KVH)[None, :, None]) * PS
    + (kpos % PS)[None, None, :]
)
mask = (kpos[None, :] < lens[:, None].long())[:, None, None, :]
for dtype in (torch.bfloat16, torch.float32):
    kc, vc = torch.randn(P, KVH, PS, D).to(dtype), torch.randn(P, KVH, PS, D).to(dtype)
    q = torch.randn(B, H, D).to(dtype)
    o = torch.empty_like(q)
    tag = "bf16" if dtype == torch.bfloat16 else "f32"
    if dtype == torch.bfloat16:
        if ops.flash_supported(D):
            starts = torch.arange(B + 1, dtype=torch.int32)
            t = bench(lambda: ops.paged_attention_bf16(o, q, kc, vc, table, lens, starts, 1 / 8, 0))
        else:
            t = float("nan")
    else:
        t = bench(lambda: ops.paged_decode_attention(o, q, kc, vc, table, lens, 1 / 8, 0))
    kr, vr = kc.reshape(-1, D), vc.reshape(-1, D)
    ref = bench(
        lambda: F.scaled_dot_product_attention(
            q.unsqueeze(2), kr[gather], vr[gather], attn_mask=mask, scale=1 / 8, enable_gqa=True
        ),
        3,
    )
    out[f"decode_attn_{tag}_kernel_ms"] = t * 1e3
    out[f"decode_attn_{tag}_gather_sdpa_ms"] = ref * 1e3
T = 1024
pages = T // PS
kc, vc = (
    torch.randn(pages + 1, KVH, PS, D).bfloat16(),
    torch.randn(pages + 1, KVH, PS, D).bfloat16(),
)
q = torch.randn(T, H, D).bfloat16()
o = torch.empty_like(q)
flops = 4 * T * T * D * H / 2
if ops.flash_supported(D):
    tbl = (torch.arange(pages) + 1).view(1, pages).int()
    out["prefill_attn_flash_gflop_s"] = flops / bench(lambda: ops.paged_attention_bf16(
        o, q, kc, vc, tbl, torch.tensor([T], dtype=torch.int32),
        torch.tensor([0, T], dtype=torch.int32), 1 / 8, 0), 3) / 1e9
qq, kk, vv = (
    q.transpose(0, 1)[None],
    torch.randn(1, KVH, T, D).bfloat16(),
    torch.randn(1, KVH, T, D).bfloat16(),
)
out["prefill_attn_sdpa_gflop_s"] = flops / bench(
    lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True), 3
) / 1e9
print(json.dumps(out))
"""


def lscpu() -> dict:
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {
        "model": fields.get("Model name", "?").strip(),
        "flags": fields.get("Flags", "").strip(),
    }


def run_tier(tier: str) -> dict:
    return run_worker(tier, WORKER, {})


def run_worker(tier: str, worker: str, extra_env: dict) -> dict:
    """Python source ``worker`` in a process at ISA ``tier`` (the libraries capped with it), one
    thread; its last line of output, parsed as JSON."""
    from pdserve.kernels import _LIBRARY_CAPS

    env = {**os.environ, "PDSERVE_CPU_ISA": tier, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.update(extra_env)
    for name in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY"):
        env.pop(name, None)
    env.update(_LIBRARY_CAPS.get(tier, {}))
    proc = subprocess.run(
        [sys.executable, "-c", worker], env=env, capture_output=True, text=True, timeout=3600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"tier {tier}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--tiers", default=None, help="comma-separated (default: every tier this host has)"
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from pdserve import kernels

    tiers = a.tiers.split(",") if a.tiers else kernels.load().available_isas()
    results = {t: run_tier(t) for t in tiers}
    rows = sorted({k for r in results.values() for k in r})
    print("| measurement | " + " | ".join(tiers) + " |")
    print("|---|" + "---|" * len(tiers))
    for k in rows:
        cells = [results[t].get(k, "") for t in tiers]
        print(
            f"| {k} | "
            + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in cells)
            + " |"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": lscpu(), "tiers": results}, f, indent=2)


if __name__ == "__main__":
    main()
