"""``pdserve plan``: how to split a budget of servers into prefill and decode for a workload.

    pdserve plan --router http://127.0.0.1:8000 --budget 4 \\
        --request-rate 2 --input-len 256-512 --output-len 128 --slo-ttft-ms 3000 --slo-tpot-ms 50
    pdserve plan --prefill http://p:30000 --decode http://d:30001 --workload chat.yaml \\
        --budget 8 --json
    taskset -c 0 pdserve plan --calibrate --model-path DIR --torch-num-threads 1 --output cpu1.json
    pdserve plan --calibration cpu1.json --budget 2 --workload chat.yaml

Calibration comes from running servers (their start-up calibration and a few seconds' probe of
decode, ``measure.py``), from a file written by ``--calibrate`` (which starts a colocated server
on this machine, measures it the same way and stops it), or several files (one per TP/DP size).
Every split is simulated over the workload's sampled requests (``simulate.py``); the table gives
the predicted goodput, TTFT and TPOT percentiles and the highest rate each split sustains.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Optional

from pdserve.plan import calibrate, measure, planner
from pdserve.plan import profile as prof_mod
from pdserve.plan import workload as wl
from pdserve.plan.profile import Profile
from pdserve.plan.workload import PlanError

logger = logging.getLogger(__name__)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pdserve plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("workload (flags override the file's keys)")
    g.add_argument(
        "--workload", default=None, help="JSON or YAML file with the keys below (snake_case)"
    )
    g.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="requests/s (Poisson); without it, splits are ranked by the highest rate they sustain",
    )
    g.add_argument(
        "--input-len",
        default=None,
        help="prompt tokens: N, LOW-HIGH (uniform) or N1,N2,... (drawn)",
    )
    g.add_argument("--output-len", default=None, help="output tokens, as --input-len")
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument(
        "--num-requests", type=int, default=None, help="requests simulated (default 400)"
    )
    g.add_argument("--seed", type=int, default=None, help="as pdserve bench's --seed (default 1)")
    b = p.add_argument_group("budget and output")
    b.add_argument(
        "--budget",
        type=int,
        default=None,
        help="units to split: cores or GPUs, one per rank (a TP-2 server takes 2)",
    )
    b.add_argument(
        "--attainment",
        type=float,
        default=0.9,
        help="max rate: the highest rate at which this share of requests meets both SLOs",
    )
    b.add_argument("--no-max-rate", action="store_true", help="skip the max-rate search (faster)")
    b.add_argument("--json", action="store_true", help="print JSON instead of the table")
    c = p.add_argument_group("calibration")
    c.add_argument(
        "--calibration",
        action="append",
        default=[],
        metavar="FILE",
        help="a profile written by --calibrate (repeat for several TP/DP sizes)",
    )
    c.add_argument(
        "--prefill", action="append", default=[], metavar="URL", help="a running prefill server"
    )
    c.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="a running decode server"
    )
    c.add_argument(
        "--server", action="append", default=[], metavar="URL", help="a running colocated server"
    )
    c.add_argument(
        "--router", default=None, metavar="URL", help="a pdserve router: its GET /workers"
    )
    c.add_argument("--api-key", default=None, help="for servers and router started with --api-key")
    c.add_argument(
        "--save-calibration",
        default=None,
        metavar="FILE",
        help="also write the profile measured from the servers (one shape only)",
    )
    c.add_argument(
        "--probe-batches", default="1,8,32", help="decode batch sizes the probe measures"
    )
    c.add_argument(
        "--probe-long-prompt",
        type=int,
        default=None,
        help="prompt tokens of the probe's long prefill (default: the workload's longest, "
        "else 1024)",
    )
    c.add_argument(
        "--kv-bandwidth",
        type=float,
        default=None,
        metavar="BYTES_PER_S",
        help="KV transfer rate (default: measured; see the docs)",
    )
    c.add_argument(
        "--pd-overhead-s",
        type=float,
        default=0.005,
        help="per PD request: the router's second leg, bootstrap, handshake (as pdserve router's)",
    )
    k = p.add_argument_group("--calibrate: measure a server started here and write its profile")
    k.add_argument("--calibrate", action="store_true")
    k.add_argument("--model-path", default=None)
    k.add_argument("--torch-num-threads", type=int, default=1)
    k.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="passed to pdserve serve (repeat; e.g. "
        "--serve-arg=--max-total-tokens --serve-arg=32768)",
    )
    k.add_argument(
        "--output", default=None, metavar="FILE", help="where --calibrate writes the profile"
    )
    return p.parse_args(argv)


def workload_from(a: argparse.Namespace) -> wl.Workload:
    values = wl.load_file(a.workload) if a.workload else {}
    for key in wl.KEYS:
        v = getattr(a, key, None)
        if v is not None:
            values[key] = v
    return wl.make(values)


def _batches(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise PlanError(f"probe_batches: expected sizes like 1,8,32, got {text!r}") from None
    if len(set(out)) < 2 or min(out) < 1:
        raise PlanError(f"probe_batches: need two different sizes >= 1, got {text!r}")
    return out


def profiles_from(a: argparse.Namespace, w: Optional[wl.Workload]) -> list[Profile]:
    servers = (
        [(u, "prefill") for u in a.prefill]
        + [(u, "decode") for u in a.decode]
        + [(u, "colocated") for u in a.server]
    )
    if a.router:
        servers += measure.router_workers(a.router, a.api_key)
    if a.calibration and servers:
        raise PlanError("calibration: give either --calibration files or servers, not both")
    if a.calibration:
        return [prof_mod.load(path) for path in a.calibration]
    long_prompt = a.probe_long_prompt or (w.input_len.high if w else 1024)
    profs = calibrate.from_servers(
        servers,
        batches=_batches(a.probe_batches),
        long_prompt=long_prompt,
        api_key=a.api_key,
        kv_bandwidth=a.kv_bandwidth,
        pd_overhead_s=a.pd_overhead_s,
    )
    if a.save_calibration:
        if len(profs) != 1:
            raise PlanError(
                f"save_calibration: the servers have {len(profs)} shapes; a file holds one"
            )
        prof_mod.save(profs[0], a.save_calibration)
    return profs


def describe(p: Profile) -> str:
    pf, df = p.prefill, p.decode
    text = (
        f"{p.name} ({p.units} unit{'s' * (p.units > 1)}): prefill {pf.fixed_s * 1e3:.1f} ms + "
        f"{pf.s_per_token * 1e3:.3f} ms/token"
    )
    if pf.s_per_token2:
        text += f" + {pf.s_per_token2 * 1e9:.3f} ns x n^2"
    if df is not None:
        text += (
            f"; decode step {df.fixed_s * 1e3:.1f} ms + {df.s_per_request * 1e3:.3f} ms/row + "
            f"{df.s_per_context_token * 1e6:.3f} us/context token"
        )
    text += (
        f"; KV {p.kv_bytes_per_token} B/token at {p.kv_bandwidth / 1e9:.2f} GB/s; pool "
        f"{p.max_total_tokens} tokens; overhead {p.request_overhead_s * 1e3:.1f} ms/request"
    )
    return text


def table(w: wl.Workload, preds: list[planner.Prediction], attainment: float) -> str:
    def pcts(d: dict) -> str:
        return " / ".join(f"{d[k]:.0f}" for k in ("p50", "p90", "p99")) if d else "-"

    def num(x: Optional[float], f: str = ".2f") -> str:
        return format(x, f) if x is not None else "-"

    lines = [
        f"| split | units | goodput req/s | SLOs met | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms "
        f"| max rate (>= {attainment:.0%}) |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, p in enumerate(preds):
        share = f"{p.share:.0%}" if p.share is not None else "-"
        lines.append(
            f"| {p.candidate.label}{' **recommended**' if i == 0 else ''} | {p.candidate.units} "
            f"| {num(p.goodput, '.3f')} | {share} | {pcts(p.ttft_ms)} | {pcts(p.tpot_ms)} "
            f"| {num(p.max_rate)} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    if not logging.getLogger().handlers:
        from pdserve.log import setup_logging

        setup_logging("plan")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe request otherwise
    try:
        if a.calibrate:
            return run_calibrate(a)
        w = workload_from(a)
        if a.budget is None:
            raise PlanError("budget: required (--budget N: the cores or GPUs to split)")
        profs = profiles_from(a, w)
        d_profs = [p for p in profs if p.decode is not None]
        if not d_profs:
            raise PlanError(
                "calibration: no profile has a decode fit (give a decode or colocated server)"
            )
        preds = planner.plan(
            w, a.budget, profs, d_profs, a.attainment, search_max_rate=not a.no_max_rate
        )
    except PlanError as e:
        print(f"pdserve plan: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(
            json.dumps(
                {
                    "workload": w.describe(),
                    "budget": a.budget,
                    "attainment": a.attainment,
                    "profiles": [p.to_json() for p in profs],
                    "recommended": preds[0].to_json(),
                    "candidates": [p.to_json() for p in preds],
                },
                indent=1,
            )
        )
        return 0
    print(f"workload: {w.describe()}; budget {a.budget}")
    for p in profs:
        print(f"profile {describe(p)}")
    print()
    print(table(w, preds, a.attainment))
    print(f"\nrecommended: {preds[0].candidate.label}")
    return 0


def run_calibrate(a: argparse.Namespace) -> int:
    if not a.model_path:
        raise PlanError("model_path: --calibrate needs --model-path")
    if not a.output:
        raise PlanError("output: --calibrate needs --output FILE")
    if a.torch_num_threads < 1:
        raise PlanError(f"torch_num_threads: must be >= 1, got {a.torch_num_threads}")
    profile = calibrate.calibrate_model(
        a.model_path,
        a.serve_arg,
        threads=a.torch_num_threads,
        batches=_batches(a.probe_batches),
        long_prompt=a.probe_long_prompt or 1024,
        kv_bandwidth=a.kv_bandwidth,
        pd_overhead_s=a.pd_overhead_s,
    )
    prof_mod.save(profile, a.output)
    print(f"profile {describe(profile)}")
    print(f"wrote {a.output}")
    return 0
