"""LoRA adapters at run time (vLLM's and SGLang's routes): ``POST /v1/load_lora_adapter`` and
``/load_lora_adapter`` (``{"lora_name", "lora_path"}``), ``POST /v1/unload_lora_adapter`` and
``/unload_lora_adapter`` (``{"lora_name"}``). Every scheduler rank loads the adapter (its share
of it) before the front end serves its name; an adapter is unloaded only once no request queued
or running here uses it (400 naming how many do)."""

from __future__ import annotations

from typing import Annotated, Any, Awaitable, Callable

import msgspec
from fastapi import FastAPI, Request, Response

from pdserve.openapi import Operation
from pdserve.server import http_util
from pdserve.server.errors import APIError, bad_request
from pdserve.server.tokenizer_manager import TokenizerManager

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class LoadLoraBody(msgspec.Struct, forbid_unknown_fields=False):
    lora_name: Name
    lora_path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


class UnloadLoraBody(msgspec.Struct, forbid_unknown_fields=False):
    lora_name: Name


class LoraAdapters(msgspec.Struct):
    success: bool
    adapters: list[dict[str, Any]]


LOAD_PATHS = ("/v1/load_lora_adapter", "/load_lora_adapter")
UNLOAD_PATHS = ("/v1/unload_lora_adapter", "/unload_lora_adapter")


def add_routes(app: FastAPI, tm: TokenizerManager, control: Callable[..., Awaitable[Any]]) -> None:
    args = tm.server_args

    async def call(op: str, **kw) -> dict:
        if not args.enable_lora:
            raise bad_request("this server serves no LoRA adapters (start it with --enable-lora)")
        try:
            return await control(op, **kw)
        except RuntimeError as e:  # the scheduler's ValueError names the caller's mistake
            text = str(e)
            if text.startswith("ValueError: "):
                raise bad_request(text[len("ValueError: ") :]) from None
            raise APIError(500, f"{op}: {text}") from None

    async def load(request: Request) -> Response:
        body = await http_util.read_body(request, args.max_body_bytes, LoadLoraBody)
        if body.lora_name == args.served_model_name:
            raise bad_request(f"lora_name: {body.lora_name!r} is the base model's name")
        out = await call("load_lora", lora_name=body.lora_name, lora_path=body.lora_path)
        tm.adapters[body.lora_name] = body.lora_path
        return http_util.json_response({"success": True, **out})

    async def unload(request: Request) -> Response:
        body = await http_util.read_body(request, args.max_body_bytes, UnloadLoraBody)
        # refused from now on here, so that none arrives between the check and the unload
        path = tm.adapters.pop(body.lora_name, None)
        try:
            out = await call("unload_lora", lora_name=body.lora_name)
        except APIError:
            if path is not None:
                tm.adapters[body.lora_name] = path
            raise
        return http_util.json_response({"success": True, **out})

    for path in LOAD_PATHS:
        app.add_api_route(path, load, methods=["POST"])
    for path in UNLOAD_PATHS:
        app.add_api_route(path, unload, methods=["POST"])


def docs(args) -> dict[tuple[str, str], Operation]:
    routes = (
        (LOAD_PATHS, "Load a LoRA adapter (a PEFT directory) under a name", LoadLoraBody),
        (UNLOAD_PATHS, "Unload a LoRA adapter no queued or running request uses", UnloadLoraBody),
    )
    return {
        ("post", path): Operation(summary, body, LoraAdapters, offered=args.enable_lora)
        for paths, summary, body in routes
        for path in paths
    }


def model_cards(tm: TokenizerManager, base: dict) -> list[dict]:
    """``/v1/models``' entries of the adapters, after the base model's (vLLM's shape)."""
    return [
        {**base, "id": name, "root": path, "parent": base["id"]}
        for name, path in sorted(tm.adapters.items())
    ]
