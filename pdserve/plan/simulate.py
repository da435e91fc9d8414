"""A discrete-event simulation of one cluster serving sampled requests, with the costs of a
``Profile`` (its module doc gives the cost model).

What each server does follows pdserve's scheduler (``engine/scheduler.py``): every forward
carries one row per decoding request plus prompt tokens up to ``max_prefill_tokens`` (chunks of
at most ``chunked_prefill_size`` of one prompt), first the prompts already started, then new
ones in arrival order while the batch has room (``max_running_requests``) and the KV pool holds
the request's prompt and output. Forwards run back to back while there is work.

- colocated: the router sends request i to server i mod C (round robin); a request's first
  token comes with the forward that ends its prompt, then it decodes one token per forward.
- PD: request i goes to prefill i mod P and decode i mod D. Decode first reserves the KV of
  prompt + output (the request waits in decode's pre-allocation queue while it cannot); then
  the prefill server runs the prompt, sends its KV (one transfer at a time per prefill server),
  and after ``pd_overhead_s`` decode takes the request at its next forward boundary, where its
  first token goes out (pdserve's decode reports first tokens before the next forward).

Times per request: TTFT = first token - arrival, TPOT = (finish - first token) / (output - 1),
both with the router path's ``request_overhead_s`` added.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from pdserve.plan.profile import Profile
from pdserve.plan.workload import Requests


@dataclass
class Result:
    ttft: np.ndarray  # s, NaN where a request never got its first token
    tpot: np.ndarray  # s, NaN for one-token outputs and unfinished requests
    finish: np.ndarray  # s since the first arrival, NaN when unfinished
    arrivals: np.ndarray


class Clock:
    def __init__(self):
        self.now = 0.0
        self.events: list = []
        self.seq = itertools.count()

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn, args))

    def run(self, until: float = float("inf")) -> None:
        while self.events and self.events[0][0] <= until:
            self.now, _, fn, args = heapq.heappop(self.events)
            fn(*args)


class Server:
    """One server's scheduler loop. ``mode``: colocated (prefill + decode), prefill (a request
    ends with its prompt: ``on_prompt_done``), decode (requests come prefilled: ``join``)."""

    runs = (
        True  # decode-only forwards as one event per run (False: one per forward; the same result)
    )

    def __init__(
        self,
        clock: Clock,
        prof: Profile,
        mode: str,
        reqs: Requests,
        res: Result,
        on_prompt_done: Optional[Callable[[int], None]] = None,
        on_finish: Optional[Callable[[int], None]] = None,
    ):
        self.clock, self.prof, self.mode, self.reqs, self.res = clock, prof, mode, reqs, res
        self.on_prompt_done, self.on_finish = on_prompt_done, on_finish
        self.waiting: deque[int] = deque()  # prompts not started
        self.prefilling: list[list[int]] = []  # [request, prompt tokens done]
        self.joining: list[int] = []  # decode: prefilled requests waiting for the next boundary
        self.busy = False
        self.kv_used = 0  # tokens reserved by requests on this server
        # decoding rows: after `steps` forwards, a row that joined after forward j holds
        # 1 + steps - j output tokens; context = sum(prompt + 1 - j) + rows * steps
        self.steps = 0
        self.rows = 0
        self.ctx_base = 0
        self.ends: list[tuple[int, int, int]] = []  # (forward after which it ends, request, j)
        self.run: Optional[tuple[float, float, float, int]] = None
        self.gen = 0  # bumped when a run is cut: the old end event is stale

    # -- input ---------------------------------------------------------------------------------
    def submit(self, i: int) -> None:
        self.waiting.append(i)
        self.kick()

    def join(self, i: int) -> None:
        self.joining.append(i)
        self.kick()

    def reserve(self, i: int) -> int:
        return int(self.reqs.prompts[i] + (self.reqs.outputs[i] if self.mode != "prefill" else 0))

    def kick(self) -> None:
        if not self.busy:
            self.forward()
        elif self.run is not None:
            self._cut_run()

    # -- forwards ------------------------------------------------------------------------------
    # Forwards of decode rows alone, with nothing waiting, run as one event up to the next
    # finish (``run``: start, first step's time, growth per step, steps); an input that arrives
    # meanwhile cuts the run at the end of the step in progress.
    def _run_time(self, k: int) -> float:
        _, first, growth, _ = self.run
        return k * first + growth * k * (k - 1) / 2

    def _cut_run(self) -> None:
        start, first, growth, steps = self.run
        elapsed = self.clock.now - start
        if growth > 0:  # k steps take k * first + growth * k (k - 1) / 2 <= elapsed
            b = first - growth / 2
            done = int((-b + math.sqrt(b * b + 2 * growth * elapsed)) / growth)
        else:
            done = int(elapsed / first)
        while done > 0 and self._run_time(done) > elapsed:
            done -= 1
        while self._run_time(done + 1) <= elapsed:
            done += 1
        cut = done if done and self._run_time(done) >= elapsed else done + 1
        if cut < steps:
            self.gen += 1
            self.run = (start, first, growth, cut)
            self.clock.at(start + self._run_time(cut), self._forward_done, [], cut, self.gen)

    def _start_decoding(self, i: int) -> None:
        """Request i has its first token (now): it decodes from the next forward on."""
        now = self.clock.now
        self.res.ttft[i] = now - self.reqs.arrivals[i]
        out = int(self.reqs.outputs[i])
        if out <= 1:
            self._finish(i)
            return
        heapq.heappush(self.ends, (self.steps + out - 1, i, self.steps))
        self.rows += 1
        self.ctx_base += int(self.reqs.prompts[i]) + 1 - self.steps

    def _finish(self, i: int) -> None:
        self.res.finish[i] = self.clock.now
        if self.mode != "prefill":
            self.kv_used -= self.reserve(i)
        if self.on_finish is not None:
            self.on_finish(i)

    def forward(self) -> None:
        for i in self.joining:
            self._start_decoding(i)
        self.joining.clear()
        self.run = None
        p = self.prof
        budget, chunks = p.max_prefill_tokens, []
        for entry in self.prefilling:  # prompts already started go first
            if budget <= 0:
                break
            i, done = entry
            ext = min(int(self.reqs.prompts[i]) - done, p.chunked_prefill_size, budget)
            chunks.append((entry, ext))
            budget -= ext
        while (
            self.waiting
            and budget > 0
            and self.rows + len(self.prefilling) < p.max_running_requests
        ):
            i = self.waiting[0]
            need = self.reserve(i) if self.mode == "colocated" else 0
            if self.kv_used + need > p.max_total_tokens and (self.rows or self.prefilling):
                break  # waits for room (alone, it runs: pdserve would retract, not refuse)
            self.waiting.popleft()
            self.kv_used += need
            entry = [i, 0]
            self.prefilling.append(entry)
            ext = min(int(self.reqs.prompts[i]), p.chunked_prefill_size, budget)
            chunks.append((entry, ext))
            budget -= ext
        if not chunks and not self.rows:
            self.busy = False
            return
        self.busy = True
        ctx = self.ctx_base + self.rows * self.steps
        if not chunks and not self.waiting and self.runs:
            first = p.decode.step_s(self.rows, ctx)
            steps = self.ends[0][0] - self.steps
            self.run = (self.clock.now, first, p.decode.s_per_context_token * self.rows, steps)
            self.clock.at(
                self.clock.now + self._run_time(steps), self._forward_done, [], steps, self.gen
            )
            return
        t = p.decode.step_s(self.rows, ctx) if self.rows else p.prefill.fixed_s
        t += sum(p.prefill.chunk_s(ext, entry[1]) for entry, ext in chunks)
        self.clock.at(
            self.clock.now + t, self._forward_done, chunks, 1 if self.rows else 0, self.gen
        )

    def _forward_done(self, chunks, decoded: int, gen: int) -> None:
        if gen != self.gen:
            return  # a run that was cut: its new end is another event
        self.run = None
        if decoded:
            self.steps += decoded
            while self.ends and self.ends[0][0] <= self.steps:
                _, i, j = heapq.heappop(self.ends)
                self.rows -= 1
                self.ctx_base -= int(self.reqs.prompts[i]) + 1 - j
                self._finish(i)
        for entry, ext in chunks:
            entry[1] += ext
            i = entry[0]
            if entry[1] >= self.reqs.prompts[i]:
                self.prefilling.remove(entry)
                if self.mode == "prefill":
                    self.on_prompt_done(i)
                else:
                    self._start_decoding(i)
        self.forward()


def _empty(reqs: Requests) -> Result:
    n = len(reqs)
    return Result(np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan), reqs.arrivals)


def _finish_result(res: Result, reqs: Requests, overhead: float) -> Result:
    tokens = reqs.outputs.astype(np.float64) - 1
    with np.errstate(invalid="ignore", divide="ignore"):
        res.tpot = np.where(tokens > 0, (res.finish - res.arrivals - res.ttft) / tokens, np.nan)
    res.ttft = res.ttft + overhead
    res.finish = res.finish + overhead
    return res


def colocated(prof: Profile, servers: int, reqs: Requests, horizon: float) -> Result:
    clock, res = Clock(), _empty(reqs)
    pool = [Server(clock, prof, "colocated", reqs, res) for _ in range(servers)]
    for i, t in enumerate(reqs.arrivals):
        clock.at(float(t), pool[i % servers].submit, i)
    clock.run(horizon)
    return _finish_result(res, reqs, prof.request_overhead_s)


def disaggregated(
    p_prof: Profile, d_prof: Profile, prefills: int, decodes: int, reqs: Requests, horizon: float
) -> Result:
    clock, res = Clock(), _empty(reqs)
    link_free = [0.0] * prefills  # when each prefill server's KV link is next free
    pending: list[deque[int]] = [deque() for _ in range(decodes)]  # decode's pre-allocation queue

    def admit(d: int) -> None:
        srv = dec[d]
        while pending[d]:
            i = pending[d][0]
            need = srv.reserve(i)
            held = srv.kv_used > 0
            if held and (
                srv.kv_used + need > d_prof.max_total_tokens
                or reserved[d] >= d_prof.max_running_requests
            ):
                return
            pending[d].popleft()
            srv.kv_used += need
            reserved[d] += 1
            pre[i % prefills].submit(i)

    def prompt_done(i: int) -> None:
        p = i % prefills
        start = max(clock.now, link_free[p])
        link_free[p] = (
            start
            + (int(reqs.prompts[i]) * p_prof.kv_bytes_per_token + p_prof.kv_bytes_per_request)
            / p_prof.kv_bandwidth
        )
        clock.at(link_free[p] + p_prof.pd_overhead_s, dec[i % decodes].join, i)

    def finished(i: int) -> None:
        d = i % decodes
        reserved[d] -= 1
        admit(d)

    def arrive(i: int) -> None:
        pending[i % decodes].append(i)
        admit(i % decodes)

    reserved = [0] * decodes
    pre = [
        Server(clock, p_prof, "prefill", reqs, res, on_prompt_done=prompt_done)
        for _ in range(prefills)
    ]
    dec = [Server(clock, d_prof, "decode", reqs, res, on_finish=finished) for _ in range(decodes)]
    for i, t in enumerate(reqs.arrivals):
        clock.at(float(t), arrive, i)
    clock.run(horizon)
    return _finish_result(res, reqs, p_prof.request_overhead_s)
