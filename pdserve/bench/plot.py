"""``pdserve bench plot RESULT.json [...] --output FILE.png``: compare benchmark runs.

Top row: latency CDFs (TTFT, TPOT, ITL, E2E) of every run, overlaid, with the SLOs drawn when a
run had them. Bottom row, only when the runs span two or more finite request rates: request
throughput, output token throughput and goodput against request rate, one line per series.

A run's label is its ``--labels`` entry (default: the file name without ``.json``). Series, with
``--group-by``: ``prefix`` (default) takes the label up to its last ``@``, so ``pd@2`` and
``pd@4`` form the series ``pd``; ``backend`` and ``base-url`` use the run's argument; ``all`` puts
every run in one series. Runs at an infinite request rate are left out of the rate plots.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Optional

import numpy as np

from pdserve.bench.metrics import RequestRecord

GROUP_BY = ("prefix", "backend", "base-url", "all")


def load_result(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    for key in ("args", "summary", "records"):
        if key not in result:
            raise ValueError(f"{path}: not a benchmark result (no {key!r})")
    return result


def request_rate(result: dict[str, Any]) -> float:
    return float(result["args"].get("request_rate", "inf"))


def series_name(result: dict[str, Any], label: str, group_by: str) -> str:
    if group_by == "prefix":
        return label.rsplit("@", 1)[0]
    if group_by == "backend":
        return str(result["args"].get("backend"))
    if group_by == "base-url":
        return str(result["args"].get("base_url"))
    return "all"


def latency_samples(result: dict[str, Any]) -> dict[str, np.ndarray]:
    """Successful requests' latencies in ms: one TTFT/TPOT/E2E per request, every ITL gap."""
    recs = [RequestRecord.from_json(r) for r in result["records"]]
    ok = [r for r in recs if r.success]

    def ms(xs: list) -> np.ndarray:
        return np.sort(np.asarray(xs, dtype=np.float64) * 1000.0)

    return {
        "TTFT": ms([r.ttft for r in ok]),
        "TPOT": ms([r.tpot for r in ok if r.tpot is not None]),
        "ITL": ms([g for r in ok for g in r.itl]),
        "E2E": ms([r.e2e_latency for r in ok]),
    }


def make_figure(results: list[dict[str, Any]], labels: list[str], group_by: str = "prefix"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = {request_rate(r) for r in results if np.isfinite(request_rate(r))}
    sweep = len(rates) >= 2
    fig, axes = plt.subplots(2 if sweep else 1, 4, figsize=(18, 8 if sweep else 4), squeeze=False)
    slo = {"TTFT": "slo_ttft_ms", "TPOT": "slo_tpot_ms"}
    for col, metric in enumerate(("TTFT", "TPOT", "ITL", "E2E")):
        ax = axes[0][col]
        for result, label in zip(results, labels):
            x = latency_samples(result)[metric]
            if len(x):
                ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=label)
        limits = {result["args"].get(slo[metric]) for result in results} if metric in slo else set()
        for limit in sorted(v for v in limits if v is not None):
            ax.axvline(limit, color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"{metric} CDF")
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][0].legend(fontsize="small")
    if sweep:
        _rate_row(axes[1], results, labels, group_by)
    fig.tight_layout()
    return fig


def _rate_row(axes, results: list[dict[str, Any]], labels: list[str], group_by: str) -> None:
    series: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for result, label in zip(results, labels):
        if np.isfinite(request_rate(result)):
            name = series_name(result, label, group_by)
            series.setdefault(name, []).append((request_rate(result), result["summary"]))
    panels = (
        ("request_throughput", "Request throughput (req/s)"),
        ("output_throughput", "Output throughput (tok/s)"),
        ("goodput", "Goodput (req/s)"),
    )
    for ax, (key, title) in zip(axes, panels):
        for name, points in series.items():
            points.sort(key=lambda p: p[0])
            if key == "goodput":
                points = [(x, s["goodput"]["rate"]) for x, s in points if s.get("goodput")]
            else:
                points = [(x, s[key]) for x, s in points]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", label=name)
        if key == "goodput" and not ax.lines:
            ax.text(0.5, 0.5, "no SLOs given", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    axes[3].axis("off")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="pdserve bench plot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("results", nargs="+", help="JSON files written by --output-file")
    p.add_argument("--output", required=True, help="image file (.png, .svg, .pdf)")
    p.add_argument("--labels", default=None, help="comma-separated, one per result")
    p.add_argument("--group-by", choices=GROUP_BY, default="prefix")
    args = p.parse_args(argv)
    if args.labels:
        labels = args.labels.split(",")
        if len(labels) != len(args.results):
            p.error(f"--labels: {len(labels)} labels for {len(args.results)} results")
    else:
        labels = [os.path.splitext(os.path.basename(path))[0] for path in args.results]
    try:
        results = [load_result(path) for path in args.results]
    except (OSError, ValueError) as e:
        p.error(str(e))
    fig = make_figure(results, labels, args.group_by)
    fig.savefig(args.output, dpi=100)
    return 0
