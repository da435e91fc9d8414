"""The worker API: ``GET/POST /workers``, ``GET/DELETE /workers/{worker_id}``, in the wire shape
of sglang-router 0.3.2 (``docs/architecture.md``, "Workers at run time"), so scripts written
for it work here. Guarded by the router's ``--api-key`` like every route but /health and
/metrics.

Where pdserve differs, it is stricter or says more: a worker is checked before the answer (202
means it is in the pool and takes requests, where sglang-router queues a job and answers 202
whatever the outcome), bad input is a 4xx naming the problem, ``DELETE`` drains, and the
worker objects carry pdserve's extra fields (``draining``, ``in_flight``, ``dp_size``, ...).
sglang-router's other request fields (priority, cost, labels, ...) are accepted and ignored.
"""

from __future__ import annotations

import urllib.parse
from typing import Literal, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from pdserve.router.membership import WORKER_TYPES, Membership, MembershipError
from pdserve.router.workers import PREFILL, Worker, WorkerPool


class WorkerConfigRequest(BaseModel):
    """``POST /workers``. Fields of sglang-router's request that pdserve does not use (priority,
    cost, labels, model_id, tokenizer_path, ...) are accepted and listed in ``ignored_fields``."""

    model_config = ConfigDict(extra="allow")
    url: str = Field(description="the worker's base URL, http(s)://HOST:PORT")
    worker_type: Optional[Literal["prefill", "decode", "regular"]] = Field(
        None, description="default: the role the server reports (its disaggregation_mode)"
    )
    bootstrap_port: Optional[int] = Field(
        None, ge=1, le=65535, description="a prefill's bootstrap port; default: the one it reports"
    )
    api_key: Optional[str] = Field(
        None, description="must be the router's --worker-api-key when given"
    )


class WorkerMetadata(BaseModel):
    model_config = ConfigDict(extra="allow")


class WorkerInfo(BaseModel):
    """One worker, as sglang-router lists it, plus pdserve's fields."""

    id: str
    url: str
    model_id: str
    priority: int = 50
    cost: float = 1.0
    worker_type: Literal["prefill", "decode", "regular"]
    is_healthy: bool
    load: int = Field(description="requests in hand: its last polled load plus what was sent since")
    connection_mode: str = "HTTP"
    bootstrap_port: Optional[int] = None
    metadata: dict[str, str] = Field(
        default_factory=dict, description="what its /server_info reports, as strings"
    )
    disable_health_check: bool = False
    # pdserve
    draining: bool = Field(False, description="being removed: takes no new request")
    drain_reason: Optional[str] = None
    in_flight: int = Field(0, description="requests this router has open on it")
    requests: int = Field(0, description="requests this router sent it")
    dp_size: int = 1
    transfer_backend: Optional[str] = None
    source: str = Field(description="how it joined: command line, api or dns NAME")
    circuit: str = "closed"


class WorkerStats(BaseModel):
    prefill_count: int
    decode_count: int
    regular_count: int


class WorkerListResponse(BaseModel):
    workers: list[WorkerInfo]
    total: int
    stats: WorkerStats


class WorkerAccepted(BaseModel):
    status: str = "accepted"
    worker_id: str
    url: Optional[str] = None
    location: Optional[str] = None
    message: str
    worker: Optional[WorkerInfo] = Field(None, description="the worker as added (POST only)")
    ignored_fields: list[str] = Field(default_factory=list)


class WorkerError(BaseModel):
    error: str
    code: str


def error(status: int, message: str, code: str = "BAD_REQUEST") -> JSONResponse:
    return JSONResponse({"error": message, "code": code}, status_code=status)


