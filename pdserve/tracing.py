"""OpenTelemetry traces over OTLP/HTTP (``--otlp-traces-endpoint URL``, servers and router).

A request's W3C ``traceparent`` header makes its spans children of the caller's. The router
opens a ``router`` span for the whole answer (to a stream's last byte) and sends its own
``traceparent`` on both legs; each server, when the request finishes, records one span for its
part (``prefill``, ``decode`` or ``generate``, from receipt to finish) with a child span per stage
of its timeline (``server/timeline.py``: ``prefill_forward``, ``prefill_transfer``,
``decode_transfer``, ``decode_generate``, ...), timed by the events the scheduler recorded. So one
PD request is one trace: router, prefill with its forward and KV transfer, decode with its wait
for the KV and its generation. Spans leave in batches on a background thread
(``BatchSpanProcessor``), to ``URL/v1/traces`` unless the URL already names that path.

The OpenTelemetry SDK and its OTLP/HTTP exporter are optional (``pip install
'pdserve[tracing]'``); the flag without them is a start-up error that names them.
"""

from __future__ import annotations

import contextvars
from typing import Any, Iterable, Mapping, Optional

TRACEPARENT = "traceparent"
PACKAGES = "opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http"
EXPORT_DELAY_MS = 500  # how long a finished span may wait to leave with others

# the caller's traceparent for the request being handled (set by TraceContextMiddleware)
_incoming: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
    "pdserve_traceparent", default=None
)


def incoming() -> Optional[str]:
    """The ``traceparent`` of the HTTP request being handled, if it sent one."""
    return _incoming.get()


def traces_url(endpoint: str) -> str:
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def check_installed() -> None:
    """ValueError naming the packages when the SDK or its exporter is missing."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        raise ValueError(
            f"otlp_traces_endpoint: needs {PACKAGES} (pip install 'pdserve[tracing]'): {e}"
        ) from None


class TraceContextMiddleware:
    """Pure ASGI: keeps the request's ``traceparent`` where ``incoming()`` reads it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            for name, value in scope.get("headers") or ():
                if name == b"traceparent":
                    token = _incoming.set(value.decode("latin-1"))
                    try:
                        return await self.app(scope, receive, send)
                    finally:
                        _incoming.reset(token)
        await self.app(scope, receive, send)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class LiveSpan:
    """A span still open (the router's): ``traceparent`` to send downstream, then ``end``."""

    def __init__(self, span, propagator):
        self.span = span
        carrier: dict[str, str] = {}
        from opentelemetry import trace

        propagator.inject(carrier, context=trace.set_span_in_context(span))
        self.traceparent = carrier.get(TRACEPARENT)

    def end(self, **attributes: Any) -> None:
        self.span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        self.span.end()


class Tracing:
    def __init__(self, endpoint: str, service: str):
        check_installed()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self.provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=traces_url(endpoint)),
                schedule_delay_millis=EXPORT_DELAY_MS,
            )
        )
        self.tracer = self.provider.get_tracer("pdserve")
        self.propagator = TraceContextTextMapPropagator()

    def _parent(self, traceparent: Optional[str]):
        return self.propagator.extract({TRACEPARENT: traceparent}) if traceparent else None

    def start(self, name: str, traceparent: Optional[str], **attributes: Any) -> LiveSpan:
        from opentelemetry.trace import SpanKind

        span = self.tracer.start_span(
            name,
            context=self._parent(traceparent),
            kind=SpanKind.SERVER,
            attributes={k: v for k, v in attributes.items() if v is not None},
        )
        return LiveSpan(span, self.propagator)

    def record(
        self,
        name: str,
        traceparent: Optional[str],
        start: float,
        end: float,
        attributes: Mapping[str, Any],
        children: Iterable[tuple[str, float, float]],
    ) -> None:
        """A finished span from ``start`` to ``end`` (``time.time()`` seconds) and its children
        ``(name, start, end)``."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        span = self.tracer.start_span(
            name,
            context=self._parent(traceparent),
            kind=SpanKind.SERVER,
            start_time=_ns(start),
            attributes={k: v for k, v in attributes.items() if v is not None},
        )
        inside = trace.set_span_in_context(span)
        for child, a, b in children:
            self.tracer.start_span(child, context=inside, start_time=_ns(a)).end(end_time=_ns(b))
        span.end(end_time=_ns(end))

    def shutdown(self) -> None:
        """Send what is left (at exit)."""
        self.provider.shutdown()
