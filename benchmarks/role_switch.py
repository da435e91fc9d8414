"""How long a role switch takes against starting a server of that role.

  python benchmarks/role_switch.py [--model-path DIR] [--cycles 2] [--max-total-tokens N]
      [--out F.json]

Starts one ``pdserve serve --disaggregation-mode decode`` (the demo model by default), records the
wall time from the process start to ``/health`` 200 (what a restart in another role costs: model
load, packing, pools, warm-up, calibration) and the scheduler's own start (``scheduler_start_s``:
model load, packing, pools), then switches it decode -> prefill -> colocated -> decode
``--cycles`` times with ``POST /switch_role`` (idle, so the drain is empty) and reports each
switch's timings as the server measured them (re-wiring on the ranks, warm-up, total) and the
wall time of the call. Every switch checks that the weights digest stayed the start-up one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROLES = ["prefill", "colocated", "decode"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model-path", default=None, help="default: the demo model (pdserve prepare-model)"
    )
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument(
        "--max-total-tokens", type=int, default=None, help="default: the server's own sizing"
    )
    ap.add_argument("--torch-num-threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    model = (
        a.model_path
        or subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "prepare-model", "smollm2-135m-instruct"],
            check=True,
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    port, bport = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        "--model-path",
        model,
        "--port",
        str(port),
        "--disaggregation-mode",
        "decode",
        "--disaggregation-bootstrap-port",
        str(bport),
        "--torch-num-threads",
        str(a.torch_num_threads),
    ]
    if a.max_total_tokens:
        cmd += ["--max-total-tokens", str(a.max_total_tokens)]
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": str(a.torch_num_threads)},
    )
    try:
        with httpx.Client(base_url=url, timeout=600) as h:
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"server exited with {proc.returncode}")
                try:
                    if h.get("/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            to_healthy = time.monotonic() - t0
            info = h.get("/server_info").json()["scheduler_info"]
            switches = []
            for _ in range(a.cycles):
                for role in ROLES:
                    t = time.monotonic()
                    r = h.post("/switch_role", json={"role": role})
                    wall = time.monotonic() - t
                    assert r.status_code == 200, r.text
                    out = r.json()
                    assert out["weights"] == info["weights"], "weights changed"
                    switches.append(
                        {
                            "from": out["previous_role"],
                            "to": role,
                            "wall_s": round(wall, 4),
                            **out["timings"],
                        }
                    )
                    print(
                        f"{out['previous_role']:>9} -> {role:<9} call {wall:7.3f}s  re-wiring "
                        f"{out['timings']['reconfigure_s']:6.3f}s  warm-up "
                        f"{out['timings']['warmup_s']:6.3f}s"
                    )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    result = {
        "model": model,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": cmd[1:],
        "start_to_healthy_s": round(to_healthy, 3),
        "scheduler_start_s": info["scheduler_start_s"],
        "kv_pages": info["num_pages"],
        "page_size": info["page_size"],
        "weights_bytes": info["weights"]["bytes"],
        "switches": switches,
        "median_switch_wall_s": round(statistics.median(s["wall_s"] for s in switches), 4),
    }
    print(
        f"start to /health 200: {to_healthy:.2f}s (scheduler {info['scheduler_start_s']:.2f}s); "
        f"median switch {result['median_switch_wall_s']:.3f}s; KV pool {info['num_pages']} pages"
    )
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
