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
import time

import torch

WORKLOADS = {"short": (32, 128, 32), "long": (8, 1024, 16)}


def lscpu() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    wanted = [f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma")]
    return {"model": fields.get("Model name", "?").strip(), "flags": " ".join(wanted)}


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def run(path: str, dtype: str, deterministic: bool, workload: str, threads: int) -> dict:
    import pdserve

    n, inp, out = WORKLOADS[workload]
    ps = prompts(n, inp)
    eng = pdserve.Engine(model_path=path, dtype=dtype, torch_num_threads=threads, max_total_tokens=1 << 17,
                         disable_radix_cache=True, enable_deterministic_inference=deterministic,
                         max_running_requests=n)

    def sp(k):
        return {"temperature": 0, "max_new_tokens": k, "ignore_eos": True}

    try:
        eng.generate(input_ids=ps[:2], sampling_params=sp(4))  # warm-up
        t0 = time.perf_counter()
        eng.generate(input_ids=ps, sampling_params=sp(1))
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=ps, sampling_params=sp(out))
        total = time.perf_counter() - t0
    finally:
        eng.shutdown()
    tokens = n * out
    # the decode phase: the full run minus its prefill (nan when noise made the difference negative)
    decode_s = total - prefill
    return {"prefill_s": prefill, "total_s": total, "out_tok_s": tokens / total,
            "decode_tok_s": n * (out - 1) / decode_s if decode_s > 0 else float("nan"),
            "ids": [o["output_ids"] for o in outs]}


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
    print(f"# {results['machine']['model']} ({results['machine']['flags']}), {args.threads} thread(s)")
    print("| dtype | workload | prefill s (default ; det) | ratio | decode tok/s (default ; det) | ratio | "
          "out tok/s (default ; det) | ratio | same tokens every round |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for workload in args.workloads.split(","):
            best: dict = {False: None, True: None}
            det_ids = []
            for r in range(args.rounds):
                for det in ((False, True) if r % 2 == 0 else (True, False)):
                    res = run(path, dtype, det, workload, args.threads)
                    if det:
                        det_ids.append(res.pop("ids"))
                    else:
                        res.pop("ids")
                    b = best[det]
                    best[det] = res if b is None else {
                        "prefill_s": min(b["prefill_s"], res["prefill_s"]), "total_s": min(b["total_s"], res["total_s"]),
                        "out_tok_s": max(b["out_tok_s"], res["out_tok_s"]),
                        "decode_tok_s": max(b["decode_tok_s"], res["decode_tok_s"])}
            d, x = best[False], best[True]
            same = all(ids == det_ids[0] for ids in det_ids)
            row = {"dtype": dtype, "workload": workload, "default": d, "deterministic": x, "same_tokens": same}
            results["rows"].append(row)
            print(f"| {dtype} | {workload} {WORKLOADS[workload]} | {d['prefill_s']:.2f} ; {x['prefill_s']:.2f} | "
                  f"{x['prefill_s'] / d['prefill_s']:.2f} | {d['decode_tok_s']:.1f} ; {x['decode_tok_s']:.1f} | "
                  f"{x['decode_tok_s'] / d['decode_tok_s']:.2f} | {d['out_tok_s']:.1f} ; {x['out_tok_s']:.1f} | "
                  f"{x['out_tok_s'] / d['out_tok_s']:.2f} | {same} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
