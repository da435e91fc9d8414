"""``pdserve plan``'s predictions against measurements on this machine: the splits of a budget
of 2 servers (1 core and 1 torch thread each) for two workloads.

Set-ups, as in ``pd_vs_colocated.py`` (``taskset`` pins each server; router and client unpinned):
  pd         1 prefill on core 0 + 1 decode on core 1, behind ``pdserve router``   (the 1P1D split)
  colocated  2 colocated servers on cores 0 and 1, behind ``pdserve router --policy round_robin``

For each workload, with every server up and idle:
  1. ``pdserve plan --router <pd's router> --budget 2`` on the workload, with ``--num-requests``
     and ``--seed`` of the benchmark runs, so it simulates the very requests they send
     (calibration: the prefill's start-up calibration, a probe of the decode server);
  2. ``pdserve bench`` against each set-up: the same prompts, the same Poisson arrival times.
Then a table: predicted and measured goodput, TTFT and TPOT percentiles, per split.

  python benchmarks/plan_validation.py [--workloads short,long] [--num-prompts N]
      [--out-dir docs/bench/plan_validation]
  python benchmarks/plan_validation.py --report-only      # re-read the saved JSONs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pd_vs_colocated as pvc  # noqa: E402  (its set-ups and benchmark call)

from pdserve.bench.metrics import RequestRecord, is_good  # noqa: E402

# input/output: the longest length; lengths are uniform in [range_ratio * len, len] (bench's)
WORKLOADS = {
    "short": dict(
        input_len=64,
        output_len=256,
        range_ratio=0.5,
        rate=0.8,
        slo_ttft_ms=1500.0,
        slo_tpot_ms=60.0,
        num_prompts=30,
    ),
    "long": dict(
        input_len=1024,
        output_len=16,
        range_ratio=0.5,
        rate=0.3,
        slo_ttft_ms=6000.0,
        slo_tpot_ms=200.0,
        num_prompts=24,
    ),
}
SPLITS = {"pd": "1P1D", "colocated": "2 colocated"}
SEED = 100


def workload_args(name: str, a: argparse.Namespace) -> argparse.Namespace:
    w = WORKLOADS[name]
    return argparse.Namespace(
        model_path=a.model_path,
        input_len=w["input_len"],
        output_len=w["output_len"],
        range_ratio=w["range_ratio"],
        vocab_size=a.vocab_size,
        slo_ttft_ms=w["slo_ttft_ms"],
        slo_tpot_ms=w["slo_tpot_ms"],
    )


def num_prompts(name: str, a: argparse.Namespace) -> int:
    return a.num_prompts or WORKLOADS[name]["num_prompts"]


def lengths(n: int, ratio: float) -> str:
    return f"{max(1, int(ratio * n))}-{n}"


def run_plan(router_url: str, name: str, a: argparse.Namespace) -> dict:
    w = WORKLOADS[name]
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "plan",
        "--router",
        router_url,
        "--budget",
        "2",
        "--request-rate",
        str(w["rate"]),
        "--input-len",
        lengths(w["input_len"], w["range_ratio"]),
        "--output-len",
        lengths(w["output_len"], w["range_ratio"]),
        "--slo-ttft-ms",
        str(w["slo_ttft_ms"]),
        "--slo-tpot-ms",
        str(w["slo_tpot_ms"]),
        "--num-requests",
        str(num_prompts(name, a)),
        "--seed",
        str(SEED),
        "--json",
        "--save-calibration",
        str(a.out_dir / f"calibration-{name}.json"),
    ]
    print("$ " + " ".join(cmd[1:]), file=sys.stderr)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"pdserve plan failed:\n{out.stderr}")
    return json.loads(out.stdout)


def run_study(a: argparse.Namespace, names: list[str]) -> None:
    if a.model_path is None:
        from pdserve.models.demo import ensure_demo_model

        a.model_path = ensure_demo_model()
    logs = Path(tempfile.mkdtemp(prefix="plan-validation-"))
    print(f"server logs: {logs}", file=sys.stderr)
    started = {}
    try:
        for setup in SPLITS:
            started[setup] = pvc.start_setup(
                setup, a.model_path, logs, ["--max-total-tokens", "32768"]
            )
        for name in names:
            wa = workload_args(name, a)
            for setup, (router, servers) in started.items():  # warm-up at the workload's shapes
                pvc.bench(
                    router.url, logs / f"warmup-{name}-{setup}.json", float("inf"), 10_000, wa, 2
                )
                pvc.wait_idle(servers)
            plan = run_plan(started["pd"][0].url, name, a)
            (a.out_dir / f"plan-{name}.json").write_text(json.dumps(plan, indent=1))
            loads = {}
            for setup, (router, servers) in started.items():
                loads[setup] = [round(os.getloadavg()[0], 2)]
                print(
                    f"== {name} on {setup} ({time.strftime('%H:%M:%S')}, "
                    f"load {loads[setup][0]:.2f})",
                    file=sys.stderr,
                )
                pvc.bench(
                    router.url,
                    a.out_dir / f"bench-{name}-{setup}.json",
                    WORKLOADS[name]["rate"],
                    SEED,
                    wa,
                    num_prompts(name, a),
                )
                loads[setup].append(round(os.getloadavg()[0], 2))
                pvc.wait_idle(servers)
            (a.out_dir / f"load-{name}.json").write_text(json.dumps(loads))
    finally:
        for router, servers in started.values():
            router.stop()
            for p in servers:
                p.stop()


def measured(path: Path, w: dict) -> dict:
    res = json.loads(path.read_text())
    s = res["summary"]
    recs = [RequestRecord.from_json(r) for r in res["records"]]
    good = sum(is_good(r, w["slo_ttft_ms"], w["slo_tpot_ms"]) for r in recs)
    return {
        "goodput": good / s["duration_s"],
        "share": good / len(recs),
        "ttft": s["ttft_ms"],
        "tpot": s["tpot_ms"],
    }


def report(a: argparse.Namespace, names: list[str]) -> str:
    lines = []
    for name in names:
        w = WORKLOADS[name]
        plan_path = a.out_dir / f"plan-{name}.json"
        if not plan_path.exists():
            continue
        plan = json.loads(plan_path.read_text())
        loads = json.loads((a.out_dir / f"load-{name}.json").read_text())
        by_split = {c["split"]: c for c in plan["candidates"]}
        lines += [
            "",
            f"**{name}**: prompts {lengths(w['input_len'], w['range_ratio'])} tokens, outputs "
            f"{lengths(w['output_len'], w['range_ratio'])} tokens, Poisson {w['rate']:g} req/s, "
            f"{num_prompts(name, a)} requests, SLOs TTFT <= {w['slo_ttft_ms']:g} ms, "
            f"TPOT <= {w['slo_tpot_ms']:g} ms. "
            f"Recommended: **{plan['recommended']['split']}**.",
            "",
            "| split | goodput req/s pred / meas | SLOs met pred / meas | TTFT p50 ms pred / meas "
            "| TTFT p90 pred / meas | TPOT p50 ms pred / meas | TPOT p90 pred / meas | max rate "
            "pred | load |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for setup, split in SPLITS.items():
            path = a.out_dir / f"bench-{name}-{setup}.json"
            if not path.exists():
                continue
            p, m = by_split[split], measured(path, w)
            lines.append(
                f"| {split} | {p['goodput']:.3f} / {m['goodput']:.3f} | {p['slo_share']:.0%} / "
                f"{m['share']:.0%} | {p['ttft_ms']['p50']:.0f} / {m['ttft']['median']:.0f} | "
                f"{p['ttft_ms']['p90']:.0f} / {m['ttft']['p90']:.0f} | {p['tpot_ms']['p50']:.1f} / "
                f"{m['tpot']['median']:.1f} | {p['tpot_ms']['p90']:.1f} / {m['tpot']['p90']:.1f} | "
                f"{p['max_rate']:.2f} | {' / '.join(f'{x:.1f}' for x in loads.get(setup, []))} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model-path", default=None, help="default: the demo model (SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--workloads", default="short,long", help=f"from {', '.join(WORKLOADS)}")
    ap.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="per (workload, set-up); default: the workload's",
    )
    ap.add_argument("--vocab-size", type=int, default=49152)
    ap.add_argument("--out-dir", type=Path, default=Path("docs/bench/plan_validation"))
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    names = a.workloads.split(",")
    for n in names:
        if n not in WORKLOADS:
            ap.error(f"--workloads: unknown {n!r}; choose from {', '.join(WORKLOADS)}")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    if not a.report_only:
        t0 = time.time()
        run_study(a, names)
        print(f"study took {time.time() - t0:.0f} s", file=sys.stderr)
    print(report(a, names))


if __name__ == "__main__":
    main()
