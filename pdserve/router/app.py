"""The router's HTTP front (FastAPI) and ``pdserve router`` entry point.

Generation endpoints go through the ``Dispatcher``; the rest either answer from the router's
own state (``/health``, ``/metrics``) or fan out to the workers and gather their answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.api_key import APIKeyMiddleware
from pdserve.keepalive import SERVER_IDLE_S
from pdserve.log import setup_logging
from pdserve.router import admission, lora, pairing, processes, responses, worker_api
from pdserve.router.admission import Admission
from pdserve.router.args import RouterArgs, parse_args
from pdserve.router.autoscale import Autoscaler
from pdserve.router.discovery import DNSDiscovery
from pdserve.router.dispatch import Dispatcher, error_response
from pdserve.router.kv_index import KVIndex, PromptBlocks
from pdserve.router.legs import wait_disconnect
from pdserve.router.membership import Membership
from pdserve.router.metrics import RequestCounter, RouterMetrics
from pdserve.router.prompt import PromptReader
from pdserve.router.protocol import BadRequest, parse_body
from pdserve.router.workers import DECODE, PREFILL, REGULAR, Worker, WorkerPool
from pdserve.tracing import Tracing

logger = logging.getLogger(__name__)

GENERATE_PATHS = (
    "/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
)
NO_INDEX = (
    "the router follows no KV events (policy cache_aware or --pd-policy conditional turn them on)"
)
_DRAIN_LIMIT = 64 * 1024 * 1024  # read at most this much of an oversized body before giving up


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or ``BadRequest(413)``. An oversized body is still read (up to a cap) so
    the client, still sending, gets the 413 rather than a reset connection."""
    declared = request.headers.get("content-length", "")
    too_big = declared.isdigit() and int(declared) > limit
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        too_big = too_big or size > limit
        if too_big:
            if size > limit + _DRAIN_LIMIT:
                break
            continue
        chunks.append(chunk)
    if too_big:
        raise BadRequest(f"request body is larger than the limit of {limit} bytes", status=413)
    return b"".join(chunks)


async def until_disconnect(request: Request, work_coro) -> Response:
    """Run a dispatch in this task, cancelling it (and so its upstream legs) if the client goes
    away first. One watcher task per request; the dispatch itself runs here, not in a task."""
    me = asyncio.current_task()
    left = False

    async def watch() -> None:
        nonlocal left
        await wait_disconnect(request.receive)
        left = True
        me.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await work_coro
    except asyncio.CancelledError:
        if not left:
            raise
        me.uncancel()
    finally:
        watcher.cancel()
    logger.info("client left before %s was answered; upstream requests cancelled", request.url.path)
    return Response(status_code=499)


class RouterApp(FastAPI):
    """FastAPI, except that a POST to a generation route skips FastAPI's own middleware and
    routing (error pages, telemetry, body limits, dependency solving; skipping them took a PD
    request from 0.91 to 0.63 ms of CPU, docs/benchmarks.md "Router overhead") and goes through
    the router's middleware straight to ``generate``. The routes stay registered for
    /openapi.json."""

    fast_path = None  # an ASGI app for GENERATE_PATHS, set by ``create_app``

    async def __call__(self, scope, receive, send) -> None:
        if (
            self.fast_path is not None
            and scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in GENERATE_PATHS
        ):
            return await self.fast_path(scope, receive, send)
        await super().__call__(scope, receive, send)


def _json_or_text(resp: httpx.Response):
    try:
        return resp.json()
    except ValueError:
        return resp.text


