"""OpenAI-style API keys on the HTTP front ends (``pdserve serve`` and ``pdserve router``).

With ``--api-key KEY`` every request must carry ``Authorization: Bearer KEY`` (or, as
Anthropic's clients send it, ``x-api-key: KEY``), except
``/health`` (load balancers and orchestrators probe it without credentials) and ``/metrics``
(Prometheus scrapes it; it holds counters, no request content). This follows SGLang, whose
``--api-key`` guards every route but the health and metrics ones; vLLM guards only ``/v1``.
A request without the key, or with another, gets 401 with an OpenAI error object. The key is
compared in constant time.
"""

from __future__ import annotations

import hmac
import json

OPEN_PATHS = frozenset({"/health", "/metrics"})


def bearer(key: str | None) -> dict[str, str]:
    """The header that presents ``key`` (none without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def _presented_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key of ``Authorization: Bearer KEY``, or of ``x-api-key: KEY`` (Anthropic's clients)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    for name, value in headers:
        if name.lower() == b"x-api-key":
            return value.strip()
    return None


class APIKeyMiddleware:
    """ASGI middleware: refuse HTTP requests that do not present the key. Pure ASGI, so streamed
    responses and disconnect detection pass through untouched."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        presented = _presented_key(scope.get("headers") or [])
        if presented is not None and hmac.compare_digest(presented, self.key):
            return await self.app(scope, receive, send)
        message = (
            "missing API key: send it as 'Authorization: Bearer <key>'"
            if presented is None
            else "incorrect API key provided"
        )
        body = json.dumps(
            {"error": {"message": message, "type": "invalid_request_error", "code": 401}}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
