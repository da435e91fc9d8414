"""What ``--enable-deterministic-inference`` costs: the offline engine with and without it, side by
side in one run, alternating order, on the demo model (or ``--model-path``).

  python benchmarks/deterministic_cost.py [--model-path DIR] [--threads 1] [--rounds 2]
      [--dtypes bfloat16,float32] [--json out.json]

Workloads (random tokens, greedy, ignore_eos, radix cache off, all submitted at once):
``short`` 32 x 128 in / 32 out and ``long`` 8 x 1024 in / 16 out. Reported per dtype and
workload: prefill seconds (a run with one output token), decode tok/s (the full run minus its
prefill), total output tok/s, and each as a ratio deterministic / default (best of the rounds for
each). Also checks that the deterministic runs give the same tokens in every round.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess

import torch
from offline_throughput import lscpu_model, pdserve_run

WORKLOADS = {"short": (32, 128, 32), "long": (8, 1024, 16)}


def lscpu() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    flags = next(
        (ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), []
    )
    wanted = [f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma")]
    return {"model": lscpu_model(), "flags": " ".join(wanted)}


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def run(path: str, dtype: str, deterministic: bool, workload: str, threads: int) -> dict:
    """``offline_throughput.py``'s measurement (warm-up, a one-token prefill run, the full run)."""
    n, inp, out = WORKLOADS[workload]
    res = pdserve_run(
        path,
        prompts(n, inp),
        out,
        threads,
        dtype=dtype,
        enable_deterministic_inference=deterministic,
        max_running_requests=n,
    )
    res.pop("engine").shutdown()
    # the decode phase: the full run minus its prefill (nan when noise made the difference negative)
    decode_s = res["total_s"] - res["prefill_s"]
    return {
        "prefill_s": res["prefill_s"],
        "total_s": res["total_s"],
        "out_tok_s": res["tok_s"],
        "decode_tok_s": n * (out - 1) / decode_s if decode_s > 0 else float("nan"),
        "ids": res["ids"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--workloads", default="short,long")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model_path
    if path is None:
        from pdserve.models.demo import ensure_demo_model

        path = ensure_demo_model()
    results: dict = {"machine": lscpu(), "threads": args.threads, "rows": []}
    print(
        f"# {results['machine']['model']} ({results['machine']['flags']}), {args.threads} thread(s)"
    )
    print(
        "| dtype | workload | prefill s (default ; det) | ratio | decode tok/s (default ; det) | "
        "ratio | out tok/s (default ; det) | ratio | same tokens every round |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for workload in args.workloads.split(","):
            best: dict = {False: None, True: None}
            det_ids = []
            for r in range(args.rounds):
                for det in (False, True) if r % 2 == 0 else (True, False):
                    res = run(path, dtype, det, workload, args.threads)
                    if det:
                        det_ids.append(res.pop("ids"))
                    else:
                        res.pop("ids")
                    b = best[det]
                    best[det] = (
                        res
                        if b is None
                        else {
                            "prefill_s": min(b["prefill_s"], res["prefill_s"]),
                            "total_s": min(b["total_s"], res["total_s"]),
                            "out_tok_s": max(b["out_tok_s"], res["out_tok_s"]),
                            "decode_tok_s": max(b["decode_tok_s"], res["decode_tok_s"]),
                        }
                    )
            d, x = best[False], best[True]
            same = all(ids == det_ids[0] for ids in det_ids)
            row = {
                "dtype": dtype,
                "workload": workload,
                "default": d,
                "deterministic": x,
                "same_tokens": same,
            }
            results["rows"].append(row)
            print(
                f"| {dtype} | {workload} {WORKLOADS[workload]} | {d['prefill_s']:.2f} ; "
                f"{x['prefill_s']:.2f} | {x['prefill_s'] / d['prefill_s']:.2f} | "
                f"{d['decode_tok_s']:.1f} ; {x['decode_tok_s']:.1f} | "
                f"{x['decode_tok_s'] / d['decode_tok_s']:.2f} | {d['out_tok_s']:.1f} ; "
                f"{x['out_tok_s']:.1f} | {x['out_tok_s'] / d['out_tok_s']:.2f} | {same} |",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
