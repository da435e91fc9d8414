"""PD routing choices side by side: colocated, 1P1D with ``--pd-policy always`` / ``conditional``,
with and without the decode prefix cache, and 2P1D with round_robin or cache_aware prefill
routing, on a multi-turn chat workload and on a long-prompt mix.

  python benchmarks/pd_routing.py [--model-path DIR] [--setups KEYS] [--workloads multi-turn,long]
      [--json OUT]

Every (set-up, workload) pair gets freshly started servers and router, stopped afterwards.
Prefill servers run on core 0, decode servers on core 1 (one torch thread each; the 2P1D set-ups
put both prefills on core 0); the colocated server runs on cores 0,1 with two threads and is
reached through ``pdserve router --worker`` so the extra hop is the same. Every server publishes
KV events (``--kv-events-endpoint``) and every router gets ``--tokenizer-path``, since
cache_aware and conditional need them. The load is ``pdserve bench`` (``--backend openai``,
text prompts), its summary gives TTFT / ITL / TPOT and goodput under the SLOs.

Server and router counters are read after a warm-up of our own (random prompts of another seed,
``--warmup-prompts`` of them, long enough that a conditional router sends them through PD) and
again after the run; the tables show the differences, so they count the measured requests only
(the bench's own warm-up is turned off). KV bytes come from the prefills' Prometheus counter
``pdserve:kv_transfer_bytes_total`` (the prefills' ``/server_info`` ``kv_bytes_sent`` or
``recent_transfers`` when it is missing), divided by the completed requests, local ones
included. Cache hits are the servers' ``cache_hit_tokens`` (``/server_info``): on a decode server
they include what it found for the prompts it prefilled itself (conditional). The local share is
the router's ``pdserve_router_pd_decisions_total{mode="local"}`` over all its decisions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdserve.bench import serving  # noqa: E402
from tests.helpers import cluster as c  # noqa: E402

RECENT_TRANSFERS_MAX = 256  # PrefillQueues.recent_transfers' maxlen (pdserve/disagg/prefill.py)


@dataclass(frozen=True)
class Setup:
    key: str
    name: str
    colocated: bool = False
    prefills: int = 1
    decode_cache: bool = False
    pd_policy: str = "always"
    prefill_policy: str | None = None


SETUPS = (
    Setup("colocated", "colocated", colocated=True),
    Setup("pd", "PD always"),
    Setup("pd-dc", "PD always + decode cache", decode_cache=True),
    Setup("cond", "PD conditional", pd_policy="conditional"),
    Setup("cond-dc", "PD conditional + decode cache", decode_cache=True, pd_policy="conditional"),
    Setup(
        "2p1d-rr",
        "2P1D round_robin + decode cache",
        prefills=2,
        decode_cache=True,
        prefill_policy="round_robin",
    ),
    Setup(
        "2p1d-ca",
        "2P1D cache_aware + decode cache",
        prefills=2,
        decode_cache=True,
        prefill_policy="cache_aware",
    ),
)
BASELINE = "PD always"
WORKLOADS = ("multi-turn", "long")


def kv_events() -> list[str]:
    return [
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{c.free_port()}",
        "--kv-events-replay-endpoint",
        f"tcp://127.0.0.1:{c.free_port()}",
    ]


def pinned(
    name: str, model: str, logs: Path, core: str, threads: int, dtype: str, *args: str
) -> c.Proc:
    port = c.free_port()
    cmd = [
        "taskset",
        "-c",
        core,
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        "--model-path",
        model,
        "--port",
        str(port),
        "--torch-num-threads",
        str(threads),
        "--served-model-name",
        "demo",
        "--max-total-tokens",
        "65536",
        "--dtype",
        dtype,
        *kv_events(),
        *args,
    ]
    return c.Proc(name, cmd, port, logs, env={"OMP_NUM_THREADS": str(threads)})


# ---- counters -------------------------------------------------------------------------------
def prom(proc: c.Proc) -> dict[tuple, float]:
    """Every sample of ``/metrics``: (name, sorted labels) -> value."""
    text = proc.http.get("/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def sample_sum(samples: dict[tuple, float], name: str, **labels: str) -> float | None:
    vals = [
        v
        for (n, lab), v in samples.items()
        if n == name and all(dict(lab).get(k) == x for k, x in labels.items())
    ]
    return sum(vals) if vals else None


def server_counters(proc: c.Proc) -> dict:
    states = proc.http.get("/server_info").json()["internal_states"]  # one per DP group
    transfers = [t for s in states for t in s.get("recent_transfers", [])]
    metrics = prom(proc)
    return {
        "cache_hit_tokens": sum(s.get("cache_hit_tokens", 0) for s in states),
        "prompt_tokens": sum(s.get("prompt_tokens", 0) for s in states),
        "kv_bytes_sent": sum(s.get("kv_bytes_sent", 0) for s in states)
        if any("kv_bytes_sent" in s for s in states)
        else None,
        "kv_bytes_metric": sample_sum(metrics, "pdserve:kv_transfer_bytes_total"),
        "transfers": transfers,
        "transfers_full": any(
            len(s.get("recent_transfers", [])) >= RECENT_TRANSFERS_MAX for s in states
        ),
    }


def router_counters(router: c.Proc) -> dict:
    m = prom(router)
    decisions: dict[str, float] = {}
    for (name, lab), v in m.items():
        if name == "pdserve_router_pd_decisions_total":
            d = dict(lab)
            decisions[f"{d.get('mode')}/{d.get('reason')}"] = v
    return {
        "decisions": decisions,
        "upstream_errors": sample_sum(m, "pdserve_router_upstream_errors_total") or 0.0,
        "retries": sample_sum(m, "pdserve_router_retries_total") or 0.0,
        "non_200": sum(
            v
            for (n, lab), v in m.items()
            if n == "pdserve_router_requests_total" and dict(lab).get("status") != "200"
        ),
    }


def snapshot(prefills: list[c.Proc], decode: c.Proc | None, router: c.Proc) -> dict:
    return {
        "prefills": [server_counters(p) for p in prefills],
        "decode": server_counters(decode) if decode is not None else None,
        "router": router_counters(router),
    }


def diff(before: dict, after: dict, completed: int) -> tuple[dict, list[str]]:
    """What the measured run added to the counters, and warnings."""
    warnings: list[str] = []
    out: dict = {}
    new_transfers, source, kv_bytes = [], None, 0.0
    for i, (b, a) in enumerate(zip(before["prefills"], after["prefills"])):
        seen = {t["rid"] for t in b["transfers"]}
        new = [t for t in a["transfers"] if t["rid"] not in seen]
        new_transfers += new
        if a["transfers_full"]:
            warnings.append(
                f"prefill {i}: recent_transfers hit its {RECENT_TRANSFERS_MAX} entries, its "
                "transfer count (and its KV bytes, if taken from there) is a lower bound"
            )
        if a["kv_bytes_metric"] is not None and b["kv_bytes_metric"] is not None:
            kv_bytes += a["kv_bytes_metric"] - b["kv_bytes_metric"]
            source = source or "metric pdserve:kv_transfer_bytes_total"
        elif a["kv_bytes_sent"] is not None:
            kv_bytes += a["kv_bytes_sent"] - (b["kv_bytes_sent"] or 0)
            source = source or "/server_info kv_bytes_sent"
        else:
            kv_bytes += sum(t["kv_bytes"] for t in new)
            source = source or "/server_info recent_transfers"
    out["kv_bytes"] = kv_bytes
    out["kv_bytes_source"] = source
    out["kv_bytes_recent_transfers"] = sum(t["kv_bytes"] for t in new_transfers)
    out["transfers"] = len(new_transfers)
    out["pages_sent"] = sum(t["pages"] for t in new_transfers)
    out["kv_bytes_per_request"] = kv_bytes / completed if completed else None
    out["prefill_cache_hit_tokens"] = sum(
        a["cache_hit_tokens"] - b["cache_hit_tokens"]
        for b, a in zip(before["prefills"], after["prefills"])
    )
    out["prefill_prompt_tokens"] = sum(
        a["prompt_tokens"] - b["prompt_tokens"]
        for b, a in zip(before["prefills"], after["prefills"])
    )
    out["prefill_requests_per_server"] = [
        len({t["rid"] for t in a["transfers"]} - {t["rid"] for t in b["transfers"]})
        for b, a in zip(before["prefills"], after["prefills"])
    ]
    if after["decode"] is not None:
        out["decode_cache_hit_tokens"] = (
            after["decode"]["cache_hit_tokens"] - before["decode"]["cache_hit_tokens"]
        )
        out["decode_prompt_tokens"] = (
            after["decode"]["prompt_tokens"] - before["decode"]["prompt_tokens"]
        )
    rb, ra = before["router"], after["router"]
    decisions = {k: v - rb["decisions"].get(k, 0.0) for k, v in ra["decisions"].items()}
    decisions = {k: v for k, v in decisions.items() if v}
    out["pd_decisions"] = decisions
    total = sum(decisions.values())
    out["local_share"] = (
        sum(v for k, v in decisions.items() if k.startswith("local/")) / total if total else None
    )
    for k in ("upstream_errors", "retries", "non_200"):
        out[f"router_{k}"] = ra[k] - rb[k]
        if out[f"router_{k}"]:
            warnings.append(
                f"router {k.replace('_', ' ')}: {out[f'router_{k}']:.0f} during the run"
            )
    return out, warnings


# ---- load -----------------------------------------------------------------------------------
def common_argv(url: str, model: str) -> list[str]:
    return [
        "--backend",
        "openai",
        "--base-url",
        url,
        "--model",
        "demo",
        "--tokenizer",
        model,
        "--ignore-eos",
        "--disable-tqdm",
    ]


def workload_argv(workload: str, a) -> list[str]:
    slo = [
        "--slo-ttft-ms",
        str(a.slo_ttft_ms),
        "--slo-tpot-ms",
        str(a.slo_tpot_ms),
        "--warmup-requests",
        "0",
    ]
    if workload == "multi-turn":
        return [
            "--dataset-name",
            "multi-turn",
            "--mt-num-sessions",
            str(a.sessions),
            "--mt-num-turns",
            str(a.turns),
            "--mt-system-len",
            str(a.system_len),
            "--mt-user-len",
            str(a.user_len),
            "--mt-output-len",
            str(a.output_len),
            "--mt-think-time",
            str(a.think_time),
            "--random-range-ratio",
            "1",
            "--max-concurrency",
            str(a.concurrency),
            *slo,
        ]
    return [
        "--dataset-name",
        "random",
        "--num-prompts",
        str(a.long_prompts),
        "--random-input-len",
        str(a.long_input_len),
        "--random-output-len",
        str(a.long_output_len),
        "--random-range-ratio",
        str(a.long_range_ratio),
        "--request-rate",
        str(a.long_rate),
        *slo,
    ]


def warm_up(url: str, model: str, a, logs: Path, tag: str) -> None:
    argv = [
        *common_argv(url, model),
        "--dataset-name",
        "random",
        "--num-prompts",
        str(a.warmup_prompts),
        "--random-input-len",
        str(a.warmup_input_len),
        "--random-output-len",
        "8",
        "--random-range-ratio",
        "1",
        "--max-concurrency",
        "2",
        "--seed",
        "4242",
        "--warmup-requests",
        "0",
        "--output-file",
        str(logs / f"{tag}.warmup.json"),
    ]
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        rc = serving.main(argv)
    if rc != 0:
        raise RuntimeError(f"warm-up of {tag} failed")


def run(setup: Setup, workload: str, model: str, logs: Path, a) -> dict:
    tag = f"{setup.key}.{workload}"
    servers: list[c.Proc] = []
    prefills: list[c.Proc] = []
    decode: c.Proc | None = None
    if setup.colocated:
        W = pinned(f"W-{tag}", model, logs, "0,1", 2, a.dtype)
        servers = prefills = [W]
    else:
        for i in range(setup.prefills):
            bport = c.free_port()
            P = pinned(
                f"P{i}-{tag}",
                model,
                logs,
                "0",
                1,
                a.dtype,
                "--disaggregation-mode",
                "prefill",
                "--disaggregation-bootstrap-port",
                str(bport),
            )
            P.bootstrap_port = bport
            prefills.append(P)
        extra = ["--disaggregation-decode-enable-radix-cache"] if setup.decode_cache else []
        decode = pinned(
            f"D-{tag}", model, logs, "1", 1, a.dtype, "--disaggregation-mode", "decode", *extra
        )
        servers = [*prefills, decode]
    R = None
    try:
        t0 = time.monotonic()
        c.start_all(servers)
        if setup.colocated:
            router_args = ["--policy", "round_robin", "--tokenizer-path", model]
            R = c.router(f"R-{tag}", [], [], logs, "--worker", servers[0].url, *router_args)
        else:
            router_args = ["--tokenizer-path", model, "--pd-policy", setup.pd_policy]
            if setup.prefill_policy:
                router_args += ["--prefill-policy", setup.prefill_policy]
            if setup.pd_policy == "conditional" and a.pd_prefill_fit:
                fixed, per_token = a.pd_prefill_fit.split(",")
                router_args += [
                    "--pd-prefill-fixed-s",
                    fixed,
                    "--pd-prefill-s-per-token",
                    per_token,
                ]
            R = c.router(f"R-{tag}", prefills, [decode], logs, *router_args)
        R.start()
        started_s = time.monotonic() - t0
        print(
            f"== {setup.name} / {workload} ({time.strftime('%H:%M:%S')}, "
            f"servers up in {started_s:.0f} s)",
            file=sys.stderr,
        )
        if setup.pd_policy == "conditional":
            for s in servers:
                cal = s.http.get("/server_info").json().get("calibration") or {}
                print(
                    f"   {s.name} calibration: {cal.get('prefill_fixed_s')} s + "
                    f"{cal.get('prefill_s_per_token')} s/token",
                    file=sys.stderr,
                )
        warm_up(R.url, model, a, logs, tag)
        time.sleep(0.5)  # let the last KV events and transfer records land
        before = snapshot(prefills, decode, R)
        out = logs / f"{tag}.json"
        argv = [*common_argv(R.url, model), *workload_argv(workload, a), "--output-file", str(out)]
        t1 = time.monotonic()
        with contextlib.redirect_stdout(sys.stderr):  # stdout is kept for the tables
            rc = serving.main(argv)
        bench_s = time.monotonic() - t1
        if rc != 0:
            raise RuntimeError(
                f"benchmark of {setup.name} / {workload} failed (rc {rc}); logs in {logs}"
            )
        saved = json.loads(out.read_text())
        summary = saved["summary"]
        turns = breakdown(saved["records"], a.slo_ttft_ms)
        time.sleep(0.5)
        after = snapshot(prefills, decode, R)
        counters, warnings = diff(before, after, summary["completed"])
        if setup.colocated:  # its only server is in the prefill slot; it moves no KV
            counters["kv_bytes"], counters["kv_bytes_per_request"] = 0.0, None
        # includes the servers' own start-up prefills (warm-up, calibration), which move no KV
        transfers_before = (
            [len(s["transfers"]) for s in before["prefills"]] if not setup.colocated else []
        )
        calibration = {
            s.name: (s.http.get("/server_info").json().get("calibration") or {}) for s in servers
        }
        for w in warnings:
            print(f"   warning: {w}", file=sys.stderr)
        return {
            "setup": setup.name,
            "key": setup.key,
            "workload": workload,
            "summary": summary,
            "breakdown": turns,
            **counters,
            "warnings": warnings,
            "transfer_records_before_run_per_prefill": transfers_before,
            "calibration": calibration,
            "router_args": router_args,
            "startup_s": started_s,
            "bench_s": bench_s,
            "bench_argv": argv,
        }
    finally:
        for s in [x for x in (R, *reversed(servers)) if x is not None]:
            s.stop()


# ---- report ---------------------------------------------------------------------------------
def fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def ratio(x: float | None, base: float | None) -> str:
    if x is None or not base:
        return "-"
    return f"{x / base:.2f}x"


def table(rows: list[dict]) -> list[str]:
    base = next((r for r in rows if r["setup"] == BASELINE), None)
    header = (
        "| set-up | done | TTFT mean / p90 / p99 ms | ITL p99 ms | TPOT mean ms | goodput req/s "
        f"(share) | TTFT mean vs {BASELINE} | goodput vs {BASELINE} | KV MB/req | prefilled on "
        "decode | prefill cache hits (tok) | decode cache hits (tok) |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["summary"]
        ttft, itl, tpot, good = (
            s["ttft_ms"] or {},
            s["itl_ms"] or {},
            s["tpot_ms"] or {},
            s["goodput"] or {},
        )
        b = (base or {}).get("summary") or {}
        kv = r["kv_bytes_per_request"]
        local = r["local_share"]
        lines.append(
            f"| {r['setup']} | {s['completed']}/{s['completed'] + s['failed']} "
            f"| {fmt(ttft.get('mean'))} / {fmt(ttft.get('p90'))} / {fmt(ttft.get('p99'))} "
            f"| {fmt(itl.get('p99'), '.1f')} | {fmt(tpot.get('mean'), '.1f')} "
            f"| {fmt(good.get('rate'), '.3f')} ({fmt(100 * good['share'] if good else None)}%) "
            f"| {ratio(ttft.get('mean'), (b.get('ttft_ms') or {}).get('mean'))} "
            f"| {ratio(good.get('rate'), (b.get('goodput') or {}).get('rate'))} "
            f"| {'-' if kv is None else f'{kv / 1e6:.1f}'} "
            f"| {'-' if local is None else f'{100 * local:.0f}%'} "
            f"| {r['prefill_cache_hit_tokens']} | {fmt(r.get('decode_cache_hit_tokens'))} |"
        )
    return lines


def breakdown(records: list[dict], slo_ttft_ms: float) -> dict:
    """From the bench's per-request records: TTFT of first turns and of later ones (the prefix
    reuse shows in the later ones), and the share meeting each SLO alone and TPOT <= 100 ms."""
    ok = [r for r in records if r.get("success")]

    def mean(xs):
        return 1e3 * sum(xs) / len(xs) if xs else None

    def share(pred):
        return sum(1 for r in ok if pred(r)) / len(records) if records else None

    ttft_ok = lambda r: r["ttft"] * 1e3 <= slo_ttft_ms  # noqa: E731
    tpot = lambda r: r.get("tpot") or 0.0  # noqa: E731
    return {
        "ttft_first_turn_ms": mean([r["ttft"] for r in ok if r.get("turn") in (0, None)]),
        "ttft_later_turns_ms": mean([r["ttft"] for r in ok if (r.get("turn") or 0) > 0]),
        "share_ttft_slo": share(ttft_ok),
        "share_tpot_50": share(lambda r: tpot(r) <= 0.05),
        "share_ttft_and_tpot_100": share(lambda r: ttft_ok(r) and tpot(r) <= 0.1),
    }


def breakdown_table(rows: list[tuple[str, dict]], slo_ttft_ms: float) -> list[str]:
    lines = [
        "| set-up | TTFT first turns ms | TTFT later turns ms | share TTFT <= "
        f"{slo_ttft_ms / 1e3:g} s | share TPOT <= 50 ms | share TTFT <= {slo_ttft_ms / 1e3:g} s "
        "and TPOT <= 100 ms |",
        "|---|---|---|---|---|---|",
    ]
    for name, b in rows:
        pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # noqa: E731
        lines.append(
            f"| {name} | {fmt(b['ttft_first_turn_ms'])} | {fmt(b['ttft_later_turns_ms'])} "
            f"| {pct(b['share_ttft_slo'])} | {pct(b['share_tpot_50'])} | "
            f"{pct(b['share_ttft_and_tpot_100'])} |"
        )
    return lines


def retabulate(logdir: Path, slo_ttft_ms: float) -> None:
    """The breakdown tables again, from the per-run JSONs a run left in its log folder."""
    for workload in WORKLOADS:
        rows = []
        for setup in SETUPS:
            f = logdir / f"{setup.key}.{workload}.json"
            if f.exists():
                rows.append(
                    (setup.name, breakdown(json.loads(f.read_text())["records"], slo_ttft_ms))
                )
        if rows:
            print(f"\n### {workload}: by turn and by SLO ({logdir})\n")
            print("\n".join(breakdown_table(rows, slo_ttft_ms)))


def pick_setups(text: str) -> list[Setup]:
    if text == "all":
        return list(SETUPS)
    chosen = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        match = [s for s in SETUPS if item.lower() in (s.key, s.name.lower())]
        if not match:
            raise SystemExit(
                f"--setups: unknown {item!r}; choose from "
                + "; ".join(f"{s.key} ({s.name})" for s in SETUPS)
            )
        chosen += [s for s in match if s not in chosen]
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default=None)
    ap.add_argument(
        "--setups",
        default="all",
        help="comma-separated keys or names: " + ", ".join(f"{s.key} ({s.name})" for s in SETUPS),
    )
    ap.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated: multi-turn, long"
    )
    g = ap.add_argument_group("multi-turn workload")
    g.add_argument("--sessions", type=int, default=8)
    g.add_argument("--turns", type=int, default=4)
    g.add_argument("--system-len", type=int, default=512)
    g.add_argument("--user-len", type=int, default=64)
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--think-time", type=float, default=0.5)
    g.add_argument("--concurrency", type=int, default=8)
    g = ap.add_argument_group("long-prompt workload")
    g.add_argument("--long-prompts", type=int, default=24)
    g.add_argument("--long-rate", type=float, default=1.0, help="requests per second (Poisson)")
    g.add_argument("--long-input-len", type=int, default=1024)
    g.add_argument("--long-output-len", type=int, default=64)
    g.add_argument(
        "--long-range-ratio",
        type=float,
        default=0.25,
        help="input AND output lengths are uniform in [ratio * len, "
        "len] (the bench's random dataset)",
    )
    g = ap.add_argument_group("SLOs and warm-up")
    g.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    g.add_argument("--slo-tpot-ms", type=float, default=50.0)
    g.add_argument("--warmup-prompts", type=int, default=4)
    g.add_argument(
        "--warmup-input-len",
        type=int,
        default=600,
        help="tokens; above the router's --pd-local-max-tokens (512) "
        "so conditional warms the PD path",
    )
    ap.add_argument(
        "--pd-prefill-fit",
        default=None,
        metavar="FIXED_S,S_PER_TOKEN",
        help="conditional set-ups: give the router this prefill cost (--pd-prefill-fixed-s, "
        "--pd-prefill-s-per-token) instead of the servers' start-up calibration, which is noisy "
        "when servers start together on a busy machine",
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("auto", "bfloat16", "float32"),
        help="every server's --dtype. Not auto by default: auto times bf16 against float32 at "
        "start-up on each server, servers starting together can choose differently, and a prefill "
        "and a decode with different KV dtypes cannot pair (kv_dtype mismatch)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--retabulate",
        default=None,
        metavar="LOGDIR",
        help="print the by-turn / by-SLO tables from a finished run's log folder, run nothing",
    )
    a = ap.parse_args()
    if a.retabulate:
        return retabulate(Path(a.retabulate), a.slo_ttft_ms)
    setups = pick_setups(a.setups)
    if a.pd_prefill_fit:
        try:
            _fixed, _per_token = (float(x) for x in a.pd_prefill_fit.split(","))
        except ValueError:
            raise SystemExit(
                f"--pd-prefill-fit: expected FIXED_S,S_PER_TOKEN, got {a.pd_prefill_fit!r}"
            ) from None
    workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"--workloads: unknown {w!r}; choose from {', '.join(WORKLOADS)}")
    if a.model_path is None:
        from pdserve.models.demo import ensure_demo_model

        a.model_path = ensure_demo_model()
    logs = Path(tempfile.mkdtemp(prefix="pd-routing-bench-"))
    print(f"server logs: {logs}", file=sys.stderr)
    t0 = time.monotonic()
    results = {w: [run(s, w, a.model_path, logs, a) for s in setups] for w in workloads}
    total_s = time.monotonic() - t0

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")),
        "?",
    )
    print(
        f"machine: {platform.machine()}, {cpu}, {os.cpu_count()} cores; prefill(s) on core 0, "
        "decode on core 1, one torch thread each; colocated on cores 0,1 with two threads; "
        "router and load generator unpinned"
    )
    print(
        f"model: {a.model_path}; --dtype {a.dtype}; --max-total-tokens 65536; SLO: TTFT <= "
        f"{a.slo_ttft_ms:g} ms, TPOT <= {a.slo_tpot_ms:g} ms; wall time {total_s / 60:.1f} min"
    )
    print(
        "conditional router's prefill cost: "
        + (
            f"--pd-prefill-fit {a.pd_prefill_fit}"
            if a.pd_prefill_fit
            else "the servers' start-up calibration (in --json)"
        )
    )
    lo_in = max(1, int(a.long_range_ratio * a.long_input_len))
    lo_out = max(1, int(a.long_range_ratio * a.long_output_len))
    params = {
        "multi-turn": f"multi-turn chat: {a.sessions} sessions x {a.turns} turns, system "
        f"{a.system_len}, user {a.user_len}, answers {a.output_len} tokens, think time "
        f"{a.think_time} s, concurrency {a.concurrency} (`--dataset-name multi-turn`, each turn "
        "resends the conversation so far)",
        "long": f"long-prompt mix: {a.long_prompts} requests, input {lo_in}..{a.long_input_len} "
        f"tokens, output {lo_out}..{a.long_output_len} tokens (uniform, `--dataset-name random "
        f"--random-range-ratio {a.long_range_ratio:g}`), Poisson {a.long_rate:g} req/s, "
        "no concurrency cap",
    }
    for w in workloads:
        print()
        print(f"### {params[w]}")
        print()
        print("\n".join(table(results[w])))
        print()
        print(
            "\n".join(
                breakdown_table([(r["setup"], r["breakdown"]) for r in results[w]], a.slo_ttft_ms)
            )
        )
        for r in results[w]:
            for warning in r["warnings"]:
                print(f"- {r['setup']}: {warning}")
    print()
    print(
        f"Notes: counters are differences between a read after our own warm-up ({a.warmup_prompts} "
        f"random prompts of {a.warmup_input_len} tokens, another seed) and one after the run, so "
        "they count the measured requests only; the bench's own warm-up is off. KV MB/req: KV "
        "bytes the prefills wrote into decode (pdserve:kv_transfer_bytes_total) over completed "
        "requests, local ones included. 'prefilled on decode': router decisions with mode=local "
        "over all decisions. Cache hits are the servers' cache_hit_tokens (colocated: its one "
        "server, in the prefill column; decode's include local prefills). Ratios are against "
        f"'{BASELINE}' (TTFT: lower is better, goodput: higher is better)."
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"args": vars(a), "machine": cpu, "cores": os.cpu_count(), "results": results},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
