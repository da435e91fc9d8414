"""The fused MoE kernel against torch's two ways of running the experts, side by side in one run.

  PYTHONPATH=. python benchmarks/moe_kernel.py [--tokens 1,32,256,2048] [--threads 1,2] [--int8]
                                               [--json out.json]

One Qwen3-30B-A3B-shaped MoE layer (hidden 2048, 128 experts, top 8, expert MLP 768, SiLU, bf16,
random weights), random routing (softmax top-8 of random logits, a fresh routing for each call
out of 8, so that batch-1 calls read their experts from memory, not from the last call's cache):

- ``fused``: ``PackedExperts`` (``kernels/csrc/moe.cpp``), bf16; with ``--int8`` also w8a8_int8;
- ``grouped_mm``: pairs sorted by expert, ``torch.nn.functional.grouped_mm`` with offsets =
  cumsum of the counts, as transformers' ``grouped_mm_experts_forward`` runs it;
- ``loop``: one ``F.linear`` pair per expert hit, the weighted rows added into a float32 output.

Per row: ms per call, GB/s of expert weights read (the experts hit, each read once), GFLOP/s
(2 x 3 x hidden x intermediate per (token, slot)) and the time ratios of the fused kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 128, 8, 768
ROUTINGS = 8


def cpu_info() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    info = dict(ln.split(":", 1) for ln in out.splitlines() if ":" in ln)
    flags = [f for f in info.get("Flags", "").split() if f.startswith(("avx512", "amx"))]
    return {"model": info.get("Model name", "?").strip(), "flags": flags}


def bench(kinds: dict, calls: list, min_time: float, min_reps: int = 3) -> dict[str, float]:
    """Median seconds per call of each kind, the kinds taking turns call by call (so that a busy
    host slows all of them alike), cycling through ``calls`` (argument tuples), after a warm-up."""
    for fn in kinds.values():
        fn(*calls[0])
    times: dict[str, list[float]] = {name: [] for name in kinds}
    start = time.perf_counter()
    i = 0
    while i < min_reps or time.perf_counter() - start < min_time * len(kinds):
        for name, fn in kinds.items():
            t0 = time.perf_counter()
            fn(*calls[i % len(calls)])
            times[name].append(time.perf_counter() - t0)
        i += 1
    return {name: statistics.median(ts) for name, ts in times.items()}


def routing(T: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = torch.softmax(torch.randn(T, EXPERTS, generator=gen), -1).topk(TOP_K, dim=-1)
    return ids.to(torch.int32), weights


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    return F.silu(gu[:, :INTER]) * gu[:, INTER:]


def grouped_mm_experts(w13: torch.Tensor, w2: torch.Tensor):
    def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        T, K = ids.shape
        expert_g, perm = torch.sort(ids.reshape(-1))
        counts = torch.histc(expert_g.float(), bins=EXPERTS, min=0, max=EXPERTS - 1)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gu = F.grouped_mm(x[perm // K], w13.transpose(-2, -1), offs=offs)
        y = F.grouped_mm(silu_mul(gu), w2.transpose(-2, -1), offs=offs)
        y = y * weights.reshape(-1)[perm, None]
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel())
        return y[inv].view(T, K, -1).float().sum(1)

    return run


def loop_experts(w13: torch.Tensor, w2: torch.Tensor):
    def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        K = ids.shape[1]
        out = torch.zeros(x.shape[0], x.shape[1])
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=EXPERTS).tolist()
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            pairs = order[start : start + c]
            start += c
            tokens = pairs // K
            y = F.linear(silu_mul(F.linear(x[tokens], w13[e])), w2[e])
            out.index_add_(0, tokens, y.float() * weights.reshape(-1)[pairs, None])
        return out

    return run


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", default="1,32,256,2048")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--int8", action="store_true", help="add rows for the w8a8_int8 kernel")
    ap.add_argument(
        "--min-time",
        type=float,
        default=1.0,
        help="seconds per kind and row (at least 3 calls each)",
    )
    ap.add_argument("--json")
    args = ap.parse_args()

    from pdserve import kernels
    from pdserve.layers.moe.fused import PackedExperts

    ops = kernels.load()
    if ops is None:
        raise SystemExit(f"pdserve's CPU kernels are not available: {kernels.unavailable_reason()}")
    gen = torch.Generator().manual_seed(0)
    w13 = (0.02 * torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen)).to(torch.bfloat16)
    w2 = (0.02 * torch.randn(EXPERTS, HIDDEN, INTER, generator=gen)).to(torch.bfloat16)
    kinds = {"fused": PackedExperts(w13, w2, ops=ops)}
    if args.int8:
        kinds["fused_int8"] = PackedExperts(w13, w2, ops=ops, quantization="w8a8_int8")
    kinds["grouped_mm"] = grouped_mm_experts(w13, w2)
    kinds["loop"] = loop_experts(w13, w2)
    bytes_per_expert = {k: 3 * HIDDEN * INTER * (1 if k == "fused_int8" else 2) for k in kinds}

    cpu = cpu_info()
    print(f"CPU: {cpu['model']}; {' '.join(cpu['flags'])}; kernels ISA {ops.isa()}")
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, HIDDEN, generator=gen).to(torch.bfloat16)
            calls = [(x, *routing(T, gen)) for _ in range(ROUTINGS)]
            hit = statistics.mean(int(ids.unique().numel()) for _, ids, _ in calls)
            flop = 2 * 3 * HIDDEN * INTER * T * TOP_K
            ref = kinds["loop"](*calls[0])
            result = {"threads": threads, "tokens": T, "experts_hit": hit}
            for name, s in bench(kinds, calls, args.min_time).items():
                err = ((kinds[name](*calls[0]) - ref).abs().max() / ref.abs().max()).item()
                result[name] = {
                    "ms": s * 1e3,
                    "gb_s": hit * bytes_per_expert[name] / s / 1e9,
                    "gflop_s": flop / s / 1e9,
                    "max_rel_err_vs_loop": err,
                }
            rows.append(result)
            print(json.dumps(result), flush=True)

    print(
        "\n| threads | tokens | experts hit | kernel | ms | GB/s of experts | GFLOP/s | vs "
        "grouped_mm | vs loop |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for name in kinds:
            m = r[name]
            ratio = lambda other: f"{m['ms'] / r[other]['ms']:.2f}"  # noqa: E731
            print(
                f"| {r['threads']} | {r['tokens']} | {r['experts_hit']:.1f} | {name} | "
                f"{m['ms']:.2f} | {m['gb_s']:.1f} | {m['gflop_s']:.0f} | {ratio('grouped_mm')} | "
                f"{ratio('loop')} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "isa": ops.isa(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
