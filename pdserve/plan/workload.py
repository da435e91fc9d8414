"""The workload a plan is made for: arrival rate, prompt and output lengths, SLOs.

Lengths are a fixed number (``512``), a uniform range of integers (``"256-512"``, both ends
included; ``pdserve bench --random-input-len 512 --random-range-ratio 0.5`` is ``256-512``), or
a list of observed values drawn with equal weight (``[100, 2000, 350]`` in a file,
``"100,2000,350"`` as a flag). Requests arrive as a Poisson process. The draws are those of
``pdserve bench`` under the same seed (lengths from ``numpy.random.default_rng(seed)``, prompt
lengths first; the arrival gaps from a second generator of that seed), so a plan and a benchmark run
of the same workload see the same requests.

A workload file (JSON, or YAML when PyYAML is installed) holds the same keys as the flags::

    request_rate: 2.0        # requests/s
    input_len: 256-512
    output_len: 128
    slo_ttft_ms: 3000
    slo_tpot_ms: 50
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from pdserve.bench.serving import poisson_arrivals


class PlanError(ValueError):
    """Bad input to the planner; the message names the field or the file."""


@dataclass(frozen=True)
class Lengths:
    """A distribution of token counts: uniform over [low, high], or drawn from ``values``."""

    low: int
    high: int
    values: tuple[int, ...] = ()

    @classmethod
    def parse(cls, name: str, spec: Any) -> "Lengths":
        if isinstance(spec, bool):
            raise PlanError(f"{name}: expected a length, got {spec!r}")
        if isinstance(spec, (list, tuple)):
            return cls._of_values(name, spec)
        if isinstance(spec, float) and spec.is_integer():
            spec = int(spec)
        if isinstance(spec, int):
            return cls._range(name, spec, spec)
        if isinstance(spec, dict) and set(spec) == {"uniform"}:
            lo_hi = spec["uniform"]
            if isinstance(lo_hi, (list, tuple)) and len(lo_hi) == 2:
                return cls._range(name, *(_int(name, x) for x in lo_hi))
        if isinstance(spec, str):
            text = spec.strip()
            if "," in text:
                return cls._of_values(name, text.split(","))
            lo, sep, hi = text.partition("-")
            return cls._range(name, _int(name, lo), _int(name, hi) if sep else _int(name, lo))
        raise PlanError(
            f"{name}: expected N, 'LOW-HIGH', a list of lengths or {{uniform: [LOW, HIGH]}}, "
            f"got {spec!r}"
        )

    @classmethod
    def _range(cls, name: str, low: int, high: int) -> "Lengths":
        if low < 1 or high < low:
            raise PlanError(f"{name}: need 1 <= LOW <= HIGH, got {low}-{high}")
        return cls(low, high)

    @classmethod
    def _of_values(cls, name: str, items) -> "Lengths":
        values = tuple(_int(name, x) for x in items)
        if not values or min(values) < 1:
            raise PlanError(
                f"{name}: a list of lengths needs at least one value, all >= 1, got {list(items)!r}"
            )
        return cls(min(values), max(values), values)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.values:
            return rng.choice(np.asarray(self.values), size=n)
        return rng.integers(self.low, self.high + 1, size=n)  # as pdserve bench's sample_lengths

    @property
    def mean(self) -> float:
        return float(np.mean(self.values)) if self.values else (self.low + self.high) / 2

    def __str__(self) -> str:
        if self.values:
            return (
                ",".join(map(str, self.values))
                if len(self.values) <= 6
                else f"{len(self.values)} values"
            )
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


def _int(name: str, x: Any) -> int:
    try:
        if isinstance(x, float) and not x.is_integer():
            raise ValueError
        return int(str(x).strip()) if not isinstance(x, (int, float)) else int(x)
    except (TypeError, ValueError):
        raise PlanError(f"{name}: {x!r} is not a whole number of tokens") from None


@dataclass(frozen=True)
class Workload:
    request_rate: Optional[float]  # requests/s; None: only the highest rate each split sustains
    input_len: Lengths
    output_len: Lengths
    slo_ttft_ms: Optional[float] = None
    slo_tpot_ms: Optional[float] = None
    num_requests: int = 400
    seed: int = 1

    def __post_init__(self):
        if self.request_rate is not None and not (
            math.isfinite(self.request_rate) and self.request_rate > 0
        ):
            raise PlanError(
                f"request_rate: must be a finite number > 0 (requests/s), got {self.request_rate}"
            )
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise PlanError(f"{name}: must be > 0 ms, got {v}")
        if self.num_requests < 10:
            raise PlanError(f"num_requests: must be >= 10, got {self.num_requests}")

    def requests(self, rate: Optional[float] = None) -> "Requests":
        """The sampled requests at ``rate`` (default: the workload's)."""
        rate = rate if rate is not None else self.request_rate
        if rate is None:
            raise PlanError("request_rate: needed to sample requests")
        rng = np.random.default_rng(self.seed)
        prompts = self.input_len.sample(rng, self.num_requests)
        outputs = self.output_len.sample(rng, self.num_requests)
        arrivals = np.asarray(poisson_arrivals(self.num_requests, rate, self.seed))
        return Requests(arrivals, prompts.astype(np.int64), outputs.astype(np.int64))

    def describe(self) -> str:
        rate = (
            f"{self.request_rate:g} req/s"
            if self.request_rate
            else "rate: the highest each split sustains"
        )
        slos = (
            ", ".join(
                f"{k} <= {v:g} ms"
                for k, v in (("TTFT", self.slo_ttft_ms), ("TPOT", self.slo_tpot_ms))
                if v is not None
            )
            or "no SLO"
        )
        return (
            f"{rate}, prompts {self.input_len} tokens, outputs {self.output_len} tokens, {slos}; "
            f"{self.num_requests} requests (seed {self.seed})"
        )


@dataclass
class Requests:
    arrivals: np.ndarray  # s
    prompts: np.ndarray  # tokens
    outputs: np.ndarray  # tokens, >= 1

    def __len__(self) -> int:
        return len(self.arrivals)


KEYS = {f.name for f in fields(Workload)}


def load_file(path: Union[str, Path]) -> dict[str, Any]:
    """The keys of a workload file, checked against the known ones."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise PlanError(f"workload file {p}: {e.strerror or e}") from None
    yaml_file = p.suffix in (".yaml", ".yml")
    try:
        if yaml_file:
            import yaml  # PyYAML, which transformers installs

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except ImportError:
        raise PlanError(
            f"workload file {p}: reading YAML needs PyYAML; write it as JSON instead"
        ) from None
    except Exception as e:  # json.JSONDecodeError, yaml.YAMLError
        raise PlanError(
            f"workload file {p}: not valid {'YAML' if yaml_file else 'JSON'}: {e}"
        ) from None
    if not isinstance(data, dict):
        raise PlanError(f"workload file {p}: expected a mapping of {', '.join(sorted(KEYS))}")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - KEYS)
    if unknown:
        raise PlanError(
            f"workload file {p}: unknown key(s) {', '.join(unknown)}; known: "
            f"{', '.join(sorted(KEYS))}"
        )
    return data


def make(values: dict[str, Any]) -> Workload:
    """A workload from file keys and flags (flags already merged over the file's keys)."""
    for name in ("input_len", "output_len"):
        if values.get(name) is None:
            raise PlanError(f"{name}: required (--{name.replace('_', '-')} or the workload file)")
    out: dict[str, Any] = {
        "input_len": Lengths.parse("input_len", values["input_len"]),
        "output_len": Lengths.parse("output_len", values["output_len"]),
    }
    for name in ("request_rate", "slo_ttft_ms", "slo_tpot_ms"):
        v = values.get(name)
        if v is not None:
            out[name] = _number(name, v)
    for name in ("num_requests", "seed"):
        if values.get(name) is not None:
            out[name] = _int(name, values[name])
    out.setdefault("request_rate", None)
    return Workload(**out)


def _number(name: str, v: Any) -> float:
    if isinstance(v, bool):
        raise PlanError(f"{name}: expected a number, got {v!r}")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise PlanError(f"{name}: expected a number, got {v!r}") from None


def at_rate(w: Workload, rate: float) -> Workload:
    return replace(w, request_rate=rate)
