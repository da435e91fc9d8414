"""Server overhead: output tokens/s of the offline Engine against `pdserve serve` driven by
`pdserve bench` (64 concurrent streaming requests), same workload, same run, one after the other.

  python benchmarks/server_overhead.py [--model-path DIR] [--num-prompts 64] [--input-len 128]
      [--output-len 64] [--threads 1]

The offline run gets the same random token prompts the benchmark client sends.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers import cluster as c  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    if a.model_path is None:
        from pdserve.models.demo import ensure_demo_model

        a.model_path = ensure_demo_model()
    import torch

    import pdserve
    from pdserve.bench import serving

    torch.set_num_threads(a.threads)
    logs = Path(tempfile.mkdtemp(prefix="server-overhead-"))
    srv = c.server(
        "server",
        a.model_path,
        logs,
        "--max-total-tokens",
        "65536",
        "--torch-num-threads",
        str(a.threads),
        "--disable-radix-cache",
    ).start()
    try:
        out_file = logs / "bench.json"
        bench_args = [
            "--base-url",
            srv.url,
            "--backend",
            "sglang",
            "--dataset-name",
            "random",
            "--random-input-len",
            str(a.input_len),
            "--random-output-len",
            str(a.output_len),
            "--random-range-ratio",
            "1",
            "--num-prompts",
            str(a.num_prompts),
            "--max-concurrency",
            str(a.num_prompts),
            "--ignore-eos",
            "--disable-tqdm",
            "--seed",
            "1",
            "--output-file",
            str(out_file),
        ]
        serving.main(bench_args)
        result = json.loads(out_file.read_text())
        server_tps = result["summary"]["output_throughput"]
    finally:
        srv.stop()
    eng = pdserve.Engine(
        model_path=a.model_path,
        torch_num_threads=a.threads,
        max_total_tokens=65536,
        disable_radix_cache=True,
    )
    import random

    rng = random.Random(1)
    prompts = [
        [rng.randrange(100, 40000) for _ in range(a.input_len)] for _ in range(a.num_prompts)
    ]
    eng.generate(input_ids=prompts[:2], sampling_params={"temperature": 0, "max_new_tokens": 4})
    t0 = time.perf_counter()
    outs = eng.generate(
        input_ids=prompts,
        sampling_params={"temperature": 0, "max_new_tokens": a.output_len, "ignore_eos": True},
    )
    offline_tps = sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - t0)
    print(f"machine: {platform.machine()}, {a.threads} torch thread(s), torch {torch.__version__}")
    print(f"workload: {a.num_prompts} x {a.input_len} in x {a.output_len} out, greedy, ignore_eos")
    print(
        f"offline Engine: {offline_tps:.1f} tok/s; server via pdserve bench: {server_tps:.1f} "
        f"tok/s; server/offline = {server_tps / offline_tps:.3f}"
    )


if __name__ == "__main__":
    main()
