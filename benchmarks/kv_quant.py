"""PD (1 prefill, 1 decode) with a bf16 KV cache against int8 and fp8 KV: the KV bytes each
request's transfer moves and TTFT, in one run on the same model and prompts.

  python benchmarks/kv_quant.py [--dtypes bfloat16,int8,fp8_e4m3] [--lens 4096,7936]
      [--reps 1] [--backend local] [--warmup 256] [--json OUT]

The model is Llama-3.2-1B-shaped (``decode_step.py``'s config: 16 layers, 8 KV heads of 64, bf16
compute, random weights via ``--load-format dummy``). Per KV dtype one prefill and one decode
(``--kv-cache-dtype``; both sides must agree) with a router in front, one torch thread per
server; the set-ups run one after the other (two 1B servers at a time fit the host's memory),
each on the same prompts (fresh random tokens: no prefix-cache hits), after one warm-up request.
Reported per cell: median TTFT, the KV bytes of the transfer as the prefill's own record counts
them (pages and, for int8, their scales), the time from the last send to the room's completion,
and both as ratios to bf16.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step import model_dir  # noqa: E402
from layer_pipeline import last_transfer  # noqa: E402
from offline_throughput import lscpu_model  # noqa: E402
from pd_overhead import ttft  # noqa: E402

from tests.helpers import cluster as c  # noqa: E402


def run_dtype(kv: str, model: str, a: argparse.Namespace, prompts: dict, logs: Path) -> list[dict]:
    common = ["--load-format", "dummy", "--dtype", "bfloat16", "--kv-cache-dtype", kv]
    common += ["--max-total-tokens", str(max(a.lens) + 1024), "--torch-num-threads", "1"]
    common += ["--chunked-prefill-size", str(max(a.lens))]
    common += ["--disaggregation-transfer-backend", a.backend]
    # the default heartbeats and waiting timeout: liveness does not wait on a forward
    D = c.decode(f"D-{kv}", model, logs, *common)
    P, _ = c.prefill(f"P-{kv}", model, logs, *common)
    procs, rows = [D, P], []
    try:
        for p in procs:
            p.start(wait=False)
        for p in procs:
            p.wait_ready(timeout=900)
        R = c.router(f"R-{kv}", [P], [D], logs).start()
        procs.append(R)
        ttft(R.url, prompts["warmup"])
        for n in a.lens:
            times, records = [], []
            for ids in prompts[n]:
                times.append(ttft(R.url, ids))
                records.append(last_transfer(P))
            row = {
                "kv_cache_dtype": kv,
                "prompt_tokens": n,
                "ttft_s": statistics.median(times),
                "ttft_all_s": times,
                "kv_bytes": statistics.median(r["kv_bytes"] for r in records),
                "after_last_send_ms": statistics.median(r["after_last_chunk_s"] for r in records)
                * 1e3,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for p in reversed(procs):
            p.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bfloat16,int8,fp8_e4m3")
    ap.add_argument("--lens", default="4096,7936")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--backend", default="local")
    ap.add_argument("--warmup", type=int, default=256, help="tokens of the warm-up prompt")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    a.lens = [int(x) for x in a.lens.split(",")]
    rng = random.Random(0)
    prompts = {
        n: [[rng.randrange(100, 40000) for _ in range(n)] for _ in range(a.reps)] for n in a.lens
    }
    prompts["warmup"] = [rng.randrange(100, 40000) for _ in range(a.warmup)]
    model = str(model_dir(Path(tempfile.gettempdir()) / "pdserve-bench", max(a.lens) + 1024))
    logs = Path(tempfile.mkdtemp(prefix="kv-quant-"))
    rows = []
    for kv in a.dtypes.split(","):
        rows += run_dtype(kv, model, a, prompts, logs)
    base = {r["prompt_tokens"]: r for r in rows if r["kv_cache_dtype"] == "bfloat16"}
    for r in rows:
        ref = base.get(r["prompt_tokens"])
        if ref is not None:
            r["bytes_ratio"] = r["kv_bytes"] / ref["kv_bytes"]
            r["ttft_ratio"] = r["ttft_s"] / ref["ttft_s"]
    import torch

    print(f"machine: {platform.machine()}, {lscpu_model()}; torch {torch.__version__}")
    print(f"model: Llama-3.2-1B-shaped (random bf16); {a.backend}; median of {a.reps}; logs {logs}")
    print(
        f"{'KV dtype':>9} {'prompt':>7} {'KV MB':>8} {'bytes ratio':>12} {'TTFT s':>8} "
        f"{'TTFT ratio':>11} {'tail ms':>8}"
    )
    for r in rows:
        print(
            f"{r['kv_cache_dtype']:>9} {r['prompt_tokens']:>7} {r['kv_bytes'] / 1e6:>8.1f} "
            f"{r.get('bytes_ratio', float('nan')):>12.4f} {r['ttft_s']:>8.2f} "
            f"{r.get('ttft_ratio', float('nan')):>11.3f} {r['after_last_send_ms']:>8.1f}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"backend": a.backend, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
