"""The HTTP front end: FastAPI routes over one ``TokenizerManager``.

Readiness: ``/health`` answers 200 only after the scheduler reported ready and the warm-up
generation passed (or was skipped), and while the scheduler process is alive. When a scheduler
rank dies (on a multi-host server also when a rank on another node is lost: the ranks here exit)
every running request fails with 503, ``/health`` and the generation routes answer 503 with the
reason for ``LOST_SCHEDULER_LINGER_S``, and then ``on_fatal`` stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Callable, ClassVar

import msgspec
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

import pdserve
from pdserve.api_key import APIKeyMiddleware
from pdserve.host import host_identity
from pdserve.server import (
    api_schema,
    expert_api,
    generate_api,
    http_util,
    lora_api,
    messages_api,
    migrate_api,
    openai_api,
    responses_api,
    role_switch,
)
from pdserve.server.calibration import calibrate
from pdserve.server.errors import APIError, bad_request
from pdserve.server.tokenizer_manager import TokenizerManager
from pdserve.tracing import TraceContextMiddleware

logger = logging.getLogger(__name__)

WARMUP_TIMEOUT_S = 600.0
HEALTH_GENERATE_TIMEOUT_S = 20.0
CONTROL_TIMEOUT_S = 10.0
# a PD server's queues in GET /get_load (disagg/prefill.py and decode.py ``queues``)
QUEUE_KEYS = ("bootstrap_queue", "inflight_queue", "prealloc_queue", "transfer_queue")
# after the scheduler is lost the front end answers 503 with the reason this long, then exits
LOST_SCHEDULER_LINGER_S = 5.0


class AbortRequest(msgspec.Struct):
    # a non-empty rid, or abort_all true
    JSON_SCHEMA: ClassVar[dict[str, Any]] = {
        "anyOf": [
            {"required": ["rid"], "properties": {"rid": {"minLength": 1}}},
            {"required": ["abort_all"], "properties": {"abort_all": {"const": True}}},
        ]
    }

    rid: str = ""
    abort_all: bool = False


def create_app(
    tm: TokenizerManager,
    *,
    warmup: bool = True,
    on_fatal: Callable[[str], None] = lambda reason: None,
) -> FastAPI:
    args = tm.server_args
    client = tm.client
    state: dict[str, Any] = {"ready": False}

    async def one_token(timeout: float) -> None:
        req = tm.submit(generate_api.health_request(tm))
        await asyncio.wait_for(tm.wait(req), timeout)
        http_util.raise_if_failed([req])

    switcher = role_switch.RoleSwitch(tm, one_token)  # POST /switch_role

    async def warm_up() -> None:
        try:
            if warmup:
                t0 = time.monotonic()
                await one_token(WARMUP_TIMEOUT_S)
                logger.info("warm-up generation passed in %.2fs", time.monotonic() - t0)
                state["calibration"] = await asyncio.wait_for(
                    # the pool's cache only: the tiers keep what earlier runs left there
                    calibrate(tm, lambda: control("flush_cache", tiers=False)),
                    WARMUP_TIMEOUT_S,
                )
            state["ready"] = True
            logger.info("server ready on http://%s:%d", args.host, args.port)
        except Exception as e:
            logger.error("warm-up failed: %r", e)
            on_fatal(f"warm-up failed: {e!r}")

    def scheduler_exited() -> None:
        loop = asyncio.get_running_loop()
        for fd in client.sentinels():
            loop.remove_reader(fd)
        for p in client.procs:
            p.join(0.2)
        reason = client.exit_reason()
        logger.error("%s; answering 503 for %.0fs, then stopping", reason, LOST_SCHEDULER_LINGER_S)
        state["ready"] = False
        state["lost"] = reason
        tm.fail_all(reason, 503)
        client.fail_controls(reason)
        loop.call_later(LOST_SCHEDULER_LINGER_S, on_fatal, reason)

    def refuse_if_lost() -> None:
        if state.get("lost"):
            raise APIError(503, f"the scheduler is gone: {state['lost']}")

    def refuse_if_unavailable() -> None:
        """503 while the server cannot take new work: its scheduler is gone, or it switches its
        role."""
        refuse_if_lost()
        switcher.refuse_if_switching()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        client.start_receiving()
        for fd in client.sentinels():  # any rank's exit ends the server
            loop.add_reader(fd, scheduler_exited)
        task = loop.create_task(warm_up())
        try:
            yield
        finally:
            task.cancel()
            if tm.tracing is not None:
                tm.tracing.shutdown()  # the spans still waiting
            for fd in client.sentinels():
                with contextlib.suppress(Exception):
                    loop.remove_reader(fd)

    app = FastAPI(
        title="pdserve",
        version=pdserve.__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    api_schema.install(app, tm)  # /openapi.json: bodies and answers of the routes below

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {exc!r}").response()

    async def control(op: str, **kw) -> Any:
        try:
            return await client.control(op, kw or None, timeout=CONTROL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise APIError(
                503, f"scheduler did not answer {op!r} within {CONTROL_TIMEOUT_S:.0f}s"
            ) from None

    # ---- generation ----------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        refuse_if_unavailable()
        return await generate_api.handle(request, tm)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        refuse_if_unavailable()
        return await openai_api.completions(request, tm)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        refuse_if_unavailable()
        return await openai_api.chat_completions(request, tm)

    responses = responses_api.ResponsesAPI(tm, args.responses_store_size)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        refuse_if_unavailable()
        return await responses.create(request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return responses.get(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return responses.delete(response_id)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        try:
            refuse_if_unavailable()
        except APIError as e:
            return messages_api.error_response(e)
        return await messages_api.create(request, tm)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await messages_api.count_tokens(request, tm)

    @app.post("/migrate")
    async def migrate(request: Request) -> Response:
        refuse_if_lost()
        return await migrate_api.migrate(request, tm)

    @app.post("/migrate_in")
    async def migrate_in(request: Request) -> Response:
        refuse_if_unavailable()
        return await migrate_api.migrate_in(request, tm)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await http_util.read_body(request, args.max_body_bytes, AbortRequest)
        if not body.rid and not body.abort_all:
            raise bad_request("give 'rid' or 'abort_all': true")
        return http_util.json_response({"aborted": tm.abort("" if body.abort_all else body.rid)})

    # ---- health and info -----------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        refuse_if_unavailable()
        if not state["ready"] or not client.is_alive():
            raise APIError(
                503, "server is starting" if client.is_alive() else "scheduler is not running"
            )
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        refuse_if_unavailable()
        try:
            await one_token(HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, APIError) as e:
            raise APIError(503, f"health generation failed: {e!r}") from None
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> Response:
        card = {
            "id": args.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "root": args.model_path,
            "max_model_len": tm.context_length,
        }
        cards = [card] + lora_api.model_cards(tm, card)
        return http_util.json_response({"object": "list", "data": cards})

    async def server_info() -> Response:
        info = args.to_dict()
        for secret in ("disaggregation_secret", "api_key"):
            if info.get(secret):
                info[secret] = "***"
        status = (
            "switching"
            if switcher.current
            else "failed"
            if switcher.broken
            else "ready"
            if state["ready"]
            else "starting"
        )
        info.update(
            status=status,
            version=pdserve.__version__,
            **role_switch.server_info_fields(switcher),
            scheduler_info=client.info,
            max_total_num_tokens=client.info.get("max_total_tokens"),
            model_context_length=tm.context_length,
            internal_states=[],
            calibration=state.get("calibration"),
            host_id=host_identity(),
        )
        with contextlib.suppress(APIError, RuntimeError):
            stats = await control("stats")
            info["internal_states"] = stats.get("dp") or [stats]  # one per DP group, as SGLang
        return http_util.json_response(info)

    def model_info() -> Response:
        keys = ("context_length", "vocab_size", "model_fingerprint", "eos_token_ids", "page_size")
        return http_util.json_response(
            {
                "model_path": args.model_path,
                "tokenizer_path": args.tokenizer_path,
                "is_generation": True,
                "served_model_name": args.served_model_name,
                **{k: client.info.get(k) for k in keys},
            }
        )

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, model_info, methods=["GET"])

    # ---- scheduler control ---------------------------------------------------------------
    @app.get("/get_load")
    async def get_load() -> Response:
        load = await control("get_load")
        keys = ("num_reqs", "num_waiting_reqs", "num_tokens", "num_shed_reqs")
        groups = load.get("dp") or [{"dp_rank": 0, **load}]  # one entry per DP group, as SGLang
        # a prefill's recent KV transfer speed, once it has moved some
        rate = "kv_transfer_bytes_per_s"
        queues = [
            k for k in QUEUE_KEYS if k in load
        ]  # a PD role's queues (the router's --autoscale reads them)
        return http_util.json_response(
            [
                {
                    "dp_rank": g["dp_rank"],
                    **{k: int(g.get(k, 0)) for k in keys},
                    **({rate: round(g[rate])} if g.get(rate) else {}),
                    **{k: int(g[k]) for k in queues},
                }
                for g in groups
            ]
        )

    @app.get("/kv_events/snapshot")
    async def kv_events_snapshot() -> Response:
        """What the radix cache holds, as BlockStored events per DP group, with the seq of the last
        published batch it reflects (a subscriber that lost events starts again from here)."""
        if not args.kv_events_endpoint:
            raise APIError(404, "KV events are off: start the server with --kv-events-endpoint")
        return http_util.json_response(await control("kv_events_snapshot"))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if not await control("flush_cache"):
            raise bad_request("cache not flushed: requests are running or waiting")
        return http_util.json_response({"success": True})

    role_switch.add_routes(app, tm, switcher, refuse_if_lost, lambda: state["ready"])

    # MoE expert load: SGLang's record endpoints, load metrics (--expert-distribution-recorder-mode)
    experts = expert_api.add_routes(app, args, control, tm.metrics.registry)
    lora_api.add_routes(app, tm, control)

    @app.get("/metrics")
    async def metrics() -> Response:
        with contextlib.suppress(APIError, RuntimeError):
            tm.metrics.set_scheduler_stats(await control("stats"))
        tm.metrics.relayed.set(sum(1 for st in tm.states.values() if st.relay is not None))
        with contextlib.suppress(APIError, RuntimeError):
            await experts.refresh_metrics()
        return Response(tm.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/integrity")
    async def integrity() -> Response:
        """The scheduler's pool accounting (tests use it to assert that nothing leaked)."""
        try:
            result = await control("integrity")
        except RuntimeError as e:
            return http_util.json_response({"ok": False, "error": str(e)}, status=500)
        return http_util.json_response(
            {"ok": True, "integrity": result, "front_end_requests": len(tm.states)}
        )

    if tm.tracing is not None:
        app.add_middleware(TraceContextMiddleware)
    if args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    return app
