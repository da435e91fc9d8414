"""What the decode prefix cache is worth on multi-turn chat: a 1P1D pair without and with
``--disaggregation-decode-enable-radix-cache``, the same conversations through pdserve's router.

  python benchmarks/decode_prefix_cache.py [--model-path DIR] [--json OUT]

Prefill on core 0, decode on core 1 (one torch thread each). ``pdserve bench --dataset-name
multi-turn``: every turn resends the conversation so far (with the real answers). Reported: TTFT
and TPOT, the KV bytes prefill wrote into decode (``/server_info`` transfer records), and the
tokens decode found in its own cache.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdserve.bench import serving  # noqa: E402
from tests.helpers import cluster as c  # noqa: E402


def pinned(name: str, model: str, logs: Path, core: str, *args: str) -> c.Proc:
    port = c.free_port()
    cmd = ["taskset", "-c", core, sys.executable, "-m", "pdserve.cli", "serve", "--model-path", model,
           "--port", str(port), "--torch-num-threads", "1", "--served-model-name", "demo",
           "--max-total-tokens", "65536", *args]
    return c.Proc(name, cmd, port, logs, env={"OMP_NUM_THREADS": "1"})


def run(setup: str, model: str, logs: Path, a) -> dict:
    bport = c.free_port()
    P = pinned(f"P-{setup}", model, logs, "0", "--disaggregation-mode", "prefill",
               "--disaggregation-bootstrap-port", str(bport))
    P.bootstrap_port = bport
    extra = ["--disaggregation-decode-enable-radix-cache"] if setup == "decode cache" else []
    D = pinned(f"D-{setup}", model, logs, "1", "--disaggregation-mode", "decode", *extra)
    R = None
    try:
        c.start_all((P, D))
        R = c.router(f"R-{setup}", [P], [D], logs).start()
        out = logs / f"{setup.replace(' ', '_')}.json"
        argv = ["--backend", "openai", "--base-url", R.url, "--model", "demo", "--tokenizer", model,
                "--dataset-name", "multi-turn", "--mt-num-sessions", str(a.sessions), "--mt-num-turns", str(a.turns),
                "--mt-system-len", str(a.system_len), "--mt-user-len", str(a.user_len), "--mt-output-len",
                str(a.output_len), "--mt-think-time", str(a.think_time), "--random-range-ratio", "1", "--ignore-eos",
                "--max-concurrency", str(a.concurrency), "--disable-tqdm", "--output-file", str(out)]
        print(f"== {setup} ({time.strftime('%H:%M:%S')})", file=sys.stderr)
        if serving.main(argv) != 0:
            raise RuntimeError(f"benchmark of {setup} failed")
        summary = json.loads(out.read_text())["summary"]
        p_state = P.http.get("/server_info").json()["internal_states"][0]
        d_state = D.http.get("/server_info").json()["internal_states"][0]
        transfers = p_state["recent_transfers"]
        return {"summary": summary, "kv_bytes": sum(t["kv_bytes"] for t in transfers),
                "pages_sent": sum(t["pages"] for t in transfers), "transfers": len(transfers),
                "decode_cache_hit_tokens": d_state["cache_hit_tokens"]}
    finally:
        for s in [x for x in (R, D, P) if x is not None]:
            s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--think-time", type=float, default=0.5)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.model_path is None:
        from pdserve.models.demo import ensure_demo_model

        a.model_path = ensure_demo_model()
    logs = Path(tempfile.mkdtemp(prefix="decode-prefix-bench-"))
    print(f"server logs: {logs}", file=sys.stderr)
    result = {setup: run(setup, a.model_path, logs, a) for setup in ("no decode cache", "decode cache")}
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    print(f"machine: {platform.machine()}, {cpu}, {os.cpu_count()} cores; prefill on core 0, decode on core 1")
    print(f"multi-turn: {a.sessions} sessions x {a.turns} turns, system {a.system_len}, user {a.user_len}, "
          f"answers {a.output_len} tokens, think time {a.think_time} s, concurrency {a.concurrency}")
    print("| set-up | TTFT mean / p90 ms | TPOT mean ms | KV MB moved | pages sent | decode cache hits (tokens) |")
    print("|---|---|---|---|---|---|")
    for setup, r in result.items():
        s = r["summary"]
        print(f"| {setup} | {s['ttft_ms']['mean']:.0f} / {s['ttft_ms']['p90']:.0f} | {s['tpot_ms']['mean']:.1f} | "
              f"{r['kv_bytes'] / 1e6:.1f} | {r['pages_sent']} | {r['decode_cache_hit_tokens']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
