"""Where a PD request is prefilled (``--pd-policy``): always on a prefill server (``always``, the
classic PD path), or per request either there or on the decode server itself (``conditional``).

A pdserve decode server serves a request that carries no bootstrap fields like a colocated
server: it prefills locally and no KV moves. ``conditional`` compares, for the pair the
policies chose, the estimated time to first token of both ways:

- through PD: prefill's queue (its polled tokens and requests at its prefill rate) + the prefill
  of the tokens prefill does not hold + the KV of the tokens decode does not hold, at the
  prefill's measured transfer rate (``kv_transfer_bytes_per_s`` in its ``/get_load``, else
  ``--pd-kv-bandwidth``) + ``--pd-overhead-s`` (the second leg, bootstrap, handshake);
- on decode: decode's prefill of the tokens it does not hold, plus a penalty for the streams it
  is decoding, which all stall while it prefills: ``--pd-itl-weight`` x running requests x that
  prefill time.

Prefill times come from each server's start-up calibration (``/server_info`` ``calibration``,
``server/calibration.py``), or from ``--pd-prefill-fixed-s`` / ``--pd-prefill-s-per-token``
when given. The cached prefixes come from the KV index (``router/kv_index.py``; none known
without KV events). A prompt whose uncached part on decode exceeds ``--pd-local-max-tokens``
always goes through PD: a long local prefill would hold decode's streams back for too long
whatever the estimate. Batches, prompts the router cannot read and workers without a
calibration go through PD. Each decision and its inputs goes to the metrics and, for /generate,
to ``meta_info["pd_decision"]``; every answer says it in ``X-PDServe-PD-Mode``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Optional

from pdserve.router.kv_index import KVIndex, PromptBlocks
from pdserve.router.protocol import rewrite_event_objects
from pdserve.router.workers import Worker

PD, LOCAL = "pd", "local"
HEADER = "X-PDServe-PD-Mode"


@dataclass
class Decision:
    mode: str  # PD or LOCAL
    reason: str
    prompt_tokens: int = 0
    prefill_cached_tokens: int = 0
    decode_cached_tokens: int = 0
    ttft_pd_s: Optional[float] = None
    ttft_local_s: Optional[float] = None
    itl_penalty_s: Optional[float] = None

    def meta(self) -> dict:
        return {
            k: round(v, 6) if isinstance(v, float) else v
            for k, v in asdict(self).items()
            if v is not None
        }


@dataclass
class PrefillFit:
    fixed_s: float
    s_per_token: float

    def time(self, tokens: float) -> float:
        return self.fixed_s + self.s_per_token * max(tokens, 0)


class PDPolicy:
    def __init__(self, args, index: Optional[KVIndex]):
        self.args = args
        self.index = index
        self.conditional = args.pd_policy == "conditional"

    def fit(self, worker: Worker) -> Optional[PrefillFit]:
        cal = (worker.info or {}).get("calibration") or {}
        fixed = (
            self.args.pd_prefill_fixed_s
            if self.args.pd_prefill_fixed_s is not None
            else cal.get("prefill_fixed_s")
        )
        per_token = (
            self.args.pd_prefill_s_per_token
            if self.args.pd_prefill_s_per_token is not None
            else cal.get("prefill_s_per_token")
        )
        if not isinstance(fixed, (int, float)) or not isinstance(per_token, (int, float)):
            return None
        return PrefillFit(float(fixed), float(per_token))

    def cached(self, worker: Worker, prompt: PromptBlocks) -> int:
        return self.index.matched_tokens(worker, prompt)[0] if self.index is not None else 0

    def _ttft_pd(
        self, fit: PrefillFit, n: int, p_cached: int, d_cached: int, prefill: Worker, decode: Worker
    ) -> float:
        """Through PD: prefill's queue, its prefill of what it does not hold, the KV decode does
        not hold at prefill's transfer rate, and the fixed overhead."""
        p_reqs, p_tokens = prefill.load_estimate()
        queue_s = fit.s_per_token * p_tokens + fit.fixed_s * p_reqs
        sched = (decode.info or {}).get("scheduler_info") or {}
        kv_per_token = sched.get("kv_bytes_per_token") or 0
        kv_per_request = sched.get("kv_bytes_per_request") or 0  # a hybrid's recurrent state
        bandwidth = prefill.kv_bandwidth or self.args.pd_kv_bandwidth
        transfer_s = ((n - d_cached) * kv_per_token + kv_per_request) / bandwidth
        return queue_s + fit.time(n - p_cached) + transfer_s + self.args.pd_overhead_s

    def estimate_ttft(
        self, prompt: Optional[PromptBlocks], prefill: Optional[Worker], main: Worker
    ) -> Optional[float]:
        """The time to first token of a request prefilled on ``prefill`` for ``main`` (decode), or
        on ``main`` itself (None: colocated, or decode prefilling locally): that server's queue
        and prefill (and the KV's way through PD); None without a calibration or a prompt."""
        if prompt is None:
            return None
        n = len(prompt.ids)
        fit = self.fit(prefill or main)
        if fit is None:
            return None
        if prefill is not None:
            cached = self.cached(prefill, prompt), self.cached(main, prompt)
            return self._ttft_pd(fit, n, *cached, prefill, main)
        reqs, tokens = main.load_estimate()
        queue_s = fit.s_per_token * tokens + fit.fixed_s * reqs
        return queue_s + fit.time(n - self.cached(main, prompt))

    def decide(
        self, prompt: Optional[PromptBlocks], prefill: Worker, decode: Worker, batch: bool
    ) -> Decision:
        if not self.conditional:
            return Decision(PD, "always")
        if batch:
            return Decision(PD, "batch")
        if prompt is None:
            return Decision(PD, "prompt_unknown")
        p_fit, d_fit = self.fit(prefill), self.fit(decode)
        n = len(prompt.ids)
        if p_fit is None or d_fit is None:
            return Decision(PD, "no_calibration", n)
        p_cached, d_cached = self.cached(prefill, prompt), self.cached(decode, prompt)
        d_todo = n - d_cached
        out = Decision(PD, "", n, p_cached, d_cached)
        out.ttft_pd_s = self._ttft_pd(p_fit, n, p_cached, d_cached, prefill, decode)
        local_s = d_fit.time(d_todo)
        d_reqs, _ = decode.load_estimate()
        out.ttft_local_s = local_s
        out.itl_penalty_s = self.args.pd_itl_weight * d_reqs * local_s
        if d_todo > self.args.pd_local_max_tokens:
            out.reason = "too_long"
        elif out.ttft_local_s + out.itl_penalty_s <= out.ttft_pd_s:
            out.mode, out.reason = LOCAL, "faster_local"
        else:
            out.reason = "faster_pd"
        return out


def _add(obj, meta: dict, finished_only: bool) -> bool:
    """``meta_info["pd_decision"]`` on each /generate item of ``obj`` (in a stream: the items
    that finish in this event)."""
    items = obj if isinstance(obj, list) else [obj]
    changed = False
    for item in items:
        info = item.get("meta_info") if isinstance(item, dict) else None
        if isinstance(info, dict) and (not finished_only or info.get("finish_reason") is not None):
            info["pd_decision"] = meta
            changed = True
    return changed


def add_to_meta_json(raw: bytes, meta: dict) -> bytes:
    try:
        obj = json.loads(raw)
    except ValueError:
        return raw
    return json.dumps(obj, ensure_ascii=False).encode() if _add(obj, meta, False) else raw


def add_to_meta_event(event: bytes, meta: dict) -> bytes:
    return rewrite_event_objects(event, lambda obj: _add(obj, meta, True))
