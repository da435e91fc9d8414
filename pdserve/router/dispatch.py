"""Dual dispatch (docs/architecture.md, "Request path (PD)"): pick a (prefill, decode) pair
(``selection.py``), send both the same body, answer with decode's response (a stream through
``relay.py``), retry on a new pair when a leg breaks before any output.

The rules, for one attempt:
- prefill fails first (connection error or non-2xx): decode is cancelled at once and the
  prefill error is the answer (or a retry). Otherwise decode's status and body are the answer;
- prefill's answer is awaited only to merge input logprobs (/generate with
  ``return_logprob``) or the timeline (``X-PDServe-Timeline``, router/timeline.py); otherwise it
  is drained in the background and never holds decode back;
- a stream is committed to the client (status 200) only once decode's first event arrived, so
  failures before that can still be retried; a first event that is an error (decode reports a
  failed transfer in its stream) counts as a failure before output, answered with its own HTTP
  status; a failure after it ends the stream with an SSE error event and ``data: [DONE]``;
- a 429 (the worker's queue is full) is retried as a failure is; answered, it keeps its
  ``Retry-After``;
- blame: a leg that breaks is at fault, except that a 502 from a pdserve server means "my peer
  failed" (decode: prefill's KV never came or was bad; prefill: decode aborted, died or never
  asked), which blames the other leg. A prefill 502 waits briefly for decode's own answer,
  which names the root cause (e.g. 503 "decode is overloaded");
- a retry replaces only the worker at fault: after a prefill failure it keeps the same decode
  when that is still available, after a decode failure it picks another decode; when no other
  worker of that role is available the retry goes to the same ones (a lone pair retries too);
  each retry waits its backoff first (``retry_backoff_s``);
- the client going away cancels whatever is in flight (closing a leg cancels it on the server).
Colocated mode (``--worker``) is the same with no prefill leg and the body passed on unchanged
(but for ``routed_dp_rank`` with ``--dp-aware``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve.api_key import bearer
from pdserve.router import pd_policy, protocol, timeline
from pdserve.router.kv_index import KVIndex, PromptBlocks
from pdserve.router.legs import (
    PEER_FAILED,
    RETRY_AFTER_S,
    SHED,
    EventReader,
    Leg,
    LegResult,
    ProxyStream,
    UpstreamError,
    new_session,
)
from pdserve.router.pd_policy import Decision
from pdserve.router.prompt import PromptReader
from pdserve.router.relay import Relay
from pdserve.router.selection import Selector
from pdserve.router.workers import Worker, WorkerPool

logger = logging.getLogger(__name__)

SLO_HEADER = "x-slo-ttft-ms"  # a request's own TTFT SLO (milliseconds)

BLAME_GRACE_S = (
    0.5  # how long one leg's error waits for the other leg's answer to tell whose fault it was
)
_NOT_FORWARDED = {
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "proxy-connection",
    "expect",
    "accept-encoding",
    "content-type",
}


def retry_backoff_s(args, attempt: int) -> float:
    """The wait before retry ``attempt`` (1, 2, ...): exponential from
    ``retry_initial_backoff_ms`` by ``retry_backoff_multiplier``, capped at
    ``retry_max_backoff_ms``, with ``retry_jitter_factor`` of random spread."""
    ms = min(
        args.retry_max_backoff_ms,
        args.retry_initial_backoff_ms * args.retry_backoff_multiplier ** (attempt - 1),
    )
    jitter = args.retry_jitter_factor
    return ms * random.uniform(1 - jitter, 1 + jitter) / 1000


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(protocol.error_body(status, message), status_code=status)


@dataclass
class Failure:
    """A leg that broke before decode produced output; ``response`` is what the client gets."""

    worker: Worker  # whose answer this is
    result: LegResult
    blame: Worker | None = None  # whose fault it was, when not ``worker``'s

    @property
    def blamed(self) -> Worker:
        return self.blame or self.worker

    def response(self) -> Response:
        r = self.result
        if r.status == SHED:  # every pair tried was full: the client waits as the worker said
            headers = {"Retry-After": r.retry_after or str(RETRY_AFTER_S)}
            return Response(
                r.body, status_code=r.status, media_type=r.content_type, headers=headers
            )
        if r.status is not None:
            return Response(r.body, status_code=r.status, media_type=r.content_type)
        return error_response(504 if r.timed_out else 502, r.error)


def failure(answered: Worker, result: LegResult, other: Worker | None) -> Failure:
    """The failure of the leg to ``answered``; its 502 blames ``other`` (see the module doc)."""
    return Failure(answered, result, other if result.status == PEER_FAILED else None)


@dataclass
class Call:
    """One client request, as every attempt sees it."""

    path: str
    raw: bytes
    body: dict
    headers: dict
    stream: bool
    merge_logprobs: bool
    items: int | None  # batch size for per-item bootstrap fields
    outputs: int  # decode outputs expected (inputs x samples), to map them to prefill items
    timeline: bool = False  # the client asked for the timeline (router/timeline.py)
    events: dict = field(default_factory=dict)  # the router's timeline events of this request
    prompt: PromptBlocks | None = (
        None  # the prompt's tokens, when a policy needs them and they are known
    )
    decision: Decision | None = None  # where the answering attempt prefilled (--pd-policy)
    slo_s: float | None = None  # the time to first token it must not exceed (--ttft-slo-ms)
    # the model's estimate of its TTFT (unscaled) and when it was dispatched (time.monotonic)
    ttft_estimate: tuple[float, float] | None = None
    keeper: Any = None  # keeps a /v1/responses answer (router/responses.py)

    @property
    def rewrites(self) -> bool:
        """Decode's answer is edited on its way (merges, the PD decision in meta_info)."""
        return self.merge_logprobs or self.timeline or self.shows_decision

    @property
    def shows_decision(self) -> bool:
        return (
            self.decision is not None
            and self.decision.reason != "always"
            and self.path == "/generate"
        )


