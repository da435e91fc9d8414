"""What ``pdserve router --autoscale`` gains: a fixed split against the split it moves to, on the
same servers and the same kind of load.

  python benchmarks/autoscale.py [--model-path DIR] [--seconds 40] [--clients 8] [--out F.json]

Starts three servers (one prefill, two decodes; the demo model by default, one thread each) and
runs two loads in turn, each from a fresh random prompt per request (no prefix-cache hits):

- ``prefill-heavy``: long prompts, a few output tokens;
- ``decode-heavy``: short prompts, long outputs.

For each load: first a router without ``--autoscale`` over the split the servers have now
(measured for ``--seconds``), then an autoscaling router over the same servers, run until its
first switch has completed and then measured for ``--seconds`` again. The decode-heavy load
starts from the split the prefill-heavy one left. Reported per phase: completed requests/s,
output tokens/s, request latency p50/p90 (of the requests that ended in the measured window, after
``--warmup`` seconds); and the ratios autoscaled / fixed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

LOADS = {  # name: (prompt length range, output tokens)
    "prefill-heavy": ((1500, 2500), 4),
    "decode-heavy": ((8, 32), 96),
}
AUTOSCALE = [
    "--autoscale",
    "--autoscale-interval",
    "1",
    "--autoscale-window",
    "8",
    "--autoscale-cooldown",
    "5",
    "--autoscale-queue",
    "1.5",
    "--drain-timeout",
    "120",
    "--health-check-interval",
    "1",
]


def free_port() -> int:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Proc:
    def __init__(self, name: str, cmd: list[str], port: int, threads: int):
        self.name, self.port, self.url = name, port, f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(
            prefix=f"autoscale-{name}-", suffix=".log", delete=False
        )
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"{self.name} exited with {self.proc.returncode}; log: {self.log.name}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise SystemExit(f"{self.name} not ready after {timeout}s; log: {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Load:
    def __init__(
        self, url: str, lengths: tuple[int, int], new_tokens: int, clients: int, seed: int
    ):
        self.url, self.lengths, self.new_tokens = url, lengths, new_tokens
        self.stop = threading.Event()
        self.done: list[tuple[float, float, int, int]] = []  # (start, end, status, output tokens)
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._run, args=(random.Random(seed * 1000 + i),), daemon=True)
            for i in range(clients)
        ]
        for t in self.threads:
            t.start()

    def _run(self, rng: random.Random) -> None:
        with httpx.Client(timeout=600) as h:
            while not self.stop.is_set():
                ids = [rng.randrange(100, 40000) for _ in range(rng.randint(*self.lengths))]
                t0 = time.monotonic()
                try:
                    r = h.post(
                        self.url + "/generate",
                        json={
                            "input_ids": ids,
                            "sampling_params": {
                                "temperature": 0,
                                "max_new_tokens": self.new_tokens,
                                "ignore_eos": True,
                            },
                        },
                    )
                    status, n = (
                        r.status_code,
                        len(r.json().get("output_ids", [])) if r.status_code == 200 else 0,
                    )
                except httpx.HTTPError:
                    status, n = -1, 0
                with self.lock:
                    self.done.append((t0, time.monotonic(), status, n))

    def measure(self, seconds: float) -> dict:
        t0 = time.monotonic()
        time.sleep(seconds)
        t1 = time.monotonic()
        with self.lock:
            inside = [d for d in self.done if t0 <= d[1] <= t1]  # ended in the window
            failed = sum(1 for d in self.done if d[2] != 200)
        lat = sorted(d[1] - d[0] for d in inside if d[2] == 200)
        return {
            "seconds": round(t1 - t0, 2),
            "requests": len(lat),
            "failed_total": failed,
            "req_per_s": round(len(lat) / (t1 - t0), 3),
            "output_tok_per_s": round(sum(d[3] for d in inside if d[2] == 200) / (t1 - t0), 1),
            "latency_p50_s": round(statistics.median(lat), 3) if lat else None,
            "latency_p90_s": round(lat[int(0.9 * (len(lat) - 1))], 3) if lat else None,
        }

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(600)


def router(
    name: str, prefills: list[tuple[str, int]], decodes: list[str], extra: list[str]
) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "router", "--port", str(port), *extra]
    for url, bport in prefills:
        cmd += ["--prefill", url, str(bport)]
    for url in decodes:
        cmd += ["--decode", url]
    r = Proc(name, cmd, port, 1)
    r.wait_ready(60)
    return r


def split(prefills, decodes) -> str:
    return f"{len(prefills)}P{len(decodes)}D"


def roles_of(r: Proc) -> tuple[list[tuple[str, int]], list[str]]:
    ws = [w for w in httpx.get(r.url + "/workers").json()["workers"] if not w["draining"]]
    return (
        [(w["url"], w["bootstrap_port"]) for w in ws if w["worker_type"] == "prefill"],
        [w["url"] for w in ws if w["worker_type"] == "decode"],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model-path", default=None, help="default: the demo model (pdserve prepare-model)"
    )
    ap.add_argument("--seconds", type=float, default=40.0, help="measured time per phase")
    ap.add_argument(
        "--warmup", type=float, default=20.0, help="unmeasured seconds before each phase"
    )
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-running-requests", type=int, default=4, help="each server's batch limit")
    ap.add_argument("--switch-timeout", type=float, default=300.0)
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
    common = [
        "--model-path",
        model,
        "--torch-num-threads",
        "1",
        "--max-total-tokens",
        "65536",
        "--max-running-requests",
        str(a.max_running_requests),
        "--disaggregation-bootstrap-timeout",
        "300",
        "--disaggregation-waiting-timeout",
        "300",
        "--disaggregation-prealloc-timeout",
        "300",
    ]
    servers = []
    for name, mode in (("P1", "prefill"), ("D1", "decode"), ("D2", "decode")):
        port, bport = free_port(), free_port()
        servers.append(
            Proc(
                name,
                [
                    sys.executable,
                    "-m",
                    "pdserve.cli",
                    "serve",
                    "--port",
                    str(port),
                    "--disaggregation-mode",
                    mode,
                    "--disaggregation-bootstrap-port",
                    str(bport),
                    *common,
                ],
                port,
                1,
            )
        )
        servers[-1].bootstrap_port = bport
    results = []
    try:
        for s in servers:
            s.wait_ready()
        prefills = [(servers[0].url, servers[0].bootstrap_port)]
        decodes = [servers[1].url, servers[2].url]
        for i, (load_name, (lengths, new_tokens)) in enumerate(LOADS.items()):
            row = {"load": load_name, "prompt_tokens": list(lengths), "output_tokens": new_tokens}
            r = router(f"fixed-{i}", prefills, decodes, [])
            load = Load(r.url, lengths, new_tokens, a.clients, seed=2 * i)
            time.sleep(a.warmup)  # until the queues reached their steady length
            row["fixed"] = {"split": split(prefills, decodes), **load.measure(a.seconds)}
            load.finish()
            r.stop()
            print(json.dumps(row["fixed"]), flush=True)
            r = router(f"autoscale-{i}", prefills, decodes, AUTOSCALE)
            load = Load(r.url, lengths, new_tokens, a.clients, seed=2 * i + 1)
            t0 = time.monotonic()
            switch = None
            while time.monotonic() - t0 < a.switch_timeout:
                done = [
                    s
                    for s in httpx.get(r.url + "/autoscale").json()["switches"]
                    if s["outcome"] != "running"
                ]
                if done:
                    switch = done[0]
                    break
                time.sleep(1)
            prefills, decodes = roles_of(r)
            row["switch"] = switch and {**switch, "after_s": round(time.monotonic() - t0, 1)}
            time.sleep(a.warmup)
            row["autoscaled"] = {"split": split(prefills, decodes), **load.measure(a.seconds)}
            load.finish()
            r.stop()
            f, s = row["fixed"], row["autoscaled"]
            row["ratio_req_per_s"] = (
                round(s["req_per_s"] / f["req_per_s"], 2) if f["req_per_s"] else None
            )
            row["ratio_latency_p50"] = (
                round(s["latency_p50_s"] / f["latency_p50_s"], 2)
                if f["latency_p50_s"] and s["latency_p50_s"]
                else None
            )
            print(json.dumps(row), flush=True)
            results.append(row)
    finally:
        for s in servers:
            s.stop()
    out = {
        "command": " ".join(sys.argv),
        "machine": lscpu(),
        "python": platform.python_version(),
        "clients": a.clients,
        "max_running_requests": a.max_running_requests,
        "results": results,
    }
    print(
        "\n| load | fixed split | req/s | p50 s | autoscaled split | req/s | p50 s | req/s ratio | "
        "p50 ratio | switched after s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in results:
        f, s, sw = row["fixed"], row["autoscaled"], row["switch"] or {}
        print(
            f"| {row['load']} | {f['split']} | {f['req_per_s']} | {f['latency_p50_s']} | "
            f"{s['split']} | {s['req_per_s']} | {s['latency_p50_s']} | {row['ratio_req_per_s']} | "
            f"{row['ratio_latency_p50']} | {sw.get('after_s')} ({sw.get('seconds')} s switch) |"
        )
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)


def lscpu() -> str:
    try:
        info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor()
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    keep = [f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma")]
    return (
        f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs, "
        f"flags: {' '.join(keep)}"
    )


if __name__ == "__main__":
    main()