def describe(worker: Worker) -> WorkerInfo:
    info = worker.info or {}
    keys = (
        "dp_size",
        "tp_size",
        "model_path",
        "disaggregation_mode",
        "served_model_name",
        "disaggregation_transfer_backend",
    )
    backend = info.get("disaggregation_transfer_backend")
    return WorkerInfo(
        id=worker.id,
        url=worker.url,
        model_id=str(info.get("served_model_name") or info.get("model_path") or "unknown"),
        worker_type=WORKER_TYPES[worker.role],
        is_healthy=worker.healthy,
        load=worker.load_estimate()[0],
        bootstrap_port=worker.bootstrap_port if worker.role == PREFILL else None,
        metadata={k: str(info[k]) for k in keys if k in info},
        draining=worker.draining is not None,
        drain_reason=worker.draining,
        in_flight=worker.in_flight,
        requests=worker.dispatched,
        dp_size=worker.dp_size or _positive_int(info.get("dp_size")),
        transfer_backend=backend if isinstance(backend, str) else None,
        source=worker.source,
        circuit=worker.breaker.state,
    )


def _positive_int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _find(pool: WorkerPool, worker_id: str) -> Worker | None:
    """By id, or by URL (percent-encoded or not), which sglang-router does not take."""
    key = urllib.parse.unquote(worker_id).rstrip("/")
    return next((w for w in pool.workers if key in (w.id, w.url)), None)


def add_routes(
    app: FastAPI, pool: WorkerPool, membership: Membership, worker_api_key: str | None
) -> None:
    responses = {
        400: {"model": WorkerError},
        404: {"model": WorkerError},
        409: {"model": WorkerError},
    }

    @app.exception_handler(RequestValidationError)
    async def bad_body(_request: Request, exc: RequestValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}"
            for e in exc.errors()
        )
        return error(400, problems)

    @app.get("/workers", response_model=WorkerListResponse, tags=["workers"])
    async def list_workers() -> WorkerListResponse:
        workers = [describe(w) for w in pool.workers]
        counts = {
            t: sum(w.worker_type == t for w in workers) for t in ("prefill", "decode", "regular")
        }
        return WorkerListResponse(
            workers=workers,
            total=len(workers),
            stats=WorkerStats(**{f"{t}_count": n for t, n in counts.items()}),
        )

    @app.get(
        "/workers/{worker_id:path}",
        response_model=WorkerInfo,
        responses=responses,
        tags=["workers"],
    )
    async def get_worker(worker_id: str):
        worker = _find(pool, worker_id)
        if worker is None:
            return error(404, f"Worker {worker_id} not found", "WORKER_NOT_FOUND")
        return describe(worker)

    @app.post(
        "/workers",
        status_code=202,
        response_model=WorkerAccepted,
        responses=responses,
        tags=["workers"],
    )
    async def create_worker(spec: WorkerConfigRequest):
        """Check the worker (health, server info, role, bootstrap port, pairing) and add it; 202
        once it takes requests."""
        if spec.api_key is not None and spec.api_key != worker_api_key:
            return error(
                400,
                "api_key: the router presents its --worker-api-key to every worker; a "
                "per-worker key is not supported",
            )
        try:
            worker = await membership.add(
                spec.url, spec.worker_type, spec.bootstrap_port, source="api"
            )
        except MembershipError as e:
            return error(e.status, str(e), e.code)
        return JSONResponse(
            WorkerAccepted(
                worker_id=worker.id,
                url=worker.url,
                location=f"/workers/{worker.id}",
                message=f"{WORKER_TYPES[worker.role]} worker added: healthy, paired, "
                "taking requests",
                worker=describe(worker),
                ignored_fields=sorted(spec.model_extra or {}),
            ).model_dump(),
            status_code=202,
        )

    @app.delete(
        "/workers/{worker_id:path}",
        status_code=202,
        response_model=WorkerAccepted,
        responses=responses,
        tags=["workers"],
    )
    async def delete_worker(worker_id: str):
        """Drain the worker: no new request goes to it, what it runs finishes (up to
        --drain-timeout), then it is forgotten (GET /workers/{id} answers 404)."""
        worker = _find(pool, worker_id)
        if worker is None:
            return error(404, f"Worker {worker_id} not found", "WORKER_NOT_FOUND")
        membership.remove(worker, "removed through DELETE /workers")
        return JSONResponse(
            WorkerAccepted(
                worker_id=worker.id,
                url=worker.url,
                location=f"/workers/{worker.id}",
                message=f"draining: {worker.in_flight} request(s) in flight finish first",
            ).model_dump(),
            status_code=202,
        )
