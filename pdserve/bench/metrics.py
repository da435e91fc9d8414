"""Per-request records and the benchmark summary.

Definitions (times in records are seconds, in the summary milliseconds):
- TTFT: request sent -> first output token received.
- ITL: every gap between consecutive output tokens. A stream chunk that brings n > 1 tokens
  after the first counts as n gaps of (chunk gap / n); tokens that come with the first chunk
  add no gap.
- TPOT of a request: (e2e - ttft) / (output_len - 1), i.e. excluding the first token;
  undefined (None) for output_len <= 1.
- E2E: request sent -> last byte of the response.
- Percentiles: ``numpy.percentile`` with ``method="linear"`` (numpy's default): for n sorted
  values x, the p-th percentile is read at rank p/100 * (n - 1), interpolating linearly between
  the two neighbouring values.
- Throughputs count successful requests only, over the benchmark duration (first request sent
  -> last response done).
- Goodput: a successful request is good when ttft <= --slo-ttft-ms and tpot <= --slo-tpot-ms (a
  missing SLO is no constraint; an undefined TPOT meets the TPOT SLO). ``share`` is good requests
  over all requests (failed ones included); ``rate`` is good requests per second of duration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # s
    itl: list[float] = field(default_factory=list)  # s, one per token after the first chunk
    e2e_latency: float = 0.0  # s
    start_time: float = 0.0  # s since the benchmark started
    session: int = 0
    turn: int = 0
    generated: Any = None  # the output (text, or ids for id prompts): multi-turn sessions resend it

    @property
    def tpot(self) -> Optional[float]:
        if self.output_len <= 1:
            return None
        return (self.e2e_latency - self.ttft) / (self.output_len - 1)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RequestRecord":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def distribution_ms(values_s: Sequence[float]) -> Optional[dict[str, float]]:
    """mean / median / p90 / p99 in ms of values given in seconds; None when there are none."""
    if len(values_s) == 0:
        return None
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p90, p99 = np.percentile(a, PERCENTILES, method="linear")
    return {"mean": float(a.mean()), "median": float(p50), "p90": float(p90), "p99": float(p99)}


def is_good(r: RequestRecord, slo_ttft_ms: Optional[float], slo_tpot_ms: Optional[float]) -> bool:
    if not r.success:
        return False
    if slo_ttft_ms is not None and r.ttft * 1000.0 > slo_ttft_ms:
        return False
    tpot = r.tpot
    if slo_tpot_ms is not None and tpot is not None and tpot * 1000.0 > slo_tpot_ms:
        return False
    return True


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo_ttft_ms: Optional[float] = None,
    slo_tpot_ms: Optional[float] = None,
) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    dur = max(duration_s, 1e-9)
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_len for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / dur,
        "input_throughput": n_in / dur,
        "output_throughput": n_out / dur,
        "total_throughput": (n_in + n_out) / dur,
        # mean number of requests in flight
        "concurrency": sum(r.e2e_latency for r in ok) / dur,
        "ttft_ms": distribution_ms([r.ttft for r in ok]),
        "tpot_ms": distribution_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": distribution_ms([g for r in ok for g in r.itl]),
        "e2e_ms": distribution_ms([r.e2e_latency for r in ok]),
        "goodput": None,
    }
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(is_good(r, slo_ttft_ms, slo_tpot_ms) for r in records)
        summary["goodput"] = {
            "slo_ttft_ms": slo_ttft_ms,
            "slo_tpot_ms": slo_tpot_ms,
            "good": good,
            "share": good / len(records) if records else 0.0,
            "rate": good / dur,
        }
    return summary


def format_summary(summary: dict[str, Any], info: dict[str, Any]) -> str:
    """The result table, in the layout of bench_serving's. ``info`` rows come first."""
    width = 50
    lines = [" Serving Benchmark Result ".center(width, "=")]

    def row(name: str, value: Any) -> None:
        if isinstance(value, float):
            value = f"{value:.2f}"
        lines.append(f"{name + ':':<40} {value:<10}")

    for name, value in info.items():
        row(name, value)
    row("Successful requests", summary["completed"])
    row("Failed requests", summary["failed"])
    row("Benchmark duration (s)", summary["duration_s"])
    row("Total input tokens", summary["total_input_tokens"])
    row("Total generated tokens", summary["total_output_tokens"])
    row("Request throughput (req/s)", summary["request_throughput"])
    row("Input token throughput (tok/s)", summary["input_throughput"])
    row("Output token throughput (tok/s)", summary["output_throughput"])
    row("Total token throughput (tok/s)", summary["total_throughput"])
    row("Concurrency", summary["concurrency"])
    goodput = summary.get("goodput")
    if goodput:
        row("Goodput (req/s)", goodput["rate"])
        row("Requests meeting SLOs (%)", 100.0 * goodput["share"])
    sections = (
        ("e2e_ms", "End-to-End Latency", "E2E Latency"),
        ("ttft_ms", "Time to First Token", "TTFT"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
        ("itl_ms", "Inter-Token Latency", "ITL"),
    )
    for key, title, short in sections:
        lines.append(title.center(width, "-"))
        dist = summary.get(key)
        if dist is None:
            lines.append("(no data)")
            continue
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            row(f"{label} {short} (ms)", dist[stat])
    lines.append("=" * width)
    return "\n".join(lines)