class Router:
    """Everything one router instance owns; built by ``create_app``."""

    def __init__(self, args: RouterArgs):
        self.args = args
        follow = args.follows_kv_events
        slo = args.ttft_slo_ms is not None  # estimates need prompts, calibrations and loads
        self.pool = WorkerPool(
            args,
            poll_loads="least_load" in args.policies or follow or slo,
            needs_info=follow or args.pd_mode or slo,
        )  # PD: backends and hosts (router/pairing.py)
        self.metrics = RouterMetrics(self.pool)
        self.index = (
            KVIndex(
                self.metrics,
                lambda: self.pool.client,
                {"CPU": args.cache_aware_host_weight, "STORAGE": args.cache_aware_storage_weight},
            )
            if follow
            else None
        )
        self.prompts = (
            PromptReader(args.tokenizer_path) if follow or slo else None
        )  # the index and the TTFT estimates need prompt tokens
        self._tokenizer_task: asyncio.Task | None = None
        self.pool.info_listeners.append(self.on_worker_info)
        if self.index is not None:
            self.metrics.watch_index(self.index)
            self.pool.forget_listeners.append(self.index.detach)
        self.dispatcher = Dispatcher(self.pool, self.metrics, args, self.index, self.prompts)
        self.responses = responses.Responses(args.responses_store_size)
        self.tracing = (
            Tracing(args.otlp_traces_endpoint, "pdserve-router")
            if args.otlp_traces_endpoint
            else None
        )
        self.admission = (
            Admission(
                args.max_concurrent_requests,
                args.rate_limit_tokens_per_second,
                args.queue_size,
                args.queue_timeout_secs,
                args.tenant_weights,
            )
            if args.max_concurrent_requests > 0
            else None
        )
        if self.admission is not None:
            self.metrics.watch_admission(self.admission)
        self.membership = Membership(self.pool, args)  # workers joining and leaving at run time
        self.discovery = (
            DNSDiscovery(self.pool, self.membership, args)
            if args.prefill_dns or args.decode_dns
            else None
        )
        self.autoscaler = Autoscaler(self.pool, self.membership, args) if args.autoscale else None

    def on_worker_info(self, worker: Worker, info: dict) -> None:
        if worker.role in (PREFILL, DECODE):
            others = self.pool.by_role[DECODE if worker.role == PREFILL else PREFILL]
            pairs = [
                (worker, o) if worker.role == PREFILL else (o, worker)
                for o in others
                if o.info is not None
            ]
            for why in filter(None, (pairing.why_not(p, d) for p, d in pairs)):
                logger.warning("these two will not be paired: %s", why)
        if self.index is not None:
            self.index.attach(worker, info)
        if (
            self.prompts is not None
            and self.prompts.tokenizer is None
            and self._tokenizer_task is None
        ):
            path = info.get("tokenizer_path") or info.get("model_path")
            self._tokenizer_task = asyncio.create_task(asyncio.to_thread(self.prompts.load, path))

    @property
    def loading_tokenizer(self) -> bool:
        return self._tokenizer_task is not None and not self._tokenizer_task.done()

    async def start(self) -> None:
        await self.dispatcher.start()
        await self.pool.start()
        if self.discovery is not None:
            await self.discovery.start()
        if self.autoscaler is not None:
            await self.autoscaler.start()
        if self.prompts is not None and self.args.tokenizer_path and self._tokenizer_task is None:
            self._tokenizer_task = asyncio.create_task(asyncio.to_thread(self.prompts.load))
        mode = ("PD" if self.args.pd_mode else "colocated") + (
            ", DP-aware" if self.args.dp_aware else ""
        )
        if self.args.pd_policy != "always":
            mode += f", --pd-policy {self.args.pd_policy}"
        logger.info(
            "router (%s, policy %s) on %s:%d with %d workers, %d healthy",
            mode,
            self.args.policy,
            self.args.host,
            self.args.port,
            len(self.pool.workers),
            sum(w.healthy for w in self.pool.workers),
        )

    async def stop(self) -> None:
        if self.autoscaler is not None:
            await self.autoscaler.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        await self.membership.stop()
        if self.index is not None:
            await self.index.stop()
        await self.pool.stop()
        if self.tracing is not None:
            self.tracing.shutdown()
        await self.dispatcher.stop()

    def first_available(self, roles: tuple[str, ...]) -> Worker | None:
        for role in roles:
            workers = self.pool.available(role)
            if workers:
                return workers[0]
        return None

    async def get_with_alias(
        self, worker: Worker, path: str, alias: str | None = None
    ) -> httpx.Response:
        resp = await self.pool.client.get(worker.url + path)
        if resp.status_code == 404 and alias:
            resp = await self.pool.client.get(worker.url + alias)
        return resp

    async def proxy_get(self, what: str, path: str, alias: str | None = None) -> Response:
        """A GET answered by the first available worker (decode first), passed on as it is."""
        worker = self.first_available((DECODE, REGULAR, PREFILL))
        if worker is None:
            return error_response(503, f"no healthy worker to ask for {what}")
        try:
            resp = await self.get_with_alias(worker, path, alias)
        except httpx.HTTPError as e:
            return error_response(502, f"{worker.url}{path} failed: {e!r}")
        return Response(
            resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type")
        )

    async def proxy_post(self, what: str, path: str, body: bytes) -> Response:
        """A POST that generates nothing, answered by the first available worker (decode
        first), passed on as it is."""
        worker = self.first_available((DECODE, REGULAR, PREFILL))
        if worker is None:
            return error_response(503, f"no healthy worker to ask for {what}")
        try:
            resp = await self.pool.client.post(
                worker.url + path, content=body, headers={"content-type": "application/json"}
            )
        except httpx.HTTPError as e:
            return error_response(502, f"{worker.url}{path} failed: {e!r}")
        return Response(
            resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type")
        )

    def roles(self) -> tuple[str, ...]:
        return (PREFILL, DECODE) if self.args.pd_mode else (REGULAR,)


