"""Prometheus metrics of one server (names follow SGLang's, with the ``pdserve:`` prefix).

Latencies and token counters are measured in the front end as outputs arrive; scheduler state
(running/waiting requests, KV pages) is read from the scheduler's ``stats`` at scrape time.
Each server owns its registry, so several apps can live in one process (tests).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
# tokens per speculative step (1 + accepted drafts), up to 1 + the most drafts
_ACCEPT_BUCKETS = (
    0.25,
    0.5,
    0.75,
    1.0,
    1.25,
    1.5,
    1.75,
    2.0,
    2.5,
    3.0,
    4.0,
    5.0,
    6.0,
    8.0,
    12.0,
    17.0,
)
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
# gauge -> key of the scheduler's stats; the PD queues exist on prefill (bootstrap, inflight) or
# decode (prealloc, transfer) servers only and stay 0 elsewhere
_QUEUE_GAUGES = (
    (
        "pdserve:num_prefill_bootstrap_queue_reqs",
        "bootstrap_queue",
        "Prefill: requests waiting for decode's KV pages",
    ),
    (
        "pdserve:num_prefill_inflight_queue_reqs",
        "inflight_queue",
        "Prefill: prefilled requests whose KV is being sent",
    ),
    (
        "pdserve:num_decode_prealloc_queue_reqs",
        "prealloc_queue",
        "Decode: requests waiting for KV pages or prefill",
    ),
    (
        "pdserve:num_decode_transfer_queue_reqs",
        "transfer_queue",
        "Decode: requests whose KV is on its way",
    ),
)


# the scheduler's stats of requests that wait to run (pdserve:num_queue_reqs)
QUEUED_KEYS = ("waiting", "bootstrap_queue", "prealloc_queue", "transfer_queue")

_HICACHE_COUNTERS = (
    ("hits", "Prompt pages loaded from a tier below the pool"),
    ("hit_tokens", "Prompt tokens loaded from a tier below the pool"),
    ("writes", "Pages written into a tier below the pool"),
    ("write_drops", "Pages not written to storage because its write queue was full"),
    ("write_failures", "Pages the storage backend failed to write"),
    ("corrupt", "Tier entries that failed their checksum or layout check (dropped)"),
)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(
                name, doc, labelnames=list(labels), buckets=buckets, registry=r
            ).labels(**labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labelnames=list(labels), registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labelnames=list(labels), registry=r).labels(**labels)

        self.ttft = hist(
            "pdserve:time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS
        )
        self.itl = hist(
            "pdserve:inter_token_latency_seconds", "Time between output tokens", _ITL_BUCKETS
        )
        self.e2e = hist(
            "pdserve:e2e_request_latency_seconds", "End-to-end request latency", _LATENCY_BUCKETS
        )
        self.prompt_tokens = counter("pdserve:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("pdserve:generation_tokens", "Generated tokens")
        self.cached_tokens = counter(
            "pdserve:cached_tokens", "Prompt tokens served from the prefix cache"
        )
        self.requests = Counter(
            "pdserve:requests",
            "Finished requests by finish reason (shed: refused or shed by a full queue, 429)",
            labelnames=["model_name", "finish_reason"],
            registry=r,
        )
        self._model_name = model_name
        self.running = gauge("pdserve:num_running_reqs", "Requests in the running batch")
        self.waiting = gauge("pdserve:num_waiting_reqs", "Requests waiting to be scheduled")
        self.relayed = gauge(
            "pdserve:num_relayed_reqs",
            "Requests moved to another decode (POST /migrate) whose streams this server relays",
        )
        self.kv_pages_used = gauge(
            "pdserve:kv_pages_used", "KV cache pages in use (requests + prefix cache)"
        )
        self.kv_pages_free = gauge("pdserve:kv_pages_free", "Free KV cache pages")
        # what gateway schedulers read (the Gateway API Inference Extension's model server
        # protocol: TotalQueuedRequests and KVCacheUtilization; SGLang's and vLLM's meaning)
        self.queued = gauge(
            "pdserve:num_queue_reqs",
            "Requests queued before running: waiting, and on PD servers the bootstrap, "
            "prealloc and transfer queues",
        )
        self.kv_usage = gauge(
            "pdserve:kv_cache_usage_perc",
            "KV cache pages held by requests over all pages (0-1; the prefix cache's evictable "
            "pages count as free)",
        )
        # vLLM's LoRA gauge as gateway schedulers read it: the adapters of running and waiting
        # requests in its labels, the time they were read as its value
        self.lora_info = Gauge(
            "pdserve:lora_requests_info",
            "LoRA adapters of the running and waiting requests (value: when read, Unix seconds)",
            labelnames=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=r,
        )
        self.cache_hit_rate = gauge(
            "pdserve:cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens"
        )
        self.stage_latency = Histogram(
            "pdserve:per_stage_req_latency_seconds",
            "Time requests spent in each stage (server/timeline.py)",
            labelnames=["model_name", "stage"],
            buckets=_STAGE_BUCKETS,
            registry=r,
        )
        self.queues = [(gauge(name, doc), key) for name, key, doc in _QUEUE_GAUGES]
        self.kv_bytes_sent = counter(
            "pdserve:kv_transfer_bytes", "KV cache bytes this prefill wrote to decodes"
        )
        self.spec_accept_length = hist(
            "pdserve:spec_accept_length",
            "Speculative decoding: tokens per verify step of a finished request (1 + accepted "
            "drafts)",
            _ACCEPT_BUCKETS,
        )
        self.spec_accept_rate = hist(
            "pdserve:spec_accept_rate",
            "Speculative decoding: accepted drafts / verify steps of a finished request",
            _ACCEPT_BUCKETS,
        )
        # the tiers below the pool (engine/kv_tier): running totals in the scheduler's stats
        # (``hicache_<what>_<medium>``), by medium
        self.hicache = {
            what: Counter(
                f"pdserve:hicache_{what}",
                doc,
                labelnames=["model_name", "medium"],
                registry=r,
            )
            for what, doc in _HICACHE_COUNTERS
        }
        self.hicache_entries = Gauge(
            "pdserve:hicache_entries",
            "Pages held by a tier below the pool",
            labelnames=["model_name", "medium"],
            registry=r,
        )
        self._hicache_seen: dict[str, int] = {}
        self._prompt_total = 0
        self._cached_total = 0
        self._kv_bytes_seen = 0

    def on_tokens(self, n: int, since_last: float, first: bool) -> None:
        """``n`` new output tokens arrived, ``since_last`` seconds after the previous output
        (after arrival for the first one)."""
        if first:
            self.ttft.observe(since_last)
        elif n:
            self.itl.observe(since_last / n)
        self.generation_tokens.inc(n)

    def on_speculation(self, verify_steps: int, accepted: int) -> None:
        """A finished request's speculation: its tokens per step, accepted drafts per step."""
        self.spec_accept_length.observe((verify_steps + accepted) / verify_steps)
        self.spec_accept_rate.observe(accepted / verify_steps)

    def on_finish(
        self, finish_type: str, prompt_tokens: int, cached_tokens: int, e2e: float
    ) -> None:
        self.e2e.observe(e2e)
        self.requests.labels(model_name=self._model_name, finish_reason=finish_type).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self._prompt_total += prompt_tokens
        self._cached_total += cached_tokens
        self.cache_hit_rate.set(
            self._cached_total / self._prompt_total if self._prompt_total else 0.0
        )

    def on_stages(self, stages) -> None:
        """``(stage, seconds)`` pairs of one finished request."""
        for stage, seconds in stages:
            self.stage_latency.labels(model_name=self._model_name, stage=stage).observe(seconds)

    def set_scheduler_stats(self, stats: dict[str, Any]) -> None:
        for gauge, key in (
            (self.running, "running"),
            (self.waiting, "waiting"),
            (self.kv_pages_used, "kv_pages_used"),
            (self.kv_pages_free, "kv_pages_free"),
            *self.queues,
        ):
            if isinstance(stats.get(key), (int, float)):
                gauge.set(stats[key])
        self._set_hicache(stats)
        queued = [stats.get(k) for k in QUEUED_KEYS]
        self.queued.set(sum(q for q in queued if isinstance(q, (int, float))))
        total, used = stats.get("kv_pages_total"), stats.get("kv_pages_used")
        if isinstance(total, int) and isinstance(used, int) and total > 0:
            held = used - int(stats.get("kv_pages_evictable") or 0)
            self.kv_usage.set(max(0, held) / total)
        lora = stats.get("lora")
        if isinstance(lora, dict):
            self.lora_info.clear()
            self.lora_info.labels(
                max_lora=str(lora.get("max", 0)),
                running_lora_adapters=",".join(lora.get("running", [])),
                waiting_lora_adapters=",".join(lora.get("waiting", [])),
            ).set(time.time())
        sent = stats.get("kv_bytes_sent")
        if isinstance(sent, int) and sent > self._kv_bytes_seen:  # a running total in the scheduler
            self.kv_bytes_sent.inc(sent - self._kv_bytes_seen)
            self._kv_bytes_seen = sent

    def _set_hicache(self, stats: dict[str, Any]) -> None:
        for key, value in stats.items():
            if not key.startswith("hicache_") or not isinstance(value, int):
                continue
            what, _, medium = key[len("hicache_") :].rpartition("_")
            labels = {"model_name": self._model_name, "medium": medium.upper()}
            if what == "entries":
                self.hicache_entries.labels(**labels).set(value)
            elif what in self.hicache and value > self._hicache_seen.get(key, 0):
                self.hicache[what].labels(**labels).inc(value - self._hicache_seen.get(key, 0))
                self._hicache_seen[key] = value

    def render(self) -> bytes:
        return generate_latest(self.registry)
