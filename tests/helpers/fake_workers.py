"""Fake pdserve workers for router tests: real HTTP servers on loopback, no model.

A ``FakeCluster`` starts prefill, decode and colocated ("regular") workers, each a small FastAPI
app served by uvicorn in its own thread. Workers record every request they get and answer like
pdserve servers do:

- prefill answers ``/generate`` with one token and ``meta_info.input_token_logprobs`` (one
  entry per prompt token), as one JSON object even when ``stream`` is true (or as SSE when
  ``sse_prefill`` is set);
- decode answers with a normal JSON body or an SSE stream, and, like a real decode server, only
  produces output once the prefill leg of each of its rooms has finished: prefill and decode of
  one cluster share a room table, so a prefill that fails makes its decode fail too.

Knobs are plain attributes, set from the test thread (``worker.fail_status = 500``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from tests.helpers.cluster import wait_for as wait_until  # noqa: F401 (used by the router tests)
from tests.helpers.ports import free_port  # noqa: F401 (used by the router tests)

MODEL = "fake-model"


class AppServer:
    """One ASGI app served by uvicorn on 127.0.0.1 in a background thread with its own loop."""

    def __init__(self, app, port: int = 0, lifespan: str = "off"):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, log_level="warning", lifespan=lifespan, timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"app-{self.port}")
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive(), what="uvicorn start")
        if not self.server.started:
            raise RuntimeError(f"server on port {self.port} failed to start")

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def stop(self, force: bool = False) -> None:
        """Shut down; ``force`` also drops open connections at once (and skips lifespan
        shutdown)."""
        self.server.should_exit = True
        self.server.force_exit = force
        self.thread.join(timeout=10)
        self.sock.close()


class Gate:
    """A thread-safe gate that async handlers wait on; closed gates hold responses back."""

    def __init__(self, is_open: bool = False):
        self._event = threading.Event()
        if is_open:
            self._event.set()

    def open(self) -> None:
        self._event.set()

    def close(self) -> None:
        self._event.clear()

    async def wait(self, request: Request | None = None, timeout: float = 30.0) -> bool:
        """True once the gate is open; False if the client of ``request`` went away first."""
        deadline = time.monotonic() + timeout
        while not self._event.is_set():
            if request is not None and await request.is_disconnected():
                return False
            if time.monotonic() > deadline:
                raise TimeoutError("gate never opened")
            await asyncio.sleep(0.005)
        return True


_arrivals = itertools.count()


@dataclass
class Recorded:
    worker: str  # name of the worker that got it
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    seq: int = field(default_factory=lambda: next(_arrivals))  # arrival order across all workers
    sent: bytearray = field(default_factory=bytearray)  # response body bytes as written
    done: bool = False  # the handler finished writing its response
    disconnected: bool = False  # the client went away before the response was complete

    @property
    def json(self) -> Any:
        return json.loads(self.body)


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def _prompt_lengths(body: dict) -> list[int]:
    """Prompt length of each input item (after ``n`` expansion for batches)."""
    if "input_ids" in body:
        ids = body["input_ids"]
        items = ids if ids and isinstance(ids[0], list) else [ids]
        return [len(x) for x in items]
    for key in ("text", "prompt"):
        if key in body:
            return [len(str(t).split()) for t in _as_list(body[key])]
    if "messages" in body:
        return [sum(len(str(m.get("content", "")).split()) for m in body["messages"]) + 3]
    return [1]


class FakeWorker:
    def __init__(self, cluster: "FakeCluster", role: str, name: str):
        self.cluster = cluster
        self.role = role  # prefill | decode | regular
        self.name = name
        self.requests: list[Recorded] = []
        self.health_status = 200
        self.load = {"num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
        self.dp_size = 1  # reported in /server_info
        self.info_extra: dict = {}  # more /server_info fields (transfer backend, host_id, ...)
        self.group_loads: list[dict] | None = (
            None  # /get_load: the totals plus these as "dp" (a pdserve with DP)
        )
        self.fail_status: int | None = None  # answer generation requests with this status
        self.fail_count: int | None = None  # only this many of them (None: all)
        self.stream_error_status: int | None = (
            None  # decode: answer a stream 200 + one SSE error event
        )
        self.respond_gate = Gate(is_open=True)  # prefill: hold the HTTP answer (KV already "sent")
        self.stream_gate = Gate(
            is_open=True
        )  # decode: hold a stream after its first event, or a JSON answer
        self.die_mid_stream = False  # decode: drop the connection after the first chunk
        self.first_event_delay_s = 0.0  # a stream's first event comes this late
        self.sse_prefill = False  # prefill: answer stream=true with SSE instead of one JSON
        self.room_timeout = 5.0  # decode: how long to wait for a room's prefill
        self.bootstrap_port = None
        self.bootstrap_sock: socket.socket | None = None
        if (
            role == "prefill"
        ):  # listens, as a prefill's bootstrap server does (nothing is served on it)
            self.bootstrap_sock = socket.create_server(("127.0.0.1", 0))
            self.bootstrap_port = self.bootstrap_sock.getsockname()[1]
        self.server = AppServer(self._build_app())
        self.url = self.server.url

    def reset(self) -> None:
        """Forget recorded requests and put every knob back to its default."""
        self.requests.clear()
        self.health_status = 200
        self.load = {"num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
        self.dp_size = 1
        self.info_extra = {}
        self.group_loads = None
        self.fail_status = None
        self.fail_count = None
        self.stream_error_status = None
        self.respond_gate.open()
        self.stream_gate.open()
        self.die_mid_stream = False
        self.first_event_delay_s = 0.0
        self.sse_prefill = False

    # ------------------------------------------------------------------ inspection helpers
    def generation_requests(self) -> list[Recorded]:
        return [r for r in self.requests if r.method == "POST" and r.path != "/flush_cache"]

    def stop(self) -> None:
        self.server.stop(force=True)
        if self.bootstrap_sock is not None:
            self.bootstrap_sock.close()

    # ------------------------------------------------------------------ app
    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return Response(status_code=self.health_status)

        @app.get("/health_generate")
        async def health_generate():
            return Response(status_code=self.health_status)

        @app.get("/server_info")
        @app.get("/get_server_info")
        async def server_info():
            return {
                "model_path": MODEL,
                "served_model_name": MODEL,
                "tp_size": 1,
                "dp_size": self.dp_size,
                "disaggregation_mode": "null" if self.role == "regular" else self.role,
                "name": self.name,
                **self.info_extra,
            }

        @app.get("/model_info")
        @app.get("/get_model_info")
        async def model_info():
            return {"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True}

        @app.get("/v1/models")
        async def models():
            return {
                "object": "list",
                "data": [{"id": MODEL, "object": "model", "owned_by": self.name}],
            }

        @app.get("/get_load")
        async def get_load():
            if self.group_loads is not None:
                return {
                    **self.load,
                    "dp": [{"dp_rank": i, **g} for i, g in enumerate(self.group_loads)],
                }
            return [{"dp_rank": 0, **self.load}]

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache(request: Request):
            await self._record(request)
            return Response("Cache flushed.\n")

        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.add_api_route(path, self._generate, methods=["POST"])
        return app

    async def _record(self, request: Request) -> Recorded:
        body = await request.body()
        rec = Recorded(self.name, request.method, request.url.path, dict(request.headers), body)
        self.requests.append(rec)
        return rec

    async def _generate(self, request: Request):
        rec = await self._record(request)
        body = rec.json
        if self.role == "prefill":
            return await self._prefill(rec, body, request.url.path, request)
        if self.role == "decode":
            rooms = _as_list(body.get("bootstrap_room"))
            ok = await self.cluster.wait_rooms(rooms, self.room_timeout)
            if not ok:  # a real decode notices at its next poll, after prefill has answered
                await asyncio.sleep(0.05)
                return self._error(rec, 500, "KV transfer failed: prefill failed or timed out")
        if self._failing():
            return self._error(rec, self.fail_status, f"{self.name} injected failure")
        if self.stream_error_status is not None and body.get("stream"):
            err = {
                "error": {
                    "message": f"{self.name} injected stream failure",
                    "code": self.stream_error_status,
                }
            }
            events = [f"data: {json.dumps(err)}\n\n".encode(), b"data: [DONE]\n\n"]
            return StreamingResponse(self._stream(rec, events), media_type="text/event-stream")
        if not body.get("stream") and not await self.stream_gate.wait(request):
            rec.disconnected = True
            return Response(status_code=499)
        return self._decode(rec, body, request.url.path)

    def _failing(self) -> bool:
        """Whether this generation request gets ``fail_status`` (``fail_count`` counts down)."""
        if self.fail_status is None or self.fail_count == 0:
            return False
        if self.fail_count is not None:
            self.fail_count -= 1
        return True

    def _error(self, rec: Recorded, status: int, message: str) -> Response:
        payload = json.dumps({"error": {"message": message, "code": status}}).encode()
        rec.sent += payload
        rec.done = True
        return Response(payload, status_code=status, media_type="application/json")

    async def _prefill(self, rec: Recorded, body: dict, path: str, request: Request) -> Response:
        rooms = _as_list(body.get("bootstrap_room"))
        if self._failing():
            self.cluster.finish_rooms(rooms, ok=False)
            return self._error(rec, self.fail_status, f"{self.name} injected failure")
        self.cluster.finish_rooms(rooms, ok=True)
        if not await self.respond_gate.wait(request):
            rec.disconnected = True
            return Response(status_code=499)
        items = []
        for n in _prompt_lengths(body):
            meta = {
                "id": f"{self.name}-{len(self.requests)}",
                "finish_reason": {"type": "length", "length": 1},
                "prompt_tokens": n,
                "completion_tokens": 1,
                "served_by": self.name,
            }
            if body.get("return_logprob"):
                meta["input_token_logprobs"] = [[-1.0 - i / 100, 100 + i, None] for i in range(n)]
                meta["output_token_logprobs"] = [[-0.5, 7, None]]
            items.append({"text": "P", "output_ids": [7], "meta_info": meta})
        out: Any = items if len(items) > 1 or _is_batch(body) else items[0]
        if path != "/generate":
            out = {
                "id": "prefill",
                "object": "text_completion",
                "choices": [],
                "served_by": self.name,
            }
        if body.get("stream") and self.sse_prefill:
            payload = f"data: {json.dumps(out)}\n\ndata: [DONE]\n\n".encode()
            media = "text/event-stream"
        else:
            payload, media = json.dumps(out).encode(), "application/json"
        rec.sent += payload
        rec.done = True
        return Response(payload, media_type=media)

    def _decode(self, rec: Recorded, body: dict, path: str) -> Response:
        max_new = int(
            (body.get("sampling_params") or {}).get("max_new_tokens")
            or body.get("max_tokens")
            or body.get("max_completion_tokens")
            or 4
        )
        lengths = _prompt_lengths(body)

        def item(index: int, upto: int) -> dict:
            meta = {
                "id": f"{self.name}-{index}",
                "finish_reason": {"type": "length", "length": max_new},
                "prompt_tokens": lengths[min(index, len(lengths) - 1)],
                "completion_tokens": upto,
                "served_by": self.name,
            }
            if body.get("return_logprob"):
                meta["input_token_logprobs"] = []
                meta["output_token_logprobs"] = [[-2.5, 2000 + i, None] for i in range(upto)]
            out = {
                "text": "Dé" * upto,
                "output_ids": list(range(2000, 2000 + upto)),
                "meta_info": meta,
            }
            if _is_batch(body):
                out["index"] = index
            return out

        def openai(upto: int, chunk: bool) -> dict:
            kind = "chat.completion" if path.endswith("chat/completions") else "text_completion"
            text = "Dé" * (1 if chunk else upto)
            choice: dict = {"index": 0, "finish_reason": "length" if upto == max_new else None}
            if kind == "chat.completion":
                choice["delta" if chunk else "message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return {
                "id": "cmpl-fake",
                "object": kind + (".chunk" if chunk and kind.startswith("chat") else ""),
                "model": MODEL,
                "choices": [choice],
                "served_by": self.name,
            }

        if not body.get("stream"):
            if path == "/generate":
                items = [item(i, max_new) for i in range(len(lengths))]
                out: Any = items if _is_batch(body) else items[0]
            else:
                out = openai(max_new, chunk=False)
            payload = json.dumps(out).encode()
            rec.sent += payload
            rec.done = True
            return Response(payload, media_type="application/json")

        events: list[bytes] = []
        for upto in range(1, max_new + 1):
            if path == "/generate":
                for i in range(len(lengths)):
                    events.append(
                        f"data: {json.dumps(item(i, upto), ensure_ascii=False)}\n\n".encode()
                    )
            else:
                events.append(f"data: {json.dumps(openai(upto, chunk=True))}\n\n".encode())
        events.append(b"data: [DONE]\n\n")
        return StreamingResponse(self._stream(rec, events), media_type="text/event-stream")

    async def _stream(self, rec: Recorded, events: list[bytes]):
        # Write the first event whole, then the rest with awkward splits (an event cut in two,
        # two events in one write, a comment line) so passthrough must be byte-exact to pass.
        try:
            await asyncio.sleep(self.first_event_delay_s)
            rec.sent += events[0]
            yield events[0]
            await self.stream_gate.wait()
            if self.die_mid_stream:
                rec.sent += b'data: {"partial'
                yield b'data: {"partial'
                raise RuntimeError("decode worker died mid-stream")
            rest = b": keep-alive\n\n" + b"".join(events[1:])
            cut = len(rest) // 3
            for piece in (rest[:cut], rest[cut:]):
                rec.sent += piece
                yield piece
                await asyncio.sleep(0)
            rec.done = True
        finally:
            if not rec.done:
                rec.disconnected = True


def _is_batch(body: dict) -> bool:
    ids = body.get("input_ids")
    return (
        isinstance(body.get("text"), list)
        or isinstance(body.get("prompt"), list)
        or bool(isinstance(ids, list) and ids and isinstance(ids[0], list))
    )


class FakeCluster:
    """Owns fake workers and the room table that links prefill and decode legs."""

    def __init__(self):
        self.workers: list[FakeWorker] = []
        self._rooms: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def add(self, role: str, name: str | None = None) -> FakeWorker:
        worker = FakeWorker(
            self, role, name or f"{role}{sum(w.role == role for w in self.workers)}"
        )
        self.workers.append(worker)
        return worker

    def _room(self, room: int) -> concurrent.futures.Future:
        with self._lock:
            return self._rooms.setdefault(room, concurrent.futures.Future())

    def finish_rooms(self, rooms: list, ok: bool) -> None:
        for room in rooms:
            fut = self._room(room)
            if not fut.done():
                fut.set_result(ok)

    async def wait_rooms(self, rooms: list, timeout: float) -> bool:
        if rooms == [None]:
            return True  # not a PD request (colocated worker)
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*(asyncio.wrap_future(self._room(r)) for r in rooms)), timeout
            )
        except asyncio.TimeoutError:
            return False
        return all(results)

    def close(self) -> None:
        for w in self.workers:
            w.respond_gate.open()
            w.stream_gate.open()
        for w in self.workers:
            if w.server.thread.is_alive():
                w.stop()
