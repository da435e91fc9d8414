"""pdserve's CPU kernels against what they replace, one thread, in one run.

  python benchmarks/cpu_kernels.py [--json out.json]

- decode attention, batch 32, 880-1,320-token contexts, 9 query / 3 KV heads, head dim 64, page 16,
  pages scattered: the paged kernel (float32 KV) and the flash kernel (bf16 KV) against the torch
  backend's gather + SDPA on the same KV;
- prefill attention, one 1,024-token prompt (and 128), causal: the flash kernel against SDPA;
- batch-1 weight streaming: the demo model's matmul shapes (30 layers + LM head) through the bf16
  GEMV against oneDNN with prepacked weights, as GB/s of weights read;
- matmuls at batch 64 and 2,048 rows: bf16 and w8a8 against oneDNN bf16, GFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import time

import torch
import torch.nn.functional as F


def bench(fn, n: int = 10) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next(
        (ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?"
    )


def decode_attention(ops) -> dict:
    from pdserve.hostmem import huge_empty

    rng = random.Random(0)
    B, H, KVH, D, PS = 32, 9, 3, 64, 16
    lens = torch.tensor([rng.randint(880, 1320) for _ in range(B)], dtype=torch.int32)
    max_pages = (int(lens.max()) + PS - 1) // PS
    P = B * max_pages + 1
    table = (
        torch.randperm(P - 1, generator=torch.Generator().manual_seed(0))[: B * max_pages] + 1
    ).view(B, max_pages)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        kv = huge_empty(2 * P * KVH * PS * D * torch.empty((), dtype=dtype).element_size())
        kv = kv.view(dtype).view(2, P, KVH, PS, D)
        kv.copy_(torch.randn(2, P, KVH, PS, D))
        kc, vc = kv[0], kv[1]
        q = torch.randn(B, H, D).to(dtype)
        o = torch.empty_like(q)
        t32 = table.int().contiguous()
        if dtype == torch.bfloat16:
            starts = torch.arange(B + 1, dtype=torch.int32)
            kernel = bench(
                lambda: ops.paged_attention_bf16(o, q, kc, vc, t32, lens, starts, 1 / 8, 0)
            )
        else:
            kernel = bench(lambda: ops.paged_decode_attention(o, q, kc, vc, t32, lens, 1 / 8, 0))
        L = max_pages * PS
        kpos = torch.arange(L)
        heads = torch.arange(KVH)
        gather = (table[:, kpos // PS][:, None, :] * KVH + heads[None, :, None]) * PS + (kpos % PS)[
            None, None, :
        ]
        mask = (kpos[None, :] < lens[:, None].long())[:, None, None, :]
        krows, vrows = kc.reshape(-1, D), vc.reshape(-1, D)

        def torch_path():
            return F.scaled_dot_product_attention(
                q.unsqueeze(2),
                krows[gather].to(q.dtype),
                vrows[gather].to(q.dtype),
                attn_mask=mask,
                scale=1 / 8,
                enable_gqa=True,
            )

        ref = bench(torch_path, 3)
        nbytes = int(lens.sum()) * KVH * D * 2 * kc.element_size()
        out[str(dtype).replace("torch.", "")] = {
            "kernel_ms": kernel * 1e3,
            "gather_sdpa_ms": ref * 1e3,
            "ratio": kernel / ref,
            "kernel_kv_gb_s": nbytes / kernel / 1e9,
        }
    return out


def prefill_attention(ops) -> dict:
    H, KVH, D, PS = 9, 3, 64, 16
    out = {}
    for T in (128, 1024):
        pages = (T + PS - 1) // PS
        kc = torch.randn(pages + 1, KVH, PS, D).bfloat16()
        vc = torch.randn(pages + 1, KVH, PS, D).bfloat16()
        q = torch.randn(T, H, D).bfloat16()
        o = torch.empty_like(q)
        table = (torch.arange(pages) + 1).view(1, pages).int()
        lens, starts = torch.tensor([T], dtype=torch.int32), torch.tensor([0, T], dtype=torch.int32)
        flash = bench(
            lambda: ops.paged_attention_bf16(o, q, kc, vc, table, lens, starts, 1 / 8, 0), 5
        )
        qq, kk, vv = (
            q.transpose(0, 1)[None],
            torch.randn(1, KVH, T, D).bfloat16(),
            torch.randn(1, KVH, T, D).bfloat16(),
        )
        sdpa = bench(
            lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True), 5
        )
        flops = 4 * T * T * D * H / 2
        out[str(T)] = {
            "flash_gflop_s": flops / flash / 1e9,
            "sdpa_gflop_s": flops / sdpa / 1e9,
            "ratio": flash / sdpa,
        }
    return out


SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def weight_streaming(ops) -> dict:
    from pdserve.layers.linear import pack_vnni16

    ws = [torch.randn(n, k).bfloat16() for n, k in SHAPES]
    total = sum(n * k * 2 for n, k in SHAPES)
    vnni = [pack_vnni16(w) for w in ws]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in ws]
    xs = {k: torch.randn(1, k).bfloat16() for k in (576, 1536)}
    outs = {n: torch.empty(1, n, dtype=torch.bfloat16) for n, _ in SHAPES}

    def gemv():
        for (n, k), w in zip(SHAPES, vnni):
            ops.linear_vnni(outs[n], xs[k], w, None)

    def dnn():
        for (_, k), w in zip(SHAPES, onednn):
            torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")

    g, d = bench(gemv, 5), bench(dnn, 5)
    return {
        "weights_mb": total / 1e6,
        "gemv_ms": g * 1e3,
        "gemv_gb_s": total / g / 1e9,
        "onednn_ms": d * 1e3,
        "onednn_gb_s": total / d / 1e9,
    }


def matmuls(ops) -> dict:
    from pdserve.layers.linear import PackedBF16, PackedW8A8

    out = {}
    for rows in (64, 2048):
        t_bf16 = t_int8 = flops = 0.0
        for n, k in SHAPES[:4]:
            w = torch.randn(n, k) * 0.02
            p, q = PackedBF16(w, None, ops, rows), PackedW8A8(w, None, ops)
            x = torch.randn(rows, k).bfloat16()
            t_bf16 += bench(
                lambda: torch.ops.mkldnn._linear_pointwise(x, p.onednn, None, "none", [], ""), 5
            )
            t_int8 += bench(lambda: q(x), 5)
            flops += 2 * rows * n * k
        out[str(rows)] = {
            "onednn_bf16_gflop_s": flops / t_bf16 / 1e9,
            "w8a8_gop_s": flops / t_int8 / 1e9,
            "w8a8_time_ratio": t_int8 / t_bf16,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from pdserve import kernels

    ops = kernels.load()
    if ops is None:
        raise SystemExit(f"the CPU kernels are not available: {kernels.unavailable_reason()}")
    result = {
        "machine": cpu_model(),
        "isa": ops.isa(),
        "torch": torch.__version__,
        "decode_attention": decode_attention(ops),
        "prefill_attention": prefill_attention(ops),
        "batch1_weight_streaming": weight_streaming(ops),
        "matmuls": matmuls(ops),
    }
    result = _rounded(result)
    print(json.dumps(result, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


def _rounded(x):
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return round(x, 3) if isinstance(x, float) else x


if __name__ == "__main__":
    main()
