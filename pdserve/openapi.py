"""``/openapi.json`` for routes that read their JSON body themselves (servers and router).

FastAPI documents a body only for routes that declare one as a parameter; pdserve's routes read
raw bytes and decode them with msgspec (cheaper than a pydantic round trip per request), so
FastAPI sees no body. ``install`` fills each operation from an ``Operation``: the request body is
the JSON Schema of the very msgspec type the route decodes with (``msgspec.json.schema``), plus
what that type declares for the checks it does by hand (``REQUIRED``: fields that must be
present, ``JSON_SCHEMA``: constraints across fields); the answers are the schemas of the response
types. A streamed answer (``"stream": true``) is ``text/event-stream``, described the OpenAPI 3.2
way by ``itemSchema`` (one event: its ``data`` is JSON, a chunk or an error object, as
``contentSchema`` says; the last is ``data: [DONE]``).
The document is built on the first request for it, never on the request path of other routes.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Optional

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

REF = "#/components/schemas/{name}"
OPENAPI_VERSION = "3.2.0"  # for itemSchema, which describes each event of a stream
SSE_DESCRIPTION = (
    'with "stream": true: server-sent events, each `data: <JSON>` (the itemSchema\'s '
    "contentSchema), then `data: [DONE]`"
)
STATUS_TEXT = {
    400: "invalid request (the message names the field)",
    401: "missing or wrong API key",
    403: "not allowed (the message names what and the flag that would allow it)",
    404: "not found (e.g. an unknown model name)",
    413: "request body too large",
    499: "the client went away",
    500: "internal error",
    502: "a worker failed",
    503: "not ready, or the scheduler is gone",
}


@dataclasses.dataclass(frozen=True)
class Operation:
    """One route's documentation. ``body``: the type its JSON body is decoded into (None: no
    body); ``response``: the type of its 200 answer (None: an empty 200); ``stream``: the type of
    each event when the request asks to stream; ``errors``: statuses answered with the error
    object."""

    summary: str
    body: Any = None
    response: Any = None
    stream: Any = None
    media_type: str = "application/json"
    errors: tuple[int, ...] = (400,)
    offered: bool = True
    error: Any = None  # the type of its error object (None: the document's)


Docs = dict[tuple[str, str], Operation]  # (method in lower case, path) -> its documentation


def build(
    app: FastAPI, docs: Docs, error: type, extra_components: Optional[dict[str, dict]] = None
) -> dict:
    """The OpenAPI 3.2 document of ``app`` with ``docs`` applied."""
    spec = get_openapi(
        title=app.title,
        version=app.version,
        openapi_version=OPENAPI_VERSION,
        description=app.description,
        routes=app.routes,
    )
    types: list[Any] = [error]
    for op in docs.values():
        types += [t for t in (op.body, op.response, op.stream, op.error) if t is not None]
    inline, components = msgspec.json.schema_components(types, ref_template=REF)
    schema_of = dict(zip(map(_key, types), inline))
    for t in types:  # what a body type declares for its hand-written checks
        if isinstance(t, type) and t.__name__ in components:
            component = components[t.__name__]
            required = getattr(t, "REQUIRED", ())
            if required:
                component["required"] = sorted({*component.get("required", ()), *required})
                for name in required:  # a field that must be given has no default
                    component["properties"][name].pop("default", None)
            extra = dict(getattr(t, "JSON_SCHEMA", None) or {})
            for name, rule in extra.pop("properties", {}).items():  # added to the field's own
                component["properties"][name] = {**component["properties"][name], **rule}
            component.update(extra)
    components.update(extra_components or {})
    spec.setdefault("components", {})["schemas"] = {
        **spec.get("components", {}).get("schemas", {}),
        **components,
    }
    error_content = {"application/json": {"schema": schema_of[_key(error)]}}
    paths = spec.get("paths", {})
    for (method, path), op in docs.items():
        if not op.offered and method in paths.get(path, {}):
            del paths[path][method]
            if not paths[path]:
                del paths[path]
    for path, methods in paths.items():
        for method, operation in methods.items():
            # unique, and stable for client generators (FastAPI repeats one id for each method of a
            # route)
            operation["operationId"] = method + re.sub(r"[^A-Za-z0-9]+", "_", path).rstrip("_")
            op = docs.get((method, path))
            if op is not None:
                _apply(operation, op, schema_of, error_content)
    return spec


def install(
    app: FastAPI,
    docs: Callable[[], Docs],
    error: type,
    extra_components: Optional[Callable[[], dict[str, dict]]] = None,
) -> None:
    """Serve ``build``'s document as ``app.openapi()`` (so at /openapi.json), built once (again
    after ``app.openapi_schema = None``: a server whose role changed)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build(
                app, docs(), error, extra_components() if extra_components else None
            )
        return app.openapi_schema

    app.openapi = openapi


def _apply(operation: dict, op: Operation, schema_of: dict, error_content: dict) -> None:
    operation["summary"] = op.summary
    if op.error is not None:
        error_content = {"application/json": {"schema": schema_of[_key(op.error)]}}
    if op.body is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": schema_of[_key(op.body)]}},
        }
    ok: dict[str, Any] = {"description": "success"}
    if op.media_type != "application/json":
        ok["content"] = {op.media_type: {"schema": {"type": "string"}}}
    elif op.response is not None:
        ok["content"] = {"application/json": {"schema": schema_of[_key(op.response)]}}
    else:
        ok["description"] = "success (empty body)"
    if op.stream is not None:
        ok["description"] = "the answer; " + SSE_DESCRIPTION
        data = {"oneOf": [schema_of[_key(op.stream)], error_content["application/json"]["schema"]]}
        ok.setdefault("content", {})["text/event-stream"] = {"itemSchema": sse_event_schema(data)}
    responses = {"200": ok}
    for status in op.errors:
        responses[str(status)] = {
            "description": STATUS_TEXT.get(status, "error"),
            "content": error_content,
        }
    operation["responses"] = responses


def sse_event_schema(data: dict) -> dict:
    """One server-sent event whose ``data`` is JSON described by ``data``, or the closing
    ``[DONE]``."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"type": "string"},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer", "minimum": 0},
        },
        "anyOf": [
            {"properties": {"data": {"const": "[DONE]"}}},
            {
                "properties": {
                    "data": {"contentMediaType": "application/json", "contentSchema": data}
                }
            },
        ],
    }


def _key(t: Any) -> str:
    """A hashable name for a type or a typing construct (Union[...], list[...])."""
    return repr(t)
