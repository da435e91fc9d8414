"""Offline output throughput: pdserve Engine vs HF transformers ``generate`` in the same run.

Workload: N prompts x IN random tokens x OUT output tokens (greedy, ignore_eos).
HF batch-1 runs a subset of the prompts (it is slow) and reports tokens/s over that subset.

  python benchmarks/offline_throughput.py [--model-path DIR] [--num-prompts 64] [--input-len 128]
      [--output-len 64] [--threads 1] [--hf-batch1-prompts 8] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import random
import time

import torch


def hf_generate(path, prompts, out_len, batch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if "smollm2" in path else torch.float32)
    model.eval()
    t0 = time.perf_counter()
    n_tokens = 0
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            ids = torch.tensor(chunk)  # equal lengths: no padding needed
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                                 min_new_tokens=out_len, do_sample=False, pad_token_id=0)
            n_tokens += (out.shape[1] - ids.shape[1]) * len(chunk)
    return n_tokens / (time.perf_counter() - t0)


def pdserve_generate(path, prompts, out_len, threads, profile):
    import pdserve

    eng = pdserve.Engine(model_path=path, torch_num_threads=threads, max_total_tokens=65536,
                         disable_radix_cache=True)
    eng.generate(input_ids=prompts[:2], sampling_params={"temperature": 0, "max_new_tokens": 4})  # warm-up
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    outs = eng.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": out_len,
                                                            "ignore_eos": True})
    if prof:
        prof.disable()
    dt = time.perf_counter() - t0
    n = sum(len(o["output_ids"]) for o in outs)
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    return n / dt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", action="append", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--hf-batch1-prompts", type=int, default=8)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    paths = a.model_path
    if not paths:
        from pdserve.models.demo import ensure_demo_model
        from tests.helpers.checkpoints import build_tiny_checkpoint

        paths = [ensure_demo_model(), build_tiny_checkpoint("llama")]
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(a.input_len)] for _ in range(a.num_prompts)]
    rows = []
    for path in paths:
        ours = pdserve_generate(path, prompts, a.output_len, a.threads, a.profile)
        hf_b = hf_generate(path, prompts, a.output_len, batch=a.num_prompts)
        hf_1 = hf_generate(path, prompts[: a.hf_batch1_prompts], a.output_len, batch=1)
        rows.append({"model": path, "pdserve_tok_s": ours, "hf_batched_tok_s": hf_b, "hf_batch1_tok_s": hf_1,
                     "ratio_vs_hf_batched": ours / hf_b, "ratio_vs_hf_batch1": ours / hf_1})
    print(f"machine: {platform.machine()} {torch.get_num_threads()} torch threads, torch {torch.__version__}")
    print(f"workload: {a.num_prompts} prompts x {a.input_len} in x {a.output_len} out, greedy, ignore_eos")
    print(f"{'model':<50} {'pdserve':>10} {'HF batched':>11} {'HF bs1':>9} {'x HF-b':>7} {'x HF-1':>7}")
    for r in rows:
        print(f"{r['model'][-50:]:<50} {r['pdserve_tok_s']:>10.1f} {r['hf_batched_tok_s']:>11.1f} "
              f"{r['hf_batch1_tok_s']:>9.1f} {r['ratio_vs_hf_batched']:>7.2f} {r['ratio_vs_hf_batch1']:>7.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
