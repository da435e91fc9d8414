"""What one server costs, as the planner models it: a ``Profile`` (a calibration file holds one).

- Prefill: a forward of n new prompt tokens after k cached ones takes
  ``fixed_s + s_per_token * n + s_per_token2 * n * (2k + n)`` (the last term is attention, which
  grows with the context; ``s_per_token2`` is 0 when only two lengths were measured, as in a
  server's start-up calibration).
- Decode: a forward of B decode rows whose contexts add up to C tokens takes
  ``fixed_s + s_per_request * B + s_per_context_token * C``. A forward that carries prefill
  tokens next to decode rows (a colocated server's mixed batch) costs the decode step plus the
  prefill tokens' per-token terms.
- Transfer: ``kv_bytes_per_token`` x prompt tokens (plus ``kv_bytes_per_request``: a hybrid's
  fixed-size recurrent state) at ``kv_bandwidth`` bytes/s, one transfer at a time per prefill
  server, then ``pd_overhead_s`` (the router's second leg, bootstrap, handshake).
- ``request_overhead_s``: the client → router → server path of every request.
- Capacity: ``max_total_tokens`` of KV per server (a request holds prompt + output), at most
  ``max_running_requests`` in its batch, at most ``max_prefill_tokens`` prompt tokens per forward
  and ``chunked_prefill_size`` of one prompt.

``units`` is what the server takes of a budget (its ranks: tp_size x pp_size; one core or one
GPU each). ``sources`` says where each figure came from.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from pdserve.plan.workload import PlanError

VERSION = 1


@dataclass
class PrefillFit:
    fixed_s: float
    s_per_token: float
    s_per_token2: float = 0.0

    def chunk_s(self, new: int, cached: int = 0) -> float:
        """The per-token part of a forward for one prompt chunk (no fixed cost)."""
        return self.s_per_token * new + self.s_per_token2 * new * (2 * cached + new)

    def time(self, n: int) -> float:
        return self.fixed_s + self.chunk_s(n)

    @classmethod
    def fit(cls, points: dict[int, float]) -> "PrefillFit":
        """Least squares over measured (tokens, seconds); the quadratic term only with >= 3
        lengths, every coefficient >= 0."""
        ns = sorted(points)
        if len(ns) < 2:
            raise PlanError(f"prefill: need times at two prompt lengths or more, got {points}")
        cols = [[1.0] * len(ns), [float(n) for n in ns]] + (
            [[float(n) ** 2 for n in ns]] if len(ns) >= 3 else []
        )
        # drop the n^2 term first, then the fixed cost: the per-token cost dominates
        coef = _nonneg_lstsq(np.array(cols).T, np.array([points[n] for n in ns]), (2, 0))
        return cls(*coef) if len(coef) == 3 else cls(coef[0], coef[1])


@dataclass
class DecodeFit:
    fixed_s: float
    s_per_request: float
    s_per_context_token: float = 0.0

    def step_s(self, batch: int, context_tokens: float) -> float:
        return self.fixed_s + self.s_per_request * batch + self.s_per_context_token * context_tokens

    @classmethod
    def fit(cls, points: Sequence[Sequence[float]]) -> "DecodeFit":
        """Least squares over measured (batch, context tokens, step seconds), coefficients >= 0;
        the context term needs points at two context lengths per request."""
        pts = [tuple(map(float, p)) for p in points]
        if len({p[0] for p in pts}) < 2:
            raise PlanError(f"decode: need step times at two batch sizes or more, got {points}")
        per_req = {round(c / b) for b, c, _ in pts}
        cols = [[1.0] * len(pts), [b for b, _, _ in pts]] + (
            [[c for _, c, _ in pts]] if len(per_req) >= 2 else []
        )
        coef = _nonneg_lstsq(np.array(cols).T, np.array([s for _, _, s in pts]), (2, 1))
        return cls(*coef) if len(coef) == 3 else cls(coef[0], coef[1])


def _nonneg_lstsq(a: np.ndarray, y: np.ndarray, drop_order: Sequence[int]) -> list[float]:
    """Least squares with every coefficient >= 0: while one comes out negative, the next column
    of ``drop_order`` still in the fit is dropped (its coefficient 0) and the rest refitted, so
    noise never makes a term negative and the secondary terms go first."""
    keep = list(range(a.shape[1]))
    order = [i for i in drop_order if i in keep]
    while True:
        coef = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
        if all(c >= 0 for c in coef) or not order:
            out = [0.0] * a.shape[1]
            for i, c in zip(keep, coef):
                out[i] = max(float(c), 0.0)
            return out
        keep.remove(order.pop(0))


@dataclass
class Profile:
    prefill: PrefillFit
    decode: Optional[DecodeFit]  # None: measured on a prefill server only (a prefill profile)
    kv_bytes_per_token: int
    kv_bandwidth: float  # bytes/s
    max_total_tokens: int
    max_running_requests: int = 256
    max_prefill_tokens: int = 2048
    chunked_prefill_size: int = 2048
    request_overhead_s: float = 0.002
    pd_overhead_s: float = 0.005
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    model: str = ""
    kv_bytes_per_request: int = 0  # a hybrid's recurrent state, moved whatever the prompt's length
    sources: dict[str, Any] = field(default_factory=dict)
    measured: dict[str, Any] = field(default_factory=dict)  # the raw points the fits came from

    def __post_init__(self):
        checks = {
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bandwidth": self.kv_bandwidth,
            "max_total_tokens": self.max_total_tokens,
            "max_running_requests": self.max_running_requests,
            "max_prefill_tokens": self.max_prefill_tokens,
            "chunked_prefill_size": self.chunked_prefill_size,
            "tp_size": self.tp_size,
            "dp_size": self.dp_size,
            "pp_size": self.pp_size,
        }
        for name, v in checks.items():
            if (
                not isinstance(v, (int, float))
                or isinstance(v, bool)
                or not math.isfinite(v)
                or v <= 0
            ):
                raise PlanError(f"calibration: {name} must be a number > 0, got {v!r}")
        for name, v in (
            ("kv_bytes_per_request", self.kv_bytes_per_request),
            ("request_overhead_s", self.request_overhead_s),
            ("pd_overhead_s", self.pd_overhead_s),
            *((f"prefill.{k}", x) for k, x in asdict(self.prefill).items()),
            *((f"decode.{k}", x) for k, x in (asdict(self.decode) if self.decode else {}).items()),
        ):
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise PlanError(f"calibration: {name} must be a number >= 0, got {v!r}")
        if self.decode is not None and self.decode.step_s(1, 1) <= 0:
            raise PlanError(
                "calibration: a decode step must take some time (decode fit is all zero)"
            )
        if self.prefill.time(1) <= 0:
            raise PlanError("calibration: a prefill must take some time (prefill fit is all zero)")

    @property
    def units(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def name(self) -> str:
        parts = (
            [f"tp{self.tp_size}"]
            + ([f"dp{self.dp_size}"] if self.dp_size > 1 else [])
            + ([f"pp{self.pp_size}"] if self.pp_size > 1 else [])
        )
        return "".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: Any, where: str = "calibration") -> "Profile":
        if not isinstance(data, dict):
            raise PlanError(f"{where}: expected a JSON object")
        if data.get("version") != VERSION:
            raise PlanError(
                f"{where}: version {data.get('version')!r}, this pdserve reads version {VERSION}"
            )
        known = set(cls.__dataclass_fields__) | {"version"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"{where}: unknown key(s) {', '.join(unknown)}")
        body = {k: v for k, v in data.items() if k != "version"}
        try:
            body["prefill"] = PrefillFit(**body["prefill"])
            body["decode"] = DecodeFit(**body["decode"]) if body["decode"] is not None else None
            return cls(**body)
        except KeyError as e:
            raise PlanError(f"{where}: missing {e.args[0]}") from None
        except TypeError as e:
            raise PlanError(f"{where}: {e}") from None
        except PlanError as e:
            raise PlanError(f"{where}: {e}") from None


def load(path: str | Path) -> Profile:
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise PlanError(f"calibration file {p}: {e.strerror or e}") from None
    except ValueError as e:
        raise PlanError(f"calibration file {p}: not valid JSON: {e}") from None
    return Profile.from_json(data, f"calibration file {p}")


def save(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_json(), indent=1) + "\n", encoding="utf-8")
