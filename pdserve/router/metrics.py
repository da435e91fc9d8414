"""Prometheus metrics of one router (its own registry, so several routers can share a process)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.router import timeline
from pdserve.router.workers import WorkerPool

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_STAGE_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
)


class _WorkerCollector:
    """Per-worker gauges read from the pool at scrape time."""

    def __init__(self, pool: WorkerPool):
        self.pool = pool

    def collect(self):
        in_flight = GaugeMetricFamily(
            "pdserve_router_worker_in_flight",
            "requests in flight per worker",
            labels=["worker", "role"],
        )
        healthy = GaugeMetricFamily(
            "pdserve_router_worker_healthy",
            "1 if the worker passes health checks",
            labels=["worker", "role"],
        )
        breaker = GaugeMetricFamily(
            "pdserve_router_worker_circuit_open",
            "1 if the worker's breaker is not closed",
            labels=["worker", "role"],
        )
        for w in self.pool.workers:
            in_flight.add_metric([w.url, w.role], w.in_flight)
            healthy.add_metric([w.url, w.role], int(w.healthy))
            breaker.add_metric([w.url, w.role], int(w.breaker.state != "closed"))
        yield from (in_flight, healthy, breaker)


class _AdmissionCollector:
    """The admission bucket's decisions and queue (router/admission.py), read at scrape time."""

    def __init__(self, admission):
        self.admission = admission

    def collect(self):
        decisions = CounterMetricFamily(
            "pdserve_router_admission",
            "admission decisions: admitted, queued (then admitted or timed out), rejected (429), "
            "timed_out (408)",
            labels=["result"],
        )
        for result, n in self.admission.counts.items():
            decisions.add_metric([result], n)
        queued = GaugeMetricFamily(
            "pdserve_router_admission_queue_depth", "requests waiting for an admission token"
        )
        queued.add_metric([], self.admission.queued)
        yield from (decisions, queued)


class _IndexCollector:
    """Blocks in the router's KV index per worker, read at scrape time."""

    def __init__(self, index):
        self.index = index

    def collect(self):
        blocks = GaugeMetricFamily(
            "pdserve_router_kv_index_blocks",
            "KV blocks the router knows a worker holds",
            labels=["worker"],
        )
        for url, n in self.index.blocks().items():
            blocks.add_metric([url], n)
        yield blocks


class RouterMetrics:
    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, pool: WorkerPool):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve_router_requests",
            "requests answered, by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.shed = Counter(
            "pdserve_router_shed",
            "requests refused (429) because their estimated time to first token exceeded the SLO",
            ["endpoint"],
            registry=self.registry,
        )
        self.retries = Counter(
            "pdserve_router_retries",
            "retries on a new worker pair",
            ["endpoint"],
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            "pdserve_router_upstream_errors",
            "failed upstream requests",
            ["role"],
            registry=self.registry,
        )
        self.upstream_latency = Histogram(
            "pdserve_router_upstream_latency_seconds",
            "time from sending to a worker until its answer ended",
            ["role"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.stage_latency = Histogram(
            "pdserve_router_per_stage_req_latency_seconds",
            "time routed requests spent in each stage (router/timeline.py)",
            ["stage"],
            buckets=_STAGE_BUCKETS,
            registry=self.registry,
        )
        self.kv_event_batches = Counter(
            "pdserve_router_kv_event_batches",
            "KV event batches applied to the router's index, per worker",
            ["worker"],
            registry=self.registry,
        )
        self.kv_events_rejected = Counter(
            "pdserve_router_kv_events_rejected",
            "KV event batches (or snapshots) rejected, per worker and reason",
            ["worker", "reason"],
            registry=self.registry,
        )
        self.kv_index_resyncs = Counter(
            "pdserve_router_kv_index_resyncs",
            "KV index rebuilds from a snapshot "
            "(or gaps filled by replay: reason 'replayed'), per worker and reason",
            ["worker", "reason"],
            registry=self.registry,
        )
        self.cache_matched_tokens = Histogram(
            "pdserve_router_cache_matched_ratio",
            "share of the prompt the chosen worker holds (cache_aware)",
            ["role"],
            buckets=(0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1),
            registry=self.registry,
        )
        self.pd_decisions = Counter(
            "pdserve_router_pd_decisions",
            "where PD requests were prefilled (--pd-policy), by mode and reason",
            ["mode", "reason"],
            registry=self.registry,
        )
        self.pd_estimated_ttft = Histogram(
            "pdserve_router_pd_estimated_ttft_seconds",
            "estimated time to first token of the two ways (--pd-policy conditional)",
            ["path"],
            buckets=_STAGE_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_WorkerCollector(pool))

    def watch_index(self, index) -> None:
        self.registry.register(_IndexCollector(index))

    def watch_admission(self, admission) -> None:
        self.registry.register(_AdmissionCollector(admission))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestCounter:
    """ASGI middleware counting answered requests by route and status (a request whose client
    left before any answer counts as 499) and recording the router's timeline events: received,
    first and last body byte sent (the dispatcher adds ``dispatched``)."""

    def __init__(self, app, metrics: RouterMetrics, endpoints: set[str]):
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 499
        events = timeline.events_of(scope)
        events["received"] = time.time()

        async def counting_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body":
                if message.get("body"):
                    events.setdefault("first_byte", time.time())
                if not message.get("more_body", False):
                    events["last_byte"] = time.time()

        try:
            await self.app(scope, receive, counting_send)
        finally:
            path = scope.get("path", "")
            self.metrics.requests.labels(
                path if path in self.endpoints else "other", str(status)
            ).inc()
            if "dispatched" in events:  # a generation request that reached the workers
                for stage, seconds in timeline.stages(events):
                    self.metrics.stage_latency.labels(stage).observe(seconds)
