"""One async request function per backend: ``sglang`` (/generate), ``openai`` (/v1/completions),
``openai-chat`` (/v1/chat/completions). Each returns a ``RequestRecord`` and never raises for a
failed request: the failure is recorded with its reason.

Streams are read as server-sent events; a chunk's arrival time (``time.perf_counter``) is the
time of every ``data:`` line in it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

import aiohttp

from pdserve.bench.datasets import BenchRequest
from pdserve.bench.metrics import RequestRecord

ENDPOINTS = {
    "sglang": "/generate",
    "openai": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}


class StreamError(Exception):
    """The server reported an error inside an otherwise successful response."""


@dataclass
class RequestOptions:
    model: Optional[str] = None
    ignore_eos: bool = False
    stream: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)


async def iter_sse_data(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, str]]:
    """Yield ``(arrival time, payload)`` for each ``data:`` line, however the bytes are chunked."""
    buf = b""
    async for chunk in resp.content.iter_any():
        now = time.perf_counter()
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            line = line.strip()
            if line.startswith(b"data:"):
                yield now, line[5:].strip().decode("utf-8")
    line = buf.strip()
    if line.startswith(b"data:"):
        yield time.perf_counter(), line[5:].strip().decode("utf-8")


class _Growing:
    """Accumulates a text or id sequence that a server may send either cumulatively (each chunk
    repeats everything so far, as SGLang's /generate does for ``text``) or as deltas. A chunk
    that does not extend what was accumulated switches it to delta mode for good."""

    def __init__(self, empty: Any):
        self.value = empty
        self.cumulative = True

    def feed(self, piece: Any) -> Any:
        """Returns the new part."""
        n = len(self.value)
        if self.cumulative and n and len(piece) >= n and piece[:n] == self.value:
            new = piece[n:]
            self.value = piece
            return new
        if n:
            self.cumulative = False
        self.value = self.value + piece
        return piece


class GenerateStream:
    """Token accounting for /generate chunks: ``meta_info.completion_tokens`` (a running total)
    when present, else the length of ``output_ids``, else one token per chunk with new text."""

    def __init__(self) -> None:
        self.text = _Growing("")
        self.ids = _Growing([])
        self.num_tokens = 0
        self.prompt_tokens: Optional[int] = None

    def feed(self, chunk: dict[str, Any]) -> int:
        """Returns the number of new tokens in ``chunk``; raises ``StreamError`` on an error."""
        if chunk.get("error"):
            raise StreamError(str(chunk["error"]))
        meta = chunk.get("meta_info") or {}
        finish = meta.get("finish_reason")
        if isinstance(finish, dict) and finish.get("type") == "abort":
            raise StreamError(f"aborted: {finish.get('message')}")
        if meta.get("prompt_tokens") is not None:
            self.prompt_tokens = int(meta["prompt_tokens"])
        new_text = self.text.feed(chunk["text"]) if isinstance(chunk.get("text"), str) else ""
        new_ids = self.ids.feed(list(chunk["output_ids"])) if chunk.get("output_ids") else []
        if meta.get("completion_tokens") is not None:
            total = int(meta["completion_tokens"])
        elif self.ids.value:
            total = len(self.ids.value)
        else:
            total = self.num_tokens + (1 if new_text or new_ids else 0)
        new = max(0, total - self.num_tokens)
        self.num_tokens = max(total, self.num_tokens)
        return new


class _Timer:
    """Turns token arrivals into TTFT and ITL on a record."""

    def __init__(self, rec: RequestRecord, start: float):
        self.rec, self.start, self.last = rec, start, None

    def tokens(self, now: float, n: int) -> None:
        if n <= 0:
            return
        if self.last is None:
            self.rec.ttft = now - self.start
        else:
            self.rec.itl.extend([(now - self.last) / n] * n)
        self.last = now


def _sglang_payload(req: BenchRequest, opts: RequestOptions) -> dict[str, Any]:
    key = "input_ids" if isinstance(req.prompt, list) else "text"
    body: dict[str, Any] = {key: req.prompt}
    body["sampling_params"] = {
        "max_new_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": opts.ignore_eos,
    }
    body["stream"] = opts.stream
    return body


def _openai_payload(req: BenchRequest, opts: RequestOptions, chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": opts.model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": opts.stream,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if opts.stream:
        body["stream_options"] = {"include_usage": True}
    if opts.ignore_eos:
        body["ignore_eos"] = True
    return body


async def _read_sglang(resp, rec: RequestRecord, timer: _Timer, stream: bool) -> None:
    state = GenerateStream()
    if stream:
        async for now, data in iter_sse_data(resp):
            if data == "[DONE]":
                break
            timer.tokens(now, state.feed(json.loads(data)))
    else:
        body = await resp.json(content_type=None)
        timer.tokens(time.perf_counter(), state.feed(body))
    rec.output_len = state.num_tokens
    rec.generated = list(state.ids.value) if isinstance(rec.generated, list) else state.text.value
    if state.prompt_tokens is not None:
        rec.prompt_len = state.prompt_tokens


async def _read_openai(resp, rec: RequestRecord, timer: _Timer, stream: bool, chat: bool) -> None:
    def piece(choice: dict[str, Any]) -> str:
        if chat:
            return ((choice.get("delta") or choice.get("message") or {}).get("content")) or ""
        return choice.get("text") or ""

    chunks, usage = 0, None
    if stream:
        async for now, data in iter_sse_data(resp):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                raise StreamError(str(chunk["error"]))
            usage = chunk.get("usage") or usage
            text = "".join(piece(c) for c in chunk.get("choices") or [])
            if text:
                chunks += 1
                rec.generated += text
                timer.tokens(now, 1)
    else:
        body = await resp.json(content_type=None)
        usage = body.get("usage")
        rec.generated = "".join(piece(c) for c in body.get("choices") or [])
        chunks = 1 if rec.generated else 0
        timer.tokens(time.perf_counter(), chunks)
    rec.output_len = chunks
    if usage:
        rec.output_len = int(usage.get("completion_tokens", chunks))
        if usage.get("prompt_tokens") is not None:
            rec.prompt_len = int(usage["prompt_tokens"])


async def send_request(
    session: aiohttp.ClientSession,
    backend: str,
    base_url: str,
    req: BenchRequest,
    opts: RequestOptions,
) -> RequestRecord:
    rec = RequestRecord(
        prompt_len=req.prompt_len,
        session=req.session,
        turn=req.turn,
        generated=[] if isinstance(req.prompt, list) else "",
    )
    if backend == "sglang":
        body = _sglang_payload(req, opts)
    else:
        body = _openai_payload(req, opts, chat=backend == "openai-chat")
    body.update(opts.extra_body)
    start = time.perf_counter()
    rec.start_time = start
    timer = _Timer(rec, start)
    try:
        async with session.post(base_url + ENDPOINTS[backend], json=body) as resp:
            if resp.status != 200:
                text = await resp.text()
                raise StreamError(f"HTTP {resp.status}: {text[:500]}")
            if backend == "sglang":
                await _read_sglang(resp, rec, timer, opts.stream)
            else:
                await _read_openai(resp, rec, timer, opts.stream, backend == "openai-chat")
        rec.e2e_latency = time.perf_counter() - start
        if timer.last is None:  # an empty answer (or tokens without text): all came at the end
            rec.ttft = rec.e2e_latency
        rec.success = True
    except Exception as e:  # noqa: BLE001 - any failure fails this request only, with its reason
        rec.e2e_latency = time.perf_counter() - start
        rec.error = f"{type(e).__name__}: {e}"
    return rec
