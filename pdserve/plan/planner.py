"""Candidate splits of a budget, their predicted latencies and goodput, and the recommendation.

A budget is N units (cores or GPUs: one per rank). Candidates, for every prefill profile and
decode profile given (profiles differ in TP/DP/PP size): ``C`` colocated servers with C x units
<= N, and every PD split of ``P`` prefill + ``D`` decode servers (P, D >= 1) that fits in N and
leaves no room for one more server of either role. A split of one role only is not a PD
cluster and is not offered.

For each candidate the sampled requests are simulated (``simulate.py``). Goodput is as
``pdserve bench`` counts it: requests meeting both SLOs per second, from the first arrival to the
last answer. ``max_rate`` is the highest arrival rate at which at least ``attainment`` of the
requests meet both SLOs (bisection over rates, the same requests re-timed). The recommendation
is the highest goodput at the workload's rate (within 2 %, the higher ``max_rate``, then the
fewer units); without a rate, the highest ``max_rate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from pdserve.plan import simulate
from pdserve.plan.profile import Profile
from pdserve.plan.workload import PlanError, Requests, Workload

PERCENTILES = (50, 90, 99)
TIE = 0.02


@dataclass
class Candidate:
    prefill: int  # servers; 0 for colocated
    decode: int
    colocated: int
    p_prof: Optional[Profile] = None
    d_prof: Optional[Profile] = None

    @property
    def label(self) -> str:
        if self.colocated:
            name = self.d_prof.name
            return f"{self.colocated} colocated" + (f" ({name})" if name != "tp1" else "")
        tags = (
            ""
            if self.p_prof.name == self.d_prof.name == "tp1"
            else f" (P {self.p_prof.name}, D {self.d_prof.name})"
        )
        return f"{self.prefill}P{self.decode}D{tags}"

    @property
    def units(self) -> int:
        if self.colocated:
            return self.colocated * self.d_prof.units
        return self.prefill * self.p_prof.units + self.decode * self.d_prof.units

    def run(self, reqs: Requests) -> simulate.Result:
        if self.colocated:
            return simulate.colocated(self.d_prof, self.colocated, reqs, float("inf"))
        return simulate.disaggregated(
            self.p_prof, self.d_prof, self.prefill, self.decode, reqs, float("inf")
        )


@dataclass
class Prediction:
    candidate: Candidate
    rate: Optional[float]
    goodput: Optional[float] = None  # good requests/s
    share: Optional[float] = None  # good / all
    throughput: Optional[float] = None
    ttft_ms: dict[str, float] = field(default_factory=dict)
    tpot_ms: dict[str, float] = field(default_factory=dict)
    max_rate: Optional[float] = None

    def to_json(self) -> dict:
        c = self.candidate
        return {
            "split": c.label,
            "prefill": c.prefill,
            "decode": c.decode,
            "colocated": c.colocated,
            "prefill_profile": c.p_prof.name if c.p_prof else None,
            "decode_profile": c.d_prof.name,
            "units": c.units,
            "rate": self.rate,
            "goodput": self.goodput,
            "slo_share": self.share,
            "throughput": self.throughput,
            "ttft_ms": self.ttft_ms,
            "tpot_ms": self.tpot_ms,
            "max_rate": self.max_rate,
        }


def candidates(budget: int, p_profs: list[Profile], d_profs: list[Profile]) -> list[Candidate]:
    if budget < 1:
        raise PlanError(f"budget: must be >= 1 unit (core or GPU), got {budget}")
    out: list[Candidate] = []
    for d in d_profs:
        if d.units <= budget:
            out.append(Candidate(0, 0, budget // d.units, d_prof=d))
    for p in p_profs:
        for d in d_profs:
            for np_ in range(1, budget // p.units + 1):
                left = budget - np_ * p.units
                nd = left // d.units
                if nd < 1:
                    continue
                spare = left - nd * d.units
                if spare >= p.units:  # one more prefill would fit: that split is listed too
                    continue
                out.append(Candidate(np_, nd, 0, p, d))
    if not out:
        sizes = sorted({x.units for x in p_profs + d_profs})
        raise PlanError(
            f"budget: {budget} unit(s) hold no server of the profiles given (sizes {sizes})"
        )
    return out


def percentiles_ms(values: np.ndarray) -> dict[str, float]:
    v = values[~np.isnan(values)]
    if not len(v):
        return {}
    return {f"p{q}": float(x) for q, x in zip(PERCENTILES, np.percentile(v * 1e3, PERCENTILES))}


def good_mask(res: simulate.Result, w: Workload) -> np.ndarray:
    ok = ~np.isnan(res.finish)
    if w.slo_ttft_ms is not None:
        ok &= res.ttft * 1e3 <= w.slo_ttft_ms
    if w.slo_tpot_ms is not None:
        ok &= np.isnan(res.tpot) | (res.tpot * 1e3 <= w.slo_tpot_ms)  # one-token answers meet it
    return ok


def evaluate(c: Candidate, w: Workload, rate: float) -> Prediction:
    reqs = w.requests(rate)
    res = c.run(reqs)
    good = good_mask(res, w)
    done = ~np.isnan(res.finish)
    span = (
        max(float(np.nanmax(res.finish)) - float(reqs.arrivals[0]), 1e-9)
        if done.any()
        else float("inf")
    )
    return Prediction(
        c,
        rate,
        goodput=float(good.sum()) / span,
        share=float(good.mean()),
        throughput=float(done.sum()) / span,
        ttft_ms=percentiles_ms(res.ttft),
        tpot_ms=percentiles_ms(res.tpot),
    )


def max_rate(c: Candidate, w: Workload, attainment: float, iters: int = 7) -> float:
    """The highest rate at which ``attainment`` of the requests meet both SLOs (0 if none does):
    doubling or halving from 1 req/s to bracket it, then bisection on a log scale."""

    def meets(rate: float) -> bool:
        return evaluate(c, w, rate).share >= attainment

    rate = 1.0
    if meets(rate):
        while meets(rate * 2):
            rate *= 2
            if rate > 1e6:
                return rate
        lo, hi = rate, rate * 2
    else:
        while not meets(rate / 2):
            rate /= 2
            if rate < 1e-4:
                return 0.0
        lo, hi = rate / 2, rate
    for _ in range(iters):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


def plan(
    w: Workload,
    budget: int,
    p_profs: list[Profile],
    d_profs: list[Profile],
    attainment: float = 0.9,
    search_max_rate: bool = True,
) -> list[Prediction]:
    """Every candidate's prediction, the recommended one first."""
    if not 0 < attainment <= 1:
        raise PlanError(f"attainment: must be in (0, 1], got {attainment}")
    preds = []
    for c in candidates(budget, p_profs, d_profs):
        pred = evaluate(c, w, w.request_rate) if w.request_rate else Prediction(c, None)
        if search_max_rate or not w.request_rate:
            pred.max_rate = max_rate(c, w, attainment)
        preds.append(pred)
    return sorted(preds, key=lambda p: _rank(p, preds))


def _rank(p: Prediction, all_: list[Prediction]) -> tuple:
    if p.goodput is None:
        return (-(p.max_rate or 0.0), p.candidate.units)
    best = max(x.goodput for x in all_)
    tied = p.goodput >= best * (1 - TIE)
    return (not tied, -(p.max_rate or 0.0) if tied else -p.goodput, p.candidate.units, -p.goodput)
