"""HTTP errors of the front end: one exception type, one JSON shape.

Every error answer, native or OpenAI, is ``{"error": {"message", "type", "code"}}`` with the
HTTP status in ``code``; in a stream it is one ``data: {"error": ...}`` event followed by
``data: [DONE]``.
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec
from starlette.responses import Response

_TYPES = {
    400: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "internal_error",
    503: "service_unavailable",
}


# seconds a client refused with 429 (a full queue, engine/admission.py) is told to wait
RETRY_AFTER_S = 1


class APIError(Exception):
    """A request that cannot be served; ``status`` is the HTTP status that reflects the cause.
    A 429 tells the client when to retry (``Retry-After``)."""

    def __init__(self, status: int, message: str, type_: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or _TYPES.get(
            status, "internal_error" if status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.status}}

    def response(self) -> Response:
        return Response(
            msgspec.json.encode(self.body()),
            status_code=self.status,
            media_type="application/json",
            headers={"Retry-After": str(RETRY_AFTER_S)} if self.status == 429 else None,
        )

    def sse(self) -> bytes:
        return b"data: " + msgspec.json.encode(self.body()) + b"\n\ndata: [DONE]\n\n"


def bad_request(message: str) -> APIError:
    return APIError(400, message)


def from_abort(finish_reason: dict[str, Any]) -> Optional[APIError]:
    """The error an abort finish reason stands for, or None for a plain abort (no status)."""
    if finish_reason.get("type") != "abort" or not finish_reason.get("status_code"):
        return None
    return APIError(
        int(finish_reason["status_code"]), str(finish_reason.get("message") or "request aborted")
    )
