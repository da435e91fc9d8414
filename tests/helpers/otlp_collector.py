"""An OTLP/HTTP trace receiver for tests: ``POST /v1/traces`` with a protobuf
``ExportTraceServiceRequest`` (what OpenTelemetry's OTLP/HTTP exporter sends), decoded with the
OpenTelemetry protocol's own messages and kept as plain span records."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.helpers.ports import free_port


class Collector:
    def __init__(self):
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self.spans: list[dict] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                req = trace_service_pb2.ExportTraceServiceRequest()
                req.ParseFromString(body)
                collector._keep(req)
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def _keep(self, req) -> None:
        records = []
        for rs in req.resource_spans:
            service = next(
                (a.value.string_value for a in rs.resource.attributes if a.key == "service.name"),
                None,
            )
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs = {}
                    for a in s.attributes:
                        v = a.value
                        attrs[a.key] = (
                            getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None
                        )
                    records.append(
                        {
                            "service": service,
                            "name": s.name,
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent_span_id": s.parent_span_id.hex(),
                            "start": s.start_time_unix_nano / 1e9,
                            "end": s.end_time_unix_nano / 1e9,
                            "attributes": attrs,
                        }
                    )
        with self.lock:
            self.spans += records

    def trace(self, trace_id: str, names: set[str], timeout: float = 30.0) -> list[dict]:
        """The spans of ``trace_id`` once every name of ``names`` arrived."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = [s for s in self.spans if s["trace_id"] == trace_id]
            if names <= {s["name"] for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
