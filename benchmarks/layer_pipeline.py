"""TTFT of PD with chunk-wise against layer-wise KV transfer (``--enable-disagg-layer-pipeline``),
per transfer backend, in one run on the same model and the same decode.

  python benchmarks/layer_pipeline.py [--backends local,mooncake,nixl] [--lens 4096,7936]
      [--reps 2] [--group-size 4] [--chunk 8192] [--warmup 512] [--json OUT]

The model is Llama-3.2-1B-shaped (``decode_step.py``'s config: 16 layers, 8 KV heads of 64, bf16,
random weights via ``--load-format dummy``). Per backend: one decode, two prefills (one sends
each chunk's pages after its forward, one sends every ``--group-size`` layers' pages during it;
``--disagg-layer-pipeline-min-prefill-len 0``), a router in front of each pair; one torch thread
per server, every server on the same cores. Requests go one at a time, alternating between the
two set-ups (fresh random prompts: no prefix-cache hits), ``--reps`` per length after one
``--warmup``-token request to each; a prompt is one chunk (``--chunk``), so chunk-wise transfer
starts only after the whole forward. Reported per cell: median TTFT of each, their ratio, and from
the prefill's own record of each transfer the KV bytes, the time from the last send to the room's
completion (``after_last_chunk``: what layer-wise transfer shortens) and the layer groups sent
during the forward.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step import model_dir  # noqa: E402
from offline_throughput import lscpu_model  # noqa: E402
from pd_overhead import ttft  # noqa: E402

from tests.helpers import cluster as c  # noqa: E402


def last_transfer(proc: c.Proc) -> dict:
    time.sleep(0.05)  # the prefill records the transfer just after answering
    return proc.http.get("/server_info").json()["internal_states"][0]["recent_transfers"][-1]


def run_backend(backend: str, model: str, a: argparse.Namespace, logs: Path) -> list[dict]:
    common = [
        "--load-format",
        "dummy",
        "--dtype",
        "bfloat16",
        "--max-total-tokens",
        str(2 * max(a.lens) + 1024),
        "--torch-num-threads",
        "1",
        "--chunked-prefill-size",
        str(a.chunk),
        "--disaggregation-transfer-backend",
        backend,
    ]
    layered = ["--enable-disagg-layer-pipeline", "--disagg-layer-group-size", str(a.group_size)]
    layered += ["--disagg-layer-pipeline-min-prefill-len", "0"]
    # the default heartbeats and waiting timeout: a one-chunk prefill of 8k tokens runs about a
    # minute, and its keepalives and heartbeat answers go on during the forward
    D = c.decode(f"D-{backend}", model, logs, *common)
    P_chunks, _ = c.prefill(f"Pc-{backend}", model, logs, *common)
    P_layers, _ = c.prefill(f"Pl-{backend}", model, logs, *common, *layered)
    procs = [D, P_chunks, P_layers]
    rows = []
    try:
        for p in procs:
            p.start(wait=False)
        for p in procs:
            p.wait_ready(timeout=900)
        R_chunks = c.router(f"Rc-{backend}", [P_chunks], [D], logs).start()
        procs.append(R_chunks)
        R_layers = c.router(f"Rl-{backend}", [P_layers], [D], logs).start()
        procs.append(R_layers)
        setups = {"chunks": (R_chunks, P_chunks), "layers": (R_layers, P_layers)}
        rng = random.Random(0)
        for n in a.lens:

            def prompt():
                return [rng.randrange(100, 40000) for _ in range(n)]

            for router, _ in setups.values():  # warm-up (a short prompt: a long one takes minutes)
                ttft(router.url, [rng.randrange(100, 40000) for _ in range(a.warmup)])
            times = {k: [] for k in setups}
            records = {k: [] for k in setups}
            for rep in range(a.reps):
                order = list(setups) if rep % 2 == 0 else list(reversed(setups))
                for k in order:
                    router, prefill = setups[k]
                    times[k].append(ttft(router.url, prompt()))
                    records[k].append(last_transfer(prefill))
            row = {"backend": backend, "prompt_tokens": n}
            for k in setups:
                row[f"{k}_ttft_s"] = statistics.median(times[k])
                row[f"{k}_ttft_all_s"] = times[k]
                row[f"{k}_kv_bytes"] = statistics.median(r["kv_bytes"] for r in records[k])
                row[f"{k}_after_last_send_ms"] = (
                    statistics.median(r["after_last_chunk_s"] for r in records[k]) * 1e3
                )
                row[f"{k}_layer_groups"] = statistics.median(r["layer_groups"] for r in records[k])
            row["ratio"] = row["layers_ttft_s"] / row["chunks_ttft_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for p in reversed(procs):
            p.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="local,mooncake,nixl")
    ap.add_argument("--lens", default="4096,7936")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=512, help="tokens of each warm-up prompt")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    a.lens = [int(x) for x in a.lens.split(",")]
    a.chunk = max(a.chunk, max(a.lens))
    model = str(model_dir(Path(tempfile.gettempdir()) / "pdserve-bench", max(a.lens) + 1024))
    logs = Path(tempfile.mkdtemp(prefix="layer-pipeline-"))
    rows = []
    for backend in a.backends.split(","):
        rows += run_backend(backend, model, a, logs)
    import torch

    print(f"machine: {platform.machine()}, {lscpu_model()}; torch {torch.__version__}")
    print(f"model: Llama-3.2-1B-shaped (random bf16); median of {a.reps} per cell; logs {logs}")
    print(
        f"{'backend':>8} {'prompt':>7} {'chunks TTFT s':>14} {'layers TTFT s':>14} {'ratio':>6} "
        f"{'KV MB':>7} {'tail ms (chunks)':>17} {'tail ms (layers)':>17} {'groups':>7}"
    )
    for r in rows:
        print(
            f"{r['backend']:>8} {r['prompt_tokens']:>7} {r['chunks_ttft_s']:>14.2f} "
            f"{r['layers_ttft_s']:>14.2f} {r['ratio']:>6.3f} {r['chunks_kv_bytes'] / 1e6:>7.1f} "
            f"{r['chunks_after_last_send_ms']:>17.1f} {r['layers_after_last_send_ms']:>17.1f} "
            f"{r['layers_layer_groups']:>7.0f}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
