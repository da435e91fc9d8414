"""LoRA adapters through the router: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(and SGLang's paths without ``/v1``) go to every worker, prefill and decode alike, since a PD
request needs its adapter on both sides. A load that some workers refuse is undone on those that
took it, and the refusal is answered (the workers' own 4xx when they all refused alike)."""

from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.router.dispatch import error_response
from pdserve.router.protocol import BadRequest

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
PATHS = {LOAD: LOAD, "/load_lora_adapter": LOAD, UNLOAD: UNLOAD, "/unload_lora_adapter": UNLOAD}


def add_routes(app: FastAPI, router, read: Callable[[Request], Awaitable[bytes]]) -> None:
    """``read``: the request's body within the router's size limit (BadRequest otherwise)."""

    async def post_all(workers, path: str, raw: bytes):
        async def one(w):
            try:
                return w, await router.pool.client.post(
                    w.url + path, content=raw, headers={"content-type": "application/json"}
                )
            except httpx.HTTPError as e:
                return w, e

        return await asyncio.gather(*(one(w) for w in workers))

    async def change(request: Request) -> Response:
        try:
            raw = await read(request)
        except BadRequest as e:
            return error_response(e.status, str(e))
        path = PATHS[request.url.path]
        workers = router.pool.workers
        if not workers:
            return error_response(503, "no worker to load or unload the adapter on")
        results = await post_all(workers, path, raw)
        done = [w for w, r in results if isinstance(r, httpx.Response) and r.status_code == 200]
        failed = [(w, r) for w, r in results if w not in done]
        if not failed:
            return JSONResponse({"success": True, "workers": [w.url for w in done]})
        if path == LOAD and done:  # not loaded anywhere rather than on some
            try:
                name = json.loads(raw).get("lora_name")
            except ValueError:
                name = None
            undo = json.dumps({"lora_name": name}).encode()
            await post_all(done, UNLOAD, undo)
            done = []
        statuses = {r.status_code for _, r in failed if isinstance(r, httpx.Response)}
        if len(failed) == len(results) and len(statuses) == 1 and statuses.pop() < 500:
            first = failed[0][1]  # every worker refused alike: their answer
            return Response(
                first.content,
                status_code=first.status_code,
                media_type=first.headers.get("content-type"),
            )
        return JSONResponse(
            {
                "success": False,
                "workers": [w.url for w in done],
                "failed": [
                    {
                        "url": w.url,
                        "error": repr(r) if isinstance(r, Exception) else r.text[:500],
                    }
                    for w, r in failed
                ],
            },
            status_code=502,
        )

    for path in PATHS:
        app.add_api_route(path, change, methods=["POST"])