def create_app(args: RouterArgs) -> FastAPI:
    router = Router(args)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = RouterApp(title="pdserve router", lifespan=lifespan)
    app.state.router = router

    async def generate(request: Request) -> Response:
        return await read_and_dispatch(request, admitted=False)

    async def read_and_dispatch(request: Request, admitted: bool) -> Response:
        """Read, admit (router/admission.py) and dispatch one generation request; ``admitted``:
        the caller holds the request's admission token until its answer is sent."""
        try:
            raw = await read_body(request, args.max_body_bytes)
            body = parse_body(raw)
        except BadRequest as e:
            return error_response(e.status, str(e))
        keeper = None
        if request.url.path == responses.PATH:
            try:
                expanded, keeper = router.responses.prepare(body)
            except BadRequest as e:
                return error_response(e.status, str(e))
            if expanded is not body:
                body, raw = expanded, json.dumps(expanded, ensure_ascii=False).encode()
        if admitted:
            tenant = request.headers.get(args.tenant_header, "")
            try:
                await router.admission.enter(tenant, admission.priority_of(body, args))
            except admission.Refusal as e:
                refusal = error_response(e.status, e.message)
                if e.status == 429:
                    refusal.headers["Retry-After"] = str(admission.RETRY_AFTER_S)
                return refusal
            request.state.admitted = True
        call = router.dispatcher.make_call(request, request.url.path, raw, body)
        call.keeper = keeper
        return await until_disconnect(request, router.dispatcher.handle(call))

    for path in GENERATE_PATHS:
        app.add_api_route(path, generate, methods=["POST"])

    async def generate_asgi(scope, receive, send) -> None:
        request = Request(scope, receive)
        gated = router.admission is not None
        span = None
        if router.tracing is not None:  # pdserve/tracing.py: the legs carry its traceparent
            span = router.tracing.start(
                "router", request.headers.get("traceparent"), **{"http.route": scope["path"]}
            )
            request.state.traceparent = span.traceparent
        status = None
        try:
            response = await read_and_dispatch(request, admitted=gated)
            status = response.status_code
            await response(scope, receive, send)  # a stream: to its last byte
        finally:
            if gated and getattr(request.state, "admitted", False):
                router.admission.leave()
            if span is not None:
                span.end(**{"http.response.status_code": status})

    @app.get("/health")
    async def health():
        if router.loading_tokenizer:
            return error_response(503, "loading the tokenizer for prompt matching")
        if router.pool.ready():
            return JSONResponse({"status": "ok"})
        missing = [r for r in router.roles() if not router.pool.available(r)]
        return error_response(503, f"no healthy {' or '.join(missing)} worker")

    @app.get("/health_generate")
    async def health_generate():
        results = await router.pool.fan_out(
            "GET",
            "/health_generate",
            [w for w in router.pool.workers if w.available],
            timeout=max(args.health_check_timeout, 60.0),
        )
        ok_roles = {
            w.role for w, r in results if isinstance(r, httpx.Response) and r.status_code == 200
        }
        missing = [r for r in router.roles() if r not in ok_roles]
        if missing:
            return error_response(503, f"no {' or '.join(missing)} worker could generate")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        body = router.responses.store.get(response_id)
        if body is None:
            return error_response(404, f"response {response_id!r} not found")
        return JSONResponse(body)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if not router.responses.store.delete(response_id):
            return error_response(404, f"response {response_id!r} not found")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        try:
            raw = await read_body(request, args.max_body_bytes)
        except BadRequest as e:
            return error_response(e.status, str(e))
        return await router.proxy_post("a token count", "/v1/messages/count_tokens", raw)

    @app.get("/v1/models")
    async def models():
        return await router.proxy_get("models", "/v1/models")

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info(request: Request):
        path = request.url.path
        return await router.proxy_get(
            "model info", path, "/get_model_info" if path == "/model_info" else "/model_info"
        )

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        async def one(w: Worker) -> dict:
            out = w.describe()
            try:
                resp = await router.get_with_alias(w, "/server_info", "/get_server_info")
                resp.raise_for_status()
                out["server_info"] = resp.json()
            except (httpx.HTTPError, ValueError) as e:
                out["error"] = repr(e)
            return out

        infos = await asyncio.gather(*(one(w) for w in router.pool.workers))
        out: dict = {}
        main = next(
            (
                i["server_info"]
                for i, w in zip(infos, router.pool.workers, strict=True)
                if w.role == router.pool.main_role and isinstance(i.get("server_info"), dict)
            ),
            None,
        )
        out.update(main or {})  # top level looks like a server's, for clients that read it
        out["router"] = args.to_dict()
        for role in router.roles():
            out[role] = [
                i for i, w in zip(infos, router.pool.workers, strict=True) if w.role == role
            ]
        return out

    @app.get("/get_load")
    async def get_load():
        results = await router.pool.fan_out("GET", "/get_load", router.pool.workers)
        out: dict = {role: [] for role in router.roles()}
        for w, r in results:
            entry = w.describe()
            if isinstance(r, httpx.Response) and r.status_code == 200:
                entry["load"] = _json_or_text(r)
            else:
                entry["error"] = repr(r) if isinstance(r, Exception) else f"HTTP {r.status_code}"
            out[w.role].append(entry)
        return out

    lora.add_routes(app, router, lambda request: read_body(request, args.max_body_bytes))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        results = await router.pool.fan_out("POST", "/flush_cache", router.pool.workers)
        flushed = [
            w.url for w, r in results if isinstance(r, httpx.Response) and r.status_code == 200
        ]
        failed = [
            {
                "url": w.url,
                "error": repr(r) if isinstance(r, Exception) else f"HTTP {r.status_code}",
            }
            for w, r in results
            if w.url not in flushed
        ]
        return JSONResponse(
            {"flushed": flushed, "failed": failed}, status_code=502 if failed else 200
        )

    @app.get("/kv_index")
    async def kv_index():
        """What the router knows of each worker's KV cache (router/kv_index.py)."""
        if router.index is None:
            return error_response(404, NO_INDEX)
        return JSONResponse(
            {
                "tokenizer": router.prompts is not None and router.prompts.tokenizer is not None,
                "workers": router.index.describe(),
            }
        )

    @app.post("/kv_index/match")
    async def kv_index_match(request: Request):
        """How much of a request's prompt each worker holds, as the router sees it: the body of a
        generation request, its endpoint in ``?path=`` (default /generate)."""
        if router.index is None:
            return error_response(404, NO_INDEX)
        path = request.query_params.get("path", "/generate")
        if path not in GENERATE_PATHS:
            return error_response(400, f"path: must be one of {', '.join(GENERATE_PATHS)}")
        try:
            body = parse_body(await read_body(request, args.max_body_bytes))
        except BadRequest as e:
            return error_response(e.status, str(e))
        ids = router.prompts.ids(path, body) if router.prompts is not None else None
        if not ids:
            return error_response(
                400,
                "no prompt tokens: a single prompt (input_ids, or text with the tokenizer "
                "loaded) is needed",
            )
        prompt = PromptBlocks(ids)
        return JSONResponse(
            {
                "prompt_tokens": len(ids),
                "workers": {
                    w.url: router.index.matched_tokens(w, prompt)[0] for w in router.pool.workers
                },
                # the same with a prefix below a worker's pool at its tier's weight (cache_aware)
                "weighted": {
                    w.url: router.index.weighted_tokens(w, prompt) for w in router.pool.workers
                },
            }
        )

    worker_api.add_routes(app, router.pool, router.membership, args.worker_api_key)

    @app.get("/autoscale")
    async def autoscale():
        """The autoscaler's state (router/autoscale.py): backlog per server of each role, the switch
        under way, the last switches with their reasons and outcomes."""
        if router.autoscaler is None:
            return error_response(404, "autoscaling is off: start the router with --autoscale")
        return JSONResponse(router.autoscaler.state())

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type=RouterMetrics.CONTENT_TYPE)

    endpoints = {r.path for r in app.routes if hasattr(r, "path")}
    fast = generate_asgi
    if args.workers > 1:  # inside the key check: a caller without the key still gets 401
        app.add_middleware(processes.FrozenMembership)
    if args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
        fast = APIKeyMiddleware(fast, api_key=args.api_key)
    app.add_middleware(RequestCounter, metrics=router.metrics, endpoints=endpoints)
    app.fast_path = RequestCounter(fast, metrics=router.metrics, endpoints=endpoints)
    return app


def serve(args: RouterArgs, role: str = "router", sockets=None) -> None:
    """Run one router process until it is stopped (on ``sockets`` when given, else host:port)."""
    setup_logging(role, args.log_level)
    for noisy in ("httpx", "httpcore"):  # one INFO line per upstream request otherwise
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    app = create_app(args)
    level = (
        "warning" if args.log_level == "info" else args.log_level
    )  # uvicorn's INFO lines are per request
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,
        log_level=level,
        access_log=False,
        timeout_graceful_shutdown=10,
        timeout_keep_alive=SERVER_IDLE_S,  # pooling clients close theirs first
    )
    uvicorn.Server(config).run(sockets=sockets)


def main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
    except ValueError as e:
        print(f"pdserve router: {e}", file=sys.stderr)
        return 2
    if args.workers > 1:
        setup_logging("router", args.log_level)
        return processes.run(args)
    serve(args)
    return 0
