"""Calibration from running servers: their own figures, plus a short probe of decode.

Read from each server: ``/server_info`` (the start-up ``calibration``, ``server/calibration.py``:
the prefill fit; ``scheduler_info``: KV bytes per token, KV pool size; the batch flags and the
TP/DP/PP sizes) and, from a prefill server, ``/get_load`` (``kv_transfer_bytes_per_s``, its
measured transfer rate, once it has moved some KV). A router's ``GET /workers`` lists its
servers.

Servers do not time their decode steps, so the planner measures them (``probe``): on a decode
or colocated server (both serve a request without bootstrap fields by prefilling it
themselves), B streamed requests of L-token prompts decode together; the window in which all B
are decoding, divided by the tokens each produced in it, is the step time at batch B with the
context the rows held. Points: B in ``batches`` at a short prompt, and a few rows at a longer
prompt for the context term. The probe also times one prompt at ``long_prompt`` tokens
(``max_new_tokens`` 1) so that the prefill fit covers the workload's longest prompts, and
takes the gap between a short prompt's time to first token and the fit's as the HTTP path's
``request_overhead_s``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

import httpx
import numpy as np

from pdserve.plan.profile import DecodeFit
from pdserve.plan.workload import PlanError

logger = logging.getLogger(__name__)

TIMEOUT_S = 300.0
PROBE_NEW_TOKENS = 32
SHORT_PROMPT = 16


@dataclass
class ServerView:
    url: str
    role: str  # prefill | decode | colocated
    info: dict
    load: dict

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(int(self.info.get(k) or 1) for k in ("tp_size", "dp_size", "pp_size"))

    @property
    def sched(self) -> dict:
        return self.info.get("scheduler_info") or {}


def _headers(api_key: Optional[str]) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _get(client: httpx.Client, url: str, what: str) -> Any:
    try:
        r = client.get(url)
    except httpx.HTTPError as e:
        raise PlanError(f"{what}: cannot reach {url}: {e}") from None
    if r.status_code != 200:
        raise PlanError(f"{what}: {url} answered {r.status_code}: {r.text[:200]}")
    try:
        return r.json()
    except ValueError:
        raise PlanError(f"{what}: {url} did not answer JSON") from None


def read_server(url: str, role: Optional[str], api_key: Optional[str] = None) -> ServerView:
    url = url.rstrip("/")
    with httpx.Client(timeout=30, headers=_headers(api_key)) as client:
        info = _get(client, url + "/server_info", "server")
        if not isinstance(info, dict) or "scheduler_info" not in info:
            raise PlanError(
                f"server: {url}/server_info is not a pdserve server's (no scheduler_info)"
            )
        mode = info.get("disaggregation_mode") or "null"
        actual = {"null": "colocated"}.get(mode, mode)
        if role is not None and role != actual:
            raise PlanError(f"server: {url} was given as {role} but is a {actual} server")
        if info.get("status") != "ready" or not info.get("calibration"):
            raise PlanError(
                f"server: {url} is {info.get('status')!r} and reports no calibration yet "
                "(servers calibrate after their warm-up)"
            )
        load = {}
        if actual == "prefill":
            load = _get(client, url + "/get_load", "server")
            load = load if isinstance(load, dict) else {}
    return ServerView(url, actual, info, load)


def router_workers(url: str, api_key: Optional[str] = None) -> list[tuple[str, str]]:
    """(url, role) of each healthy worker a router lists."""
    with httpx.Client(timeout=30, headers=_headers(api_key)) as client:
        data = _get(client, url.rstrip("/") + "/workers", "router")
    workers = data.get("workers") if isinstance(data, dict) else None
    if not isinstance(workers, list):
        raise PlanError(
            f"router: {url}/workers lists no workers (is it a pdserve or sglang router?)"
        )
    roles = {"prefill": "prefill", "decode": "decode", "regular": "colocated"}
    return [
        (w["url"], roles[w.get("worker_type", "regular")])
        for w in workers
        if isinstance(w, dict) and w.get("is_healthy", True) and not w.get("draining")
    ]


# -- the probe ----------------------------------------------------------------------------------
async def _stream(
    client: httpx.AsyncClient, url: str, ids: list[int], new_tokens: int
) -> list[tuple[float, int]]:
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True},
    }
    marks: list[tuple[float, int]] = []
    async with client.stream("POST", url + "/generate", json=body) as r:
        if r.status_code != 200:
            raise PlanError(
                f"probe: {url}/generate answered {r.status_code}: {(await r.aread())[:200]!r}"
            )
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                meta = json.loads(line[6:]).get("meta_info") or {}
                marks.append((time.perf_counter(), int(meta.get("completion_tokens", 0))))
    return marks


async def _batch(
    url: str, api_key, prompts: list[list[int]], new_tokens: int
) -> tuple[float, list]:
    async with httpx.AsyncClient(timeout=TIMEOUT_S, headers=_headers(api_key)) as client:
        t0 = time.perf_counter()
        marks = await asyncio.gather(*(_stream(client, url, p, new_tokens) for p in prompts))
    return t0, marks


def _decode_point(
    prompt: int, t0: float, marks: list[list[tuple[float, int]]]
) -> Optional[tuple[int, float, float]]:
    """(batch, context tokens, step seconds) from the window where every request decodes."""
    start = max(m[0][0] for m in marks)
    end = min(m[-1][0] for m in marks)
    if end <= start:
        return None

    def count(m, t):  # tokens received by time t
        return max((c for ts, c in m if ts <= t), default=0)

    steps = float(np.mean([count(m, end) - count(m, start) for m in marks]))
    if steps < 4:
        return None
    mid = (start + end) / 2
    ctx = sum(prompt + count(m, mid) for m in marks)
    return len(marks), float(ctx), (end - start) / steps


def probe(
    view: ServerView,
    batches: tuple[int, ...],
    long_prompt: int,
    api_key: Optional[str] = None,
    seed: int = 0,
) -> tuple[DecodeFit, dict[int, float], float, dict]:
    """Decode fit, measured prefill times {tokens: s} at ``long_prompt``, the HTTP overhead, raw
    points."""
    if view.role == "prefill":
        raise PlanError(
            f"probe: {view.url} is a prefill server; decode steps are measured on a decode or "
            "colocated server"
        )
    rng = np.random.default_rng(seed)
    vocab = int(view.sched.get("vocab_size") or 1000)
    capacity = int(view.sched.get("max_total_tokens") or 4096)
    context = int(view.info.get("model_context_length") or 2048)

    def prompts(b: int, n: int) -> list[list[int]]:
        return [
            [int(x) for x in rng.integers(min(100, vocab - 1), vocab, size=n)] for _ in range(b)
        ]

    def point(b: int, n: int) -> None:
        # again with 4x the tokens when the requests did not decode together for long enough
        # (their prefills spread out on a busy host)
        for new_tokens in (PROBE_NEW_TOKENS, 4 * PROBE_NEW_TOKENS):
            b = max(1, min(b, capacity // (n + new_tokens + 1)))
            pt = _decode_point(
                n, *asyncio.run(_batch(view.url, api_key, prompts(b, n), new_tokens))
            )
            if pt:
                points.append(pt)
                return

    points, raw = [], {"decode": [], "prefill": {}}
    for b in batches:
        point(b, SHORT_PROMPT)
    point(4, max(SHORT_PROMPT * 8, min(512, context - 4 * PROBE_NEW_TOKENS - 2)))
    raw["decode"] = [[b, round(c), round(s, 6)] for b, c, s in points]
    if len({p[0] for p in points}) < 2:
        raise PlanError(
            f"probe: {view.url} gave too few decode measurements ({raw['decode']}); "
            "is it overloaded?"
        )
    decode = DecodeFit.fit(points)

    def ttft(n: int) -> float:
        best = float("inf")
        for _ in range(2):
            t0, (marks,) = asyncio.run(_batch(view.url, api_key, prompts(1, n), 1))
            best = min(best, marks[0][0] - t0)
        return best

    prefill_points = {}
    long_prompt = min(long_prompt, context - 2, capacity - 2)
    cal = view.info.get("calibration") or {}
    measured = {int(k): float(v) for k, v in (cal.get("measured") or {}).items()}
    if measured and long_prompt > 1.5 * max(measured):
        prefill_points[long_prompt] = ttft(long_prompt)
    short = min(measured) if measured else SHORT_PROMPT
    overhead = max(0.0, ttft(short) - measured[short]) if measured else 0.0
    # the long prompt's time went through HTTP too: on the calibration's footing without it
    prefill_points = {n: max(t - overhead, 1e-6) for n, t in prefill_points.items()}
    raw["prefill"] = {str(n): round(t, 6) for n, t in prefill_points.items()}
    raw["request_overhead_s"] = round(overhead, 6)
    return decode, prefill_points, overhead, raw


def host_memcpy_bandwidth(size: int = 64 << 20) -> float:
    """Bytes/s of one large copy in this process: what the ``local`` backend's memmoves reach."""
    src = np.ones(size, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return size / best