@dataclass
class Outgoing:
    """What one attempt sends: the body of the decode (or colocated) leg and of the prefill leg,
    and the DP group each goes to (None: the server chooses, or not one group)."""

    payload: bytes
    p_payload: bytes | None = None
    dp_rank: int | None = None
    p_dp_rank: int | None = None


def _encode(body: dict) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode()


def _group(worker: Worker | None, body: dict | None) -> int | None:
    """The DP group of ``worker`` that ``body`` is routed to, when it names one it has."""
    rank = protocol.client_routed_rank(body) if body is not None else None
    if worker is None or not isinstance(rank, int) or isinstance(rank, bool):
        return None
    return rank if 0 <= rank < (worker.dp_size or 1) else None


class Dispatcher:
    def __init__(
        self,
        pool: WorkerPool,
        metrics,
        args,
        index: KVIndex | None = None,
        prompts: PromptReader | None = None,
    ):
        self.pool = pool
        self.metrics = metrics
        self.args = args
        self.prompts = prompts
        self.selector = Selector(pool, metrics, args, index)
        self.client: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task] = set()
        self._encoder_turn = itertools.count()

    async def start(self) -> None:
        self.client = new_session(self.args.request_timeout, bearer(self.args.worker_api_key))

    async def stop(self) -> None:
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.client is not None:
            await self.client.close()

    def make_call(self, request: Request, path: str, raw: bytes, body: dict) -> Call:
        headers = {k: v for k, v in request.headers.items() if k not in _NOT_FORWARDED}
        if self.args.worker_api_key:  # the client's key is for the router; workers get the router's
            headers.pop("authorization", None)
            headers.pop("x-api-key", None)
        headers.update({"content-type": "application/json", "accept-encoding": "identity"})
        traceparent = getattr(request.state, "traceparent", None)  # the router's span
        if traceparent:
            headers["traceparent"] = traceparent
        pd = self.pool.pd_mode
        batch = protocol.item_count(path, body)
        items = batch if pd else None
        samples = protocol.sample_count(body) if path == "/generate" else 1
        prompt = None
        if self.prompts is not None and batch is None:
            ids = self.prompts.ids(path, body)
            prompt = PromptBlocks(ids, self.adapter_of(path, body)) if ids else None
        return Call(
            path,
            raw,
            body,
            headers,
            stream=bool(body.get("stream")),
            merge_logprobs=pd and path == "/generate" and bool(body.get("return_logprob")),
            items=items,
            outputs=(items or 1) * samples,
            timeline=timeline.requested(request.headers),
            events=timeline.events_of(request.scope),
            prompt=prompt,
            slo_s=self.slo_of(request),
        )

    def adapter_of(self, path: str, body: dict) -> str | None:
        """The LoRA adapter a request names: ``lora_path`` (native), or an OpenAI ``model`` that
        is not a worker's served model."""
        if path == "/generate":
            name = body.get("lora_path")
            return name if isinstance(name, str) else None
        name = body.get("model")
        if not isinstance(name, str) or not name:
            return None
        served = {w.info.get("served_model_name") for w in self.pool.workers if w.info}
        # (without the workers' facts every name counts as the base model's)
        return name if served and name not in served else None

    def slo_of(self, request: Request) -> float | None:
        """The request's TTFT SLO in seconds: its ``x-slo-ttft-ms`` header, else --ttft-slo-ms."""
        if self.args.ttft_slo_ms is None:
            return None
        try:
            ms = float(request.headers.get(SLO_HEADER, self.args.ttft_slo_ms))
        except ValueError:
            ms = self.args.ttft_slo_ms
        return ms / 1000 if ms > 0 else None

    async def handle(self, call: Call) -> Response:
        exclude: set[Worker] = set()
        failure: Failure | None = None
        keep: Worker | None = None
        merge_logprobs = call.merge_logprobs
        for attempt in range(self.args.max_retries + 1):
            pair, why = self.selector.select(exclude, keep, call.prompt)
            if pair is None and failure is not None:
                # no other worker: the same ones again (a transfer that failed after a network
                # blip, or a worker that shed load, often serves the retry)
                pair, why = self.selector.select(set(), keep, call.prompt)
            if pair is None:
                if failure is None:
                    return error_response(503, why)
                break
            if attempt:
                await asyncio.sleep(retry_backoff_s(self.args, attempt))
                self.metrics.retries.labels(call.path).inc()
                logger.info(
                    "retrying %s on %s after: %s",
                    call.path,
                    [w.url for w in pair],
                    failure.result.error or f"HTTP {failure.result.status}",
                )
            prefill, main = (pair[0], pair[1]) if len(pair) == 2 else (None, pair[0])
            if prefill is not None:
                prefill, call.decision = self.selector.decide(
                    call.prompt,
                    prefill,
                    main,
                    call.path,
                    batch=call.items is not None or call.outputs > 1,
                )
            if not attempt and call.slo_s is not None:
                shed = self.over_slo(call, prefill, main)
                if shed is not None:
                    return shed
            call.merge_logprobs = (
                merge_logprobs and prefill is not None
            )  # decode has them all when local
            attempt_fn = self._stream if call.stream else self._unary
            outcome = await attempt_fn(call, prefill, main, self.outgoing(call, prefill, main))
            if isinstance(outcome, Response):
                if call.decision is not None and call.decision.reason != "always":
                    outcome.headers[pd_policy.HEADER] = call.decision.mode
                return outcome
            failure = outcome
            if not failure.result.retryable:
                break
            exclude.add(failure.blamed)
            keep = main if failure.blamed is prefill else None
        return failure.response()

    def over_slo(self, call: Call, prefill: Worker | None, main: Worker) -> Response | None:
        """A 429 for a request whose estimated time to first token on the chosen workers exceeds
        its SLO (``pd_policy.estimate_ttft``); None when it fits or cannot be estimated."""
        raw = self.selector.pd.estimate_ttft(call.prompt, prefill, main)
        if raw is None:
            return None
        call.ttft_estimate = (raw, time.monotonic())
        estimate = raw * main.ttft_scale  # corrected by what its streams' TTFTs were
        if estimate <= call.slo_s:
            return None
        self.metrics.shed.labels(call.path).inc()
        response = error_response(
            SHED,
            f"the estimated time to first token is {estimate:.3f} s, over this request's "
            f"SLO of {call.slo_s:.3f} s (--ttft-slo-ms, x-slo-ttft-ms); retry later",
        )
        response.headers["Retry-After"] = str(max(1, math.ceil(estimate - call.slo_s)))
        return response

    def encoders_for(self, body: dict) -> dict:
        """EPD: ``body`` with the encoder servers its images go to, starting at the next one in
        turn (a request's images spread over them)."""
        addrs = self.args.encoder
        if not addrs or not isinstance(body, dict):
            return body
        start = next(self._encoder_turn) % len(addrs)
        return {**body, "encoder_addrs": addrs[start:] + addrs[:start]}

    def outgoing(self, call: Call, prefill: Worker | None, main: Worker) -> Outgoing:
        """The bodies for one attempt: bootstrap fields for PD, DP groups with ``--dp-aware``,
        encoder servers for EPD."""
        if self.args.encoder and prefill is None and not self.args.dp_aware:
            return Outgoing(_encode(self.encoders_for(call.body)))
        if prefill is None and not self.args.dp_aware:
            return Outgoing(call.raw)
        body = call.body
        if prefill is not None:
            body = protocol.with_bootstrap(body, prefill.host, prefill.bootstrap_port, call.items)
            logger.debug(
                "%s -> prefill %s, decode %s, room %s",
                call.path,
                prefill.url,
                main.url,
                body["bootstrap_room"],
            )
        if not self.args.dp_aware:
            payload = _encode(body)
            if self.args.encoder and prefill is not None:  # the images are prefill's to compute
                return Outgoing(payload, _encode(self.encoders_for(body)))
            return Outgoing(payload, payload)
        choose = self.selector.group_chooser
        p_body, d_body = protocol.with_dp_ranks(
            body, prefill and choose(prefill, call.prompt), choose(main, call.prompt)
        )
        return Outgoing(
            _encode(d_body),
            p_body and _encode(p_body),
            _group(main, d_body),
            _group(prefill, p_body),
        )

    def _legs(self, call: Call, prefill: Worker | None, main: Worker, out: Outgoing):
        call.events["dispatched"] = time.time()

        def leg(w: Worker, payload: bytes, dp_rank: int | None) -> Leg:
            return Leg(
                self.client,
                w,
                call.path,
                payload,
                call.headers,
                self.pool.on_connect_error,
                self.metrics,
                dp_rank,
            )

        p_leg = leg(prefill, out.p_payload, out.p_dp_rank) if prefill is not None else None
        return p_leg, leg(main, out.payload, out.dp_rank)

    async def _unary(self, call: Call, prefill, main, out: Outgoing) -> Response | Failure:
        p_leg, d_leg = self._legs(call, prefill, main, out)
        handed_off = False
        try:
            d_task = d_leg.result()
            p_task = p_leg.result() if p_leg else None
            fail = await self._watch_prefill(d_task, p_task, p_leg, main)
            if fail:
                return fail
            dres: LegResult = d_task.result()
            if not dres.ok:
                return (
                    failure(main, dres, prefill)
                    if dres.retryable
                    else Failure(main, dres).response()
                )
            body, media_type, p_items = dres.body, dres.content_type, None
            if call.merge_logprobs or (call.timeline and p_task is not None):
                pres: LegResult = await p_task
                p_items = protocol.prefill_items(pres.body) if pres.ok else None
                merged = (
                    protocol.merge_logprobs_json(body, p_items)
                    if call.merge_logprobs and pres.ok
                    else None
                )
                if merged is not None:
                    body, media_type = merged, "application/json"
                elif call.merge_logprobs:
                    logger.warning(
                        "could not merge input logprobs from %s: %s",
                        prefill.url,
                        pres.error or f"HTTP {pres.status}",
                    )
            elif p_task is not None and not p_task.done():
                self._drain(p_leg)
                handed_off = True
            if call.timeline:
                body = timeline.merge_json(body, p_items, call.outputs, call.events)
            if call.shows_decision:
                body = pd_policy.add_to_meta_json(body, call.decision.meta())
            if call.keeper is not None and dres.status == 200:
                call.keeper.json(body)
            return Response(body, status_code=dres.status, media_type=media_type)
        finally:
            await d_leg.close()
            if p_leg is not None and not handed_off:
                await p_leg.close()

    async def _stream(self, call: Call, prefill, main, out: Outgoing) -> Response | Failure:
        p_leg, d_leg = self._legs(call, prefill, main, out)
        handed_off = False
        try:
            p_task = p_leg.result() if p_leg else None
            fail = await self._watch_prefill(d_leg.headers_task, p_task, p_leg, main)
            if fail:
                return fail
            try:
                resp = d_leg.headers_task.result()
            except UpstreamError as e:
                return Failure(main, d_leg.failed(e))
            if resp.status != 200:
                dres = await d_leg.result()
                return (
                    failure(main, dres, prefill)
                    if dres.retryable
                    else Failure(main, dres).response()
                )
            p_items = None
            if call.merge_logprobs or (call.timeline and p_task is not None):
                # Merging (input logprobs, the timeline) needs prefill's whole answer before
                # decode's first event goes out.
                pres: LegResult = await p_task
                if not pres.ok:
                    return failure(prefill, pres, main)
                p_items = protocol.prefill_items(pres.body)
            reader = EventReader(d_leg.chunks())
            first_task = asyncio.create_task(reader.next())
            fail = await self._watch_prefill(first_task, p_task, p_leg, main)
            if fail:
                first_task.cancel()
                await asyncio.wait({first_task})
                return fail
            try:
                first = first_task.result()
            except UpstreamError as e:
                return Failure(main, d_leg.failed(e))
            error = protocol.first_event_error(first)
            if error is None and call.ttft_estimate is not None:
                raw, since = call.ttft_estimate
                main.observe_ttft(time.monotonic() - since, raw)
                call.ttft_estimate = None  # once per request
            if error is not None:  # decode failed before any output: still retryable
                status, body = error
                if (
                    p_task is not None and not p_task.done()
                ):  # a prefill failure usually answers too
                    await asyncio.wait({p_task}, timeout=BLAME_GRACE_S)
                pres = p_task.result() if p_task is not None and p_task.done() else None
                prefill_at_fault = status == PEER_FAILED or (
                    pres is not None and not pres.ok and pres.status != PEER_FAILED
                )
                d_leg.finish(prefill_at_fault or status < 500)
                dres = LegResult(
                    status, body, "application/json", error=body.decode(errors="replace")
                )
                return Failure(main, dres, prefill if prefill_at_fault else None)
            handed_off = True
            relay = Relay(call, first, reader, p_leg, d_leg, p_items, self._drain)
            return ProxyStream(
                relay.chunks(),
                status_code=200,
                media_type=resp.headers.get("content-type"),
                on_close=relay.close,
            )
        finally:
            if not handed_off:
                await d_leg.close()
                if p_leg is not None:
                    await p_leg.close()

    async def _watch_prefill(
        self, task: asyncio.Task, p_task: asyncio.Task | None, p_leg, main: Worker
    ) -> Failure | None:
        """Wait for ``task`` (a decode step). If the prefill leg fails first, or together with
        a decode step that did not succeed, return the prefill failure: decode cannot produce
        output without prefill's KV, and prefill's error names the cause. When prefill says its
        peer failed (502), decode's own answer (waited for briefly) is the one to return."""
        pending = {task} if p_task is None else {task, p_task}
        while not task.done():
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if p_task in done:
                pending.discard(p_task)
                pres = p_task.result()
                if not pres.ok and not task.done() and pres.status == PEER_FAILED:
                    await asyncio.wait({task}, timeout=BLAME_GRACE_S)
                if not pres.ok and not task.done():
                    return failure(p_leg.worker, pres, main)
        if (
            p_task is None
            or not p_task.done()
            or p_task.result().ok
            or p_task.result().status == PEER_FAILED
        ):
            return None
        decode_step = None if task.cancelled() or task.exception() is not None else task.result()
        if isinstance(decode_step, LegResult) and decode_step.ok:
            return None  # decode answered in full: its output stands
        return failure(p_leg.worker, p_task.result(), main)

    def _drain(self, leg: Leg) -> None:
        """Let a prefill leg whose answer nobody needs finish in the background."""

        async def run() -> None:
            try:
                await asyncio.wait_for(asyncio.shield(leg.result()), self.args.request_timeout)
            except (asyncio.TimeoutError, UpstreamError):
                pass
            finally:
                await leg.close()

        task = asyncio.create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
