"""TTFT of PD (1 prefill + 1 decode, local backend, behind the router) against a colocated server,
measured in one run on the same model, plus per PD request the KV bytes moved, the transfer window
and GB/s (as reported by the prefill server).

  python benchmarks/pd_overhead.py [--model-path DIR] [--lens 128,512,2048] [--reps 7] [--threads 1]

Requests are sent one at a time, alternating between the two set-ups, so only one server
computes at any moment. Each prompt is fresh random tokens (no prefix-cache hits).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers import cluster as c  # noqa: E402


def ttft(url: str, ids: list[int]) -> float:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True},
        "stream": True,
    }
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/generate", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if (
                first is None
                and line.startswith("data: {")
                and json.loads(line[6:]).get("output_ids")
            ):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("no token in the stream")
    return first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--lens", default="128,512,2048")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.model_path is None:
        from pdserve.models.demo import ensure_demo_model

        a.model_path = ensure_demo_model()
    logs = Path(tempfile.mkdtemp(prefix="pd-overhead-"))
    common = [
        "--max-total-tokens",
        "32768",
        "--torch-num-threads",
        str(a.threads),
        "--chunked-prefill-size",
        "4096",
    ]
    colo = c.server("colocated", a.model_path, logs, *common)
    P, _ = c.prefill("prefill", a.model_path, logs, *common)
    D = c.decode("decode", a.model_path, logs, *common)
    procs = [colo, P, D]
    try:
        for p in procs:
            p.start(wait=False)
        for p in procs:
            p.wait_ready()
        R = c.router("router", [P], [D], logs).start()
        procs.append(R)
        rng = random.Random(0)
        rows = []
        for n in [int(x) for x in a.lens.split(",")]:

            def prompt():
                return [rng.randrange(100, 40000) for _ in range(n)]

            ttft(colo.url, prompt())
            ttft(R.url, prompt())  # warm-up at this length
            t_colo, t_pd, transfers = [], [], []
            for _ in range(a.reps):
                t_colo.append(ttft(colo.url, prompt()))
                t_pd.append(ttft(R.url, prompt()))
                time.sleep(0.05)  # let the prefill record the transfer
                transfers.append(
                    P.http.get("/server_info").json()["internal_states"][0]["recent_transfers"][-1]
                )
            mc, mp = statistics.median(t_colo), statistics.median(t_pd)
            rows.append(
                {
                    "prompt_tokens": n,
                    "colocated_ttft_ms": mc * 1e3,
                    "pd_ttft_ms": mp * 1e3,
                    "ratio": mp / mc,
                    "target_ms": (1.10 * mc + 0.005) * 1e3,
                    "kv_bytes": statistics.median(t["kv_bytes"] for t in transfers),
                    "transfer_window_ms": statistics.median(t["window_s"] for t in transfers) * 1e3,
                    "after_last_chunk_ms": statistics.median(
                        t["after_last_chunk_s"] for t in transfers
                    )
                    * 1e3,
                    "gb_per_s": statistics.median(t["gb_per_s"] for t in transfers),
                }
            )
    finally:
        for p in reversed(procs):
            p.stop()
    import torch

    print(
        f"machine: {platform.machine()}, {a.threads} torch thread(s) per server, "
        f"torch {torch.__version__}"
    )
    print(f"model: {a.model_path}; median of {a.reps} sequential requests per cell")
    print(
        f"{'prompt':>7} {'colo TTFT ms':>13} {'PD TTFT ms':>11} {'PD/colo':>8} {'target ms':>10} "
        f"{'KV MB':>8} {'window ms':>10} {'tail ms':>8} {'GB/s':>6}"
    )
    for r in rows:
        print(
            f"{r['prompt_tokens']:>7} {r['colocated_ttft_ms']:>13.1f} {r['pd_ttft_ms']:>11.1f} "
            f"{r['ratio']:>8.3f} {r['target_ms']:>10.1f} {r['kv_bytes'] / 1e6:>8.2f} "
            f"{r['transfer_window_ms']:>10.2f} {r['after_last_chunk_ms']:>8.2f} "
            f"{r['gb_per_s']:>6.2f}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
