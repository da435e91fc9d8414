"""CPU seconds and wall time a ``pdserve serve`` takes from its start until ``/health`` answers,
per process of the server (the front end, each scheduler rank), for one or more checkouts run
side by side (alternately, so a busy host slows each the same):

    python benchmarks/server_startup.py --model-path CKPT --repeat 5 [--checkout DIR ...]

Without ``--checkout`` it measures this tree; ``--warmup`` counts the warm-up generation and
the calibration too, as a server started without ``--skip-warmup`` runs them before ``/health``.
The CPU time of a process is read from ``/proc/<pid>/stat`` while it lives (after ``/health``
answered, before it is stopped), so the scheduler's time counts even though the front end never
waits for it. Prints a table with the median of each and the ratio of each checkout's total to
the first's."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        todo += _children(p)
    return pids


def _name(pid: int, root: int) -> str:
    if pid == root:
        return "front end"
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    if "resource_tracker" in cmdline:
        return "resource tracker"
    comm = Path(f"/proc/{pid}/comm").read_text().strip()  # a forked rank has its parent's cmdline
    if "multiprocessing" in cmdline or comm.startswith("pdserve-tp"):
        return "scheduler"
    return cmdline[:40]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(checkout: Path, model_path: str, extra: list[str], warmup: bool = False) -> dict:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(checkout))
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--model-path", model_path]
    cmd += ["--port", str(port), *([] if warmup else ["--skip-warmup"]), *extra]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - t0 > 300:
                raise RuntimeError("the server did not answer /health within 300 s")
            time.sleep(0.05)
        wall = time.monotonic() - t0
        per = {}
        for pid in _tree(proc.pid):
            try:
                name = _name(pid, proc.pid)
                per[name] = per.get(name, 0.0) + _cpu_seconds(pid)
            except OSError:
                pass
        return {"wall": wall, "cpu": sum(per.values()), "per": per}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--checkout", action="append", default=[], help="a pdserve tree (repeatable)")
    p.add_argument("--server-arg", action="append", default=[], help="one more serve flag")
    p.add_argument(
        "--warmup",
        action="store_true",
        help="count the warm-up generation and calibration too (/health waits for them)",
    )
    args = p.parse_args()
    checkouts = [Path(c).resolve() for c in args.checkout] or [Path(__file__).resolve().parents[1]]
    runs: dict[Path, list[dict]] = {c: [] for c in checkouts}
    one_start(checkouts[0], args.model_path, args.server_arg)  # page cache, kernels built
    for _ in range(args.repeat):
        for c in checkouts:
            runs[c].append(one_start(c, args.model_path, args.server_arg, args.warmup))
    base = statistics.median(r["cpu"] for r in runs[checkouts[0]])
    print(f"{'checkout':<40} {'wall s':>7} {'CPU s':>7} {'ratio':>6}  per process (CPU s)")
    for c in checkouts:
        rs = runs[c]
        cpu = statistics.median(r["cpu"] for r in rs)
        wall = statistics.median(r["wall"] for r in rs)
        names = sorted({n for r in rs for n in r["per"]})
        per = ", ".join(
            f"{n.strip()}: {statistics.median(r['per'].get(n, 0.0) for r in rs):.2f}" for n in names
        )
        print(f"{str(c):<40} {wall:7.2f} {cpu:7.2f} {cpu / base:6.2f}  {per}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
